"""Prune: apply the retention policy to iteration k's train outputs (``otbflow.runtime.retention``).

The workflow decides what iteration k keeps (``otbflow.runtime.retention.decision``: the rule's
``--keep-*`` flags, also its rerun trigger) and runs this (a local job of the head process, no
queueing) once every job that reads the
policy or the AdamW state iteration k trained is done: the next iteration's features and train,
the rollout that samples with this policy, its evaluation. What is not kept loses its heavy files
(weights, the optimizer's DeepSpeed state); the folders stay with a PRUNED.json. The output
records what was kept, what was deleted and the bytes freed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from otbflow.io import write_json
from otbflow.runtime.policy_folder import policy_weights, pruned_record
from otbflow.runtime.retention import optimizer_state, prune_folder

log = logging.getLogger("otbflow.prune")


@dataclass
class Args:
    iteration: int
    """RL iteration k whose train outputs are pruned."""
    policy: str
    """iter_k/train/policy (HF folder)."""
    out: str
    """Output JSON: the decision, what was deleted, the bytes freed."""
    optimizer: str = ""
    """iter_k/train/optimizer (none with train.reset_optimizer)."""
    keep_policy: bool = False
    """Keep the policy's weights (the workflow passes otbflow.runtime.retention.decision's)."""
    keep_optimizer: bool = False
    """Keep the optimizer state (the workflow passes otbflow.runtime.retention.decision's)."""


def run(cfg: DictConfig, args: Args) -> None:
    freed = {"policy": 0, "optimizer": 0}
    if not args.keep_policy:
        why = f"not kept by the retention policy after iteration {args.iteration} (retention.policy_every)"
        freed["policy"] = prune_folder(args.policy, "weights", why, policy_weights(args.policy))
    if args.optimizer and not args.keep_optimizer:
        why = f"iteration {args.iteration + 1} trained from it, and retention.optimizer is 'last'"
        freed["optimizer"] = prune_folder(args.optimizer, "optimizer state", why, optimizer_state(args.optimizer))
    # what the folders hold now (a policy pruned under an earlier, stricter setting stays pruned)
    kept = {"policy": pruned_record(args.policy) is None}
    kept["optimizer"] = bool(args.optimizer) and pruned_record(args.optimizer) is None
    write_json({"iteration": args.iteration, "kept": kept, "freed_bytes": freed}, args.out)
    for name, folder in (("policy", args.policy), ("optimizer", args.optimizer)):
        if folder:
            state = "kept" if kept[name] else f"pruned ({freed[name] / 2**20:.1f} MiB freed)"
            log.info("iteration %d %s: %s, %s", args.iteration, name, Path(folder), state)
