"""Retention: what a finished iteration keeps on disk (config ``retention``; docs/training.md,
"Disk: what a run keeps").

Every iteration's train stage writes the next policy (``iter_k/train/policy/``) and, unless
``train.reset_optimizer``, its AdamW state (``iter_k/train/optimizer/``, 3x the fp32 weights).
Kept forever they grow a run's disk without bound (a 7B model: ~14 GB of bf16 weights and ~84 GB
of fp32 master weights and moments per iteration). The ``prune`` stage of iteration k, which
Snakemake runs once every job that reads these outputs is done (and their completion recorded),
deletes the heavy files of those not kept: the weights of a policy, the ``state/`` of an optimizer.
The folder stays, with its small files, Snakemake's timestamp and ``PRUNED.json`` (what was
deleted, why; ``otbflow.runtime.policy_folder``, with the weight files a policy folder holds):
Snakemake still sees a complete, unchanged output, so a plain rerun redoes nothing, while a job
that would read pruned weights is refused before any job runs (``pruned_inputs``), and a stage run
by hand on a pruned folder stops with the reason (``policy_folder.check_not_pruned``).

Kept: the policy after every ``retention.policy_every``-th update, the last
``rollout.staleness + 1`` policies (what iteration ``iterations`` would start from and sample
with: a run can be extended), and with ``retention.optimizer: last`` only the last AdamW state and
the one a longer run would read (``otbflow.runtime.adamw``: with ``train.optimizer_every`` >= 2 the
second-newest checkpoint).
Importing this module imports no torch (the Snakefile imports it).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from otbflow.runtime import adamw
from otbflow.runtime.policy_folder import PRUNED, pruned_record


@dataclass(frozen=True)
class Decision:
    """What iteration k keeps of its train outputs."""

    policy: bool
    optimizer: bool


def decision(cfg: DictConfig, k: int) -> Decision:
    """The retention rule, in one place: iteration k's policy is kept when k+1 is a multiple of
    ``retention.policy_every`` (0: always), k is one of the last ``rollout.staleness + 1``
    iterations or it is kept for its AdamW state; its optimizer state, where it writes one
    (``adamw.writes``), when ``retention.optimizer`` is 'all', k is the last or a longer run's
    train jobs would read it (``adamw.extension``: with ``train.optimizer_every`` >= 2 the two
    newest checkpoints, a replay starting from the policy and state of either)."""
    n, last, s = cfg.retention.policy_every, cfg.iterations - 1, cfg.rollout.staleness
    for_extension = adamw.extension(cfg, k)
    policy = n == 0 or (k + 1) % n == 0 or k >= last - s or for_extension
    optimizer = adamw.writes(cfg, k) and (cfg.retention.optimizer == "all" or k >= last or for_extension)
    return Decision(policy=policy, optimizer=optimizer)


def kept_policies(cfg: DictConfig) -> list[int]:
    return [k for k in range(cfg.iterations) if decision(cfg, k).policy]


def _size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def prune_folder(folder: str | Path, what: str, reason: str, heavy: list[Path]) -> int:
    """Delete ``heavy`` (files or folders inside ``folder``), recording them first in PRUNED.json
    (a job killed half-way leaves a folder that says it is pruned, never one that looks whole).
    Returns the bytes freed (those recorded, for a folder already pruned)."""
    folder = Path(folder)
    if (record := pruned_record(folder)) is not None:
        return sum(r["bytes"] for r in record["removed"])
    if not heavy:
        return 0
    removed = [{"name": p.name, "bytes": _size(p)} for p in heavy]
    record = {"what": what, "reason": reason, "removed": removed, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    tmp = folder / f".{PRUNED}.tmp"
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(folder / PRUNED)
    for p in heavy:
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    return sum(r["bytes"] for r in removed)


OPTIMIZER_META = "meta.json"
"""An optimizer folder's record (layout, policy digest, the job that wrote it), written last."""
OPTIMIZER_WRITER = "writer.json"
"""In an optimizer folder being written: the process that writes it (host, pid, start, boot,
heartbeat file), so that a reader elsewhere waits while it lives; removed before ``meta.json``."""
OPTIMIZER_FAILED = "failed.json"
"""In the emptied temporary folder of an optimizer state whose write after its job failed (a warm
train worker's, in the background): the error, for the publish job to name."""


def optimizer_partial(folder: str | Path) -> Path:
    """Where an optimizer folder is written before it is renamed into place."""
    p = Path(folder)
    return p.with_name(f".{p.name}.partial")


def writer_alive(pending: str | Path) -> bool:
    """Whether a process is writing the optimizer folder ``pending`` now (its ``OPTIMIZER_WRITER``
    record): on this host while its process runs, elsewhere while its heartbeat is fresh. Not
    this process, whose own writes are joined instead."""
    from otbflow.runtime.process import alive, me

    record = optimizer_partial(pending) / OPTIMIZER_WRITER
    try:
        info = json.loads(record.read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(info, dict) or all(info.get(k) == v for k, v in me().items()):
        return False
    return alive(info, Path(info.get("heartbeat") or record), by_pid_here=True)


WRITER_WAIT_S = 3600.0
"""The longest a publisher waits for a live writer of an optimizer state (``wait_for_writer``)."""


def wait_for_writer(pending: str | Path, wait_s: float = WRITER_WAIT_S, poll_s: float = 0.5) -> float:
    """Wait while the optimizer state ``pending`` is unfinished (no ``OPTIMIZER_META``) and its
    writer lives (``writer_alive``), ``wait_s`` at most; the seconds waited."""
    start = time.monotonic()
    while not (Path(pending) / OPTIMIZER_META).is_file() and writer_alive(pending):
        if time.monotonic() - start > wait_s:
            break
        time.sleep(poll_s)
    return time.monotonic() - start


def optimizer_state(folder: str | Path) -> list[Path]:
    """The DeepSpeed checkpoint of an optimizer folder (its meta.json is kept)."""
    return [p for p in [Path(folder) / "state"] if p.exists()]


MANIFEST_ONLY = ("replay_policies",)
"""Inputs of which a job reads only the manifest (``otbflow.runtime.manifest``), which a pruned
policy folder keeps: the train job's replayed policies (``otbflow.training.replay``)."""


def _named(files, name: str) -> list:
    value = getattr(files, name, None) if name in getattr(files, "_names", {}) else None
    return [value] if isinstance(value, str) else list(value or [])


def pruned_inputs(jobs) -> dict[str, list[str]]:
    """Of the jobs about to run (Snakemake's ``dag.needrun_jobs()`` with ``dag.needrun``), those
    that read a pruned folder that no job about to run makes again: {job: [folders]}. Such a run
    is refused before any job (the Snakefile's onstart)."""
    jobs = list(jobs)
    remade = {str(f) for job in jobs for f in job.output}
    found: dict[str, list[str]] = {}
    for job in jobs:
        listed = [str(f) for name in MANIFEST_ONLY for f in _named(job.input, name)]
        pruned = [
            str(f) for f in job.input if str(f) not in remade and str(f) not in listed and pruned_record(f) is not None
        ]
        if pruned:
            found[f"{job.rule.name} ({', '.join(f'{k}={v}' for k, v in job.wildcards_dict.items())})"] = pruned
    return found


def refusal(found: dict[str, list[str]]) -> str:
    lines = [f"  {job}: {', '.join(files)}" for job, files in found.items()]
    return (
        "this run needs outputs whose weights the retention policy deleted, and no job of this run "
        "makes them again:\n" + "\n".join(lines) + "\nNothing was run. Rerun the train jobs that made them "
        "(e.g. --forcerun train), or run the change on a results folder that kept them "
        "(retention.policy_every: 0, retention.optimizer: all)."
    )
