"""Seeds: every job's seed is derived from the global one (or the prompt set's) and its place."""

from __future__ import annotations

import hashlib

from omegaconf import DictConfig


def task_seed(cfg: DictConfig) -> int:
    """The prompt set's seed: task.seed, or the global seed."""
    return cfg.seed if cfg.task.seed is None else cfg.task.seed


def derive_seed(seed: int, *parts: object, bits: int = 31) -> int:
    """A seed for one job (stage, iteration, shard...) derived from the global seed: the low
    ``bits`` (at most 63) of a SHA-256 of the parts. 31 bits suit every generator; where many
    seeds must all differ (one per sampled row of a rollout), 63 bits make a collision among a
    million of them a 1-in-10^7 event (31 bits: one in 4,000 for a thousand, likely for 10^5)."""
    if not 1 <= bits <= 63:
        raise ValueError(f"bits must be in [1, 63], not {bits}")
    key = ":".join(str(p) for p in (seed, *parts))
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") & ((1 << bits) - 1)
