"""The train step's tokens/s and model FLOPs utilisation (MFU): 6 x parameters x non-pad tokens /
step time / the GPU's dense bf16 peak.

Steps come from two places:

- ``--runs DIR ...``: finished workflow folders (benchmarks/bench_iteration.py's setting folders,
  e.g. ``WORK/grpo_s0``): every train job's steps, from ``results/iter_k/train/metrics.parquet``
  (``step_time_s``: the step's wall time; ``nonpad_tokens``: its tokens). In the GPU setting
  (config/examples/gpu_qwen2.5-0.5b.yaml) a job makes one step, the first of a fresh process:
  ``cold`` (the CUDA context, cuBLAS handles and the allocator's first blocks are in it).
- ``--warm-steps N``: two more train jobs, ``otbflow train`` with the first run's resolved config
  (``results/config.yaml``), iteration 0's advantages and initial policy, and
  ``train.ppo_epochs=N``: N steps in one process, of which the 2nd to the Nth are ``warm``; the
  second job with ``train.packing=true`` (``warm_job_packed``: the same steps packed).

Tokens: all non-pad tokens of the step, the response tokens plus the prompt tokens of its rows
(the train metrics' ``nonpad_tokens``); ``mfu_response_tokens`` counts the responses alone. 6 x parameters
counts the forward and backward matrix products once per token: the parameters are counted once
where tied (the output head is the embedding's matrix), attention's products over the sequence
(~1% at ~200 tokens and this width) are left out, and the head is counted for prompt tokens whose
logits the loss does not compute (the prompt share x the head's share of the parameters, ~2% here,
too high).

The figures here are per GPU: a run whose train jobs use several GPUs reads its ``mfu`` from the
train metrics' own column, which divides by the peak x the ranks.

Peak: the dense bf16 tensor-core FLOP/s of the GPU, by the name torch gives it
(``otbflow.training.hardware.PEAKS``, the table the train stage's own ``mfu`` column uses). On a GPU not in
the table, or on CPU, ``mfu`` is null.

Prints JSON (and writes it to ``--out``) naming the command, the date, the GPU and the versions::

    python benchmarks/bench_train_mfu.py --runs WORK/grpo_s0 WORK/grpo_s1 --warm-steps 3
    python benchmarks/bench_train_mfu.py --runs .          # the workflow run in this checkout's results/
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
from otbflow.training.hardware import peak_for  # noqa: E402  (the one table of GPU peaks)


def parameters(policy: Path) -> int:
    """Parameters of a saved HF policy, from its safetensors headers (a tied head is stored once)."""
    from safetensors import safe_open

    n = 0
    for f in sorted(policy.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                shape = st.get_slice(name).get_shape()
                size = 1
                for d in shape:
                    size *= d
                n += size
    return n


def steps_of(metrics: Path, params: int, peak: float | None, **labels) -> list[dict]:
    """Each step of a train metrics table with its TFLOP/s and MFU against ``peak``, from the
    step's own ``nonpad_tokens`` and ``step_time_s`` (``tokens_per_s`` as the train stage computed
    it; its ``mfu`` column used the same table of peaks)."""
    import pyarrow.parquet as pq

    out = []
    columns = ["step", "step_time_s", "tokens", "nonpad_tokens", "sequences"]
    for row in pq.read_table(metrics, columns=columns).to_pylist():
        nonpad, t = row["nonpad_tokens"], row["step_time_s"]
        tflops = 6 * params * nonpad / t / 1e12
        out.append(
            {
                **labels,
                "step": row["step"],
                "sequences": row["sequences"],
                "step_time_s": round(t, 4),
                "response_tokens": row["tokens"],
                "nonpad_tokens": nonpad,
                "tokens_per_s": round(nonpad / t, 1),
                "tflops": round(tflops, 2),
                "mfu": round(tflops / peak, 4) if peak else None,
                "mfu_response_tokens": round(6 * params * row["tokens"] / t / 1e12 / peak, 4) if peak else None,
            }
        )
    return out


def mean(steps: list[dict]) -> dict | None:
    if not steps:
        return None
    keys = ("step_time_s", "nonpad_tokens", "tokens_per_s", "tflops", "mfu", "mfu_response_tokens")
    return {
        "steps": len(steps),
        **{k: None if steps[0][k] is None else round(sum(s[k] for s in steps) / len(steps), 4) for k in keys},
    }


def initial_policy(run: Path) -> Path:
    """The policy iteration 0 trained from: the run's ``model.path``, else its bootstrap's."""
    path = yaml.safe_load((run / "results" / "config.yaml").read_text())["model"]["path"]
    return Path(path) if path else run / "results" / "bootstrap" / "policy"


def warm_job(run: Path, steps: int, work: Path, params: int, peak: float | None, *overrides: str) -> dict:
    """``otbflow train`` on ``run``'s iteration 0 with ``steps`` passes (one step each in the GPU
    setting) and the config ``overrides``."""
    results = run / "results"
    config = results / "config.yaml"
    advantages = results / "iter_0" / "advantages" / "advantages.parquet"
    work.mkdir(parents=True, exist_ok=True)
    metrics = work / "metrics.parquet"
    cmd = [
        sys.executable,
        "-m",
        "otbflow",
        "train",
        "--config",
        str(config),
        "--advantages",
        str(advantages),
        "--policy",
        str(initial_policy(run)),
        "--out",
        str(work / "policy"),
        "--metrics",
        str(metrics),
        "--checkpoint-dir",
        str(work / "checkpoints"),
        f"train.ppo_epochs={steps}",
        "train.checkpoint_every=0",
        *overrides,
    ]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")])))
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL)
    job_s = time.perf_counter() - t0
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
    all_steps = steps_of(metrics, params, peak, run=run.name, iteration=0)
    return {"command": " ".join(cmd), "job_s": round(job_s, 2), "steps": all_steps, "warm": mean(all_steps[1:])}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=Path, nargs="+", required=True, help="finished workflow folders (with results/)")
    p.add_argument("--warm-steps", type=int, default=0, help="steps of one more train job on the first run (0: none)")
    p.add_argument("--work", type=Path, help="the extra train job's folder (default: FIRST_RUN/mfu_warm)")
    p.add_argument("--out", type=Path, help="also write the JSON here")
    a = p.parse_args(argv)
    from machine import run_record  # benchmarks/machine.py (this folder is on sys.path)

    record = run_record()
    peak, source = peak_for(record["machine"]["gpu"])
    runs = [r for r in a.runs if (r / "results" / "config.yaml").is_file()]
    if not runs:
        p.error(f"no finished run among {', '.join(map(str, a.runs))} (no results/config.yaml)")
    policy = initial_policy(runs[0])
    params = parameters(policy)
    result = {
        **record,
        "benchmark": "train_mfu",
        "policy": str(policy),
        "parameters": params,
        "peak_tflops": peak,
        "peak_source": source,
        "flops": "6 x parameters x non-pad tokens per step",
        "runs": [str(r) for r in a.runs],
        "missing_runs": [str(r) for r in a.runs if r not in runs],
        "cold": [],
    }
    for run in runs:
        for metrics in sorted((run / "results").glob("iter_*/train/metrics.parquet")):
            k = int(metrics.parent.parent.name.split("_")[1])
            result["cold"] += steps_of(metrics, params, peak, run=run.name, iteration=k)
    result["cold_mean"] = mean([s for s in result["cold"] if s["step"] == 0])
    if a.warm_steps:
        work = a.work or runs[0] / "mfu_warm"
        result["warm_job"] = warm_job(runs[0], a.warm_steps, work, params, peak)
        result["warm_job_packed"] = warm_job(runs[0], a.warm_steps, work / "packed", params, peak, "train.packing=true")
    text = json.dumps(result, indent=1)
    print(text)
    if a.out:
        a.out.write_text(text)
    return result


if __name__ == "__main__":
    main()
