"""Replaying published updates: a train job whose AdamW state is that of an earlier iteration c
(the last one written: ``train.optimizer_every``, issue "The AdamW state stays in memory") brings its
engine to the policy of iteration k - 1 by redoing the updates of iterations c+1 .. k-1 from their
cached advantages, with their own seeds, mini-batches and learning-rate schedule, as their jobs
did; no rollout or features job runs again.

Each replayed policy is checked against the manifest its job published
(``otbflow.runtime.manifest``): the fp32 master weights cast as that job published them, tensor by
tensor. On CPU the replay is bitwise; on a GPU it is bitwise only where the kernels are
deterministic, and a mismatch fails the job naming the tensors (``ReplayMismatch``): the way on is
to rerun from c with its stored rollouts (docs/training.md)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig

from otbflow.algorithms.lr_schedule import LRSchedule
from otbflow.runtime import manifest, resident
from otbflow.runtime.policy_folder import pruned_record
from otbflow.seeds import derive_seed
from otbflow.training.publish import full_fp32_state_dict, published_dtype
from otbflow.training.trainer import Trainer, load_rows, mini_batches

log = logging.getLogger("otbflow.train.replay")

SAFETENSORS_NAMES = {getattr(torch, torch_name): name for name, torch_name in manifest.DTYPES.items()}


class ReplayMismatch(RuntimeError):
    """A replayed update did not give the policy its job published."""


@dataclass
class Update:
    """One published update to redo: its iteration, advantages table and published policy."""

    iteration: int
    advantages: str
    policy: str


def state_digests(state: dict[str, torch.Tensor], names, dtype: torch.dtype) -> dict[str, dict]:
    """Manifest entries (dtype, shape, BLAKE3) of ``state``'s tensors ``names`` as a policy of
    ``dtype`` holds them: the bytes safetensors would write (``manifest.entries`` of the folder)."""
    blake3 = manifest._blake3()
    cast: dict[int, torch.Tensor] = {}
    out = {}
    for name in names:
        t = state[name]
        if t.is_floating_point():
            t = cast.setdefault(id(state[name]), t.to(dtype))
        t = t.detach().cpu().contiguous()
        raw = t.view(-1).view(torch.uint8).numpy() if t.numel() else b""
        out[name] = {"dtype": SAFETENSORS_NAMES.get(t.dtype, str(t.dtype)), "shape": list(t.shape)}
        out[name][manifest.HASH] = blake3(raw).hexdigest()
    return out


def published_tensors(policy: str) -> dict[str, dict]:
    """The manifest entries of the weights ``policy``'s job published: its manifest alone where
    retention deleted the weights (the manifest, written by the train job in this results folder,
    is the record), else checked against one pass over its files (``manifest.weights``)."""
    listed = manifest.read(policy)
    if listed is not None and pruned_record(policy) is not None:
        return listed["tensors"]
    return manifest.weights(policy, resident.KEY)[1]


def check_replayed(engine, cfg: DictConfig, update: Update, rank: int) -> None:
    """ReplayMismatch naming the tensors where the engine's weights, cast as ``update``'s job
    published them, are not that policy's (its manifest, or one pass over its files). Collective:
    every rank calls it (ZeRO-3 gathers the weights); rank 0 compares."""
    state = full_fp32_state_dict(engine, keep=rank == 0)
    if rank != 0:
        return
    published = published_tensors(update.policy)
    dtype = published_dtype(cfg, "optimizer written")
    mine = state_digests(state, [n for n in published if not n.startswith("file:")], dtype)
    bad = sorted(n for n in published if mine.get(n, {}).get(manifest.HASH) != published[n][manifest.HASH])
    if bad:
        raise ReplayMismatch(
            f"replaying iteration {update.iteration} gave other weights than {update.policy} holds in "
            f"{len(bad)} tensor(s) ({', '.join(bad[:5])}): the update is not reproducible here (a GPU without "
            "deterministic kernels). Rerun the run from the last AdamW state with its stored rollouts "
            "(docs/training.md, 'Replay')"
        )


def replay(
    engine,
    cfg: DictConfig,
    updates: list[Update],
    schedule_state: dict | None,
    pad_id: int,
    rank: int,
    world_size: int,
    ref_model=None,
) -> dict | None:
    """Redo ``updates`` in order on ``engine`` (the AdamW state and weights of the iteration before
    the first), each checked against its published policy (``check_replayed``); returns the
    learning-rate schedule's state after the last (``schedule_state``: before the first)."""
    tc = cfg.train
    for update in updates:
        data = load_rows(update.advantages, cfg)
        seed = derive_seed(cfg.seed, "train", update.iteration)
        torch.manual_seed(seed)
        trainer = Trainer(engine, data, cfg, pad_id, rank, world_size, ref_model)
        plan = mini_batches(len(data["response_ids"]), tc, seed)
        schedule = LRSchedule.from_dict(tc, schedule_state)
        schedule.set_horizon(len(plan), lambda: cfg.iterations)
        for mini in plan:
            m = trainer.step(mini, schedule.lr())
            schedule.observe(m["mean_response_length"], m["tokens"])
        schedule_state = json.loads(json.dumps(schedule.to_dict()))  # as the job's --state JSON held it
        check_replayed(engine, cfg, update, rank)
        if rank == 0:
            log.info("replayed iteration %d (%d steps): the weights of %s", update.iteration, len(plan), update.policy)
    return schedule_state


def updates_from_args(iteration: int, advantages: list[str], policies: list[str], fresh: bool) -> list[Update]:
    """The updates of iterations k - len .. k - 1 from the train stage's --replay-advantages and
    --replay-policies (as many, in order); ``fresh``: from the initial policy (iteration 0 on),
    otherwise after an AdamW state (iteration 1 on)."""
    if len(advantages) != len(policies):
        raise ValueError(
            f"--replay-advantages has {len(advantages)} table(s), --replay-policies {len(policies)} folder(s): "
            "one of each per replayed iteration"
        )
    if not advantages:
        return []
    first, least = iteration - len(advantages), 0 if fresh else 1
    if first < least:
        raise ValueError(
            f"{len(advantages)} replayed iteration(s) before iteration {iteration}: at most {iteration - least}"
        )
    return [Update(first + i, str(Path(a)), str(Path(p))) for i, (a, p) in enumerate(zip(advantages, policies))]
