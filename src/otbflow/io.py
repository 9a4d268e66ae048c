"""Safe reads and writes shared by every stage.

- ``write_parquet``: zstd Parquet written to a temporary name in the same folder, then renamed,
  so a killed job never leaves a file that looks finished. Extra key/value metadata (sampling
  parameters, versions) is stored in the Parquet footer; ``read_metadata`` reads it back.
- ``read_table``: reads a Parquet file and checks it against a table schema from
  ``otbflow.schemas`` before any work starts: missing column, wrong dtype, ragged per-token
  lists. Errors name the file and the column. ``check_finite``: no NaN or infinity in the float
  columns a stage reads, naming the first bad row and token.
- ``atomic_file``: the one write-to-a-temporary-name-then-rename; ``write_json`` and
  ``write_text`` (summaries, schedule state, configs) use it too.
- ``atomic_dir``: a context manager for folder outputs (HF model folders): write into a
  temporary sibling, renamed into place on success only.
- ``write_errors_named``: a write that failed for a reason of the storage (a full disk, a quota)
  raises ``OSError(errno, strerror, path)``, also where the writer (torch's zip writer,
  safetensors) reported it in other words; ``atomic_file`` and ``atomic_dir`` use it.
- ``check_safetensors``: every ``*.safetensors`` file of a model folder has a header that reads
  (its length, its JSON, its tensors covering the file), or the error names the file.
- ``pyplot`` / ``save_figure``: matplotlib without a display, and PNGs written the same way.
- ``bind_to_job`` / ``check_job``: a stage process dies with the job that started it, and
  ``atomic_file`` and ``atomic_dir`` publish nothing once that job has ended (it failed: an output
  written later would look done to the next run).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Iterable, Iterator, Mapping

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from otbflow.schemas import TableSchema

METADATA_KEY = b"otbflow"


class SchemaError(ValueError):
    """A Parquet input does not match the schema a stage needs."""


STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EROFS}
"""Why a write fails for its storage: no space left, over quota, file too large, I/O error,
read-only file system."""


def os_error_behind(e: BaseException) -> OSError | None:
    """The storage error (``STORAGE_ERRNOS``) that made a write fail: ``e`` itself, one in its
    chain (torch's zip writer fails with "unexpected pos", the failed write of its file object as
    the context), or the errno that a writer without Python errors names in its message
    (safetensors: "... (os error 28)"). None for any other failure."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in STORAGE_ERRNOS:
            return e
        m = re.search(r"\(os error (\d+)\)", str(e))
        if m and int(m[1]) in STORAGE_ERRNOS:
            return OSError(int(m[1]), os.strerror(int(m[1])))
        e = e.__cause__ or e.__context__
    return None


@contextlib.contextmanager
def write_errors_named(path: str | Path) -> Iterator[None]:
    """Writes to ``path`` (a file or a folder): one that fails for its storage (a full disk)
    raises ``OSError(errno, strerror, path)`` (an OSError that names its file already is kept)."""
    try:
        yield
    except Exception as e:
        err = os_error_behind(e)
        if err is None or (isinstance(e, OSError) and e.filename):
            raise
        # caused by the failed write itself where there is one (not torch's "unexpected pos"); a flush
        # at close that fails again has torch's error as its context, left unshown
        cause = err if err.__traceback__ else e
        cause.__suppress_context__ = True
        raise OSError(err.errno, err.strerror, str(path)) from cause


@contextlib.contextmanager
def atomic_file(path: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling of ``path`` (same suffix) to write; on success it replaces
    ``path`` in one rename, on failure it is removed: a killed job leaves no file that looks done.
    A write that fails for its storage (a full disk) names ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=f".tmp{path.suffix}", dir=path.parent)
    os.close(fd)
    try:
        with write_errors_named(path):
            yield Path(tmp)
        check_job(path)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_parquet(df: pl.DataFrame, path: str | Path, metadata: Mapping | None = None) -> Path:
    table = df.to_arrow()
    if metadata:
        meta = dict(table.schema.metadata or {})
        meta[METADATA_KEY] = json.dumps(metadata, sort_keys=True, default=str).encode()
        table = table.replace_schema_metadata(meta)
    with atomic_file(path) as tmp:
        pq.write_table(table, tmp, compression="zstd")
    return Path(path)


def write_text(text: str, path: str | Path) -> Path:
    """A text file written to a temporary name and renamed, like write_parquet."""
    with atomic_file(path) as tmp:
        tmp.write_text(text)
    return Path(path)


def write_json(data, path: str | Path) -> Path:
    """Indented JSON, written atomically."""
    return write_text(json.dumps(data, indent=2, default=str), path)


def read_json(path: str | Path):
    """A small JSON record, or None where it is missing or cannot be read (half-written, removed)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def write_text_if_changed(path: str | Path, text: str) -> None:
    """A small text file (a resolved config) rewritten atomically, and only when its content
    changes, so that Snakemake sees no spurious modification time."""
    if not (Path(path).is_file() and Path(path).read_text() == text):
        write_text(text, path)


def read_metadata(path: str | Path) -> dict:
    meta = pq.read_schema(path).metadata or {}
    raw = meta.get(METADATA_KEY)
    return json.loads(raw) if raw else {}


def _dtype_ok(actual: pl.DataType, expected: pl.DataType) -> bool:
    if expected == pl.List:  # any list
        return isinstance(actual, pl.List)
    if isinstance(expected, pl.List):
        return isinstance(actual, pl.List) and _dtype_ok(actual.inner, expected.inner)
    if expected == pl.Float64:  # any float is accepted where a float is needed
        return actual in (pl.Float32, pl.Float64)
    if expected == pl.Int64:
        return actual in (pl.Int8, pl.Int16, pl.Int32, pl.Int64, pl.UInt8, pl.UInt16, pl.UInt32)
    return actual == expected


def check_schema(df: pl.DataFrame, schema: TableSchema, source: str) -> None:
    """Raise SchemaError naming ``source`` and the column if ``df`` does not fit ``schema``."""
    for col, dtype in schema.columns.items():
        if col not in df.columns:
            if col in schema.optional:
                continue
            raise SchemaError(
                f"{source}: missing column '{col}' (table '{schema.name}' needs "
                f"{', '.join(c for c in schema.columns if c not in schema.optional)})"
            )
        if not _dtype_ok(df.schema[col], dtype):
            raise SchemaError(f"{source}: column '{col}' has dtype {df.schema[col]}, expected {dtype}")
        if df[col].null_count():
            raise SchemaError(f"{source}: column '{col}' has {df[col].null_count()} null values")
    for col, length_col in schema.ragged.items():
        if col not in df.columns:
            continue
        lengths = df[col].list.len()
        expected = df[length_col].list.len() if isinstance(df.schema[length_col], pl.List) else df[length_col]
        bad = (lengths != expected).arg_true()
        if len(bad):
            i = int(bad[0])
            raise SchemaError(
                f"{source}: column '{col}' is ragged against '{length_col}': row {i} has "
                f"{lengths[i]} entries, expected {expected[i]} ({len(bad)} rows differ)"
            )


def check_finite(df: pl.DataFrame, columns: Iterable[str], source: str) -> None:
    """Raise SchemaError unless every value of the float ``columns`` of ``df`` (those it has; a
    per-token list column's every entry) is finite, naming ``source``, the column, the first row
    that holds a NaN, an infinity or a null entry (its index, its group_id where the table has
    one, and for a list column the token position) and how many rows do. One NaN log-prob would
    otherwise turn every advantage of a batch into NaN, and the error surface steps later."""
    for col in columns:
        if col not in df.columns:
            continue
        series = df[col]
        if isinstance(series.dtype, pl.List):
            lengths = series.list.len().fill_null(0).to_numpy().astype(np.int64)
            arr = series.to_arrow()
            arr = arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr
            values = pl.Series(arr.flatten()).cast(pl.Float64).to_numpy()
        else:
            lengths, values = None, series.cast(pl.Float64).to_numpy()
        bad = np.flatnonzero(~np.isfinite(values))
        if not len(bad):
            continue
        at, token = int(bad[0]), ""
        rows = bad
        if lengths is not None:
            starts = np.concatenate([[0], np.cumsum(lengths)])
            rows = np.searchsorted(starts, bad, side="right") - 1
            token = f" token {at - int(starts[rows[0]])}"
        row = int(rows[0])
        group = f" (group_id {df['group_id'][row]})" if "group_id" in df.columns else ""
        raise SchemaError(
            f"{source}: column '{col}' row {row}{group}{token}: {values[at]} is not a finite number "
            f"({len(np.unique(rows))} rows of '{col}' hold non-finite values)"
        )


def read_table(path: str | Path, schema: TableSchema) -> pl.DataFrame:
    path = Path(path)
    if not path.is_file():
        raise SchemaError(f"{path}: input file not found (table '{schema.name}')")
    try:
        df = pl.read_parquet(path)
    except Exception as e:  # a truncated or non-Parquet file
        raise SchemaError(f"{path}: not a readable Parquet file ({e})") from None
    check_schema(df, schema, str(path))
    return df


def check_safetensors(folder: str | Path) -> None:
    """Raise ValueError naming the file where a ``*.safetensors`` file of the model folder
    ``folder`` has a header that safetensors cannot read (shorter than its 8-byte length, a length
    past the file's end, a header that is not JSON or not its layout, an unknown dtype, tensors
    that do not cover the file): transformers, DeepSpeed's loader and the in-place reload
    otherwise stop with safetensors' "Error while deserializing header: ..." and no file name.
    Opens each file's header (a memory map; no tensor is read)."""
    from safetensors import SafetensorError, safe_open

    for file in sorted(Path(folder).glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="numpy"):
                pass
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{file}: not a readable safetensors file ({e})") from None


@contextlib.contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield a temporary folder; on success it replaces ``path`` in one rename, on failure it is
    removed. A write that fails for its storage (a full disk) names ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        with write_errors_named(path):
            yield tmp
        check_job(path)
        if path.exists():
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def pyplot():
    """matplotlib.pyplot on the Agg backend (batch jobs have no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | Path, dpi: int = 110) -> None:
    """Lay out, write to a temporary name, close, rename into place."""
    fig.tight_layout()
    with atomic_file(path) as tmp:
        fig.savefig(tmp, dpi=dpi)
    pyplot().close(fig)


# ------------------------------------------------------------------------------------------
# The job a stage process belongs to
# ------------------------------------------------------------------------------------------


class JobGoneError(RuntimeError):
    """The job that started this process has ended: it failed, and this process publishes nothing."""


_JOB: list[tuple[int, int]] = []
"""(pid, start in clock ticks after boot) of the processes whose end is the end of this process's
job: its parent and, for a rank under torchrun, torchrun's parent (the job's shell); for a job the
preload server runs, its client and the client's parent (the job's shell). Empty: not bound (the
Snakefile, a test calling a stage in its own process), or not Linux."""
_PARENT: list[int] = []
"""The parent this process must keep (another one: its parent ended and it was adopted)."""

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def bind_to_job(parent: int) -> None:
    """Tie this stage process to the job that started it (``parent``: its parent when it started,
    ``otbflow.PARENT_AT_START``), on Linux; the CLI calls it first thing.

    - The kernel kills this process (SIGKILL) when its parent ends (``prctl(PR_SET_PDEATHSIG)``):
      ``kill -9`` of a job's shell takes its stage with it instead of leaving an orphan to write
      its outputs after Snakemake has counted the job failed. Not under srun: slurmstepd ends a
      step's tasks itself. The signal is bound to the parent's thread that started this process;
      bash and torchrun start it from their main thread.
    - ``check_job`` (before every rename into place of ``atomic_file`` and ``atomic_dir``)
      refuses to publish once the parent, or under torchrun torchrun's parent (the job's shell,
      which torchrun outlives), has ended; each is known by its pid and start time (no pid reuse).

    A job the preload server runs (``otbflow.ops.preload``: ``otbflow.PRELOAD_CLIENT`` set) is a
    child of the server, which it dies with; its job is its client (which dies with the job's
    shell, ``parent``) and that shell.

    Raises JobGoneError when the parent ended before the signal was set."""
    import ctypes
    import signal

    import otbflow
    from otbflow.runtime.process import process_stat

    if process_stat(os.getpid()) is None:  # no /proc: not Linux
        return
    if _comm(parent) != "slurmstepd":
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    pids = [parent]
    if otbflow.PRELOAD_CLIENT is not None:
        pids.insert(0, otbflow.PRELOAD_CLIENT)
    elif "TORCHELASTIC_RUN_ID" in os.environ and (stat := process_stat(parent)):  # a rank under torchrun
        pids.append(stat[1])
    _JOB[:] = [(pid, stat[2] if (stat := process_stat(pid)) else -1) for pid in pids]
    _PARENT[:] = [os.getppid() if otbflow.PRELOAD_CLIENT is not None else parent]
    check_job("this job")


WANTED: list = []
"""In a warm worker (``otbflow.ops.worker``), the check of the job it runs for a client: a function
that returns why the job is no longer wanted (its client is gone, it withdrew the job), or None."""


def check_job(path: str | Path) -> None:
    """Raise JobGoneError (naming ``path``) when the job that started this process has ended
    (``bind_to_job``), or the client a worker runs it for is gone (``WANTED``); nothing when it
    runs, or when the process is not bound."""
    from otbflow.runtime.process import process_stat

    for wanted in WANTED:
        if reason := wanted():
            raise JobGoneError(f"{path}: not written: {reason}; an output written now would look done to the next run")
    for pid, start in _JOB:
        stat = process_stat(pid)
        if stat is None or stat[0] in "ZX" or stat[2] != start or os.getppid() != _PARENT[0]:
            raise JobGoneError(
                f"{path}: not written: the job that started this process has ended (process {pid} is gone), "
                f"so Snakemake counts it failed; an output written now would look done to the next run"
            )


_FAULTS_HIT: set[str] = set()
_FAULT_PASSES: dict[str, int] = {}


def fault_point(name: str) -> None:
    """A place where tests stop a process (the environment's ``OTBFLOW_FAULT``, once per process):
    ``name`` kills it (SIGKILL, as ``kill -9`` or a lost node would), ``name:later`` kills it 5 s
    later (a background thread's fault, after the job that started it returned), ``name:sleep``
    holds it up to 60 s (``OTBFLOW_FAULT_SLEEP_S``) in short sleeps (a worker can abandon the job
    meanwhile), ``name:pause`` holds it 5 s (``OTBFLOW_FAULT_PAUSE_S``) and goes on (a slow
    moment); ``OTBFLOW_FAULT_SKIP=n`` lets the n first passes go by. Nothing otherwise."""
    fault = os.environ.get("OTBFLOW_FAULT", "")
    point = fault.rsplit(":", 1)[0] if fault.endswith((":sleep", ":later", ":pause")) else fault
    if point != name or name in _FAULTS_HIT:
        return
    _FAULT_PASSES[name] = _FAULT_PASSES.get(name, 0) + 1
    if _FAULT_PASSES[name] <= int(os.environ.get("OTBFLOW_FAULT_SKIP", "0")):
        return  # OTBFLOW_FAULT_SKIP=n: the n first passes go by (a worker's (n+1)-th job meets it)
    _FAULTS_HIT.add(name)
    import time

    if fault.endswith(":sleep"):
        import logging

        logging.getLogger("otbflow.io").warning("OTBFLOW_FAULT=%s: held here", fault)
        for _ in range(int(10 * float(os.environ.get("OTBFLOW_FAULT_SLEEP_S", "60")))):
            time.sleep(0.1)
        return
    if fault.endswith(":later"):
        time.sleep(5)
    if fault.endswith(":pause"):
        time.sleep(float(os.environ.get("OTBFLOW_FAULT_PAUSE_S", "5")))
    if fault.endswith(":pause"):
        return
    import signal

    os.kill(os.getpid(), signal.SIGKILL)


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""
