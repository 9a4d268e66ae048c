"""LR schedules: warm-up, cosine, the response-length-triggered decay, and their saved state."""

import json

import pytest

from otbflow.algorithms.lr_schedule import LRSchedule
from otbflow.config import load_config


def schedule(*overrides: str) -> LRSchedule:
    return LRSchedule(load_config(None, ["train.lr=1.0", *overrides]).train)


def walk(s: LRSchedule, lengths: list[float]) -> tuple[list[float], list[str]]:
    """The LR of each step and the event after it, feeding the steps' mean lengths."""
    lrs, events = [], []
    for x in lengths:
        lrs.append(s.lr())
        events.append(s.observe(x))
    return lrs, events


def test_constant_with_warmup():
    lrs, events = walk(schedule("train.lr_warmup_steps=4"), [10.0] * 6)
    assert lrs == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0]) and not any(events)


def test_cosine_from_peak_to_floor():
    s = schedule(
        "train.lr_schedule=cosine", "train.lr_warmup_steps=2", "train.lr_decay_steps=4", "train.lr_min_ratio=0.1"
    )
    s.set_horizon(steps_this_iteration=3, iterations=lambda: 10)  # lr_decay_steps wins over the auto horizon
    lrs, _ = walk(s, [10.0] * 8)
    assert lrs == pytest.approx(
        [0.5, 1.0, 1.0, 0.1 + 0.9 * 0.5 * (1 + 2**-0.5), 0.55, 0.1 + 0.9 * 0.5 * (1 - 2**-0.5), 0.1, 0.1]
    )


def test_cosine_auto_horizon_is_iterations_times_steps():
    s = schedule("train.lr_schedule=cosine")
    s.set_horizon(steps_this_iteration=5, iterations=lambda: 4)
    s.set_horizon(steps_this_iteration=7, iterations=lambda: 4)  # fixed at the first iteration
    assert s.state.total_steps == 20


def test_length_decay_triggers_on_a_surge_then_halves_to_the_floor():
    s = schedule(
        "train.lr_schedule=length_decay",
        "train.length_baseline_steps=3",
        "train.length_surge_factor=2",
        "train.length_surge_patience=2",
        "train.length_period_factor=1.0",
        "train.lr_min_ratio=0.2",
    )
    # baseline 10; step 4 surges once (a blip, patience 2), steps 6 and 7 surge: k_s = 7, P = 7
    lengths = [10, 10, 10, 12, 25, 10, 25, 30] + [30] * 30
    lrs, events = walk(s, lengths)
    assert s.state.surge_step == 7 and s.state.period == 7
    assert "length surge at step 7" in events[7] and "baseline 10.0" in events[7]
    assert lrs[:14] == [1.0] * 14  # halvings count from the surge: first at step 7 + P
    assert lrs[14:21] == [0.5] * 7 and lrs[21:28] == [0.25] * 7 and lrs[28:] == [0.2] * 10
    halvings = [i for i, e in enumerate(events) if e.startswith("LR halved")]
    assert halvings == [13, 20, 27]  # logged at the step before each change; none once at the floor


def test_no_surge_keeps_the_lr():
    lrs, events = walk(schedule("train.lr_schedule=length_decay", "train.length_baseline_steps=2"), [10, 12, 14] * 5)
    assert lrs == [1.0] * 15 and not any(events)


def test_state_round_trips_through_json():
    tc = load_config(
        None,
        [
            "train.lr=1.0",
            "train.lr_schedule=length_decay",
            "train.length_baseline_steps=2",
            "train.length_period_factor=1.0",
        ],
    ).train
    a = LRSchedule(tc)
    walk(a, [10, 10, 40, 40])
    b = LRSchedule.from_dict(tc, json.loads(json.dumps(a.to_dict())))
    assert b.state == a.state and b.lr() == a.lr()
    assert walk(a, [40] * 5) == walk(b, [40] * 5)
