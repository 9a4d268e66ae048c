"""Streaming decode on the hf backend (otbflow.engines.hf_stream; issue "Laminar"): newer
weights taken between decode steps, each token's version and log-prob recorded, rows resumed on
their own noise streams. The references: a teacher-forced forward of each version (a slow loop
over the tokens), transformers' own generate through ``hf_generate``, and the uninterrupted run."""

import pytest
import torch

from otbflow.engines import stop_token_ids
from otbflow.engines.hf import hf_generate, processed_logits, row_keys
from otbflow.engines.hf_stream import StreamDecoder, Trajectory
from otbflow.models.policy import encode, load_policy

PROMPTS = ["1+2=", "13+4+5=", "7*8=", "2+2+2+2=", "9-3=", "40+2="]
N, BUDGET, SEED, TEMPERATURE, TOP_P = 3, 20, 5, 0.9, 0.95


class Versions:
    """The decoder's weights: ``states`` in turn, the next one published once the decoder has
    asked ``at[v]`` times while holding version v (``newer`` is asked between decode steps)."""

    def __init__(self, states: list[dict], at: list[int]):
        self.states, self.at = states, at
        self.version, self.asked = 0, 0

    def newer(self) -> bool:
        self.asked += 1
        return self.version + 1 < len(self.states) and self.asked >= self.at[self.version]

    def take(self, model) -> int:
        self.version += 1
        self.asked = 0
        model.load_state_dict(self.states[self.version])
        return self.version


def perturbed(state: dict, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v for k, v in state.items()}


def trajectories(tok, prompts=PROMPTS) -> list[Trajectory]:
    ids = encode(tok, prompts)
    keys = row_keys(SEED, range(len(ids)), N, "cpu").tolist()
    return [Trajectory(i, j, keys[i * N + j], ids[i], BUDGET) for i in range(len(ids)) for j in range(N)]


def decode(policy, states, at, **kw):
    model, tok = load_policy(policy)
    model.load_state_dict(states[0])
    weights = Versions(states, at)
    decoder = StreamDecoder(model, tok, weights, stop_token_ids(tok, policy), TEMPERATURE, TOP_P, **kw)
    done = sorted(decoder.run(trajectories(tok)), key=lambda t: (t.prompt_index, t.sample_idx))
    return done, decoder.stats


def logprob_under(model, t: Trajectory, position: int, temperature=TEMPERATURE, top_p=TOP_P) -> float:
    """log pi(token | prompt, response[:position]) of the processed distribution, one forward."""
    ids = torch.tensor([t.prompt_ids + t.response_ids[:position]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, -1]
    return float(torch.log_softmax(processed_logits(logits, temperature, top_p), -1)[t.response_ids[position]])


@pytest.fixture(scope="module")
def states(tiny_policy):
    model, _ = load_policy(tiny_policy)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    return [base, perturbed(base, 1), perturbed(base, 2)]


def test_each_token_s_log_prob_is_its_version_s(tiny_policy, states):
    """Two switches while rows are in flight: every recorded log-prob equals, within 1e-5, the
    teacher-forced log-prob under the version the token records, and some responses span
    versions (taken mid-trajectory, each in-flight row prefilled again: counted)."""
    done, stats = decode(tiny_policy, states, at=[4, 5], batch_size=len(PROMPTS) * N)
    assert stats.switches == 2 and stats.switch_prefill_tokens > 0
    assert any(len(set(t.versions)) > 1 for t in done)
    model, _ = load_policy(tiny_policy)
    for v, state in enumerate(states):
        model.load_state_dict(state)
        for t in done:
            for pos, (lp, tv) in enumerate(zip(t.logprobs, t.versions)):
                if tv == v:
                    assert lp == pytest.approx(logprob_under(model, t, pos), abs=1e-5)
    # the versions are told apart: under the first policy the later tokens have other log-probs
    model.load_state_dict(states[0])
    later = [(t, pos, lp) for t in done for pos, (lp, tv) in enumerate(zip(t.logprobs, t.versions)) if tv]
    assert max(abs(lp - logprob_under(model, t, pos)) for t, pos, lp in later) > 1e-2
    assert all(len(t.response_ids) == len(t.logprobs) == len(t.versions) for t in done)
    assert all(t.finish_reason == ("stop" if t.response_ids[-1] == 1 else "length") for t in done)


def test_a_resumed_row_samples_what_it_would_have_uninterrupted(tiny_policy, states):
    """Under the same weights, rows stopped every third decode step and prefilled again (new
    segments: other batches, other padding) sample the tokens of one uninterrupted decode, and of
    transformers' generate through hf_generate with the same row keys."""
    same = [states[0]] * 6
    whole, _ = decode(tiny_policy, same, at=[10**9] * 6, batch_size=64)
    cut, stats = decode(tiny_policy, same, at=[3] * 6, batch_size=7)
    assert stats.switches == 5 and max(t.prefills for t in cut) >= 2
    assert [t.response_ids for t in cut] == [t.response_ids for t in whole]
    for a, b in zip(cut, whole):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    model, tok = load_policy(tiny_policy)
    ref = hf_generate(
        model,
        tok,
        encode(tok, PROMPTS),
        N,
        TEMPERATURE,
        TOP_P,
        BUDGET,
        seed=SEED,
        stop_ids=stop_token_ids(tok, tiny_policy),
    )
    assert [s.response_ids for s in ref] == [t.response_ids for t in whole]


def test_keep_version_finishes_each_trajectory_on_its_first_version(tiny_policy, states):
    """keep_version: a newer policy waits until the rows in flight finish; no trajectory spans two
    versions, nothing is prefilled again for a switch, and the later trajectories start on the
    newer versions."""
    done, stats = decode(tiny_policy, states, at=[4, 4], batch_size=5, keep_version=True)
    assert all(len(set(t.versions)) == 1 for t in done)
    assert stats.switch_prefill_tokens == 0 and stats.switches == 2
    assert {t.versions[0] for t in done} == {0, 1, 2}


def test_refilled_rows_keep_the_batch_busy(tiny_policy, states):
    """refill_below: rows that finish are replaced by waiting trajectories before the slowest row
    ends; the samples are those of the plain batches, and the batch is busier."""
    plain, plain_stats = decode(tiny_policy, states[:1], at=[0], batch_size=4)
    refilled, stats = decode(tiny_policy, states[:1], at=[0], batch_size=4, refill_below=2)
    assert [t.response_ids for t in refilled] == [t.response_ids for t in plain]
    assert stats.refill_prefill_tokens > 0
    assert stats.busy_row_steps / stats.row_steps > plain_stats.busy_row_steps / plain_stats.row_steps


@pytest.mark.parametrize("greedy", [False, True])
def test_the_backend_refilled_samples_what_it_samples_in_plain_batches(tiny_policy, greedy):
    """rollout.hf_refill_below through the rollout's own backend (open_backend): the same Samples,
    in the same order, as plain batches; greedy too (evaluation)."""
    from conftest import tiny_config

    from otbflow.engines import Sampling, open_backend

    sampling = Sampling(N, TEMPERATURE, TOP_P, BUDGET, greedy=greedy, seed=SEED)
    runs = []
    for below in (0, 0.5):
        backend = open_backend(
            tiny_config("rollout.batch_size=2", f"rollout.hf_refill_below={below}"), str(tiny_policy)
        )
        runs.append(backend.generate(encode(backend.tok, PROMPTS), sampling))
    plain, refilled = runs
    assert [(s.prompt_index, s.sample_idx, s.response_ids, s.finish_reason, s.text) for s in refilled] == [
        (s.prompt_index, s.sample_idx, s.response_ids, s.finish_reason, s.text) for s in plain
    ]
    for a, b in zip(refilled, plain):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def publish_policy(policy, model, state: dict, out) -> None:
    """A policy folder as a train job leaves it: ``policy``'s tokenizer files byte for byte, the
    weights and config, and last its manifest."""
    import shutil

    from otbflow.runtime import manifest

    shutil.copytree(policy, out)
    model.load_state_dict(state)
    model.save_pretrained(out)
    manifest.publish(out, out, {}, None)


def publish_after(monkeypatch, staged, newer, asks: int) -> None:
    """The train job publishes: ``staged`` is renamed to ``newer`` once PublishedPolicies.newer
    has been asked ``asks`` times (between two decode steps)."""
    from otbflow.engines.hf_backend import PublishedPolicies

    asked, published = {"n": 0}, PublishedPolicies.newer

    def newer_after(self):
        asked["n"] += 1
        if asked["n"] == asks + 1:
            staged.rename(newer)
        return published(self)

    monkeypatch.setattr(PublishedPolicies, "newer", newer_after)


def assert_logprobs_of_their_versions(policy, states: list[dict], df) -> None:
    """Each token's recorded log-prob (a rollouts table's, temperature 1) equals, within 1e-5, the
    teacher-forced log-prob under ``states[v]`` for the version v it records."""
    model, _ = load_policy(policy)
    for v, state in enumerate(states):
        model.load_state_dict(state)
        for row in df.iter_rows(named=True):
            t = Trajectory(0, 0, 0, row["prompt_ids"], BUDGET, row["response_ids"])
            for pos, (lp, tv) in enumerate(zip(row["rollout_logprobs"], row["token_versions"])):
                if tv == v:
                    assert lp == pytest.approx(logprob_under(model, t, pos, temperature=1.0, top_p=1.0), abs=1e-5)


@pytest.mark.parametrize("warm", [False, True], ids=["own process", "warm worker"])
def test_a_rollout_takes_the_newer_policy_between_decode_steps(
    tiny_policy, states, data_dir, tmp_path, monkeypatch, warm
):
    """rollout.take_newer 'step' at s = 1: iteration 1's rollout starts from policy 0, and the
    policy of iteration 1, published (renamed into place) while the job decodes, is taken between
    two decode steps, into the module in place (a warm worker's through its resident module).
    The table records each token's version (token_versions), each token's log-prob is its
    version's (teacher-forced), some responses span both, the metadata holds each version's
    weights identity, and the train stage's check accepts it but refuses it as staler than
    s = 0 allows."""
    from otbflow.runtime import resident

    if warm:
        monkeypatch.setattr(resident, "ENABLED", True)  # as in a warm worker; restored after the test
        monkeypatch.setattr(resident, "_held", {})
    import polars as pl
    from conftest import tiny_config

    from otbflow import schemas
    from otbflow.io import read_metadata, read_table
    from otbflow.runtime import manifest
    from otbflow.stages import rollout
    from otbflow.training.trainer import check_versions

    model, tok = load_policy(tiny_policy)
    staged, newer = tmp_path / "staged", tmp_path / "iter_0" / "train" / "policy"
    publish_policy(tiny_policy, model, states[1], staged)
    newer.parent.mkdir(parents=True)
    publish_after(monkeypatch, staged, newer, 3)  # between the third and fourth ask
    cfg = tiny_config("rollout.staleness=1", "train.rollout_is=token", "rollout.take_newer=step")
    out = tmp_path / "rollouts.parquet"
    shard = sorted(data_dir.glob("train/shard_*.parquet"))[0]
    args = rollout.Args(str(shard), str(tiny_policy), str(out), 1, 0, [str(newer)])
    rollout.run(cfg, args)

    df = read_table(out, schemas.ROLLOUTS)
    assert set(df["token_versions"].explode().drop_nulls()) == {0, 1}
    assert df["token_versions"].list.n_unique().max() == 2  # a response taken over mid-way
    meta = read_metadata(out)
    assert meta["policies"] == {"0": None, "1": manifest.read(newer)["weights"]}
    assert meta["stream"]["switches"] == 1 and meta["stream"]["switch_prefill_tokens"] > 0
    assert_logprobs_of_their_versions(tiny_policy, states[:2], df)
    check_versions(df, 1, str(out))
    with pytest.raises(ValueError, match="1 iterations before it"):
        check_versions(df.with_columns(pl.lit(1).alias("behaviour_iteration")), 0, str(out))


def test_a_newer_folder_older_than_the_held_policy_is_not_taken(tiny_policy, states, tmp_path):
    """PublishedPolicies takes a newer policy only if its manifest was written after the held
    policy was published: a folder left by an earlier run (older) is not taken until it is
    written again."""
    import os
    import shutil

    from otbflow.engines.hf_backend import PublishedPolicies
    from otbflow.runtime import manifest

    model, _ = load_policy(tiny_policy)
    start, newer = tmp_path / "start", tmp_path / "newer"
    shutil.copytree(tiny_policy, start)
    publish_policy(tiny_policy, model, states[1], newer)
    want = {k: v.clone() for k, v in model.state_dict().items()}  # what the folder holds (heads tied)
    model.load_state_dict(states[0])
    held = (start / "config.json").stat().st_mtime_ns
    os.utime(newer / manifest.MANIFEST, ns=(held - 10**9, held - 10**9))  # written a second before
    weights = PublishedPolicies([str(newer)], 0, str(start), "float32")
    assert not weights.newer()
    os.utime(newer / manifest.MANIFEST, ns=(held + 10**9, held + 10**9))  # trained again: after it
    assert weights.newer() and weights.take(model) == 1
    assert all(torch.equal(model.state_dict()[k], v) for k, v in want.items())
