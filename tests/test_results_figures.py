"""The figures of docs/results.md and docs/measurements.md that a kept record lets one recompute,
recomputed here from the record (``benchmarks/measured/*.json``), not from the code that wrote
them: a t-interval by its formula with t from a table, an MFU as 6 · parameters · tokens / time /
peak."""

from __future__ import annotations

import json
import math
import re

import pytest
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


def per_seed(rec: dict, what: str) -> list[list[float]]:
    """A record's figure of per-seed values: runs separated by '/', values by ','."""
    return [[float(v.replace("−", "-")) for v in part.split(",")] for part in figure(rec, what).split("/")]


def close(quoted: str, values: list[float], tol: float) -> bool:
    """A quoted 'm [lo, hi]' (signs as − or +) against the t-interval of ``values``; ``tol`` covers
    the per-seed values' rounding."""
    numbers = [float(x.replace("−", "-").replace("+", "")) for x in re.findall(r"[−+]?\d+\.\d+", quoted)]
    return all(abs(a - b) <= tol for a, b in zip(numbers, t_interval(values), strict=True))


def table_rows(heading_text: str) -> dict[str, list[str]]:
    """The rows of the first Markdown table after ``heading_text`` in docs/results.md, by their
    first cell (backticks dropped)."""
    text = (REPO / "docs" / "results.md").read_text()
    rest = text[text.index(heading_text) :]
    rows = {}
    for line in rest.splitlines():
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[0].strip("`").split(" ")[0].strip("`")] = cells[1:]
        elif rows:
            break
    return rows


RUNS = ["grpo", "drgrpo", "otb", "opo", "asym_reinforce"]
F = "final avg@4, seeds 0, 1, 2"


@pytest.mark.parametrize(
    ("name", "heading", "runs", "pairs"),
    [
        (
            "experiment_stability",
            "max length ratio (per seed) | max grad norm | late trend |",
            RUNS,
            {},
        ),
        (
            "experiment_stability_seeds_systems",
            "rollout–trainer k3 | tokens generated | responses generated |",
            ["grpo", "dvp", "dapo", "cosine"],
            ("| a − grpo | final avg@4 | max length ratio", ["dvp", "dapo", "cosine"]),
        ),
        (
            "experiment_stability_budgets",
            "max grad norm (non-finite steps) |",
            ["grpo", "dapo", "cosine"],
            ("| a − grpo | final avg@4 (each at its own budget)", ["dapo", "cosine"]),
        ),
    ],
)
def test_the_stability_tables_recompute_from_their_records(name, heading, runs, pairs):
    """Each run's per-seed final avg@4 in docs/results.md is its record's, and its mean
    [t-interval] is theirs by hand; each 'a − grpo' final avg@4 pair is the per-seed differences'."""
    rec = record(name)
    rows = table_rows(heading)
    values = {run: per_seed(rec, f"{run}: {F}")[0] for run in runs}
    for run in runs:
        per, quoted = rows[run][0], rows[run][1]
        assert [float(v) for v in per.split(",")] == values[run], run
        assert close(quoted.replace("*", ""), values[run], 0.0015), (run, quoted)
    if pairs:
        paired = table_rows(pairs[0])
        for a in pairs[1]:
            diffs = [x - y for x, y in zip(values[a], values["grpo"], strict=True)]
            assert close(paired[a][0].split("(")[0], diffs, 0.0015), (a, paired[a][0])
            ahead = sum(d > 0 for d in diffs)
            assert f"{ahead} of 3" in paired[a][0], a


def test_the_first_stability_run_pairs_from_its_pairs_values():
    """The probe's paired differences in prose (the rerun) are the records' per-seed columns; the
    first run's are its pairs' own recovered values, whose intervals include 0 where pairing the
    sorted columns would not (OTB − Dr.GRPO)."""
    text = " ".join((REPO / "docs" / "results.md").read_text().split())
    rec = record("experiment_stability")
    v = {run: per_seed(rec, f"{run}: {F}")[0] for run in RUNS}
    for a, b, quoted in [
        ("asym_reinforce", "drgrpo", "+0.100 [+0.027, +0.174]"),
        ("otb", "drgrpo", "+0.043 [−0.036, +0.122]"),
        ("opo", "drgrpo", "+0.039 [−0.099, +0.177]"),
        ("otb", "grpo", "+0.008 [−0.231, +0.246]"),
    ]:
        assert quoted in text and close(quoted, [x - y for x, y in zip(v[a], v[b], strict=True)], 0.0015)
    first = dict(
        zip(
            ["grpo", "drgrpo", "otb", "opo", "asym_reinforce"],
            per_seed(rec, next(w for w, _ in rec["figures"] if w.startswith("the probe's first run"))),
        )
    )
    rows = table_rows("| run | final avg@4, the 3 seeds' values in ascending order |")
    for run, values in first.items():
        assert values == sorted(values) and close(rows[run][1], values, 0.0015), run
    pair_values = per_seed(
        rec, next(w for w, _ in rec["figures"] if w.startswith("the first run: final avg@4 differences"))
    )
    quoted = [
        "+0.105 [−0.055, +0.265]",
        "+0.036 [−0.007, +0.079]",
        "+0.043 [−0.100, +0.186]",
        "−0.018 [−0.067, +0.031]",
    ]
    for values, q in zip(pair_values, quoted, strict=True):
        assert q in text and close(q, values, 0.0015), q
    _, lo, hi = t_interval([x - y for x, y in zip(first["otb"], first["drgrpo"], strict=True)])
    assert lo > 0 and "[+0.021, +0.051]" in text and f"[+{lo:.3f}, +{hi:.3f}]" == "[+0.021, +0.051]"


def test_no_unrecomputable_equal_budget_interval():
    """The equal-budget DAPO − GRPO interval's per-seed values were not kept: it is not quoted."""
    text = (REPO / "docs" / "results.md").read_text()
    assert "+0.099" not in text and "[−0.030, +0.228]" not in text


def test_the_length_ratio_pairs_recompute_from_their_record():
    """'max length ratio' a − grpo in the seeds' systems table: the per-seed ratios' differences
    (kept at 2 decimals, hence the tolerance) and the per-seed ratios the run table quotes."""
    rec = record("experiment_stability_seeds_systems")
    what = "max eval length ratio to the initial policy, seeds 0, 1, 2: grpo / dvp / dapo / cosine"
    ratios = dict(zip(["grpo", "dvp", "dapo", "cosine"], per_seed(rec, what), strict=True))
    rows = table_rows("rollout–trainer k3 | tokens generated | responses generated |")
    for run, values in ratios.items():
        assert rows[run][3] == f"{max(values):.2f} ({', '.join(f'{v:.2f}' for v in values)})", run
    paired = table_rows("| a − grpo | final avg@4 | max length ratio")
    for a in ("dvp", "dapo", "cosine"):
        assert close(paired[a][1], [x - y for x, y in zip(ratios[a], ratios["grpo"], strict=True)], 0.015), a


def test_the_h100_workers_figures_are_their_raw_record():
    """The other ranges of iteration_workers_h100 that its raw JSON holds: the periods, the warm
    timers of iterations 2–3, the ratio of the steady periods and the seconds outside the timers."""
    rec = record("iteration_workers_h100")
    raw = rec["raw"]
    warm = raw["iteration_workers"]["settings"]["grpo_s0_workers"]
    cold = raw["iteration_process_per_job"]["settings"]["grpo_s0"]

    def span(values: list[float], unit: str = " s") -> str:
        lo, hi = f"{min(values):.1f}", f"{max(values):.1f}"
        return f"{lo}{unit}" if lo == hi else f"{lo}–{hi}{unit}"

    assert figure(rec, "warm workers: seconds per iteration, steady (3 periods)") == span(warm["periods_s"])
    assert figure(rec, "process per job: seconds per iteration, steady (one period)") == span(cold["periods_s"])
    assert figure(rec, "warm workers over a process per job, steady") == f"{warm['period_s'] / cold['period_s']:.2f}×"
    assert figure(rec, "warm workers: the same") == f"{warm['outside_timers_s']:.1f} s"
    timers = {stage: warm["stages"][stage]["timers_s"][2:] for stage in ("rollout", "features", "train")}
    assert figure(rec, "warm workers, iterations 2–3: generation") == span(timers["rollout"])
    assert figure(rec, "warm workers, iterations 2–3: the features' forward pass") == span(timers["features"])
    assert figure(rec, "warm workers, iterations 2–3: the optimizer step") == span(timers["train"])


def test_the_default_runs_curves_and_gains_are_their_record():
    """docs/results.md's table of the default run per seed (avg@4 and greedy, three decimals) and
    its gains over the seeds (mean [95% t-interval], by hand) come from the kept progress tables
    of default_run_curves; the machine key the page names is the record's."""
    rec = record("default_run_curves")
    text = (REPO / "docs" / "results.md").read_text()
    key = re.search(r"fingerprint key (\S+) ", rec["machine"]).group(1)
    assert f"`{key}`" in text.replace("\n", "")
    gains = {"sampled_accuracy": [], "greedy_accuracy": []}
    for seed, run in rec["raw"].items():
        assert run["policy"] == ["initial", "iter_0", "iter_1", "iter_2", "iter_3"]
        avg, greedy = run["sampled_accuracy"], run["greedy_accuracy"]
        row = f"| {' → '.join(f'{v:.3f}' for v in avg)} | {greedy[0]:.3f} → {greedy[-1]:.3f} |"
        assert row in text, (seed, row)
        for column, values in (("sampled_accuracy", avg), ("greedy_accuracy", greedy)):
            gains[column].append(values[-1] - values[0])
    said = re.search(r"avg@4 gained (\S+ \[\S+ \S+\]) and greedy (\S+ \[\S+ \S+\])", " ".join(text.split()))
    for column, quoted in zip(("sampled_accuracy", "greedy_accuracy"), said.groups()):
        mean, lo, hi = t_interval(gains[column])
        assert quoted == f"+{mean:.3f} [{lo:+.3f}, {hi:+.3f}]", (column, quoted)
