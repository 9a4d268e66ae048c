"""The next policy a train job publishes: its weights (``published_state``), in the run's
precision (``published_dtype``), written once with their manifest (``save_policy``).

The weights go out tensor by tensor (``otbflow.runtime.tensorfile``): each cast where it must be
into a reused buffer, its BLAKE3 digest taken from the bytes written, and, in a warm train worker publishing
bf16, compared with the policy the job started from (``otbflow.runtime.delta``), so that the
folder also holds the elements that changed. The manifest comes last. Formats and rules:
docs/training.md, "The next policy"; what the digests prove: docs/security.md."""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import torch
from omegaconf import DictConfig

from otbflow.io import atomic_dir
from otbflow.runtime import adamw, delta, manifest, resident, tensorfile
from otbflow.runtime.policy_folder import TOKENIZER_FILES, publishes_bf16

log = logging.getLogger("otbflow.train")

WEIGHTS_FILE = "model.safetensors"
LAST_PUBLISH: dict = {}
"""What the last ``save_policy`` of this process wrote: {bytes, seconds, parts_s (``tensorfile.write``'s
seconds), delta_bytes, delta_elements}; the train job records it in its metrics' metadata
(``publish``)."""


def full_fp32_state_dict(engine, keep: bool) -> dict[str, torch.Tensor]:
    """The policy's full fp32 weights, on CPU (ZeRO's fp32 master weights where it keeps them).
    Collective under ZeRO: every rank must call it; only ranks with ``keep`` hold the result."""
    from deepspeed.utils import safe_get_full_fp32_param

    policy = engine.module.policy
    state = policy.state_dict()  # buffers, and every name of tied parameters
    full: dict[int, torch.Tensor | None] = {}
    for name, p in policy.named_parameters(remove_duplicate=False):
        if id(p) not in full:
            hp = safe_get_full_fp32_param(p)  # None where the module's parameter is the fp32 weight
            if hp is None:
                hp = p.detach()
            full[id(p)] = hp.float().cpu() if keep else None
        state[name] = full[id(p)]
    return state if keep else {}


def published_state(engine, keep: bool, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors the next policy is written from (``save_policy``, which casts them to
    ``dtype``): the module's own parameters where every one is already ``dtype`` and whole
    (DeepSpeed's bf16 module at ZeRO-1/2 holds the fp32 master cast after every step:
    tests/test_train_state.py, the ``_published`` layouts, compares the two bitwise), which saves
    gathering and casting the master; otherwise the fp32 master weights (``full_fp32_state_dict``,
    collective under ZeRO: every rank must call it; the choice is the layout's, the same on every
    rank). Only ranks with ``keep`` hold the result."""
    policy = engine.module.policy
    params = list(policy.named_parameters(remove_duplicate=False))
    if dtype == torch.float32 or any(p.dtype != dtype or hasattr(p, "ds_id") for _, p in params):
        return full_fp32_state_dict(engine, keep)  # hasattr ds_id: ZeRO-3's partitioned parameters
    if not keep:
        return {}
    state = policy.state_dict()  # buffers, and every name of tied parameters
    once: dict[int, torch.Tensor] = {}  # tied names: one tensor, written once
    for name, p in params:
        state[name] = once.setdefault(id(p), p.detach())
    return state


def published_dtype(cfg: DictConfig, optimizer: str) -> torch.dtype:
    """The precision of the policy a train job publishes: bf16 where the run publishes bf16
    (``policy_folder.publishes_bf16``) and the fp32 master weights go on: this job writes the AdamW
    state (``optimizer``), which holds them, or the run writes it every N >= 2 iterations
    (``train.optimizer_every``), whose train jobs carry them in a warm worker's engine and otherwise
    replay them from the last state written (``otbflow.training.replay``); fp32 otherwise (a job
    that writes no AdamW state publishes its master weights). The bf16 tensors are the fp32
    master's cast, which is what every reader computing in bf16 held after casting the fp32 policy
    (tests/test_train_state.py, the ``_published`` layouts). Not the iteration: a run extended later
    keeps what it published."""
    carried = bool(optimizer) or adamw.every(cfg) > 1
    return torch.bfloat16 if publishes_bf16(cfg) and carried else torch.float32


def written_names(state: dict[str, torch.Tensor]) -> list[str]:
    """The names whose tensors a policy's weight file holds: tied names (an output head that is
    the input embedding) once, under the first of them in the state dict's order, as transformers'
    ``save_pretrained`` writes them; sorted."""
    first: dict[int, str] = {}
    for name, t in state.items():
        first.setdefault(id(t), name)
    return sorted(first.values())


def save_policy(
    engine, state: dict[str, torch.Tensor], policy_dir: str, out: str, binding: dict | None = None, dtype=torch.float32
) -> str:
    """The next policy's HF folder: the trained weights (``state``: ``published_state``'s or the
    fp32 master, written as ``dtype``: ``published_dtype``) and config, the tokenizer of
    ``policy_dir`` copied byte for byte (not saved anew: one tokenizer file for the whole run,
    which a warm worker's resident engine can recognise by its digest), in a warm worker
    publishing bf16 the delta from ``policy_dir`` (``otbflow.runtime.delta``), and last the
    manifest of its tensors
    (``otbflow.runtime.manifest.publish``: ``binding`` and, in a worker, the run's key). Returns
    the weights' identity."""
    t0 = time.perf_counter()
    policy = engine.module.policy
    # a warm worker's readers hold the policy this job started from: what changed since, for them
    base = delta.Base(policy_dir) if resident.ENABLED and dtype == torch.bfloat16 else None
    items = [(name, state[name]) for name in written_names(state)]
    with atomic_dir(out) as tmp:  # a failed write (a full disk) raises its OSError naming ``out``
        each = base.observe if base is not None else None
        seconds: dict[str, float] = {}
        tensors = tensorfile.write(Path(tmp) / WEIGHTS_FILE, items, dtype, {"format": "pt"}, each, seconds)
        changes = base.write(tmp) if base is not None else None
        if base is not None and base.broken:
            log.warning("%s: %s differs from its manifest: no delta written", policy_dir, base.broken)
        policy.config.architectures = [type(policy).__name__]
        policy.config.dtype = str(dtype).removeprefix("torch.")  # what the files hold, not the module
        policy.config.save_pretrained(tmp)
        if policy.can_generate():
            policy.generation_config.save_pretrained(tmp)
        for name in TOKENIZER_FILES:
            if (Path(policy_dir) / name).is_file():
                shutil.copyfile(Path(policy_dir) / name, Path(tmp) / name)
        weights = manifest.publish(tmp, out, binding or {}, resident.KEY, tensors, changes)
    LAST_PUBLISH.clear()
    LAST_PUBLISH.update(
        bytes=(Path(out) / WEIGHTS_FILE).stat().st_size,
        seconds=round(time.perf_counter() - t0, 3),
        # cast, hash, and wait: for the write and the delta's comparison, which run beside them
        parts_s={k: round(v, 3) for k, v in seconds.items()},
        delta_bytes=changes["bytes"] if changes else None,
        delta_elements=changes["elements"] if changes else None,
    )
    return weights
