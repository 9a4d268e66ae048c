"""Export: the run's last policy in fp32, from the fp32 master weights of its last AdamW state.

A run that publishes its policies in bf16 (``policy_folder.publishes_bf16``: ``model.dtype:
bfloat16`` with ``train.bf16``) keeps the fp32 master weights only in the AdamW state, which
holds them as DeepSpeed shards them. At the run's end this job writes them as an HF folder of
fp32 weights (``results/final/policy_fp32/``, with the last policy's config, tokenizer and a
manifest): what a user continues from or evaluates in fp32. It reads the state through the train
stage's DeepSpeed engine, in the train stage's layout (its world size, ZeRO stage and bf16); a
warm train worker that holds the engine of that state writes it without loading anything.
Cast to bf16, its tensors are the last policy's (tests/test_adamw.py).
"""

from __future__ import annotations

import atexit
import logging
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from otbflow.models.policy import set_threads
from otbflow.runtime import policy_folder, resident
from otbflow.training.distributed import (
    _destroy_process_group,
    build_engine,
    deepspeed_config,
    init_distributed_env,
    resident_engine,
)
from otbflow.training.publish import full_fp32_state_dict, save_policy
from otbflow.training.state import check_optimizer_state, load_optimizer_state

log = logging.getLogger("otbflow.export")


@dataclass
class Args:
    policy: str
    """The run's last policy (iter_k/train/policy, bf16): its config and tokenizer go with the export."""
    optimizer: str
    """The AdamW state the same train job wrote (iter_k/train/optimizer): its fp32 master weights."""
    out: str
    """Output HF folder of the fp32 weights."""


def run(cfg: DictConfig, args: Args) -> None:
    set_threads()
    tc = cfg.train
    rank, world_size = init_distributed_env()
    atexit.register(_destroy_process_group)
    resident.join_writes()
    meta = check_optimizer_state(args.optimizer, tc, world_size, args.policy)  # of this policy, this layout
    layout = {"deepspeed": deepspeed_config(tc, world_size), "policy": policy_folder.architecture(Path(args.policy))}
    engine = resident_engine(layout, meta, args.policy)  # left held: nothing here changes it
    if engine is None:
        engine = build_engine(args.policy, tc, world_size)
        load_optimizer_state(engine, args.optimizer)
    state = full_fp32_state_dict(engine, keep=rank == 0)  # collective
    if rank == 0:
        save_policy(engine, state, args.policy, args.out, {"iteration": meta.get("iteration"), "export": "fp32"})
        log.info("the fp32 master weights of %s in %s", args.optimizer, args.out)
