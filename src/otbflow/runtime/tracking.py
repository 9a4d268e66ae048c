"""Live curves: the points of the train and evaluate jobs, written as each job goes, to TensorBoard
event files and, with ``tracking.wandb.project`` set, to Weights & Biases.

A job that tracks (the workflow passes ``--tracking-name train/iter_3``, ``evaluate/initial``) gets

- ``<results_dir>/tensorboard/<name>/``: its event file, the folder deleted and made anew when
  the job starts (a retried job replaces its points, never adds a second set; a train job that
  resumes from a checkpoint first writes again the steps the checkpoint holds), flushed after
  every point, so that ``tensorboard --logdir results/tensorboard`` shows a run as it trains;
- with W&B: the run ``<name>`` (job type: the stage) in the workflow's group, its files under
  ``<results_dir>/wandb/`` (offline: ``offline-run-*``, for ``wandb sync``).

Every point is keyed by the step over all iterations (optimizer steps so far; an evaluation: those
that made its policy) and carries ``progress/iteration`` and ``progress/tokens`` (response tokens
trained on so far). None of this is a Snakemake output: a failed job leaves its curves up to its
last point, and nothing reads them. docs/training.md, "Live curves".

This module imports no other otbflow module, and no code version hashes it
(``otbflow.runtime.codeversion.RUN_ONLY``): it changes how a job reports, never what it writes. The event
files are written here (the TFRecord framing and the three protobuf messages TensorBoard reads),
so a job imports nothing for them and needs no tensorboard package in its environment (the vLLM
one); wandb is imported only by a job that logs to it.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import secrets
import shutil
import socket
import struct
import time
from pathlib import Path
from typing import Any, Mapping

AXES = ("progress/iteration", "progress/tokens")
"""The scalars every point carries besides its step."""


class Curves:
    """Where one job's points go: an event file, a W&B run, both, or nowhere (``Curves()``)."""

    def __init__(self, events: EventFile | None = None, run: Any = None):
        self.events, self.run = events, run

    def log(self, prefix: str, values: Mapping[str, Any], step: int, iteration: int, tokens: int) -> None:
        """One point: every number of ``values`` as ``<prefix>/<key>`` (booleans as 0 or 1, other
        values left out), at ``step``, with the iteration and the tokens trained so far."""
        point = {f"{prefix}/{k}": float(v) for k, v in values.items() if isinstance(v, numbers.Real)}
        point |= dict(zip(AXES, (float(iteration), float(tokens))))
        if self.events is not None:
            self.events.scalars(step, point)
        # a resumed W&B run (online, a retried job) keeps what it has: its history only grows
        if self.run is not None and step >= self.run.starting_step:
            self.run.log({**point, "progress/step": step}, step=step)

    def close(self) -> None:
        if self.events is not None:
            self.events.close()
        if self.run is not None:
            self.run.finish()


def open_curves(cfg, name: str) -> Curves:
    """The live curves of the job ``name`` (``<stage>/<job>``; empty: none), as ``cfg.tracking``
    says: the job's TensorBoard folder made anew, its W&B run started."""
    if not name:
        return Curves()
    root, tc = Path(cfg.results_dir), cfg.tracking
    events = None
    if tc.tensorboard:
        folder = root / "tensorboard" / name
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        events = EventFile(folder)
    run = start_wandb(tc.wandb, root, name) if tc.wandb.project is not None else None
    return Curves(events, run)


# ------------------------------------------------------------------------------------------
# Weights & Biases
# ------------------------------------------------------------------------------------------


def start_wandb(w, root: Path, name: str):
    """The W&B run of job ``name``: one id per job of this results folder (a retry resumes it),
    in the workflow's group; offline, an earlier attempt's folder is replaced."""
    try:
        import wandb
    except ImportError:
        raise ImportError(
            f"tracking.wandb.project is {w.project!r} but wandb is not installed in this job's environment "
            "(pip install 'otbflow[wandb]'; for rollout.python, in that interpreter's); or set it to null"
        ) from None
    workflow = workflow_identity(root)
    run_id = f"{workflow['id']}-{name.replace('/', '-')}"
    if w.mode == "offline":
        for old in (root / "wandb").glob(f"offline-run-*-{run_id}"):
            shutil.rmtree(old, ignore_errors=True)
    config = root / "config.yaml"  # the workflow's resolved config, which the job read
    run = wandb.init(
        project=w.project,
        entity=w.entity,
        group=w.group or workflow["group"],
        name=name,
        job_type=name.split("/")[0],
        id=run_id,
        resume="allow",
        mode=w.mode,
        dir=str(root),
        config=_yaml(config) if config.is_file() else None,
        settings=wandb.Settings(console="off", silent=True),  # the job's log stays in results/logs/
    )
    run.define_metric("progress/step")  # every chart's x-axis; progress/tokens is the other one to pick
    for key in ("train/*", "evaluate/*", *AXES):
        run.define_metric(key, step_metric="progress/step")
    return run


def workflow_identity(root: Path) -> dict:
    """The W&B identity of the workflow that writes to ``root``: a random id (in every run id)
    and the default group ``<the results folder's parent>-<UTC time>``, made by its first job
    that logs to W&B and kept in ``root/wandb/workflow.json`` (created whole in one link: jobs that
    start together all read the first one's)."""
    path = root / "wandb" / "workflow.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.is_file():
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        mine = {"id": secrets.token_hex(4), "group": f"{root.resolve().parent.name}-{stamp}"}
        tmp = path.with_name(f".workflow.{os.getpid()}.{secrets.token_hex(4)}.json")
        tmp.write_text(json.dumps(mine))
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    return json.loads(path.read_text())


def _yaml(path: Path) -> dict:
    import yaml

    return yaml.safe_load(path.read_text())


# ------------------------------------------------------------------------------------------
# TensorBoard event files
# ------------------------------------------------------------------------------------------


class EventFile:
    """A TensorBoard event file of scalar summaries: TFRecords (length, masked CRC-32C of the
    length, the data, its masked CRC-32C) each holding one ``tensorflow.Event`` message, the first
    one naming the format (``brain.Event:2``). ``scalars`` writes one event per point and flushes."""

    def __init__(self, folder: Path):
        name = f"events.out.tfevents.{time.time():.0f}.{socket.gethostname()}.{os.getpid()}"
        self.file = open(folder / name, "ab")
        self._record(_event(time.time(), 0, _string(3, b"brain.Event:2")))
        self.file.flush()

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        # Summary { repeated Value value = 1 }, Value { string tag = 1; float simple_value = 2 }
        summary = b"".join(
            _string(1, _string(1, tag.encode()) + _key(2, 5) + struct.pack("<f", _finite_or_nan(v)))
            for tag, v in values.items()
        )
        self._record(_event(time.time(), step, _string(5, summary)))
        self.file.flush()

    def close(self) -> None:
        self.file.close()

    def _record(self, data: bytes) -> None:
        length = struct.pack("<Q", len(data))
        crcs = struct.pack("<I", masked_crc32c(length)), struct.pack("<I", masked_crc32c(data))
        self.file.write(length + crcs[0] + data + crcs[1])


def _finite_or_nan(v: float) -> float:
    """float32 holds no value beyond 3.4e38: those become inf, as TensorBoard's own writer does."""
    return v if math.isnan(v) or abs(v) < 3.4e38 else math.copysign(math.inf, v)


def _event(wall_time: float, step: int, payload: bytes) -> bytes:
    """Event { double wall_time = 1; int64 step = 2; oneof { string file_version = 3; Summary summary = 5 } }."""
    return _key(1, 1) + struct.pack("<d", wall_time) + _key(2, 0) + _varint(step) + payload


def _key(field: int, wire_type: int) -> bytes:
    return _varint(field << 3 | wire_type)


def _string(field: int, data: bytes) -> bytes:
    """A length-delimited field (a string, bytes or a nested message)."""
    return _key(field, 2) + _varint(len(data)) + data


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # a negative int64 as its two's complement, as protobuf writes it
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


_CRC32C_TABLE: list[int] = []


def masked_crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli) of ``data``, masked as TFRecord stores it."""
    if not _CRC32C_TABLE:
        for i in range(256):
            c = i
            for _ in range(8):
                c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
            _CRC32C_TABLE.append(c)
    crc = 0xFFFFFFFF
    for b in data:
        crc = _CRC32C_TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF
