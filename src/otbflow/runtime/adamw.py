"""Where the AdamW state is written and who reads it (``train.optimizer_every``; docs/training.md,
"The AdamW state: every N iterations").

With N = 1 every train job writes its state and the next one reads it: the next update waits for
the write. With N >= 2 (a warm train worker keeps the engine between jobs, docs/workers.md) the
state is written by the checkpoint iterations only, C = {N-1, 2N-1, ...} and the run's last, and
train job k declares the second-newest regular checkpoint c before it, with the advantages and
policies of iterations c+1 .. k-1: the newest write has a whole interval of N iterations to
finish, and a job without the resident engine (none warm, the worker lost) rebuilds it from c by
replaying at most 2N-1 published updates (``otbflow.training.replay``). Before the second
checkpoint the replay starts from the initial policy with a fresh AdamW.

One place for these facts: the workflow's rules, the retention policy, ``otbflow disk`` and the
train stage read them here. Imports no torch (the Snakefile imports it)."""

from __future__ import annotations

from omegaconf import DictConfig

AUTO_EVERY = 5
"""``train.optimizer_every: null`` with a train worker (workers.slurm and workers.train): the
smallest N whose interval holds the H100's AdamW write (14.1-15.7 s) twice over at the 6.6-6.7 s
of its generation, forward and optimizer-step timers per iteration (5 x 6.6 = 33 s >= 31.4 s;
docs/measurements.md#iteration_workers_h100), and a replay of at most 9 updates."""


def every(cfg: DictConfig) -> int:
    """N: ``train.optimizer_every``, or where it is null, AUTO_EVERY for a run whose train jobs go
    to a train worker (workers.slurm and workers.train) and 1 otherwise (0 with reset_optimizer)."""
    if cfg.train.reset_optimizer:
        return 0
    if cfg.train.optimizer_every is not None:
        return int(cfg.train.optimizer_every)
    return AUTO_EVERY if cfg.workers.slurm and cfg.workers.train > 0 else 1


def regular(cfg: DictConfig, k: int) -> bool:
    """Whether iteration k is a regular checkpoint ((k + 1) % N == 0): one that does not depend on
    the run's length, which train jobs declare."""
    n = every(cfg)
    return n > 0 and (k + 1) % n == 0


def writes(cfg: DictConfig, k: int) -> bool:
    """Whether train job k writes its AdamW state as an output (published by publish_optimizer):
    a regular checkpoint, or the run's last iteration (a run can be extended or resumed)."""
    return every(cfg) > 0 and (regular(cfg, k) or k == cfg.iterations - 1)


def written(cfg: DictConfig) -> list[int]:
    """The iterations whose AdamW state the run writes."""
    return [k for k in range(cfg.iterations) if writes(cfg, k)]


def declared(cfg: DictConfig, k: int) -> int | None:
    """The iteration whose AdamW state train job k declares: k-1 with N = 1; with N >= 2 the
    second-newest regular checkpoint before k. None: a fresh AdamW (k = 0, reset_optimizer, or
    before the second checkpoint: the replay starts from the initial policy)."""
    n = every(cfg)
    if n == 0 or k == 0:
        return None
    if n == 1:
        return k - 1
    newest = (k // n) * n - 1  # the largest c <= k-1 with (c+1) % n == 0 (-1: none)
    second = newest - n
    return second if second >= 0 else None


def replayed(cfg: DictConfig, k: int) -> list[int]:
    """The iterations whose updates train job k redoes where it has no resident engine: those
    after its declared state (from iteration 0 where it declares none), up to k-1. None with N = 1."""
    if every(cfg) <= 1 or k == 0:
        return []
    c = declared(cfg, k)
    return list(range(0 if c is None else c + 1, k))


def readers(cfg: DictConfig, c: int) -> list[int]:
    """The train jobs that declare iteration c's AdamW state."""
    return [k for k in range(c + 1, cfg.iterations) if declared(cfg, k) == c]


def extension(cfg: DictConfig, k: int) -> bool:
    """Whether iteration k's AdamW state (and the policy it belongs to) is one the train jobs of a
    longer run would declare: a regular checkpoint from the one iteration ``iterations`` declares
    on (the two newest; with N = 1 the last)."""
    first = declared(cfg, cfg.iterations)
    return regular(cfg, k) and (first is None or k >= first)
