"""Every command that README.md and docs/*.md show is executed here, so that docs that drift
from the code fail CI.

A shown command is a line of a ```bash block (continuation lines joined, comments dropped), or
an inline `code` span that is a whole command (it starts with make, snakemake, otbflow, .venv/bin/,
python or benchmarks/ and is not just a stage's name). ``HOW`` says how each one runs:

- ``AS_SHOWN``: exactly as shown, in a sandbox checkout (``conftest.make_sandbox``) that holds a
  finished tiny run (README command 1 with config/tiny.yaml, copied from ``conftest.tiny_run``);
- ``DRY``: as shown plus Snakemake's ``-n`` (a dry run: the config is loaded and validated and
  the jobs are planned, nothing runs), for commands that would run the full default workflow;
- any other string: the tiny form that runs instead (same command, smaller inputs), shown
  next to the original so that a reader can compare them;
- ``CI``: ``make test`` itself (CI runs it: .ci/run);
- ``TINY_RUN``: the session's tiny run (``conftest.tiny_run``: ``make run`` with config/tiny.yaml);
- ``SLURM``: run by tests/test_slurm_integration.py on a local one-node Slurm;
- ``EXPERIMENT``: run by tests/test_experiment.py on the reduced experiment
  (config/experiments/tiny.yaml): its report for real, a member's --forcerun as a dry run;
- ``REAL_MODEL``: run by tests/test_readme_real_model.py (a tiny Qwen2 folder and a GSM8K-layout
  file in place of the user's checkpoint and data, small sizes layered on);
- ``MODELS``: run by tests/test_workflow_models.py (the tiny workflow on Qwen2 + BPE + chat with
  the vLLM backend);
- ``WORKERS``: run by tests/test_worker.py (the workers it starts serve the tiny run redone);
- ``GPU_CHECK``: run by tests/test_gpu_check.py (the GPU check's tiny form, every step on CPU).

A command shown in the docs but missing here fails ``test_every_shown_command_is_covered``, and
so does an entry here that the docs no longer show. Python blocks run too, one subprocess per
document, in the sandbox.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
from conftest import REPO, make_sandbox, sandbox_env

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("docs")]
# docs/measurements.md is a record of the commands that measured each figure (with their machine and
# date), not instructions: the commands a reader is told to run are on the other pages.
DOCS = [REPO / "README.md", *sorted(p for p in (REPO / "docs").glob("*.md") if p.name != "measurements.md")]
PREFIXES = ("make ", "snakemake ", "otbflow ", ".venv/bin/", "python ", "python3 ", "benchmarks/")

AS_SHOWN, DRY, CI, SLURM = "as shown", "dry run", "CI", "Slurm"
TINY_RUN = "conftest.tiny_run"  # its tiny form is the session's tiny run: make run with config/tiny.yaml
EXPERIMENT = "tests/test_experiment.py"  # run there, on the reduced experiment config/experiments/tiny.yaml
REAL_MODEL = "tests/test_readme_real_model.py"  # run there, with a tiny Qwen2 folder and a GSM8K-layout file
MODELS = "tests/test_workflow_models.py"  # run there: the tiny workflow on Qwen2 + BPE + chat with vLLM
WORKERS = "tests/test_worker.py"  # run there: the workers started as shown serve the tiny run redone
GPU_CHECK = "tests/test_gpu_check.py"  # run there: the GPU check's tiny form, every step on CPU
TINY = "--configfile config/tiny.yaml"
# The variance study over seeds, one seed of the tiny config, on the tiny run's initial policy and
# prompts (the script builds them only where its folder lacks them; the bootstrap is tested elsewhere).
VARIANCE_SEEDS = (
    "mkdir -p results/scratch/vs/data && cp -r results/bootstrap/policy results/scratch/vs/policy && "
    "cp -r results/data/train results/scratch/vs/data/train && .venv/bin/python "
    "benchmarks/variance_seeds.py --seeds 0 --out results/scratch/vs --configfile config/tiny.yaml"
)
WANDB_SYNC = (
    "otbflow evaluate --prompts results/data/eval.parquet --policy results/bootstrap/policy --name initial "
    "--samples results/scratch/samples.parquet --summary results/scratch/summary.parquet "
    "--tracking-name evaluate/initial evaluate.n_samples=1 tracking.wandb.project=my_project && "
    "wandb sync --dry-run results/wandb/offline-run-* 2>&1 | grep 'Would sync 1 run'"
)
# The GPU check: the bundle is listed, not fetched; --bundle installs a one-wheel bundle of a package
# the venv holds at that version (pip leaves it as it is)
ONE_WHEEL_BUNDLE = (
    "mkdir -p results/scratch/bundle/part1 && python -m pip download -q --no-deps -d results/scratch/bundle/part1 "
    "hjson==$(python -c 'import importlib.metadata as m; print(m.version(\"hjson\"))') && "
    "bash benchmarks/gpu/check.sh --bundle results/scratch/bundle --install-only"
)
RECORD_SHOWN = (
    'python benchmarks/measurements.py record dry_run_planning_500 --title "Planning a 500-iteration run" '
    '--topic workflow --figure "jobs planned" jobs "" --figure "planned (-q)" plan_seconds s --figure '
    '"every job listed" listing_seconds s -- python benchmarks/bench_dry_run.py --iterations 500 --repeats 3'
)
RECORD_TINY = RECORD_SHOWN.replace("--iterations 500 --repeats 3", "--iterations 20 --repeats 1")
BENCH_ROLLOUT_TINY = "python benchmarks/bench_rollout.py --models tiny --backends hf --prompts 4 --group-size 2 --max-new-tokens 8 --repeats 1"
HOW: dict[str, str] = {
    # README: the two commands
    "make run": TINY_RUN,
    "make test": CI,
    # one test, in the make recipe's own process (TEST_WORKERS=0: no pytest-xdist workers to start)
    'make test PYTEST_ARGS="-k config"': 'make test TEST_WORKERS=0 PYTEST_ARGS="tests/test_docs_commands.py '
    '-k shown_commands_parse -p no:cacheprovider"',
    "snakemake --cores 2": DRY,  # what make run runs
    # Where to change what: the structure read from the imports
    "python tests/layers.py": AS_SHOWN,
    "make run ARGS=\"--config 'advantages={estimator: grpo}'\"": f"make run ARGS=\"{TINY} --config 'advantages={{estimator: grpo}}' -n\"",
    # Configuration
    "snakemake --cores 2 --config 'advantages={estimator: grpo, std_normalize: false}'": DRY,
    "snakemake --cores 2 --configfile config/tiny.yaml": AS_SHOWN,  # the tiny run: nothing left to do
    "otbflow rollout --prompts P --policy M --out O rollout.group_size=8 rollout.temperature=0.7": "otbflow rollout --prompts results/data/train/shard_0.parquet --policy results/bootstrap/policy "
    "--out results/scratch/rollout.parquet rollout.group_size=8 rollout.temperature=0.7",
    "otbflow config rollout.group_size=8": AS_SHOWN,
    "otbflow config --help-keys": AS_SHOWN,
    "otbflow <stage> --help": "otbflow rollout --help && otbflow train --help",
    "otbflow advantages --help": AS_SHOWN,
    "otbflow schema-doc > docs/schema.md": "otbflow schema-doc > results/schema.md && diff results/schema.md docs/schema.md",
    # Training
    "snakemake --cores 2 --config 'train={loss_type: reinforce, rollout_is: sequence, lr_schedule: cosine}'": DRY,
    "snakemake --cores 2 --config 'rollout={staleness: 1}' 'train={rollout_is: token}'": DRY,
    "snakemake --cores 2 --configfile config/examples/long_tail.yaml config/examples/stream.yaml": DRY,
    "snakemake --configfile my.yaml config/examples/zero2_bf16.yaml": "snakemake -n --cores 2 --configfile config/tiny.yaml config/examples/zero2_bf16.yaml",
    "otbflow train --advantages results/iter_0/advantages/advantages.parquet --policy results/bootstrap/policy "
    "--out /tmp/next --metrics /tmp/metrics.parquet train.loss_type=reinforce train.rollout_is=sequence": "otbflow train --advantages results/iter_0/advantages/advantages.parquet --policy results/bootstrap/policy "
    "--out results/scratch/next --metrics results/scratch/metrics.parquet train.loss_type=reinforce "
    "train.rollout_is=sequence",
    # Watching a run: TensorBoard on a free port until it serves the tiny run's curves, then stopped
    "tensorboard --logdir results/tensorboard": "python tests/tensorboard_serves.py results/tensorboard",
    "snakemake --cores 2 --config 'tracking={wandb: {project: my_project}}'": DRY,
    # no network here: one evaluation writes an offline W&B run, which wandb sync finds (--dry-run)
    "wandb sync results/wandb/offline-run-*": WANDB_SYNC,
    # Experiments
    ".venv/bin/snakemake -s workflow/experiment.smk --configfile config/experiments/otb_vs_grpo.yaml --cores 2": DRY,
    ".venv/bin/snakemake -s workflow/experiment.smk --configfile config/experiments/stability.yaml --cores 2": DRY,
    ".venv/bin/snakemake -s workflow/experiment.smk --configfile config/experiments/staleness.yaml --cores 2": DRY,
    ".venv/bin/snakemake -s workflow/experiment.smk --configfile config/experiments/laminar.yaml --cores 2": DRY,
    ".venv/bin/snakemake -s workflow/experiment.smk --configfile config/experiments/otb_vs_grpo.yaml "
    "--report results/otb_vs_grpo/report.html": EXPERIMENT,
    "snakemake -s Snakefile --directory results/otb_vs_grpo/otb_n4/seed_0 --configfile "
    "results/otb_vs_grpo/otb_n4/seed_0/member.yaml --cores 2 --forcerun advantages": EXPERIMENT,
    # Caching
    "snakemake --cores 2 results/iter_0/advantages/advantages.parquet": f"snakemake --cores 2 results/iter_0/advantages/advantages.parquet {TINY}",
    # the one-time migration after the quoted shell commands: on the finished tiny run, both plan nothing
    "snakemake -n --rerun-triggers mtime params input software-env --configfile my.yaml": "snakemake -n "
    f"--rerun-triggers mtime params input software-env {TINY}",
    "snakemake --touch --cores 1 --configfile my.yaml": f"snakemake --touch --cores 1 {TINY}",
    # Slurm
    "otbflow submit --configfile my.yaml --partition long --account my_project": SLURM,
    "tail -f logs/submit/4242/4242_0_log.out": SLURM,
    "squeue --me": SLURM,
    "ls .snakemake/slurm_logs/rule_train/": SLURM,
    "otbflow submit --configfile my.yaml -- --config 'advantages={estimator: grpo}'": SLURM,
    "otbflow submit --configfile my.yaml --rerun advantages": SLURM,
    "otbflow submit --configfile my.yaml": SLURM,
    "otbflow submit --configfile my.yaml --workers": SLURM,
    "snakemake --workflow-profile slurm --configfile my.yaml < /dev/null": SLURM,
    "otbflow submit --configfile my.yaml --group-iterations": SLURM,
    # a head that cannot be asked (docs/slurm.md, "When the head dies"): its lock and record cleared
    "snakemake --unlock": f"snakemake --unlock {TINY} && test ! -e .snakemake/otbflow-heads",
    # A real model and dataset
    ".venv/bin/otbflow shard --out-dir results/data task.name=dataset task.path=/data/gsm8k/train.parquet": REAL_MODEL,
    ".venv/bin/snakemake --cores 8 --config 'model={path: /models/Qwen2.5-0.5B-Instruct, dtype: bfloat16}' "
    "'task={name: dataset, path: /data/gsm8k/train.parquet}'": REAL_MODEL,
    ".venv/bin/snakemake --cores 8 --config 'model={path: /models/Qwen2.5-0.5B-Instruct, dtype: bfloat16}' "
    "'task={name: dataset, path: /data/gsm8k/train.parquet}' --report results/report.html "
    "--report-metadata results/report/metadata.yaml": REAL_MODEL,
    # a dry run here; the same pipeline runs for real on this Qwen2 + BPE + chat policy in the reduced
    # experiment (tests/test_experiment.py) and with vLLM (tests/test_workflow_models.py)
    "snakemake --cores 2 --configfile config/tiny.yaml config/examples/qwen2_bpe_chat.yaml": DRY,
    # vLLM
    "make vllm-env": CI,  # .ci/run builds it before make test
    ".venv/bin/snakemake --cores 2 --configfile config/tiny.yaml config/examples/vllm_cpu.yaml": MODELS,
    "snakemake --cores 8 --sdm conda --config 'rollout={backend: vllm}' 'model={path: /models/Qwen2.5-1.5B, dtype: bfloat16}'":
    # no conda on the CI machines: the same dry run without --sdm conda
    "snakemake -n --cores 8 --config 'rollout={backend: vllm}' 'model={path: results/bootstrap/policy, dtype: bfloat16}'",
    ".venv/bin/snakemake --cores 8 --config 'rollout={backend: vllm, python: /opt/envs/vllm/bin/python}'": DRY,
    # disk estimates (the model's config counted on the meta device: as shown)
    "otbflow disk iterations=100 retention.policy_every=0 retention.optimizer=all": AS_SHOWN,
    "otbflow disk --model-config benchmarks/shapes/qwen2.5-7b.json --prompt-tokens 200 iterations=100 "
    "rollout.prompts_per_iteration=512 rollout.group_size=16 rollout.max_new_tokens=4096 train.zero_stage=1 "
    "train.bf16=true": AS_SHOWN,
    # docs/scale.md: its check rewrites nothing (the dry run it shows runs as shown); the start-up
    # benchmark on the default shape only
    "python benchmarks/scale.py": "python benchmarks/scale.py --check",
    "python benchmarks/bench_pruning_mismatch.py": "python benchmarks/bench_pruning_mismatch.py "
    "--prompts-per-shard 2 --group-size 2 --min-p 0,0.01",
    # docs/rewards.md: a learned reward model (the user's folder: the config check refuses a missing
    # one, so a dry run needs a real folder; tests/test_workflow.py runs the workflow with a tiny one)
    "snakemake --cores 2 --config 'task={reward_model: {path: /models/my-rm, weight: 0.5}}'": (
        "python -c \"import sys; sys.path.insert(0, 'tests'); from conftest import save_reward_model; "
        "from otbflow.models.policy import build_char_tokenizer; "
        "save_reward_model(__import__('pathlib').Path('results/scratch/my-rm'), 'gpt2', build_char_tokenizer(), 32)\" && "
        "snakemake -n --cores 2 --config 'task={reward_model: {path: results/scratch/my-rm, weight: 0.5}}'"
    ),
    # docs/rewards.md: DAPO's whole recipe on the default workflow
    "snakemake --cores 2 --config 'train={clip_ratio_high: 0.28, loss_agg_mode: token-mean, kl_coef: 0}' "
    "'rollout={filter_groups: true}' 'task={overlong_buffer: 8, overlong_penalty: 0.5}'": DRY,
    "snakemake -n --config iterations=100 'shard={n_shards: 8}' 'evaluate={every: 10}'": AS_SHOWN,
    "benchmarks/bench_startup.py": "python benchmarks/bench_startup.py --shapes default --no-vllm --out results/scratch/startup.json",
    "python benchmarks/bench_startup.py --out benchmarks/measured/startup.json": "python benchmarks/bench_startup.py "
    "--shapes default --no-vllm --out results/scratch/startup.json",
    # benchmarks (tiny sizes: each prints its JSON) and set-up
    "make setup": AS_SHOWN,
    # both shown forms run as one tiny form
    "python benchmarks/bench_rollout.py": BENCH_ROLLOUT_TINY,
    "python benchmarks/bench_rollout.py --models tiny,gpt2 --backends hf --prompts 16 --group-size 8 "
    "--max-new-tokens 32 --repeats 3": BENCH_ROLLOUT_TINY,
    # the GPU check's tiny form runs it (its chain step: one iteration per setting, no TRL)
    "python benchmarks/bench_iteration.py": GPU_CHECK,
    "benchmarks/bench_advantages.py": "python benchmarks/bench_advantages.py --tokens 20000 --repeats 1",
    # docs/training.md: the Laminar simulation at its smallest scale, without the sensitivity table
    "python benchmarks/laminar_sim.py --plot docs/laminar_sim.svg": "python benchmarks/laminar_sim.py --gpus 8 "
    "--iterations 4 --no-sensitivity --plot results/scratch/laminar_sim.svg",
    # docs/workers.md: the tiny run's first job (the shard) in each mode, once
    "python benchmarks/bench_preload.py": "python benchmarks/bench_preload.py --target results/data/eval.parquet "
    "--repeats 1",
    ".venv/bin/python benchmarks/bench_advantages.py": ".venv/bin/python benchmarks/bench_advantages.py --tokens 20000 "
    "--repeats 1",
    "benchmarks/bench_features.py": "python benchmarks/bench_features.py --sequences 4 --seq-len 32 --repeats 1 "
    "--models tiny",
    "benchmarks/bench_train_memory.py": "python benchmarks/bench_train_memory.py --sequences 1 --response-len 16 "
    "--layers 1 --vocab 4096",
    ".venv/bin/python benchmarks/bench_train_memory.py": ".venv/bin/python benchmarks/bench_train_memory.py "
    "--sequences 1 --response-len 16 --layers 1 --vocab 4096",
    "benchmarks/variance_seeds.py": VARIANCE_SEEDS,
    "python benchmarks/bench_zero3_load.py --hidden 1536 --layers 12": "python benchmarks/bench_zero3_load.py "
    "--hidden 128 --layers 1 --vocab 1000",
    # docs/testing.md: the interpreters' imports (the loop only, once each)
    "python benchmarks/bench_interpreter.py --repeats 5": "python benchmarks/bench_interpreter.py --work python --repeats 1",
    "python benchmarks/bench_dry_run.py --iterations 500 --repeats 3": "python benchmarks/bench_dry_run.py "
    "--iterations 3 --repeats 1",
    "python benchmarks/bench_rewards.py --responses 2000 --repeats 3": "python benchmarks/bench_rewards.py "
    "--responses 20 --repeats 1",
    "python benchmarks/bench_reward_adversarial.py": "python benchmarks/bench_reward_adversarial.py --sizes 8000 "
    "--old-sizes 1000",
    # docs/environments.md, "The GPU check": on CPU at a tiny shape
    "benchmarks/gpu/check.sh": GPU_CHECK,
    "bash benchmarks/gpu/check.sh --device cpu --tiny --out results/gpu_check": GPU_CHECK,
    "bash benchmarks/gpu/check.sh --bundle .gpu-bundle --out results/gpu_check": GPU_CHECK,
    "bash benchmarks/gpu/check.sh --bundle .gpu-bundle --install-only": ONE_WHEEL_BUNDLE,
    "bash benchmarks/gpu/bundle.sh .gpu-bundle": "bash benchmarks/gpu/bundle.sh --list | grep -x 'snakemake==.*'",
    # the GPU check's steps run these (tiny, on CPU): its policy, decode and chain steps
    "benchmarks/make_policy.py": GPU_CHECK,
    "benchmarks/bench_decode.py": GPU_CHECK,
    # the sandbox's tiny run (its train jobs' metrics; its bootstrap policy)
    "benchmarks/bench_train_mfu.py": "python benchmarks/bench_train_mfu.py --runs .",
    "benchmarks/bench_iteration.py": GPU_CHECK,
    # the lint CI runs (.ci/run); Snakemake's own lint runs here
    "make lint": CI,
    "snakemake --lint": AS_SHOWN,
    # the recorded fingerprints are of the default run, for one machine key: here the sandbox's
    # (tiny) run, with other commands' outputs beside it, is checked against its own, recorded
    # first, and the command as shown names this key's file or says none is recorded (it then
    # differs from the tiny run: its exit is not the point; test_workflow checks the tiny run's own)
    "python tests/fingerprint.py results --recorded default": (
        "mkdir -p results/scratch && python tests/fingerprint.py results > results/scratch/fp.json && "
        "python tests/fingerprint.py results --check results/scratch/fp.json && "
        "python tests/fingerprint.py results --recorded default | grep -E '^fingerprints: (none recorded for|tests/data/)'"
    ),
    ".venv/bin/python benchmarks/variance_seeds.py --seeds 0 1 2 3 4": VARIANCE_SEEDS,
    # docs/testing.md: a record written from a benchmark's JSON (a 20-iteration plan), then measured again
    RECORD_SHOWN: RECORD_TINY,
    "python benchmarks/measurements.py rerun dry_run_planning_500": (
        f"{RECORD_TINY} && python benchmarks/measurements.py rerun dry_run_planning_500 && "
        "grep -q 'Planning a 500-iteration run' docs/measurements.md"
    ),
    # docs/workers.md: a train worker of two ranks (torchrun) registers, and ends once idle
    # (tests/test_worker.py::test_a_train_worker_of_two_ranks runs train jobs on one)
    "otbflow worker train --results results --tasks N": (
        "otbflow worker train --results results --tasks 2 --idle-exit 1 2>&1 | grep -q 'rank 1: rank 0 ended the worker'"
    ),
    # docs/workers.md: the workers serve the tiny run's iterations redone, and end once idle
    "for kind in generate features train; do otbflow worker $kind --results results --idle-exit 600 & done": WORKERS,
}


def _same(executed: str) -> str:
    """Commands that differ only by the interpreter's path run once (`python x.py` in the
    sandbox is `.venv/bin/python x.py`)."""
    return re.sub(r"^(\.venv/bin/)?python3? ", "python ", executed)


def _strip_comment(line: str) -> str:
    """``cmd  # comment`` -> ``cmd`` (a # outside quotes that starts a word)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def shown_commands(text: str) -> list[str]:
    """The commands a Markdown text shows (see the module docstring)."""
    out: list[str] = []
    for block in re.findall(r"```(?:bash|sh|shell)\n(.*?)```", text, re.S):
        pending = ""
        for line in block.splitlines():
            line = (pending + " " + line.strip()) if pending else line.strip()
            if line.endswith("\\"):
                pending = line[:-1].rstrip()
                continue
            pending = ""
            line = _strip_comment(line)
            if line:
                out.append(line)
    for span in re.findall(r"(?<!`)`([^`\n]+)`(?!`)", text):
        span = span.strip()
        if span.startswith(PREFIXES) and not re.fullmatch(r"otbflow [\w-]+", span) and not span.endswith("/"):
            out.append(span)
    return list(dict.fromkeys(out))


def all_shown() -> dict[str, list[str]]:
    shown: dict[str, list[str]] = {}
    for doc in DOCS:
        for cmd in shown_commands(doc.read_text()):
            shown.setdefault(cmd, []).append(doc.name)
    return shown


def test_every_shown_command_is_covered():
    shown = all_shown()
    missing = [f"{c!r} (in {', '.join(d)})" for c, d in shown.items() if c not in HOW]
    assert not missing, "commands shown in the docs that no test runs; add them to HOW:\n" + "\n".join(missing)
    stale = [c for c in HOW if c not in shown]
    assert not stale, f"HOW lists commands the docs no longer show: {stale}"


def test_shown_commands_parse():
    text = (
        "```bash\nmake run   # a comment\nsnakemake -n \\\n  --cores 2  # x\n# only a comment\n```\n"
        "Run `otbflow config --help-keys`, see `otbflow scaling` and `results/`."
    )
    assert shown_commands(text) == ["make run", "snakemake -n --cores 2", "otbflow config --help-keys"]
    assert _strip_comment("make run ARGS=\"--config 'a={b: c}'\"  # x") == "make run ARGS=\"--config 'a={b: c}'\""


@pytest.fixture(scope="module")
def docs_sandbox(tiny_run, tmp_path_factory):
    """A sandbox checkout with a copy of the tiny run's results (and Snakemake's record of them),
    so that commands that write do not touch the run other tests read."""
    work = make_sandbox(tmp_path_factory.mktemp("docs"))
    # the records and the page that `measurements.py record/rerun` write: the sandbox's own copies
    for folder, own in (("benchmarks", "measured"), ("docs", "measurements.md")):
        (work / folder).unlink()
        (work / folder).mkdir()
        for entry in (REPO / folder).iterdir():
            if entry.name == own:
                (shutil.copytree if entry.is_dir() else shutil.copy)(entry, work / folder / own)
            else:
                (work / folder / entry.name).symlink_to(entry)
    for name in ("results", ".snakemake"):
        shutil.copytree(
            tiny_run / name,
            work / name,
            symlinks=True,
            ignore=shutil.ignore_patterns("locks", "incomplete", "conda", "slurm_logs"),
        )
    return work


def runnable() -> list[tuple[str, str]]:
    """(shown, executed) pairs, each distinct executed command once."""
    out, seen = [], set()
    for cmd, how in HOW.items():
        if how in (CI, SLURM, EXPERIMENT, REAL_MODEL, MODELS, WORKERS, GPU_CHECK, TINY_RUN):
            continue
        if how == AS_SHOWN:
            executed = cmd
        elif how == DRY:
            executed = cmd.replace(" < /dev/null", "") + " -n"
        else:
            executed = how
        if _same(executed) not in seen:
            seen.add(_same(executed))
            out.append((cmd, executed))
    return out


@pytest.mark.parametrize("shown, executed", runnable(), ids=[c[:60] for c, _ in runnable()])
def test_shown_command_runs(docs_sandbox, shown, executed):
    res = subprocess.run(
        executed,
        shell=True,
        cwd=docs_sandbox,
        env=sandbox_env(docs_sandbox),
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=600,
    )
    assert res.returncode == 0, f"{shown!r} ran as {executed!r} and failed:\n{res.stdout[-3000:]}\n{res.stderr[-5000:]}"
    if how_is_dry(shown):
        assert "Job stats" in res.stdout or "Nothing to be done" in res.stdout, res.stdout[-2000:]


def test_make_run_is_the_session_tiny_run(tiny_run):
    """README command 1 in its tiny form is the session's tiny run (conftest.tiny_run: make run with
    config/tiny.yaml, which fails the session where it fails): it ends with the HTML report."""
    assert (tiny_run / "results" / "report.html").stat().st_size > 0


def how_is_dry(cmd: str) -> bool:
    return HOW[cmd] == DRY or " -n" in HOW[cmd].split("&&")[0]


@pytest.mark.parametrize("doc", [d for d in DOCS if "```python" in d.read_text()], ids=lambda d: d.name)
def test_python_blocks_run(docs_sandbox, doc):
    """The document's ```python blocks, in order, in one interpreter (later blocks use names the
    earlier ones defined), in the sandbox."""
    code = "\n".join(re.findall(r"```python\n(.*?)```", doc.read_text(), re.S))
    res = subprocess.run(
        ["python", "-c", code],
        cwd=docs_sandbox,
        env=sandbox_env(docs_sandbox),
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=300,
    )
    assert res.returncode == 0, f"{doc.name}'s python blocks failed:\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}"
