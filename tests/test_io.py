import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import pytest

from otbflow import schemas
from otbflow.io import SchemaError, atomic_dir, read_metadata, read_table, write_parquet


def _prompts(n=3):
    return pl.DataFrame(
        {
            "prompt_id": list(range(n)),
            "prompt": ["1+1="] * n,
            "messages": ['[{"role": "user", "content": "1+1="}]'] * n,
            "answer": ["2"] * n,
            "data_source": ["arithmetic"] * n,
            "split": ["train"] * n,
            "shard": [0] * n,
        }
    )


def test_write_is_atomic_and_keeps_metadata(tmp_path):
    path = write_parquet(_prompts(), tmp_path / "a.parquet", metadata={"temperature": 0.7})
    assert read_metadata(path) == {"temperature": 0.7}
    assert pq.ParquetFile(path).metadata.row_group(0).column(0).compression == "ZSTD"
    assert os.listdir(tmp_path) == ["a.parquet"]


def test_killed_write_leaves_nothing_that_looks_done(tmp_path, monkeypatch):
    def boom(table, where, **kw):
        with open(where, "wb") as f:
            f.write(b"PAR1 half a file")
        raise KeyboardInterrupt  # the job is killed mid-write

    monkeypatch.setattr(pq, "write_table", boom)
    with pytest.raises(KeyboardInterrupt):
        write_parquet(_prompts(), tmp_path / "b.parquet")
    assert os.listdir(tmp_path) == []


def test_read_table_names_file_and_column(tmp_path):
    path = write_parquet(_prompts().drop("answer"), tmp_path / "p.parquet")
    with pytest.raises(SchemaError, match=r"p\.parquet: missing column 'answer'"):
        read_table(path, schemas.PROMPTS)
    path = write_parquet(_prompts().with_columns(pl.col("prompt_id").cast(pl.String)), tmp_path / "q.parquet")
    with pytest.raises(SchemaError, match=r"q\.parquet: column 'prompt_id' has dtype String"):
        read_table(path, schemas.PROMPTS)
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(SchemaError, match="junk.parquet: not a readable Parquet"):
        read_table(tmp_path / "junk.parquet", schemas.PROMPTS)


def test_ragged_per_token_lists_are_rejected(rollouts_path, tmp_path):
    df = pl.read_parquet(rollouts_path)
    bad = df.with_columns(
        pl.when(pl.int_range(pl.len()) == 2)
        .then(pl.col("rollout_logprobs").list.slice(1))
        .otherwise(pl.col("rollout_logprobs"))
        .alias("rollout_logprobs")
    )
    path = write_parquet(bad, tmp_path / "r.parquet")
    with pytest.raises(SchemaError, match=r"r\.parquet: column 'rollout_logprobs' is ragged .* row 2"):
        read_table(path, schemas.ROLLOUTS)


def test_atomic_dir_replaces_only_on_success(tmp_path):
    target = tmp_path / "model"
    with atomic_dir(target) as tmp:
        (tmp / "w.bin").write_text("v1")
    with pytest.raises(RuntimeError):
        with atomic_dir(target) as tmp:
            (tmp / "w.bin").write_text("v2-partial")
            raise RuntimeError("killed")
    assert (target / "w.bin").read_text() == "v1"
    assert sorted(os.listdir(tmp_path)) == ["model"]


def test_progress_logs_about_every_tenth_and_the_end(caplog):
    import logging

    from otbflow.progress import Progress

    log = logging.getLogger("otbflow.test")
    with caplog.at_level(logging.INFO, logger="otbflow.test"):
        p = Progress(log, "rollout", 95, "prompts")
        for _ in range(95):
            p.update()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 11  # at 9, 18, ..., 90 of 95 (ten), then at the end
    assert lines[0].startswith("rollout: 9/95 prompts (9%)") and lines[-1].startswith("rollout: 95/95 prompts (100%)")
    assert lines[-1].endswith("done") and "s left" in lines[0]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="otbflow.test"):
        Progress(log, "tiny", 1).update()
    assert not caplog.records  # a job of one item writes no progress lines


# ------------------------------------------------------------------------------------------
# A stage whose job was killed writes nothing (real process trees: bash, torchrun, the stage)
# ------------------------------------------------------------------------------------------


def _processes_under(pid: int) -> list[tuple[int, list[str]]]:
    """(pid, argv) of every descendant of ``pid``."""
    from otbflow.runtime.process import process_stat

    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := process_stat(int(entry.name))):
            parents[int(entry.name)] = stat[1]
    found, frontier = [], {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier}
        for p in frontier:
            try:
                found.append((p, (Path(f"/proc/{p}/cmdline").read_bytes().decode().split("\0"))))
            except OSError:
                pass
    return found


def _gone(pid: int) -> bool:
    from otbflow.runtime.process import process_stat

    stat = process_stat(pid)
    return stat is None or stat[0] in "ZX"


def _wait(what: str, until, timeout: float = 120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if value := until():
            return value
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="Linux only (prctl, /proc)")
@pytest.mark.parametrize("launcher", ["alone", "torchrun", "preloaded"])
def test_a_stage_whose_job_shell_was_killed_writes_nothing(tmp_path, launcher):
    """A real stage (shard, made to take 2-3 s) started as Snakemake starts a rule's
    command (``bash -c 'set -euo pipefail; ...'``; under torchrun as the workflow's launcher does
    for several tasks; or forked by a warm preload server, otbflow.ops.preload): once it has
    started, it is held (SIGSTOP), its job's shell is killed (kill -9: Snakemake counts the job
    failed and deletes its outputs), and it is let go (SIGCONT). It writes no output and no
    temporary file, ever: alone, the kernel kills it with its shell; under torchrun, which outlives
    the shell, the rank refuses to publish; preloaded, its client dies with the shell and the
    server kills the stage's process group."""
    out, log = tmp_path / "prompts", tmp_path / "job.log"
    launch = f"{sys.executable} -m torch.distributed.run --standalone --nproc_per_node=1 --no-python "
    stage = f"{sys.executable} -m otbflow shard --out-dir {out} task.n_train=100000 task.max_operand=1000"
    cmd = f"set -euo pipefail; {launch if launcher == 'torchrun' else ''}{stage} > {log} 2>&1"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    server = None
    if launcher == "preloaded":
        env["OTBFLOW_PRELOAD_DIR"] = str(tmp_path / "preload")
        server = preload_server(env)
    else:
        env["OTBFLOW_PRELOAD"] = "0"
    shell = subprocess.Popen(["bash", "-c", cmd], env=env)
    try:
        _wait("the stage to start", lambda: log.is_file() and "shard started" in log.read_text())
        tree = _processes_under(shell.pid)
        if server:  # the stage is the server's child; its client stands for it in the job's shell
            children = _processes_under(server)
            tree += children
            pid = children[0][0]
        else:
            pid = next(p for p, argv in tree if argv[1:4] == ["-m", "otbflow", "shard"])
        os.kill(pid, signal.SIGSTOP)
        os.kill(shell.pid, signal.SIGKILL)
        shell.wait()
        with contextlib.suppress(ProcessLookupError):  # preloaded: the server may have killed it already
            os.kill(pid, signal.SIGCONT)
        for p, _ in tree:  # the stage, and torchrun or the client
            _wait(f"process {p} to end", lambda p=p: _gone(p))
    finally:
        for p, _ in _processes_under(shell.pid) if shell.poll() is None else []:
            os.kill(p, signal.SIGKILL)
        shell.kill()
        if server:
            os.kill(server, signal.SIGTERM)
    # no file but the log (atomic_file may have made the outputs' folder: no output, nothing that looks done)
    written = [p for p in tmp_path.rglob("*") if not p.is_dir() and "preload" not in p.parts]
    assert written == [log], log.read_text()[-2000:]
    if launcher == "torchrun":
        assert (
            f"{out}/train/shard_0.parquet: not written: the job that started this process has ended" in log.read_text()
        )


def preload_server(env: dict) -> int:
    """A warm preload server (otbflow.ops.preload) for jobs of this environment: started by a
    second job (a stage's --help: the first runs itself, the second waits for the server and runs
    on it); its pid."""
    for _ in range(2):  # the first job leaves its mark, the second starts the server
        subprocess.run([sys.executable, "-m", "otbflow", "shard", "--help"], env=env, check=True, capture_output=True)
    folder = Path(env["OTBFLOW_PRELOAD_DIR"])
    _wait("the preload server's socket", lambda: next(folder.glob("*.sock"), None), timeout=120)
    return json.loads(next(folder.glob("*.json")).read_text())["pid"]


def safetensors_bytes(header: bytes, data: bytes = b"", length: int | None = None) -> bytes:
    """A safetensors file written by hand: the header's length (8 bytes, little-endian), the
    header, the data."""
    return (len(header) if length is None else length).to_bytes(8, "little") + header + data


ONE_TENSOR = b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'
MALFORMED_SAFETENSORS = {
    "empty": b"",
    "truncated in its length": b"\x10\x00\x00",
    "a length past the end": safetensors_bytes(ONE_TENSOR, bytes(8), length=4096),
    "a length of 2**40": safetensors_bytes(ONE_TENSOR, bytes(8), length=2**40),
    "a header that is not JSON": safetensors_bytes(b"{not json" + b" " * 47, bytes(8)),
    "a header that is a JSON list": safetensors_bytes(b"[]", bytes(8)),
    "an unknown dtype": safetensors_bytes(ONE_TENSOR.replace(b"F32", b"Q99"), bytes(8)),
    "data cut short": safetensors_bytes(ONE_TENSOR, bytes(4)),
}


@pytest.mark.parametrize("case", MALFORMED_SAFETENSORS, ids=lambda c: c.replace(" ", "_"))
def test_a_malformed_safetensors_file_is_named(tmp_path, tiny_policy, case):
    """Issue 53: malformed safetensors headers stopped the loaders with safetensors' own error,
    naming no file. Each hand-made malformed file is named by check_safetensors and by the loaders
    of a policy (load_policy: features, variance, scaling, the hf rollout; the vLLM backend checks
    before its engine starts); the well-formed file beside them passes."""
    from otbflow.engines.vllm import VLLMBackend
    from otbflow.io import check_safetensors
    from otbflow.models.policy import load_policy

    good = tmp_path / "good"
    good.mkdir()
    (good / "model.safetensors").write_bytes(safetensors_bytes(ONE_TENSOR, bytes(8)))
    check_safetensors(good)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes(MALFORMED_SAFETENSORS[case])
    named = rf"{bad}/model.safetensors: not a readable safetensors file \(.+\)"
    with pytest.raises(ValueError, match=named):
        check_safetensors(bad)
    policy = tmp_path / "policy"
    shutil.copytree(tiny_policy, policy)
    (policy / "model.safetensors").write_bytes(MALFORMED_SAFETENSORS[case])
    named = rf"{policy}/model.safetensors: not a readable safetensors file"
    with pytest.raises(ValueError, match=named):
        load_policy(policy)
    with pytest.raises(ValueError, match=named):
        VLLMBackend(None, str(policy))
