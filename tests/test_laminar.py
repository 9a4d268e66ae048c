"""Laminar's streaming rollout (rollout.stream, otbflow.engines.laminar; issue "Laminar"): each
rollout continues its shard's stream from the carry the one before left and takes the first
complete groups. The references: a plain batch rollout of each prompt window (transformers'
generate through hf_generate, the same row keys), the carry's own tokens, and the bound."""

import polars as pl
import pytest
from conftest import tiny_config

from otbflow import schemas
from otbflow.config import ConfigError
from otbflow.engines.sampling import sample_groups, select_prompts
from otbflow.io import read_metadata, read_table
from otbflow.seeds import derive_seed
from otbflow.stages import rollout
from otbflow.training.trainer import check_versions

STREAM = ["rollout.stream=true", "rollout.take_newer=step", "train.rollout_is=token"]


@pytest.fixture(scope="module")
def policy(tiny_run):
    """The tiny run's bootstrapped policy: it ends its responses at different lengths (an untrained
    one runs most to the budget, so that every group would finish at the same step)."""
    return tiny_run / "results/bootstrap/policy"


@pytest.fixture(scope="module")
def shard(tiny_run):
    return tiny_run / "results/data/train/shard_0.parquet"


def streamed(cfg, policy, shard, tmp_path, iterations, carry_in=None, start=0):
    """Run the stream's rollouts of ``iterations`` (consecutive) from ``carry_in``, each on
    ``policy`` (no newer one published): their tables, metadata and the last carry."""
    tables, metas = [], []
    for k in iterations:
        out, carry = tmp_path / f"rollouts_{k}.parquet", tmp_path / f"stream_{k}.parquet"
        behaviour = max(start, k - cfg.rollout.staleness)
        args = rollout.Args(str(shard), str(policy), str(out), k, behaviour, [], carry_in and str(carry_in), str(carry))
        rollout.run(cfg, args)
        tables.append(read_table(out, schemas.ROLLOUTS))
        metas.append(read_metadata(out))
        carry_in = carry
    return tables, metas, carry_in


def test_a_stream_takes_the_first_complete_groups_and_samples_what_a_batch_rollout_samples(policy, shard, tmp_path):
    """Three streamed rollouts of one shard under one policy (staleness 2: nothing is stale):
    each takes its share of whole groups, one per prompt, some of them started by the rollout
    before it (carried, their responses resumed mid-way); every response is the one a batch
    rollout of its prompt's window samples (same seed, same row keys, one uninterrupted
    generate), and its log-probs match within 1e-5."""
    cfg = tiny_config("rollout.staleness=2", *STREAM)
    tables, metas, carry = streamed(cfg, policy, shard, tmp_path, range(3))
    m, g = 4, cfg.rollout.group_size  # prompts_per_iteration 8 over 2 shards
    for k, (df, meta) in enumerate(zip(tables, metas)):
        assert df.height == m * g and df["group_id"].n_unique() == m
        assert df.group_by("group_id").len()["len"].to_list() == [g] * m
        assert df["iteration"].unique().to_list() == [k]
        assert df["token_versions"].explode().unique().to_list() == [0]  # the one policy, version 0
        assert sum(meta["version_lag_tokens"].values()) == df["response_length"].sum()
        check_versions(df, 2, "streamed")
    stats = [meta["stream"] for meta in metas]
    assert sum(s["groups_from_carry"] for s in stats) > 0 and sum(s["resumed_responses"] for s in stats) > 0
    assert all(s["groups_dropped_stale"] == 0 for s in stats)
    prompts = read_table(shard, schemas.PROMPTS)
    seen = 0
    for df in tables:
        for (seed,), rows in df.group_by("seed"):
            window = next(j for j in range(20) if derive_seed(cfg.seed, "rollout", j, 0) == seed)
            batch = select_prompts(prompts, window, m)
            ref, _ = sample_groups(cfg, batch, str(policy), g, window, 0, seed, window)
            both = rows.join(ref, on=["prompt_id", "sample_idx"], suffix="_ref")
            assert both.height == rows.height
            assert both["response_ids"].to_list() == both["response_ids_ref"].to_list()
            for a, b in zip(both["rollout_logprobs"], both["rollout_logprobs_ref"]):
                assert a.to_list() == pytest.approx(b.to_list(), abs=1e-5)
            seen += rows.height
    assert seen == 3 * m * g
    left = read_table(carry, schemas.STREAM)
    assert left.height and set(left["finish_reason"]) <= {"", "stop", "length"}


@pytest.mark.parametrize("stale", ["drop", "regenerate"])
def test_carried_groups_older_than_the_bound_are_dropped_or_regenerated(policy, shard, tmp_path, stale):
    """At staleness 1, the rollout of iteration 2 continuing the stream that iteration 0's left
    (tokens of version 0, older than 2 - 1) drops or regenerates every carried group that holds
    a token, counts them and their tokens, and takes no token older than the bound. A regenerated
    group samples again from its first token with its own keys: under the same weights its
    responses begin with the tokens the carry held."""
    cfg = tiny_config("rollout.staleness=1", f"rollout.stale_groups={stale}", *STREAM)
    _, _, carry = streamed(cfg, policy, shard, tmp_path / "a", [0]) if (tmp_path / "a").mkdir() is None else None
    held = read_table(carry, schemas.STREAM)
    started = held.group_by("slot").agg(pl.col("response_length").sum()).filter(pl.col("response_length") > 0)
    assert started.height > 0
    (tmp_path / "b").mkdir()
    tables, metas, _ = streamed(cfg, policy, shard, tmp_path / "b", [2], carry, start=1)
    df, st = tables[0], metas[0]["stream"]
    counted = st["groups_dropped_stale"] if stale == "drop" else st["groups_regenerated"]
    assert counted == started.height and st["stale_tokens"] == started["response_length"].sum()
    assert df["token_versions"].explode().min() >= 1 and df["behaviour_iteration"].min() >= 1
    check_versions(df, 1, "streamed")
    if stale == "regenerate":
        before = held.filter(pl.col("response_length") > 0)
        both = df.join(before, on=["prompt_id", "sample_idx"], suffix="_carried")
        assert both.height > 0
        for new, old in zip(both["response_ids"], both["response_ids_carried"]):
            assert new.to_list()[: len(old)] == old.to_list()


def test_a_carry_of_another_configuration_is_refused(policy, shard, tmp_path):
    """A stream carry written with another group size is refused before any decoding, naming it."""
    _, _, carry = streamed(tiny_config("rollout.staleness=1", *STREAM), policy, shard, tmp_path, [0])
    cfg = tiny_config("rollout.staleness=1", "rollout.group_size=2", *STREAM)
    with pytest.raises(ValueError, match="another configuration or shard"):
        streamed(cfg, policy, shard, tmp_path / "x", [1], carry)


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["rollout.staleness=0", "rollout.stream=true"], "rollout.stream"),
        (["rollout.staleness=1", "rollout.stream=true", "rollout.take_newer=trajectory"], "rollout.take_newer"),
        (
            ["rollout.staleness=1", "rollout.stream=true", "rollout.take_newer=step", "rollout.filter_groups=true"],
            "rollout.filter_groups",
        ),
    ],
)
def test_stream_settings_it_cannot_honour_are_refused(overrides, key):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        tiny_config("train.rollout_is=token", *overrides)


def test_each_streamed_token_s_log_prob_is_its_version_s(policy, shard, tmp_path, monkeypatch):
    """The rollout of iteration 1 (s = 1) continues iteration 0's stream on policy 0, and the
    policy of iteration 1, published while it decodes, is taken between two decode steps: each
    token's recorded log-prob equals, within 1e-5, the teacher-forced log-prob under the version
    it records (the carried tokens' under policy 0), and no token is older than 1 - s."""
    from test_stream import assert_logprobs_of_their_versions, perturbed, publish_after, publish_policy

    from otbflow.models.policy import load_policy

    cfg = tiny_config("rollout.staleness=1", *STREAM)
    (tmp_path / "a").mkdir()
    _, _, carry = streamed(cfg, policy, shard, tmp_path / "a", [0])
    model, _ = load_policy(policy)
    states = [{k: v.clone() for k, v in model.state_dict().items()}]
    states.append(perturbed(states[0], 1))
    staged, newer = tmp_path / "staged", tmp_path / "iter_0" / "train" / "policy"
    publish_policy(policy, model, states[1], staged)
    newer.parent.mkdir(parents=True)
    publish_after(monkeypatch, staged, newer, 5)  # between the fifth and sixth ask
    out, left = tmp_path / "rollouts_1.parquet", tmp_path / "stream_1.parquet"
    rollout.run(cfg, rollout.Args(str(shard), str(policy), str(out), 1, 0, [str(newer)], str(carry), str(left)))
    df, meta = read_table(out, schemas.ROLLOUTS), read_metadata(out)
    assert meta["stream"]["switches"] == 1 and set(meta["policies"]) == {"0", "1"}
    assert set(df["token_versions"].explode()) == {0, 1} and meta["stream"]["groups_from_carry"] > 0
    check_versions(df, 1, "streamed")
    assert_logprobs_of_their_versions(policy, states, df)


def test_a_rollout_killed_before_its_carry_leaves_the_stream_to_its_rerun(policy, shard, tmp_path):
    """``otbflow rollout`` of iteration 1, killed (SIGKILL) after its rollouts and before its carry:
    no carry exists to continue from, the carry it continued is as it was, and the rollout run
    again continues it and writes both (Snakemake deletes a failed job's outputs and reruns it)."""
    import os
    import subprocess
    import sys

    from conftest import REPO

    from otbflow.config import to_yaml

    cfg = tiny_config("rollout.staleness=1", *STREAM)
    (tmp_path / "a").mkdir()
    _, _, carry = streamed(cfg, policy, shard, tmp_path / "a", [0])
    before = carry.read_bytes()
    (tmp_path / "config.yaml").write_text(to_yaml(cfg))
    out, left = tmp_path / "rollouts_1.parquet", tmp_path / "stream_1.parquet"
    cmd = [
        sys.executable,
        "-m",
        "otbflow",
        "rollout",
        "--config",
        str(tmp_path / "config.yaml"),
        "--prompts",
        str(shard),
    ]
    cmd += ["--policy", str(policy), "--out", str(out), "--iteration", "1", "--behaviour-iteration", "0"]
    cmd += ["--carry-in", str(carry), "--carry", str(left)]
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), OTBFLOW_FAULT="rollout:before-carry")
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    assert res.returncode == -9, res.stderr[-2000:]
    assert not left.exists() and carry.read_bytes() == before
    env.pop("OTBFLOW_FAULT")
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stderr[-2000:]
    assert read_metadata(out)["stream"]["carry_in"] == str(carry)
    read_table(left, schemas.STREAM)
