"""Learning-rate schedules of the train stage (``train.lr_schedule``: constant, cosine and the
response-length-triggered ``length_decay``), with state that survives RL iterations (``ScheduleState``,
resumed by the next iteration's train job). Formulas and constants: docs/training.md,
"Learning-rate schedules"."""

from __future__ import annotations

import math
import typing
from dataclasses import asdict, dataclass, field

from omegaconf import DictConfig

# The schedules by name (train.lr_schedule; the config's choices) and the train.* options each
# reads (the train stage's rerun trigger; lr and lr_warmup_steps are read by every schedule).
SCHEDULE_OPTIONS = {
    "constant": (),
    "cosine": ("lr_min_ratio", "lr_decay_steps"),
    "length_decay": (
        "lr_min_ratio",
        "length_baseline_steps",
        "length_surge_factor",
        "length_surge_patience",
        "length_period_factor",
    ),
}
SCHEDULES = tuple(SCHEDULE_OPTIONS)
"""The ``train.lr_schedule`` names (the config takes its choices from here)."""
CONSTANT, COSINE, LENGTH_DECAY = SCHEDULES


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


class LRSchedule:
    def __init__(self, tc: DictConfig, state: ScheduleState | None = None):
        if tc.lr_schedule not in SCHEDULES:
            raise ValueError(f"train.lr_schedule: unknown schedule {tc.lr_schedule!r} (one of {', '.join(SCHEDULES)})")
        self.tc = tc
        self.state = state or ScheduleState()

    @classmethod
    def from_dict(cls, tc: DictConfig, data: dict | None) -> "LRSchedule":
        return cls(tc, ScheduleState(**data) if data else None)

    def to_dict(self) -> dict:
        return asdict(self.state)

    def set_horizon(self, steps_this_iteration: int, iterations: typing.Callable[[], int]) -> None:
        """Fix the cosine horizon once (at the first iteration); ``iterations()`` (the run's
        iteration count) is asked for only where it sets the horizon (cosine, no lr_decay_steps),
        so that any other schedule's outputs do not depend on it."""
        t = self.tc
        if t.lr_schedule == COSINE and self.state.total_steps is None:
            self.state.total_steps = (
                t.lr_decay_steps + t.lr_warmup_steps
                if t.lr_decay_steps
                else max(1, steps_this_iteration * iterations())
            )

    def lr(self) -> float:
        """The learning rate of the next step (index ``state.step``)."""
        t, s, k = self.tc, self.state, self.state.step
        if t.lr_warmup_steps and k < t.lr_warmup_steps:
            return t.lr * (k + 1) / t.lr_warmup_steps
        if t.lr_schedule == COSINE:
            floor = t.lr_min_ratio * t.lr
            span = max(1, (s.total_steps or 1) - t.lr_warmup_steps)
            progress = min(1.0, (k - t.lr_warmup_steps) / span)
            return floor + (t.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
        if t.lr_schedule == LENGTH_DECAY and s.surge_step is not None:
            return t.lr * max(t.lr_min_ratio, 2.0 ** -((k - s.surge_step) // s.period))
        return t.lr

    def observe(self, mean_length: float, tokens: int = 0) -> str:
        """Record the finished step's mean response length (and its tokens) and advance; returns an
        event description ('' when nothing happened) for the step that was just taken."""
        t, s = self.tc, self.state
        k = s.step
        s.lengths.append(float(mean_length))
        s.step += 1
        s.tokens += int(tokens)
        if t.lr_schedule != LENGTH_DECAY:
            return ""
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
            return f"LR halved after step {k}: next lr {self.lr():.3g}"
        return ""
