"""The figures of docs/results.md and docs/measurements.md that a kept record lets one recompute,
recomputed here from the record (``benchmarks/measured/*.json``), not from the code that wrote
them: a t-interval by its formula with t from a table, an MFU as 6 · parameters · tokens / time /
peak."""

from __future__ import annotations

import json
import math

from conftest import REPO

MEASURED = REPO / "benchmarks" / "measured"
T_975 = {2: 4.303, 4: 2.776}  # Student t quantiles, from a printed table


def record(name: str) -> dict:
    return json.loads((MEASURED / f"{name}.json").read_text())


def figure(rec: dict, what: str) -> str:
    (value,) = [v for w, v in rec["figures"] if w == what]
    return value


def t_interval(values: list[float]) -> tuple[float, float, float]:
    """Mean and 95% t-interval by hand."""
    n = len(values)
    mean = sum(values) / n
    s = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = T_975[n - 1] * s / math.sqrt(n)
    return mean, mean - half, mean + half


def test_the_h100_cold_step_mfu_range_is_its_raw_record():
    """'its MFU 5.6–8.0%' (it read 8.1% before): the first optimizer step of a fresh process is the
    workers' iteration 0 (the mfu pass) and the process-per-job rerun's two steps (its timers),
    each at the same 101,484 non-pad tokens."""
    rec = record("iteration_workers_h100")
    raw = rec["raw"]
    mfu = raw["mfu"]
    params, peak = mfu["parameters"], mfu["peak_tflops"] * 1e12
    (workers_0,) = [c for c in mfu["cold"] if c["run"] == "grpo_s0_workers" and c["iteration"] == 0]
    steps = [
        workers_0["step_time_s"],
        *raw["iteration_process_per_job"]["settings"]["grpo_s0"]["stages"]["train"]["timers_s"],
    ]
    tokens = workers_0["nonpad_tokens"]
    mfus = [6 * params * tokens / t / peak for t in steps]
    assert figure(rec, "its MFU") == f"{100 * min(mfus):.1f}–{100 * max(mfus):.1f}%" == "5.6–8.0%"
    what = "the optimizer step as the first of a fresh process (a process per job, and the workers' iteration 0)"
    assert figure(rec, what) == f"{min(steps):.1f}–{max(steps):.1f} s"
    warm = [c["mfu"] for c in mfu["cold"] if c["run"] == "grpo_s0_workers" and c["iteration"] in (2, 3)]
    assert figure(rec, "the warm optimizer step's MFU (the train worker's iterations 2–3)") == f"{100 * min(warm):.1f}%"
    assert f"{100 * max(warm):.1f}" == f"{100 * min(warm):.1f}"


def test_the_h100_train_job_loads_no_reference():
    """The example config leaves train.kl_coef at its default 0, so no reference is loaded, and the
    record says so."""
    import yaml

    example = yaml.safe_load((REPO / "config" / "examples" / "gpu_qwen2.5-0.5b.yaml").read_text())
    default = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    assert "kl_coef" not in example.get("train", {}) and default["train"]["kl_coef"] == 0
    notes = record("iteration_h100")["notes"]
    assert "loads of the policy and the reference" not in notes and "loads none" in notes
