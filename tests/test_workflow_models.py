"""The tiny workflow on a real architecture (a Qwen2-shaped policy with a byte-level BPE tokenizer
and a ChatML chat template: config/examples/qwen2_bpe_chat.yaml over config/tiny.yaml) with
rollout.backend=vllm, its rollout and evaluate jobs run by .venv-vllm's Python (rollout.python).
The same pipeline with the transformers backend runs in tests/test_experiment.py (the reduced
experiment's members are Qwen2 + BPE + chat)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
import yaml
from conftest import QWEN2_BPE_CHAT, REPO, SMALL, TINY, vllm_python

from otbflow import schemas
from otbflow.io import read_metadata, read_table

SNAKEMAKE = str(Path(sys.executable).with_name("snakemake"))
# one worker builds the module's vLLM run once (its fixture is module-scoped)
pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.xdist_group("vllm_models")]


def snakemake(workdir: Path, extra: dict | None = None, env=None) -> subprocess.CompletedProcess:
    """The workflow on tiny.yaml + qwen2_bpe_chat.yaml + SMALL (+ extra), each a YAML config file
    (typed values: Snakemake's --config reads nested values as strings)."""
    files = []
    for name, layer in (("small.yaml", SMALL), ("extra.yaml", extra)):
        if layer:
            (workdir / name).write_text(yaml.safe_dump(layer))
            files.append(str(workdir / name))
    cmd = [
        SNAKEMAKE,
        "-s",
        str(REPO / "Snakefile"),
        "--directory",
        str(workdir),
        "--cores",
        "2",
        "--configfile",
        str(TINY),
        str(QWEN2_BPE_CHAT),
        *files,
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, env=env)
    if res.returncode != 0:
        logs = "\n".join(f"--- {p}\n{p.read_text()[-3000:]}" for p in (workdir / "results/logs").rglob("*.log"))
        raise AssertionError(f"snakemake failed ({res.returncode}):\n{res.stderr[-5000:]}\n{logs[-12000:]}")
    return res


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory):
    """The README's vLLM-on-CPU command in its tiny form: the tiny workflow on Qwen2 + BPE + chat
    (SMALL sizes) with config/examples/vllm_cpu.yaml layered on, so the rollout and evaluate jobs
    generate with vLLM in .venv-vllm. (The same pipeline with the transformers backend runs in
    tests/test_experiment.py.)"""
    python = vllm_python()
    work = tmp_path_factory.mktemp("qwen2_vllm")
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")  # engine in the job's process: starts faster on CPU
    example = yaml.safe_load((REPO / "config/examples/vllm_cpu.yaml").read_text())  # the README's vLLM-on-CPU layer
    example["rollout"]["python"] = str(python)  # absolute: the run is not in the repository
    res = snakemake(work, example, env=env)
    return work, res


def test_vllm_workflow_end_to_end(vllm_run):
    from otbflow.engines.hf import hf_generate
    from otbflow.engines.prompts import render_prompts
    from otbflow.models.policy import load_policy

    work, res = vllm_run
    r = work / "results"
    for path in (
        "iter_0/rollout/shard_0.parquet",
        "variance/pool.parquet",
        "initial/eval/samples.parquet",
        "iter_0/eval/samples.parquet",
    ):
        meta = read_metadata(r / path)
        assert meta["backend"] == "vllm" and meta["chat"] is True, path
    assert read_metadata(r / "iter_0/rollout/shard_0.parquet")["vllm_version"] == "0.32.0"
    fe = read_table(r / "iter_0/features/shard_0.parquet", schemas.FEATURES)
    delta = fe["log_ratio"].explode().abs()
    print(f"workflow, vLLM vs transformers log-probs: mean |delta| {delta.mean():.2e}, max {delta.max():.2e}")
    assert delta.mean() <= 1e-3
    assert read_table(r / "report/progress.parquet", schemas.PROGRESS)["policy"].to_list() == ["initial", "iter_0"]
    assert (r / "report/mismatch.png").is_file() and (r / "variance/summary.parquet").is_file()
    # greedy evaluation: vLLM's responses are transformers' responses to the same rendered prompts
    ev = read_table(r / "data/eval.parquet", schemas.PROMPTS)
    samples = read_table(r / "initial/eval/samples.parquet", schemas.EVAL_SAMPLES).filter(pl.col("mode") == "greedy")
    model, tok = load_policy(r / "bootstrap/policy")
    ids = render_prompts(tok, ev["prompt"].to_list(), ev["messages"].to_list(), True, "Solve step by step.")
    hf = hf_generate(
        model,
        tok,
        ids,
        greedy=True,
        max_new_tokens=16,
        stop_ids=read_metadata(r / "iter_0/rollout/shard_0.parquet")["stop_token_ids"],
    )
    by_id = dict(zip(samples["prompt_id"].to_list(), samples["response_text"].to_list()))
    assert [by_id[i] for i in ev["prompt_id"].to_list()] == [s.text for s in hf]


def test_a_vllm_worker_builds_its_engine_once_and_samples_the_same(vllm_run, tmp_path):
    """The same run's rollout and the trained policy's evaluation redone (--forcerun rollout) with a
    warm generation worker in .venv-vllm: one engine for both jobs, and the same samples as the jobs
    that each built their own engine. (Here every reward is 0, so the trained policy holds the
    initial weights and nothing is reloaded; a reload into a running engine is tested in
    tests/test_vllm.py::test_a_reloaded_engine_samples_what_a_new_engine_of_the_weights_samples.)"""
    import shutil
    import signal
    import time

    from otbflow.ops import dispatch

    work, _ = vllm_run
    copy = tmp_path / "run"
    for name in ("results", ".snakemake"):
        shutil.copytree(work / name, copy / name, symlinks=True, ignore=shutil.ignore_patterns("locks", "incomplete"))
    for name in ("small.yaml", "extra.yaml"):
        shutil.copy(work / name, copy / name)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONPATH=str(REPO / "src"))
    log = tmp_path / "worker.log"
    worker = subprocess.Popen(
        [str(vllm_python()), "-m", "otbflow", "worker", "generate", "--results", str(copy / "results")],
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=env,
    )
    try:
        for _ in range(1200):
            if dispatch.live_workers(copy / "results", "generate"):
                break
            assert worker.poll() is None, log.read_text()[-3000:]
            time.sleep(0.1)
        example = yaml.safe_load((copy / "extra.yaml").read_text())
        layers = [str(TINY), str(QWEN2_BPE_CHAT), str(copy / "small.yaml"), str(copy / "extra.yaml")]
        cmd = [SNAKEMAKE, "-s", str(REPO / "Snakefile"), "--directory", str(copy), "--cores", "2"]
        # the evaluation as target: the jobs up to it, not the scaling and report jobs after it
        cmd += ["results/iter_0/eval/samples.parquet", "--configfile", *layers, "--forcerun", "rollout"]
        run_env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
        res = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, env=run_env)
        assert res.returncode == 0, res.stderr[-5000:]
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=60)
    text = log.read_text()
    assert example["rollout"]["backend"] == "vllm" and "runs rollout" in text and "runs evaluate" in text
    assert text.count("Initializing a V1 LLM engine") == 1, "one engine for every job"
    for path in ("iter_0/rollout/shard_0.parquet", "iter_0/eval/samples.parquet"):
        before, after = pl.read_parquet(work / "results" / path), pl.read_parquet(copy / "results" / path)
        assert after.equals(before), path
