"""The real Snakemake workflow, end to end, in a temp dir: outputs, caching, bad configs."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
from conftest import REPO, TINY

from otbflow import schemas
from otbflow.io import read_metadata, read_table

SNAKEMAKE = str(Path(sys.executable).with_name("snakemake"))
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("workflow")]


def snakemake(workdir: Path, *args: str, snakefile: Path = REPO / "Snakefile", env=None, check=True):
    cmd = [
        SNAKEMAKE,
        "-s",
        str(snakefile),
        "--directory",
        str(workdir),
        "--cores",
        "2",
        "--configfile",
        str(TINY),
        *args,
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, env=env)
    if check and res.returncode != 0:
        raise AssertionError(f"snakemake failed ({res.returncode}):\n{res.stdout[-4000:]}\n{res.stderr[-6000:]}")
    return res


def planned_outputs(dry_run_stdout: str) -> set[str]:
    """Output files of the jobs a dry-run would execute."""
    outs = set()
    for line in dry_run_stdout.splitlines():
        m = re.match(r"\s+output: (.*)", line)
        if m:
            outs |= {p.strip() for p in m.group(1).split(",")}
    return outs


def planned_jobs(dry_run_stdout: str) -> list[tuple[str, set[str], set[str]]]:
    """(rule, inputs, outputs) of every job a dry-run would execute."""
    jobs = []
    for block in re.split(r"^(?=(?:local)?rule \w+:)", dry_run_stdout, flags=re.M):
        if m := re.match(r"(?:local)?rule (\w+):", block):
            files = {
                kind: {
                    p.strip() for line in re.findall(rf"^\s+{kind}: (.*)$", block, flags=re.M) for p in line.split(",")
                }
                for kind in ("input", "output")
            }
            jobs.append((m.group(1), files["input"], files["output"]))
    return jobs


def planned_rules(dry_run_stdout: str) -> set[str]:
    return set(re.findall(r"^(?:local)?rule (\w+):", dry_run_stdout, flags=re.M)) - {"all"}


@pytest.fixture(scope="module")
def run_dir(tiny_run):
    """The session's tiny run (README command 1 with config/tiny.yaml; conftest.tiny_run)."""
    return tiny_run


def test_every_output_reads_back_with_polars(run_dir):
    r = run_dir / "results"
    for s in range(2):
        read_table(r / f"data/train/shard_{s}.parquet", schemas.PROMPTS)
    read_table(r / "data/eval.parquet", schemas.PROMPTS)
    steps = []
    for k in range(2):
        for s in range(2):
            ro = read_table(r / f"iter_{k}/rollout/shard_{s}.parquet", schemas.ROLLOUTS)
            assert (ro["iteration"] == k).all()
            fe = read_table(r / f"iter_{k}/features/shard_{s}.parquet", schemas.FEATURES)
            assert fe.height == ro.height and fe["seq_max_k2"].max() < 1e-6
        adv = read_table(r / f"iter_{k}/advantages/advantages.parquet", schemas.ADVANTAGES)
        assert set(adv["estimator"]) == {"otb"}
        read_table(r / f"iter_{k}/advantages/comparison.parquet", schemas.COMPARISON)
        m = read_table(r / f"iter_{k}/train/metrics.parquet", schemas.TRAIN_METRICS)
        assert m.height >= 1 and m["grad_norm"].is_finite().all() and not m["skipped"].any()
        assert (r / f"iter_{k}/train/policy/config.json").is_file()
        steps.append(json.loads((r / f"iter_{k}/train/schedule.json").read_text())["step"])
        assert steps[-1] == sum(steps[-2:-1]) + m.height  # the LR schedule continues over iterations
    for name in ["initial", "iter_0", "iter_1"]:
        read_table(r / f"{name}/eval/samples.parquet", schemas.EVAL_SAMPLES)
        s = read_table(r / f"{name}/eval/summary.parquet", schemas.EVAL_SUMMARY)
        assert 0.0 <= s["sampled_accuracy"][0] <= 1.0
    progress = read_table(r / "report/progress.parquet", schemas.PROGRESS)
    assert progress["policy"].to_list() == ["initial", "iter_0", "iter_1"]
    assert progress["tokens_generated"].to_list()[0] == 0 and progress["tokens_generated"].is_sorted()
    read_table(r / "report/metrics.parquet", schemas.METRICS)
    for png in ["accuracy", "reward", "grad_norm", "response_length"]:
        assert (r / f"report/{png}.png").read_bytes()[:4] == b"\x89PNG"
    seqs = read_table(r / "scaling/sequences.parquet", schemas.SCALING_SEQUENCES)
    assert seqs.height >= 3 and (seqs["grad_sq_norm"] > 0).all()
    assert "grad_sq_norm_slope" in pl.read_parquet(r / "scaling/summary.parquet").columns
    pool = read_table(r / "variance/pool.parquet", schemas.ROLLOUTS)
    assert pool.height == 4 * 8 and pool["prompt_id"].n_unique() == 4  # tiny.yaml: 4 prompts x 8
    study = read_table(r / "variance/summary.parquet", schemas.VARIANCE)
    assert {"none", "otb", "eob"} <= set(study["estimator"]) and study["trace_cov"].is_finite().all()
    assert not (r / "checkpoints").exists()  # removed after each train job, empty folders included
    for rule in [
        "bootstrap",
        "shard",
        "rollout",
        "features",
        "advantages",
        "train",
        "evaluate",
        "report",
        "scaling",
        "variance_pool",
        "variance",
    ]:
        assert list((r / "logs" / rule).glob("*.log")), f"no log for {rule}"
    # the long stages log their progress (items done, rate, time left) while they work
    for rule, label in [
        ("rollout", "generation (4 per prompt)"),
        ("evaluate", "greedy generation"),
        ("features", "features"),
        ("scaling", "exact gradient norms"),
        ("variance", "per-token gradients"),
    ]:
        text = "".join(p.read_text() for p in (r / "logs" / rule).glob("*.log"))
        assert re.search(rf"{re.escape(label)}: \d+/\d+ \w+ \(100%\), [\d.e+]+ \w+/s, done", text), (rule, text[-800:])


def test_iteration_one_samples_from_iteration_zero_policy(run_dir):
    r = run_dir / "results"
    meta = read_metadata(r / "iter_1/rollout/shard_0.parquet")
    assert meta["policy"].endswith("iter_0/train/policy")
    for k in (0, 1):  # on-policy (rollout.staleness 0): every row says so
        rows = read_table(r / f"iter_{k}/rollout/shard_1.parquet", schemas.ROLLOUTS)
        assert rows["behaviour_iteration"].unique().to_list() == [k]


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_staleness_plans_rollouts_from_older_policies(tmp_path, staleness):
    """A dry run of 4 iterations: rollout k reads the policy iteration max(0, k - s) started from,
    so at s >= 1 no rollout waits for the train job of the iteration before it, while features
    and train of iteration k still read the policy trained by k - 1 (the proximal policy)."""
    config = ["iterations=4", f"rollout={{staleness: {staleness}}}", "train={rollout_is: token}"]
    jobs = planned_jobs(snakemake(tmp_path, "-n", "--config", *config).stdout)
    start = {0: "results/bootstrap/policy"} | {k: f"results/iter_{k - 1}/train/policy" for k in range(1, 4)}
    for rule, inputs, outputs in jobs:
        k = next((int(m) for o in outputs for m in re.findall(r"iter_(\d+)/(?:rollout|features|train)/", o)), None)
        if rule == "rollout":
            assert start[max(0, k - staleness)] in inputs, (k, inputs)
            trained = {i for i in inputs if i.endswith("train/policy")}
            assert all(int(re.search(r"iter_(\d+)", i).group(1)) <= k - 1 - staleness for i in trained), (k, inputs)
        elif rule in ("features", "train"):
            assert start[k] in inputs, (rule, k, inputs)
    assert sum(rule == "rollout" for rule, _, _ in jobs) == 8


def test_the_tiny_workflow_runs_one_iteration_stale(run_dir, tmp_path):
    """rollout.staleness 1 on a copy of the tiny run: iteration 0's rollouts are kept (they are the
    same at any staleness), iteration 1 samples from the initial policy, features and train use
    the policy iteration 0 trained, and the report shows the lag and the truncation. Then
    rollout.stream (below)."""
    work = copy_run(run_dir, tmp_path / "run")
    res = snakemake(work, "--config", "rollout={staleness: 1}", "train={rollout_is: token}")
    assert "rule rollout" in res.stdout + res.stderr
    r = work / "results"
    assert not any("iter_0/rollout" in line for line in (res.stdout + res.stderr).splitlines() if "output:" in line)
    rows = read_table(r / "iter_1/rollout/shard_0.parquet", schemas.ROLLOUTS)
    assert rows["iteration"].unique().to_list() == [1] and rows["behaviour_iteration"].unique().to_list() == [0]
    meta = __import__("otbflow.io", fromlist=["read_metadata"]).read_metadata
    assert meta(r / "iter_1/rollout/shard_0.parquet")["policy"].endswith("bootstrap/policy")
    assert meta(r / "iter_1/features/shard_0.parquet")["policy"].endswith("iter_0/train/policy")
    assert read_table(r / "iter_1/train/metrics.parquet", schemas.TRAIN_METRICS)["grad_norm"].is_finite().all()
    mismatch = read_table(r / "report/mismatch.parquet", schemas.MISMATCH)
    assert mismatch["lag"].to_list() == [0, 1]
    assert mismatch["measures"].to_list() == ["engine", "behaviour->proximal"]
    # a lagged batch is off-policy by a whole update; the on-policy one by float rounding only
    assert mismatch["k3_mean"][1] > 1e3 * mismatch["k3_mean"][0]
    assert mismatch["truncated_fraction"].is_finite().all()

    # rollout.stream (take_newer 'step'): the rollouts rerun, iteration 1's continuing the stream
    # that iteration 0's left (its carry, an input), taking policy 1 if published while it decodes;
    # every table is within the bound, train accepts it, and the report counts the carried groups
    # and the tokens by lag (tests/test_laminar.py: what a stream samples)
    stream = ["--config", "rollout={staleness: 1, take_newer: step, stream: true}", "train={rollout_is: token}"]
    res = snakemake(work, *stream)
    ran = planned_outputs(res.stdout + res.stderr)
    assert {f"results/iter_{k}/rollout/stream_{s}.parquet" for k in (0, 1) for s in (0, 1)} <= ran, ran
    for k in (0, 1):
        for s in (0, 1):
            path = r / f"iter_{k}/rollout/shard_{s}.parquet"
            rows = read_table(path, schemas.ROLLOUTS)
            assert rows["group_id"].n_unique() == 4 and rows["token_versions"].explode().max() <= k
            carried = meta(path)["stream"]["carry_in"]
            assert (carried or "").endswith(f"iter_0/rollout/stream_{s}.parquet") == (k == 1), carried
            assert set(meta(path)["policies"]) <= {"0", "1"}
            read_table(r / f"iter_{k}/rollout/stream_{s}.parquet", schemas.STREAM)
    assert read_table(r / "iter_1/train/metrics.parquet", schemas.TRAIN_METRICS)["grad_norm"].is_finite().all()
    summary = pl.read_parquet(r / "report/rollouts.parquet")
    assert summary["groups_carried"][0] == 0
    assert [sum(h) for h in summary["tokens_by_lag"].to_list()] == summary["tokens"].to_list()


def copy_run(run_dir: Path, work: Path) -> Path:
    """A copy of the tiny run (results and Snakemake's records) for a test that writes."""
    for name in ("results", ".snakemake"):
        shutil.copytree(
            run_dir / name, work / name, symlinks=True, ignore=shutil.ignore_patterns("locks", "incomplete")
        )
    return work


def test_retention_prunes_what_it_does_not_keep_and_refuses_what_needs_it(run_dir, tmp_path):
    """The default retention on a copy of the 2-iteration tiny run (which kept everything):
    iteration 0's policy weights and AdamW state are deleted, iteration 1's kept (the last);
    nothing reruns afterwards; a change that would evaluate the pruned policy again is refused
    before any job, naming it; extending the run and changing the estimator are not."""
    work = copy_run(run_dir, tmp_path / "run")
    keep = "retention={policy_every: 10, optimizer: last}"
    res = snakemake(work, "--config", keep)
    assert planned_rules(res.stdout + res.stderr) <= {"prune", "report"}, res.stderr[-3000:]
    r = work / "results"
    assert json.loads((r / "iter_0/train/policy/PRUNED.json").read_text())["removed"][0]["name"] == "model.safetensors"
    assert not (r / "iter_0/train/policy/model.safetensors").exists()
    assert not (r / "iter_0/train/optimizer/state").exists() and (r / "iter_0/train/optimizer/meta.json").exists()
    assert (r / "iter_1/train/policy/model.safetensors").exists() and (r / "iter_1/train/optimizer/state").is_dir()
    record = json.loads((r / "iter_0/train/retention.json").read_text())
    assert record["kept"] == {"policy": False, "optimizer": False} and min(record["freed_bytes"].values()) > 0
    assert json.loads((r / "report/disk.json").read_text())["pruned"] == sum(record["freed_bytes"].values())
    assert planned_rules(snakemake(work, "-n", "--config", keep).stdout) == set()

    before = tree_state(r)
    res = snakemake(work, "--config", keep, "evaluate={n_samples: 3}", check=False)
    out = res.stdout + res.stderr
    assert res.returncode != 0 and "evaluate (policy=iter_0): results/iter_0/train/policy" in out, out[-3000:]
    assert "Nothing was run" in out and tree_state(r) == before

    # one more iteration starts from the kept policy and optimizer state: nothing before it reruns
    jobs = planned_jobs(snakemake(work, "-n", "--config", keep, "iterations=3").stdout)
    assert {rule for rule, _, outs in jobs if any("iter_0" in o or "iter_1/rollout" in o for o in outs)} <= {"prune"}
    train = [ins for rule, ins, _ in jobs if rule == "train"]
    assert len(train) == 1 and {"results/iter_1/train/policy", "results/iter_1/train/optimizer"} <= train[0]
    # a new estimator retrains from iteration 0, which writes the pruned policy again: not refused
    # (--touch runs the check before any job, as a real run does, and then only touches the outputs)
    res = snakemake(work, "--touch", "--config", keep, "advantages={estimator: grpo}", check=False)
    assert res.returncode == 0 and "Nothing was run" not in res.stderr, res.stderr[-3000:]


def test_live_curves_of_the_run(run_dir):
    """One TensorBoard folder per train and evaluate job, one event file each; the train steps
    continue over iterations, and each evaluation sits at the step and tokens that made its policy."""
    from test_tracking import scalars

    r = run_dir / "results"
    tb = r / "tensorboard"
    jobs = sorted(str(p.parent.relative_to(tb)) for p in tb.rglob("events.out.tfevents.*"))
    assert jobs == ["evaluate/initial", "evaluate/iter_0", "evaluate/iter_1", "train/iter_0", "train/iter_1"]
    progress = read_table(r / "report/progress.parquet", schemas.PROGRESS)
    step = 0
    for k in range(2):
        m = read_table(r / f"iter_{k}/train/metrics.parquet", schemas.TRAIN_METRICS)
        loss = scalars(tb / f"train/iter_{k}")["train/loss"]
        assert [s for s, _ in loss] == list(range(step, step + m.height))
        assert [v for _, v in loss] == pytest.approx(m["loss"].to_list(), rel=1e-6)
        state = json.loads((r / f"iter_{k}/train/schedule.json").read_text())
        step = state["step"]
        curves = scalars(tb / f"evaluate/iter_{k}")
        assert curves["progress/tokens"] == [(step, state["tokens"])]
        greedy = progress.filter(pl.col("policy") == f"iter_{k}")["greedy_accuracy"][0]
        assert curves["evaluate/greedy_accuracy"] == [(step, pytest.approx(greedy, rel=1e-6))]
    assert scalars(tb / "evaluate/initial")["progress/tokens"] == [(0, 0.0)]


def test_html_report(run_dir):
    html = (run_dir / "results" / "report.html").read_text(errors="ignore")  # written by make run
    assert "accuracy.png" in html and "Held-out accuracy" in html


def test_the_report_opens_on_what_the_run_did(run_dir, tmp_path):
    """results/report.html (make run) opened in a headless browser lands on the front page, not
    on the workflow's graph: what the run did, the initial and final accuracy as progress.parquet
    has them, the tokens as rollouts.parquet sums them, the disk as disk.json has it, the learning
    curve (the accuracy plot's PNG), the run's settings and sizes; the graph is a menu entry away. In
    a 1400 px window the curve is shown at 85% of its own width or more (it was 47%, two panels
    side by side squeezed into the 512 px column)."""
    from conftest import rendered_dom

    from otbflow.runtime.usage import gib

    r = run_dir / "results"
    dom = rendered_dom(r / "report.html")
    landing = dom[dom.index("What this run did") :]
    progress = pl.read_parquet(r / "report/progress.parquet")
    for column in ("greedy_accuracy", "sampled_accuracy"):
        first, last = progress[column][0], progress[column][-1]
        assert re.search(rf"{column.split('_')[0]}.*?{first:.3f}.*?{last:.3f}", landing, re.S), column
    tokens = int(pl.read_parquet(r / "report/rollouts.parquet")["tokens"].sum())
    assert f"Rollout tokens generated: {tokens:,}" in landing
    assert gib(json.loads((r / "report/disk.json").read_text())["total"]) in landing
    assert re.search(r"Seconds per iteration: \d+\.\d s", landing)
    curve = base64.b64encode((r / "report/accuracy.png").read_bytes()).decode()
    assert f'src="data:image/png;base64,{curve}"' in landing
    assert "otb advantages, ppo_clip loss" in landing  # the run's settings
    assert re.search(r"Iterations</li><li[^>]*>2<", landing)  # its sizes (--report-metadata)
    assert '<div id="rulegraph"' not in dom  # the workflow's graph is not drawn until asked for
    shown, natural = curve_width_at_1400px(r / "report.html", tmp_path)
    png = (r / "report/accuracy.png").read_bytes()
    assert natural == int.from_bytes(png[16:20], "big")  # the PNG header's width: the curve itself
    # the column is 512 px at 1400 px (test_bootstrap_evaluate_report sizes the labels for it):
    # shown at 85% of its pixels or more, its 10-point labels at 110 dpi are 13 px tall or more
    assert 480 <= shown <= 1400 and shown >= 0.85 * natural, (shown, natural)


def curve_width_at_1400px(html: Path, tmp_path: Path) -> tuple[float, int]:
    """The front page's learning curve in headless Chromium in a 1400 x 1000 px window: the width
    it is shown at (CSS px, its bounding box) and its own width (px), written into the DOM by a
    script added to a copy of the report."""
    from conftest import chromium

    page = html.read_text(errors="ignore")
    probe = (
        "<script>setInterval(() => { const img = [...document.images].find(i => "
        "i.src.startsWith('data:image/png')); if (img && img.getBoundingClientRect().width > 0) "
        "document.body.setAttribute('data-curve', img.getBoundingClientRect().width + ' ' + img.naturalWidth); }"
        ", 100);</script>"
    )
    end = page.rindex("</body>")
    copy = tmp_path / "report_probe.html"
    copy.write_text(page[:end] + probe + page[end:])
    res = subprocess.run(
        [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=20000"]
        + ["--window-size=1400,1000", "--dump-dom", copy.resolve().as_uri()],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=300,
    )
    found = re.search(r'data-curve="([\d.]+) (\d+)"', res.stdout)
    assert found, res.stderr[-3000:]
    return float(found[1]), int(found[2])


def test_nothing_to_do_after_a_complete_run(run_dir):
    res = snakemake(run_dir, "-n")
    assert planned_rules(res.stdout) == set(), res.stdout[-2000:]


def tree_state(folder: Path) -> dict[str, tuple[str, int]]:
    """Every file under ``folder``: (sha256, mtime in ns)."""
    import hashlib

    return {
        str(p.relative_to(folder)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_previews_write_nothing_under_results(run_dir, tmp_path):
    """A dry run, --lint, --summary and --list-changes (with overrides that would change the
    resolved config) leave every file under results/ as it was, byte for byte and mtime; --report
    writes only the report it is asked for. A dry run of the experiment workflow writes nothing."""
    before = tree_state(run_dir / "results")
    overrides = ["--config", "rollout={group_size: 4}", "advantages={estimator: grpo}"]
    for args in (["-n", *overrides], ["--lint", *overrides], ["--summary", *overrides], ["--lc", "params", *overrides]):
        snakemake(run_dir, *args)
        assert tree_state(run_dir / "results") == before, args
    report = tmp_path / "preview.html"
    snakemake(run_dir, "--report", str(report), *overrides)
    assert report.stat().st_size > 0 and tree_state(run_dir / "results") == before
    res = subprocess.run(
        [SNAKEMAKE, "-s", str(REPO / "workflow/experiment.smk"), "--directory", str(tmp_path / "exp"), "-n"]
        + ["--cores", "2", "--configfile", str(REPO / "config/experiments/tiny.yaml")],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    assert res.returncode == 0 and "experiment_file" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]
    assert not (tmp_path / "exp" / "results").exists()


def test_changing_the_estimator_reruns_from_advantages_on(run_dir):
    res = snakemake(run_dir, "-n", "--config", "advantages={estimator: grpo}")
    rules = planned_rules(res.stdout)
    outs = planned_outputs(res.stdout)
    assert {"advantages", "train", "evaluate", "report"} <= rules
    assert "bootstrap" not in rules and "shard" not in rules
    assert not {"scaling", "variance", "variance_pool"} & rules  # they read neither the estimator nor its rollouts
    assert not any("iter_0/rollout" in o or "iter_0/features" in o for o in outs), outs
    assert "results/initial/eval/summary.parquet" not in outs  # the initial policy is unchanged
    assert any("iter_1/rollout" in o for o in outs)  # iteration 1 samples from a new policy


def test_editing_a_stage_source_reruns_that_stage(run_dir, tmp_path):
    """The Snakefile and the jobs import the source tree they find; edit a copy of it."""
    repo = tmp_path / "repo"
    shutil.copytree(REPO, repo, ignore=shutil.ignore_patterns(".venv*", ".git", "results", ".snakemake", "__pycache__"))
    env = dict(__import__("os").environ, PYTHONPATH=str(repo / "src"))
    res = snakemake(run_dir, "-n", snakefile=repo / "Snakefile", env=env)
    assert planned_rules(res.stdout) == set(), res.stdout[-3000:]
    # a comment and a reformat leave the code version as it was: nothing reruns
    estimators = repo / "src/otbflow/algorithms/estimators.py"
    estimators.write_text(estimators.read_text().replace("EPS_STD = 1e-6", "EPS_STD = (\n    1e-6  # a comment\n)"))
    res = snakemake(run_dir, "-n", snakefile=repo / "Snakefile", env=env)
    assert planned_rules(res.stdout) == set(), res.stdout[-3000:]
    # a changed expression reruns what reaches it
    estimators.write_text(estimators.read_text().replace("1e-6  # a comment", "1e-7"))
    res = snakemake(run_dir, "-n", snakefile=repo / "Snakefile", env=env)
    rules = planned_rules(res.stdout)
    outs = planned_outputs(res.stdout)
    assert "advantages" in rules and "bootstrap" not in rules and "shard" not in rules
    assert not any("iter_0/rollout" in o or "iter_0/features" in o for o in outs)
    assert re.search(r"reason: .*[Pp]arams", res.stdout)


def test_the_tiny_run_is_bitwise_what_it_was(run_dir):
    """Every table and policy of the tiny run equals the fingerprints recorded for this machine's
    key (tests/fingerprint.py: CPU family and model, torch's kernels and version, the jobs'
    threads), and make run said so as its last line. On a machine of another key there is nothing
    to compare with: make run said "none recorded", and the test is skipped saying how to record."""
    sys.path.insert(0, str(REPO / "tests"))
    from fingerprint import cpu_key, fingerprints, recorded

    # its last line, less make's own ("make[1]: Leaving directory ...", where make test started it)
    said = [line for line in (run_dir / "make-run.out").read_text().splitlines() if not line.startswith("make")][-1]
    found_file = recorded("tiny")
    if found_file is None:
        assert said == f"fingerprints: none recorded for {cpu_key()} (run tiny)"
        pytest.skip(
            f"no fingerprints for this machine ({cpu_key()}): record them on a checkout before a change with "
            f"python tests/fingerprint.py results > tests/data/fingerprints/{cpu_key()}/tiny.json"
        )
    want = json.loads(found_file.read_text())["fingerprints"]
    found = fingerprints(run_dir / "results")
    differ = sorted(k for k in set(want) | set(found) if want.get(k) != found.get(k))
    assert not differ, f"{len(differ)} of {len(want)} fingerprints differ: {differ}"
    assert said == f"{len(want)} of {len(want)} fingerprints equal"


def test_execution_only_keys_rerun_nothing(run_dir):
    """The stage table's execution keys (the engine's interpreter and memory, the checkpoint
    period, the live curves) and the jobs' threads change how jobs run, never what they write:
    nothing reruns."""
    res = snakemake(
        run_dir,
        "-n",
        "--config",
        f"rollout={{python: {sys.executable}, kv_cache_gib: 1, enforce_eager: true, gpu_memory_utilization: 0.5}}",
        "train={checkpoint_every: 2}",
        "resources={rollout: {threads: 2}, features: {threads: 2}}",
        "tracking={tensorboard: false, wandb: {project: p, mode: online, group: g}}",
    )
    assert planned_rules(res.stdout) == set(), res.stdout[-3000:]


def test_an_estimator_option_reruns_the_variance_study_but_not_its_pool(run_dir):
    res = snakemake(run_dir, "-n", "--config", "advantages={handle_zero_tail: false}")
    assert "variance" in planned_rules(res.stdout) and "variance_pool" not in planned_rules(res.stdout)
    # the study compares baselines unshifted and grpo without std: these options do not rerun it
    res = snakemake(run_dir, "-n", "--config", "advantages={baseline_shift: -0.1, std_normalize: false}")
    assert "advantages" in planned_rules(res.stdout) and "variance" not in planned_rules(res.stdout)


def test_evaluating_every_other_iteration_reruns_only_the_report(run_dir):
    """evaluate.every is not an input of the evaluations: on the finished 2-iteration run it drops
    iteration 0's evaluation from the report and reruns nothing else."""
    res = snakemake(run_dir, "-n", "--config", "evaluate={every: 2}")
    assert planned_rules(res.stdout) == {"report"}, res.stdout[-3000:]


def test_evaluate_every_picks_the_evaluated_policies(tmp_path):
    """5 iterations, every 2: the initial policy, iterations 1 and 3, and the last (4)."""
    res = snakemake(tmp_path, "-n", "--config", "iterations=5", "evaluate={every: 2}")
    evaluated = {o.split("/")[1] for o in planned_outputs(res.stdout) if o.endswith("eval/summary.parquet")}
    assert evaluated == {"initial", "iter_1", "iter_3", "iter_4"}, res.stdout[-3000:]


@pytest.mark.parametrize(
    "override, key",
    [
        ("advantages={estimator: foo}", "advantages.estimator"),
        ("rollout={group_size: 0}", "rollout.group_size"),
        ("rollout={groupsize: 4}", "rollout.groupsize"),
        ("resources={shard: {gpu: 1}}", "resources.shard.gpu"),  # a CPU-only stage
        ("resources={trian: {gpu: 1}}", "resources.trian"),
    ],
)
def test_bad_config_fails_before_any_job(tmp_path, override, key):
    res = snakemake(tmp_path, "--config", override, check=False)
    assert res.returncode != 0
    assert key in res.stdout + res.stderr
    assert not (tmp_path / "results").exists() or not any((tmp_path / "results").rglob("*.parquet"))


def test_the_tiny_workflow_with_the_seeds_systems(run_dir, tmp_path):
    """Issue 25's systems together on a copy of the tiny run: DAPO's dynamic sampling, the cosine
    reward with DAPO's overlong punishment, vocabulary pruning (rollout.min_p) and a learned reward
    model (a tiny random GPT-2 classifier, weight 0.5). No group whose verifiable rewards are all
    equal reaches the advantages stage; the score job adds 0.5 x its score to the shaped reward;
    the features and train stages prune; evaluation still scores 0 or 1 and gives the initial
    policy the tables it had; the report counts the dropped groups' tokens; a rerun plans nothing;
    a reward model folder that does not exist is refused before any job."""
    from conftest import save_reward_model

    from otbflow.models.policy import build_char_tokenizer

    work = copy_run(run_dir, tmp_path / "run")
    rm = save_reward_model(tmp_path / "rm", "gpt2", build_char_tokenizer(), 32)
    systems = [
        "rollout={filter_groups: true, min_p: 0.05}",
        "task={reward: cosine, overlong_buffer: 8, cosine: {exceed_margin: 4}, "
        f"reward_model: {{path: {rm}, weight: 0.5}}}}",
    ]
    snakemake(work, "--config", *systems)
    r = work / "results"
    for k in (0, 1):
        adv = read_table(r / f"iter_{k}/advantages/advantages.parquet", schemas.ADVANTAGES)
        spread = adv.group_by("group_id").agg(pl.col("verifiable_reward").n_unique())["verifiable_reward"]
        assert spread.min() == 2, k
        assert adv["rm_score"].is_not_null().all() and adv["rm_score"].std() > 0
        for s in (0, 1):
            raw = read_table(r / f"iter_{k}/rollout/shard_{s}.parquet", schemas.ROLLOUTS)
            scored = read_table(r / f"iter_{k}/rollout/scored_{s}.parquet", schemas.ROLLOUTS)
            assert scored.drop("reward", "rm_score").equals(raw.drop("reward"))
            assert (scored["reward"] - raw["reward"] - 0.5 * scored["rm_score"]).abs().max() < 1e-12
            assert not raw["reward"].equals(raw["verifiable_reward"])  # shaped
            features = read_table(r / f"iter_{k}/features/shard_{s}.parquet", schemas.FEATURES)
            assert features["pruned_fraction"].mean() > 0
        assert (
            read_table(r / f"iter_{k}/train/metrics.parquet", schemas.TRAIN_METRICS)["pruned_vocab_fraction"].min() > 0
        )
    summary = read_table(r / "report/rollouts.parquet", schemas.ROLLOUT_SUMMARY)
    for k, row in enumerate(summary.iter_rows(named=True)):  # 8 prompts per iteration, 4 per shard
        groups = read_table(r / f"iter_{k}/advantages/advantages.parquet", schemas.ADVANTAGES)["group_id"].n_unique()
        assert groups == row["groups_kept"] and (groups == 8) == (row["shards_short"] == 0), row
    assert summary["groups_dropped"].sum() > 0  # the bootstrapped policy leaves some groups uniform
    kept_tokens = [
        sum(
            read_table(r / f"iter_{k}/rollout/shard_{s}.parquet", schemas.ROLLOUTS)["response_length"].sum()
            for s in (0, 1)
        )
        for k in (0, 1)
    ]
    assert all(t >= kt for t, kt in zip(summary["tokens"].to_list(), kept_tokens))
    assert any(t > kt for t, kt in zip(summary["tokens"].to_list(), kept_tokens))  # dropped groups' tokens
    # responses generated: group_size (4) x the groups each job's metadata says it generated
    generated = [
        sum(
            4 * read_metadata(r / f"iter_{k}/rollout/shard_{s}.parquet")["dynamic_sampling"]["groups_generated"]
            for s in (0, 1)
        )
        for k in (0, 1)
    ]
    assert summary["responses"].to_list() == generated and sum(generated) > 4 * summary["groups_kept"].sum()
    progress = read_table(r / "report/progress.parquet", schemas.PROGRESS)
    assert progress["responses_generated"].to_list() == [0, generated[0], generated[0] + generated[1]]
    evals = read_table(r / "initial/eval/samples.parquet", schemas.EVAL_SAMPLES)
    before = read_table(run_dir / "results/initial/eval/samples.parquet", schemas.EVAL_SAMPLES)
    assert evals.equals(before) and set(evals["reward"].to_list()) <= {0.0, 1.0}
    assert planned_rules(snakemake(work, "-n", "--config", *systems).stdout) == set()

    before = tree_state(r)
    missing = f"task={{reward_model: {{path: {tmp_path / 'nowhere'}}}}}"
    res = snakemake(work, "--config", missing, check=False)
    out = res.stdout + res.stderr
    assert res.returncode != 0 and "config key 'task.reward_model.path'" in out and "no such folder" in out, out[-3000:]
    assert tree_state(r) == before
