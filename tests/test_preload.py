"""The preload server (otbflow.ops.preload): stage jobs forked from a process that imported them.

Its jobs write what their own processes write: the whole suite's workflows run on it (conftest sets
a session folder), and tests/test_workflow.py::test_the_tiny_run_is_bitwise_what_it_was compares
the tiny run with fingerprints recorded before it existed; here one stage is compared directly.
The killed job's shell: tests/test_io.py::test_a_stage_whose_job_shell_was_killed_writes_nothing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
from conftest import REPO
from test_io import _wait, preload_server

from otbflow.ops import preload

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="Linux only (pidfd, SCM_RIGHTS)")


@pytest.fixture
def env(tmp_path):
    """Jobs' environment with a preload folder of the test's own; its server ends with the test."""
    env = dict(os.environ, OTBFLOW_PRELOAD_DIR=str(tmp_path / "preload"), OTBFLOW_PRELOAD="1")
    yield env
    preload.stop(tmp_path / "preload")


def stage(env, *args, check=True, **kw):
    return subprocess.run(
        [sys.executable, "-m", "otbflow", *args], env=env, capture_output=True, text=True, check=check, **kw
    )


def served(env) -> list[str]:
    """The server's log lines of the jobs it forked."""
    logs = Path(env["OTBFLOW_PRELOAD_DIR"]).glob("*.log")
    return [line for log in logs for line in log.read_text().splitlines() if " as " in line]


def test_a_served_job_writes_what_its_own_process_writes(env, tiny_policy, data_dir, tmp_path):
    """A rollout (torch, the policy, sampling) in its own process, then forked by the server: the
    same table; the server's log names the job that started it and the rollout, and the rollout's
    log has the stage's own lines."""
    args = ["rollout", "--prompts", str(data_dir / "train" / "shard_0.parquet"), "--policy", str(tiny_policy)]
    own = stage({**env, "OTBFLOW_PRELOAD": "0"}, *args, "--out", str(tmp_path / "own.parquet"))
    preload_server(env)
    forked = stage(env, *args, "--out", str(tmp_path / "forked.parquet"))
    # the server's jobs: the second --help (it started the server and waited for it), then the rollout
    assert [line.split(": ")[1].split(" as ")[0] for line in served(env)] == ["shard", "rollout"]
    (about,) = Path(env["OTBFLOW_PRELOAD_DIR"]).glob("*.about")  # what the server's key is made of
    assert json.loads(about.read_text())["executable"] == sys.executable
    assert pl.read_parquet(tmp_path / "own.parquet").equals(pl.read_parquet(tmp_path / "forked.parquet"))
    for res in (own, forked):
        assert re.search(r"rollout finished in", res.stderr), res.stderr[-2000:]


def test_exit_status_errors_and_signals_are_the_jobs(env, tmp_path):
    """A refused config ends with the CLI's status 2 and message, served or not; a job that gets
    SIGTERM (its client relays it to the job's process group) ends by SIGTERM, and one whose served
    process is killed (SIGKILL) ends by SIGKILL."""
    preload_server(env)
    bad = ["shard", "--out-dir", str(tmp_path / "p"), "task.n_train=-1"]
    forked, own = stage(env, *bad, check=False), stage({**env, "OTBFLOW_PRELOAD": "0"}, *bad, check=False)
    assert forked.returncode == own.returncode == 2
    assert forked.stderr.splitlines()[-1] == own.stderr.splitlines()[-1]
    assert len(served(env)) == 2  # preload_server's second job, then the refused config
    log = tmp_path / "long.log"

    def started(out: str) -> subprocess.Popen:
        """A served shard job of many prompts, once it has started."""
        with open(log, "w") as f:
            job = subprocess.Popen(
                [sys.executable, "-m", "otbflow", "shard", "--out-dir", str(tmp_path / out), "task.n_train=100000"],
                env=env,
                stdout=f,
                stderr=subprocess.STDOUT,
            )
        _wait("the job to start", lambda: "shard started" in log.read_text())
        return job

    job = started("q")
    job.send_signal(signal.SIGTERM)
    assert job.wait(timeout=60) == -signal.SIGTERM
    assert not list((tmp_path / "q").rglob("*.parquet"))
    # the served process killed (SIGKILL: the kernel's OOM killer, kill -9): its client ends so too
    job = started("r")
    (pid,) = [int(line.split(" as ")[1].split()[0]) for line in served(env) if f" for {job.pid}" in line]
    os.kill(pid, signal.SIGKILL)
    assert job.wait(timeout=60) == -signal.SIGKILL, log.read_text()[-2000:]
    assert not list((tmp_path / "r").rglob("*.parquet"))


def test_a_changed_source_retires_the_server(env, tmp_path):
    """A server whose otbflow sources changed after it imported them refuses the next job (run in
    its own process, from the new source) and exits; the job after starts a new server."""
    src = tmp_path / "repo" / "src"
    shutil.copytree(REPO / "src", src, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "repo" / "config").symlink_to(REPO / "config")  # the default config, beside the source
    env = {**env, "PYTHONPATH": str(src)}
    first = preload_server(env)
    shard = src / "otbflow" / "stages" / "shard.py"
    shard.write_text(shard.read_text() + "\nprint('edited')\n")
    out = stage(env, "shard", "--help")
    assert "edited" in out.stdout
    _wait("the old server to end", lambda: _ended(first), timeout=30)
    log = next(Path(env["OTBFLOW_PRELOAD_DIR"]).glob("*.log")).read_text()
    assert "its sources changed: no new jobs" in log
    assert preload_server(env) != first


def test_a_keys_description_names_what_set_it_apart_and_no_value():
    """Two environments that differ in one variable: different keys, whose descriptions differ in
    that variable's entry only, and hold neither value."""
    path, place = ["", "/a", "/b"], [["ns"], "cgroup", [], 0]
    one = {"HOME": "/home/me", "WANDB_API_KEY": "secret-one"}
    two = {**one, "WANDB_API_KEY": "secret-two"}
    keys = [preload.server_key(e, path, "/py", place) for e in (one, two)]
    abouts = [preload.about(preload.key_parts(e, path, "/py", place)) for e in (one, two)]
    assert keys[0] != keys[1] and abouts[0]["env"]["HOME"] == abouts[1]["env"]["HOME"]
    assert abouts[0]["env"]["WANDB_API_KEY"] != abouts[1]["env"]["WANDB_API_KEY"]
    assert {k: v for k, v in abouts[0].items() if k != "env"} == {k: v for k, v in abouts[1].items() if k != "env"}
    assert "secret" not in json.dumps(abouts)


def test_where_it_is_off(monkeypatch):
    """Every job runs in its own process with OTBFLOW_PRELOAD=0, in a Slurm job, as a torchrun rank,
    for a command that is not a stage; the key ignores the per-job variables and nothing else."""
    monkeypatch.setattr(sys, "orig_argv", [sys.executable, "-m", "otbflow", "shard"])
    base = {"HOME": "/root"}
    assert preload.usable(["shard"], base) == (not any(os.path.exists(p) for p in preload.GPU_DEVICES))
    for extra in ({"OTBFLOW_PRELOAD": "0"}, {"SLURM_JOB_ID": "42"}, {"TORCHELASTIC_RUN_ID": "x"}):
        assert not preload.usable(["shard"], {**base, **extra})
    assert not preload.usable(["--help"], base)
    assert preload.is_stage("publish-optimizer") and not preload.is_stage("worker") and not preload.is_stage("submit")
    key = preload.server_key(base, ["", "/a"], "/py")
    job = {**base, "OTBFLOW_THREADS": "2", "SNAKEMAKE_PROFILE": "x", "PATH": "/x", "PWD": "/w", "TMPDIR": "/t"}
    assert preload.server_key(job, ["/w", "/a"], "/py") == key
    # a run started by make (its own variables), or by a process that has imported DeepSpeed
    made = {**base, "MAKEFLAGS": " -- ARGS=-n", "MAKELEVEL": "1", "MFLAGS": "", "MAKEOVERRIDES": "x"}
    assert preload.server_key({**made, "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}, ["", "/a"], "/py") == key
    assert preload.server_key(base, ["", "/a", "/a/../a"], "/py") == key  # one folder, twice
    for other in ({**base, "OMP_NUM_THREADS": "2"}, {**base, "HOME": "/h"}):  # read at import
        assert preload.server_key(other, ["", "/a"], "/py") != key
    assert preload.server_key(base, ["", "/b"], "/py") != key
    assert preload.server_key(base, ["", "/a"], "/other") != key
    place = preload.this_place()
    assert preload.server_key(base, ["", "/a"], "/py", place) == key
    elsewhere = [[*place[0][:-1], "cgroup:[1]"], *place[1:]]  # another namespace (unshare), say
    assert preload.server_key(base, ["", "/a"], "/py", elsewhere) != key


def test_an_idle_server_exits(env):
    """With no job for OTBFLOW_PRELOAD_IDLE_S (the first job's), a server removes its socket and
    record and exits; so does one told to stop (SIGTERM: the suite's end)."""
    folder = Path(env["OTBFLOW_PRELOAD_DIR"])
    for how in ("idle", "SIGTERM"):
        pid = preload_server({**env, "OTBFLOW_PRELOAD_IDLE_S": "1" if how == "idle" else "600"})
        if how == "SIGTERM":
            os.kill(pid, signal.SIGTERM)
        _wait("the server to end", lambda pid=pid: _ended(pid), timeout=30)
        assert not list(folder.glob("*.sock")) and not list(folder.glob("*.json"))
    log = next(folder.glob("*.log")).read_text()
    assert "idle 1 s: no new jobs" in log and "SIGTERM: no new jobs" in log


def _ended(pid: int) -> bool:
    """Gone, or a zombie (the server's parent, the job that started it, has ended: its reaper may be slow)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0] == "Z"
    except OSError:
        return True


def test_a_socket_path_longer_than_unix_sockets_take(tmp_path):
    """A folder deep enough that its socket's path is over the 108 bytes of a Unix socket address
    (pytest's own temporary folders are): bound and reached through a descriptor of the folder."""
    import socket

    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    path = deep / "x.sock"
    assert len(str(path)) > 108
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with preload.address(path) as where:
        server.bind(where)
    server.listen(1)
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with preload.address(path) as where:
        client.connect(where)
    server.accept()[0].sendall(b"ok")
    assert client.recv(2) == b"ok" and path.exists()
