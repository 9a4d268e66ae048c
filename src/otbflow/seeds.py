"""Seeds: every job's seed is derived from the global one (or the prompt set's) and its place."""

from __future__ import annotations

import hashlib

from omegaconf import DictConfig


def task_seed(cfg: DictConfig) -> int:
    """The prompt set's seed: task.seed, or the global seed."""
    return cfg.seed if cfg.task.seed is None else cfg.task.seed


def derive_seed(seed: int, *parts: object) -> int:
    """A seed for one job (stage, iteration, shard...) derived from the global seed."""
    key = ":".join(str(p) for p in (seed, *parts))
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "little") & 0x7FFFFFFF
