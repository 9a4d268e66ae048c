"""Learning-rate schedules of the train stage (``train.lr_schedule``: constant, cosine and the
response-length-triggered ``length_decay``), with state that survives RL iterations (``ScheduleState``,
resumed by the next iteration's train job). Formulas and constants: docs/training.md,
"Learning-rate schedules"."""

from __future__ import annotations

import math
import typing
from dataclasses import asdict, dataclass, field

from omegaconf import DictConfig

from otbflow.registry import Registry

SCHEDULES = Registry("LR schedule", "train")
"""The ``train.lr_schedule`` choices: each a class with the three hooks of ``Constant`` (the
config's choices are this registry; ``options``: the train.* keys each reads beside lr and
lr_warmup_steps, which every schedule reads)."""


@dataclass
class ScheduleState:
    step: int = 0
    """Optimizer steps taken so far, over all iterations (the next step's index)."""
    tokens: int = 0
    """Response tokens of those steps (the metrics' ``tokens``, summed): the live curves' token axis."""
    lengths: list[float] = field(default_factory=list)
    """Mean response length of every step so far (length_decay's input)."""
    surge_step: int | None = None
    """k_s, the step at which the surge was detected (None: not yet)."""
    period: int | None = None
    """P, the halving period in steps."""
    total_steps: int | None = None
    """cosine: the decay horizon fixed at the first iteration."""


@SCHEDULES.register("constant")
class Constant:
    """train.lr after the warm-up, every step."""

    @staticmethod
    def horizon(t: DictConfig, s: ScheduleState, steps_this_iteration: int, iterations) -> None:
        """Fix what the schedule needs to know of the run once, at its first iteration."""

    @staticmethod
    def lr(t: DictConfig, s: ScheduleState, k: int) -> float:
        """The learning rate of step k, after the warm-up."""
        return t.lr

    @staticmethod
    def observe(t: DictConfig, s: ScheduleState, k: int, mean_length: float, next_lr) -> str:
        """React to finished step k (its mean response length, already in ``s.lengths``; ``next_lr()``
        the next step's learning rate); returns an event description, '' when nothing happened."""
        return ""


@SCHEDULES.register("cosine", options=("lr_min_ratio", "lr_decay_steps"))
class Cosine(Constant):
    """Cosine decay from train.lr to lr_min_ratio x lr over lr_decay_steps (or the whole run)."""

    @staticmethod
    def horizon(t: DictConfig, s: ScheduleState, steps_this_iteration: int, iterations) -> None:
        if s.total_steps is not None:
            return
        if t.lr_decay_steps:
            s.total_steps = t.lr_decay_steps + t.lr_warmup_steps
        else:
            s.total_steps = max(1, steps_this_iteration * iterations())

    @staticmethod
    def lr(t: DictConfig, s: ScheduleState, k: int) -> float:
        floor = t.lr_min_ratio * t.lr
        span = max(1, (s.total_steps or 1) - t.lr_warmup_steps)
        progress = min(1.0, (k - t.lr_warmup_steps) / span)
        return floor + (t.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


@SCHEDULES.register(
    "length_decay",
    options=(
        "lr_min_ratio",
        "length_baseline_steps",
        "length_surge_factor",
        "length_surge_patience",
        "length_period_factor",
    ),
)
class LengthDecay(Constant):
    """Constant until the mean response length surges, then halved every period down to the floor."""

    @staticmethod
    def lr(t: DictConfig, s: ScheduleState, k: int) -> float:
        if s.surge_step is None:
            return t.lr
        return t.lr * max(t.lr_min_ratio, 2.0 ** -((k - s.surge_step) // s.period))

    @staticmethod
    def observe(t: DictConfig, s: ScheduleState, k: int, mean_length: float, next_lr) -> str:
        if s.surge_step is None:
            n = t.length_baseline_steps
            if len(s.lengths) < n + t.length_surge_patience:
                return ""
            baseline = sum(s.lengths[:n]) / n
            recent = s.lengths[-t.length_surge_patience :]
            if all(x > t.length_surge_factor * baseline for x in recent):
                s.surge_step = k
                s.period = max(1, round(t.length_period_factor * k))
                return (
                    f"length surge at step {k}: mean response length {mean_length:.1f} > "
                    f"{t.length_surge_factor} x baseline {baseline:.1f}; halving the LR every {s.period} steps "
                    f"down to {t.lr_min_ratio} x {t.lr:g}"
                )
            return ""
        before = (k - s.surge_step) // s.period
        after = (s.step - s.surge_step) // s.period
        if after > before and 2.0**-before > t.lr_min_ratio:
            return f"LR halved after step {k}: next lr {next_lr():.3g}"
        return ""


class LRSchedule:
    """The schedule of ``train.lr_schedule`` with its state (warm-up first, for every schedule)."""

    def __init__(self, tc: DictConfig, state: ScheduleState | None = None):
        if tc.lr_schedule not in SCHEDULES:
            raise ValueError(f"train.lr_schedule: unknown schedule {tc.lr_schedule!r} (one of {', '.join(SCHEDULES)})")
        self.tc = tc
        self.kind = SCHEDULES[tc.lr_schedule].obj
        self.state = state or ScheduleState()

    @classmethod
    def from_dict(cls, tc: DictConfig, data: dict | None) -> "LRSchedule":
        return cls(tc, ScheduleState(**data) if data else None)

    def to_dict(self) -> dict:
        return asdict(self.state)

    def set_horizon(self, steps_this_iteration: int, iterations: typing.Callable[[], int]) -> None:
        """Fix the schedule's horizon once (at the first iteration); ``iterations()`` (the run's
        iteration count) is asked for only where it sets the horizon (cosine, no lr_decay_steps),
        so that any other schedule's outputs do not depend on it."""
        self.kind.horizon(self.tc, self.state, steps_this_iteration, iterations)

    def lr(self) -> float:
        """The learning rate of the next step (index ``state.step``)."""
        t, k = self.tc, self.state.step
        if t.lr_warmup_steps and k < t.lr_warmup_steps:
            return t.lr * (k + 1) / t.lr_warmup_steps
        return self.kind.lr(t, self.state, k)

    def observe(self, mean_length: float, tokens: int = 0) -> str:
        """Record the finished step's mean response length (and its tokens) and advance; returns an
        event description ('' when nothing happened) for the step that was just taken."""
        s = self.state
        k = s.step
        s.lengths.append(float(mean_length))
        s.step += 1
        s.tokens += int(tokens)
        return self.kind.observe(self.tc, s, k, mean_length, self.lr)
