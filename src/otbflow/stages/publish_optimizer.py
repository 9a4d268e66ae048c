"""Publish optimizer: the AdamW state iteration k's train job wrote, put where the next one reads it.

The train job writes the optimizer state (a DeepSpeed checkpoint, 3x the fp32 weights) into
``iter_k/train/optimizer.pending`` (a temporary folder renamed into place, ``meta.json`` last). In
its own process it does so before it ends; a warm train worker (docs/workers.md) does so in the
background after the job has returned its policy, so that the next iteration's rollouts and
features, which need only the policy, do not wait for that write. This job (a local job of the
head, handed to the train worker where one runs, but only once its client has waited for the
write, ``otbflow.ops.dispatch.wait_before``: the worker stays free for the next train job) waits
for the write, checks that the state is the one of the policy the job published (``meta.json``'s
policy digest against ``--policy``) and renames it to ``iter_k/train/optimizer``, the declared
output that the next train job and retention read: complete before any reader starts.

When the state is lost (the worker died while writing it, its write failed, e.g. on a full disk,
whose error it names, or an older state of other weights lies there), iteration k's train outputs
are removed and the job fails, naming why: the same command
then redoes that update, from the previous iteration's state, which retention keeps until this
one is published.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from otbflow.io import check_job, read_json
from otbflow.runtime import manifest, resident
from otbflow.runtime.retention import OPTIMIZER_FAILED, OPTIMIZER_META, optimizer_partial, wait_for_writer

log = logging.getLogger("otbflow.publish_optimizer")


class OptimizerStateLost(RuntimeError):
    """The train job's optimizer state is not there, or not of its policy."""


@dataclass
class Args:
    pending: str
    """The folder the train job wrote the optimizer state to (iter_k/train/optimizer.pending)."""
    out: str
    """Output folder of the state (iter_k/train/optimizer), read by the next train job."""
    policy: str
    """The policy the train job published (iter_k/train/policy): the state must be of its weights."""
    train_outputs: list[str]
    """The train job's outputs, removed when the state is lost, so that the same command redoes it."""


def run(cfg: DictConfig, args: Args) -> None:
    start = time.monotonic()
    if resident.ENABLED:  # a warm train worker: its own writes in the background first
        resident.join_writes()
    wait_for_writer(args.pending)
    why = None
    meta_path = Path(args.pending) / OPTIMIZER_META
    if not meta_path.is_file():
        failed = read_json(optimizer_partial(args.pending) / OPTIMIZER_FAILED)
        if failed is not None:
            why = f"writing the optimizer state {args.pending} after the train job failed: {failed.get('error')}"
        else:
            why = f"{args.pending} holds no finished optimizer state (its writer died before it was complete)"
    else:
        digest = json.loads(meta_path.read_text()).get("policy_weights")
        if digest != manifest.weights_digest(args.policy, resident.KEY):
            why = f"{args.pending} is the optimizer state of other weights than {args.policy}"
    if why is not None:
        check_job(args.out)
        for path in map(Path, args.train_outputs):
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        raise OptimizerStateLost(
            f"{why}: the train job's outputs ({', '.join(args.train_outputs)}) were removed, so that the same "
            "command redoes that update from the previous iteration's state"
        )
    check_job(args.out)
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    os.replace(args.pending, out)
    log.info("published %s (%.0f s after this job started)", out, time.monotonic() - start)
