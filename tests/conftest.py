"""Shared fixtures: a tiny validated config, a tiny (untrained) policy, prompt shards."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from otbflow.config import DEFAULT_CONFIG, load_config

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "config" / "tiny.yaml"
QWEN2_BPE_CHAT = REPO / "config" / "examples" / "qwen2_bpe_chat.yaml"
# A config layer for end-to-end runs on real architectures: one iteration on one shard, few
# prompts; every stage runs, each as little as it can.
SMALL = {
    "iterations": 1,
    "shard": {"n_shards": 1},
    "task": {"n_train": 12, "n_eval": 4},
    "bootstrap": {"sft_max_steps": 20, "eval_every": 20, "n_eval_prompts": 8, "sft_batch_size": 32},
    "rollout": {"prompts_per_iteration": 4, "group_size": 4, "max_new_tokens": 16},
    "evaluate": {"n_samples": 2, "max_new_tokens": 16},
    "train": {"mini_batch_size": 16, "micro_batch_size": 8},
    "variance": {"pool_prompts": 2, "pool_size": 4, "resamples": 10, "sketch_dim": 256},
    "scaling": {"max_sequences": 8, "ci_resamples": 20},
}
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
# torch threads per stage run in a test: 2 on its own, 1 per pytest-xdist worker (make test runs
# two workers more than cores; two threads each would oversubscribe them further)
os.environ.setdefault("OTBFLOW_THREADS", "1" if os.environ.get("PYTEST_XDIST_WORKER") else "2")
# Several processes with torch threads share the cores while the suite runs: OpenMP threads that
# busy-wait after each parallel region (libgomp's default policy) burn the CPU that the other tests
# wait for. libgomp reads this when torch loads it (the imports above load no torch); every job a
# test starts inherits it. What a job computes does not depend on it (the fingerprint tests compare
# runs bitwise); what it saves: docs/testing.md, "CI".
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The preload servers of this session's stage jobs (otbflow.ops.preload) live in a folder of the
# session's (made by the first process, the pytest-xdist workers inherit it) and end with it. Idle,
# one waits 10 minutes instead of 2 for the next test's jobs: an idle server uses no CPU, a new one
# pays its imports again.
os.environ.setdefault("OTBFLOW_PRELOAD_IDLE_S", "600")
# Where the environment says not to write bytecode (PYTHONDONTWRITEBYTECODE; the CI machine sets
# it), each of the thousands of processes the suite starts would compile the otbflow modules it
# imports, 0.1 CPU-s or more apiece: the session's first process compiles src/ once (Python still
# reads those files, and compiles a module whose source is newer than its file in memory).
if not os.environ.get("PYTEST_XDIST_WORKER"):
    import compileall

    compileall.compile_dir(REPO / "src", quiet=1)
if "OTBFLOW_PRELOAD_DIR" not in os.environ:
    import tempfile

    os.environ["OTBFLOW_PRELOAD_DIR"] = _PRELOAD_DIR = tempfile.mkdtemp(prefix="otbflow-preload-")
else:
    _PRELOAD_DIR = None
# What a user's checkout has at its top level; a sandbox links to these (results/ stays its own).
SANDBOX_ENTRIES = (
    "Snakefile",
    "workflow",
    "config",
    "src",
    "envs",
    "slurm",
    "benchmarks",
    "docs",
    "tests",
    "Makefile",
    "pyproject.toml",
    "constraints.txt",
    "README.md",
)


@pytest.fixture(autouse=True)
def clean_env():
    """A train stage run in the test's process (tests/test_train*.py, tests/test_stage_keys.py) sets
    RANK, MASTER_PORT... in os.environ and keeps its rendezvous port open: every test starts
    without them and leaves none behind, so that the jobs a later test starts (a workflow's train
    job) do not inherit a port that is taken. Also ignores a Slurm job the tests may run in."""
    saved = dict(os.environ)
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID"):
        os.environ.pop(k, None)
    yield
    os.environ.clear()
    os.environ.update(saved)


def folder_digest(folder: Path) -> dict[str, str]:
    """Every file's sha256 by its path in ``folder``, but a policy's manifest.json by the tensors it
    lists: the rest of it names the folder's path (and, from a worker, carries the run key's MAC),
    which another copy of the run has otherwise (otbflow.runtime.manifest)."""
    import hashlib
    import json

    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            data = p.read_bytes()
            if p.name == "manifest.json":
                data = json.dumps(json.loads(data)["tensors"], sort_keys=True).encode()
            out[str(p.relative_to(folder))] = hashlib.sha256(data).hexdigest()
    return out


def make_sandbox(path: Path) -> Path:
    """A folder that looks like a checkout of this repository (links to its files and to the
    running interpreter's venv as .venv) but has its own results/, so that README commands run
    there as a user would run them in the checkout."""
    path.mkdir(parents=True, exist_ok=True)
    for name in SANDBOX_ENTRIES:
        if (REPO / name).exists() and not (path / name).exists():
            (path / name).symlink_to(REPO / name)
    venv = Path(sys.prefix)
    if not (path / ".venv").exists():
        (path / ".venv").symlink_to(venv)
    return path


def sandbox_env(path: Path) -> dict:
    """The environment of a user's shell in the sandbox: the venv's bin first on PATH (otbflow,
    snakemake, python), this repository's src importable."""
    env = dict(os.environ)
    env["PATH"] = f"{path / '.venv' / 'bin'}:{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(REPO / "src")
    return env


def once_per_session(tmp_path_factory, worker_id: str, name: str, build) -> Path:
    """The folder ``name`` that ``build(folder)`` fills, once per test session: under pytest-xdist
    the first worker to ask builds it, under a file lock in the session's temp root, and the others
    wait for it. ``build`` raises AssertionError with what went wrong; the others get the same
    error without building again."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if worker_id != "master":
        root = root.parent  # pytest-of-<user>/pytest-<n>: this session's, shared by its workers
    work, done, failed = root / name, root / f"{name}.done", root / f"{name}.failed"
    with FileLock(str(root / f"{name}.lock")):
        if failed.is_file():
            raise AssertionError(failed.read_text())
        if not done.is_file():
            try:
                build(work)
            except AssertionError as e:
                failed.write_text(str(e))
                raise
            done.touch()
    return work


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, worker_id):
    """README command 1 in its tiny form, once per test session: ``make run`` with config/tiny.yaml
    in a sandbox checkout (the whole workflow, 2 iterations, and the HTML report). Tests that read
    outputs, dry-run reruns or run the README's commands share this folder; those that write copy it.
    Under pytest-xdist the workers share it too (``once_per_session``)."""

    def build(work: Path) -> None:
        make_sandbox(work)
        res = subprocess.run(
            ["make", "run", "ARGS=--configfile config/tiny.yaml", "FINGERPRINTS=tiny"],
            cwd=work,
            env=sandbox_env(work),
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
        )
        log = f"{res.stdout[-4000:]}\n{res.stderr[-6000:]}"
        assert res.returncode == 0, f"make run (tiny) failed ({res.returncode}):\n{log}"
        (work / "make-run.out").write_text(res.stdout)  # its last lines: the fingerprints' check

    return once_per_session(tmp_path_factory, worker_id, "tiny_run", build)


@pytest.fixture(scope="session")
def two_rank_update(tiny_run, tmp_path_factory, worker_id):
    """The tiny run's iteration-0 train job (two ranks under torchrun) and its publish job, run by
    their client itself (no worker): ``alone0/`` (policy, metrics, optimizer state). The reference
    that the tests of a train worker of two ranks compare with (tests/test_worker.py, on a local
    worker; tests/test_slurm_integration.py, on a worker's Slurm job), built once per session."""

    def build(work: Path) -> None:
        from test_worker import launch_train

        work.mkdir()
        out = launch_train(work / "none", tiny_run, work / "alone0", 0, None, work / "clients.log")
        assert out.count("train finished in") == 2 and "runs train" not in out, out[-3000:]  # two ranks, no worker

    return once_per_session(tmp_path_factory, worker_id, "two_rank_update", build) / "alone0"


def vllm_python() -> Path:
    """The interpreter of `make vllm-env`. Absent: the test is skipped with the reason, or fails
    where OTBFLOW_REQUIRE_VLLM=1 (CI sets it, so that a missing environment cannot pass)."""
    ready = (VLLM_PYTHON.parent.parent / ".otbflow-installed").is_file()
    if not ready:
        reason = f"{VLLM_PYTHON.parent.parent} is not built (make vllm-env)"
        if os.environ.get("OTBFLOW_REQUIRE_VLLM") == "1":
            pytest.fail(f"{reason}, and OTBFLOW_REQUIRE_VLLM=1 requires it")
        pytest.skip(reason)
    return VLLM_PYTHON


def vllm_env(**extra: str) -> dict[str, str]:
    """Environment of an otbflow command run by .venv-vllm's Python: this source tree on PYTHONPATH."""
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), **extra)
    env.pop("VIRTUAL_ENV", None)
    return env


def tiny_config(*overrides: str):
    """config/config.yaml with config/tiny.yaml layered on top, plus overrides."""
    return load_config(DEFAULT_CONFIG, list(overrides), extra=yaml.safe_load(TINY.read_text()))


@pytest.fixture(scope="session")
def cfg():
    return tiny_config()


@pytest.fixture(scope="session")
def tiny_policy(tmp_path_factory, cfg):
    """An untrained tiny char-level GPT-2 saved as an HF folder."""
    from otbflow.models.policy import build_char_tokenizer, build_tiny_model

    path = tmp_path_factory.mktemp("policy") / "policy"
    tok = build_char_tokenizer()
    model = build_tiny_model(cfg.model, tok, seed=0)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def qwen2_bpe_policy(tmp_path_factory):
    """An untrained tiny Qwen2 (grouped-query attention) with a byte-level BPE tokenizer and a
    ChatML chat template, saved as an HF folder."""
    from otbflow.models.policy import build_tiny_model, build_tokenizer

    cfg = tiny_config("model.arch=qwen2", "model.tokenizer=bpe", "model.n_kv_head=1")
    path = tmp_path_factory.mktemp("policy") / "qwen2_bpe"
    tok = build_tokenizer(cfg.model, ["7+3=10;10-5=5;#5", "12+4=16;#16", "user\n", "assistant\n", "system\n"] * 4)
    build_tiny_model(cfg.model, tok, seed=0).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory, cfg):
    from otbflow.stages import shard

    out = tmp_path_factory.mktemp("data")
    shard.run(cfg, shard.Args(out_dir=str(out)))
    return out


@pytest.fixture(scope="session")
def rollouts_path(tmp_path_factory, cfg, tiny_policy, data_dir):
    from otbflow.stages import rollout

    out = tmp_path_factory.mktemp("rollout") / "shard_0.parquet"
    rollout.run(
        cfg,
        rollout.Args(
            prompts=str(data_dir / "train" / "shard_0.parquet"), policy=str(tiny_policy), out=str(out), iteration=0
        ),
    )
    return out


@pytest.fixture(scope="session")
def features_path(tmp_path_factory, cfg, tiny_policy, rollouts_path):
    from otbflow.stages import features

    out = tmp_path_factory.mktemp("features") / "shard_0.parquet"
    features.run(cfg, features.Args(rollouts=str(rollouts_path), policy=str(tiny_policy), out=str(out)))
    return out


# Long tests first. pytest-xdist hands out the tests in collection order (make test:
# --no-loadscope-reorder), so that the longest units start early and the short ones fill the end
# on both workers: the tiny run's group first (the Slurm and workflow groups wait for it), then
# the reduced experiment, which needs nothing, then the Slurm group, once the tiny run is done,
# then the other long groups, which the short tests left at the end otherwise could not balance
# (a CI run's timeline, OTBFLOW_TEST_TIMELINE, replayed through pytest-xdist's assignment rule:
# benchmarks/measured/ci_fresh_clone.json).
LONG_FIRST = (
    "tests/test_docs_commands.py",
    "tests/test_experiment.py::test_tiny_experiment",
    "tests/test_slurm_integration.py",
    "tests/test_gpu_check.py",
    "tests/test_readme_real_model.py",
    "tests/test_workflow_models.py",
    "tests/test_vllm.py",
    "tests/test_worker.py",
    "tests/test_workflow.py",
    "tests/test_train",  # test_train.py and test_train_*.py
)


def pytest_collection_modifyitems(config, items):
    def rank(item):
        return next((i for i, prefix in enumerate(LONG_FIRST) if item.nodeid.startswith(prefix)), len(LONG_FIRST))

    items.sort(key=rank)  # stable: the original order within each rank
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu:
        import torch

        if not torch.cuda.is_available():
            reason = f"needs a CUDA GPU: torch {torch.__version__} sees none (torch.cuda.is_available() is False)"
            for item in gpu:
                item.add_marker(pytest.mark.skip(reason=reason))


# OTBFLOW_TEST_TIMELINE=FILE: every test's start and end (epoch seconds, pytest-xdist worker, node
# id) appended to FILE, to see where a slow suite's time goes and when a worker waits.
_XDIST_CONTROLLER = False  # under pytest-xdist the controller only relays the workers' events


def pytest_configure(config):
    global _XDIST_CONTROLLER
    _XDIST_CONTROLLER = bool(getattr(config.option, "numprocesses", None)) and not hasattr(config, "workerinput")


def pytest_unconfigure(config):
    if _PRELOAD_DIR:  # the process that made the folder: the session is over
        import shutil

        from otbflow.ops import preload

        preload.stop(Path(_PRELOAD_DIR))
        shutil.rmtree(_PRELOAD_DIR, ignore_errors=True)


def _timeline(event: str, nodeid: str) -> None:
    path = os.environ.get("OTBFLOW_TEST_TIMELINE")
    if path and not _XDIST_CONTROLLER:
        import time

        with open(path, "a") as f:
            f.write(f"{time.time():.1f} {os.environ.get('PYTEST_XDIST_WORKER', 'master')} {event} {nodeid}\n")


def pytest_runtest_logstart(nodeid, location):
    _timeline("start", nodeid)


def pytest_runtest_logfinish(nodeid, location):
    _timeline("end", nodeid)


def chromium() -> str:
    """A headless browser for the HTML report's tests: Chromium, installed from Debian's packages
    where missing (tests/install-chromium.sh, as root, as slurm/local/slurm-up.sh installs Slurm);
    skipped, with the reason, where neither is possible."""
    import shutil

    for name in ("chromium", "chromium-browser"):
        if found := shutil.which(name):
            return found
    res = subprocess.run(
        ["bash", str(REPO / "tests" / "install-chromium.sh")],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,  # a pytest-xdist worker's stdin is its channel to the controller
        timeout=900,
    )
    if res.returncode == 77:
        pytest.skip(f"no chromium: {res.stdout.strip()}")
    assert res.returncode == 0 and shutil.which("chromium"), f"installing chromium failed: {res.stderr[-2000:]}"
    return shutil.which("chromium")


def rendered_dom(html: Path) -> str:
    """The DOM of a local HTML file once its scripts have run, from headless Chromium."""
    res = subprocess.run(
        [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=20000"]
        + ["--dump-dom", html.resolve().as_uri()],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=300,
    )
    assert res.returncode == 0 and res.stdout, res.stderr[-3000:]
    return res.stdout


def save_reward_model(path: Path, arch: str, tok, n_positions: int, num_labels: int = 1, seed: int = 0) -> Path:
    """A randomly initialised ``arch``ForSequenceClassification for ``tok``, saved with it."""
    import torch
    from omegaconf import OmegaConf
    from transformers import AutoModelForSequenceClassification

    from otbflow.models.policy import tiny_model_config

    small = OmegaConf.create(
        dict(arch=arch, n_positions=n_positions, n_embd=32, n_layer=2, n_head=2, n_kv_head=1 if arch != "gpt2" else 0)
    )
    config = tiny_model_config(small, len(tok), tok.eos_token_id, tok.pad_token_id)
    config.num_labels = num_labels
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config)
    # a random head is near zero (std 0.02 weights): scale it so that scores differ visibly
    with torch.no_grad():
        model.score.weight.mul_(50.0)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def local_slurm():
    """The local test cluster, started if it is not up. It stays up after the tests (stop it with
    slurm/local/slurm-down.sh): with Slurm's client installed and no controller, every Snakemake
    start waits about 9 s on `scontrol show config` (the Slurm executor plugin asks for MinJobAge
    when it is loaded, even for a local run), which the workflow tests after this one would pay."""
    res = subprocess.run(
        ["bash", str(REPO / "slurm/local/slurm-up.sh")],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=900,
    )
    if res.returncode == 77 or (res.returncode != 0 and not shutil.which("slurmctld")):
        reason = f"cannot start a local Slurm here: {(res.stdout + res.stderr).strip()[-500:]}"
        print(reason)
        pytest.skip(reason)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
