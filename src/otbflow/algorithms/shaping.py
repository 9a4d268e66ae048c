"""The training reward: the task's verifiable reward (``otbflow.algorithms.rewards``), shaped by the response's
length where the config asks for it:

- ``task.reward: cosine``: the cosine length-scaled reward of "Demystifying Long Chain-of-Thought
  Reasoning" (algorithms.md §8; the authors' ``openrlhf/reward/cosine.py``), which replaces the
  verifiable reward by a value that falls with length for a correct answer and rises with it for
  a wrong one, and punishes running into the generation limit;
- ``task.overlong_buffer > 0``: DAPO's soft overlong punishment (algorithms.md §6.1), added to
  whatever the reward is, over the last ``overlong_buffer`` tokens before the limit.

The rollout table keeps both: ``verifiable_reward`` (what the verifier said) and ``reward`` (what
trains). Evaluation and DAPO's dynamic sampling read the verifiable reward only (``verifier``).
Formulas and defaults: docs/rewards.md, "The cosine length-scaled reward". Imports no torch."""

from __future__ import annotations

import math
from dataclasses import dataclass

from otbflow.algorithms.rewards import get_reward, resolve_reward_name, reward_timeouts
from otbflow.registry import Entry, Registry, Requirement


@dataclass(frozen=True)
class ShapedReward(Entry):
    """A ``task.reward`` value that shapes a verifiable reward instead of naming one: ``obj`` is
    ``fn(correct, length, max_len, values, text) -> reward``, ``values`` the task subsection
    ``settings`` (whose ``verifier`` key names the verifiable reward it wraps)."""

    settings: str = ""


SHAPED_REWARDS = Registry("shaped reward", "task", entry=ShapedReward)
"""The ``task.reward`` values that shape a verifiable reward (beside the verifiers' names)."""


def shaped(task) -> ShapedReward | None:
    """The shaped reward ``task.reward`` names, or None for a verifier's name."""
    return SHAPED_REWARDS.get(task.reward)


def verifier(task) -> str:
    """The registered verifiable reward the ``task`` section scores with: ``task.reward``
    (resolved: 'auto' is 'arithmetic' for the synthetic task, 'math' for datasets), or for a
    shaped reward the one it wraps (e.g. ``task.cosine.verifier``)."""
    s = shaped(task)
    name = task[s.settings].verifier if s else task.reward
    return resolve_reward_name(task.name, name)


def verifier_keys(task) -> list[str]:
    """The config keys that choose the verifier (``verifier``): evaluation's scoring keys."""
    s = shaped(task)
    return ["task.name", "task.reward"] + ([f"task.{s.settings}.verifier"] if s else [])


def shaping_keys(task) -> list[str]:
    """The config keys that change the training reward beyond the verifier (``training_reward``)."""
    keys = SHAPED_REWARDS.option_keys(task.reward) if shaped(task) else []
    keys += ["task.overlong_buffer"] + (["task.overlong_penalty"] if task.overlong_buffer > 0 else [])
    return keys


def overlong_penalty(length: int, max_len: int, buffer: int, factor: float) -> float:
    """DAPO's soft overlong punishment of a ``length``-token response under the limit ``max_len``
    (L_max) with buffer ``buffer`` (L_cache) and ``factor``: 0 up to L_max - L_cache, then
    falling linearly to -factor at L_max, and -factor beyond it (algorithms.md §6.1; verl's
    ``min(-exceed / L_cache * factor, 0)`` keeps falling past L_max, which a response capped at
    L_max tokens never reaches). 0 where ``buffer`` is 0 (off)."""
    if buffer == 0:
        return 0.0
    expected = max_len - buffer
    if length <= expected:
        return 0.0
    if length > max_len:
        return -factor
    return (expected - length) / buffer * factor


def repetition_penalty(text: str, ngram: int, max_penalty: float) -> float:
    """The cosine reward's sparse repetition penalty (§8, ``get_repetition_penalty``): the share of
    repeated n-grams of whitespace-separated, lower-cased words times ``max_penalty`` (<= 0); 0 when
    ``max_penalty`` is 0 or the text has fewer than ``ngram`` words (the authors' code divides by
    zero there)."""
    if max_penalty == 0:
        return 0.0
    words = text.lower().split()
    grams = [tuple(words[i : i + ngram]) for i in range(len(words) - ngram + 1)]
    if not grams:
        return 0.0
    return (1 - len(set(grams)) / len(grams)) * max_penalty


@SHAPED_REWARDS.register(
    "cosine",
    options=("cosine",),
    settings="cosine",
    requires=(
        Requirement(
            "task.cosine.exceed_margin",
            "< rollout.max_new_tokens: otherwise every response counts as exceeding",
            lambda margin, cfg: margin < cfg.rollout.max_new_tokens,
        ),
    ),
)
def cosine_reward(correct: bool, length: int, max_len: int, c, text: str = "") -> float:
    """The cosine length-scaled reward (§8) of a ``length``-token response under the generation
    limit ``max_len``, with the values of ``c`` (``task.cosine``): ``c.exceed`` where
    length + ``c.exceed_margin`` >= max_len; else, with cos = cos(pi * length / max_len), a correct
    answer gets correct_min + (correct_max - correct_min)(1 + cos)/2 (correct_max at length 0,
    correct_min at max_len) and a wrong one wrong_max + (wrong_min - wrong_max)(1 + cos)/2
    (wrong_min at 0, wrong_max at max_len) plus the repetition penalty of ``text``."""
    if length + c.exceed_margin >= max_len:
        return float(c.exceed)
    cos = math.cos(math.pi * length / max_len)
    if correct:
        return c.correct_min + 0.5 * (c.correct_max - c.correct_min) * (1.0 + cos)
    shaped = c.wrong_max + 0.5 * (c.wrong_min - c.wrong_max) * (1.0 + cos)
    return shaped + repetition_penalty(text, c.repetition_ngram, c.repetition_max)


def training_reward(task, max_len: int, verifiable: float, length: int, text: str) -> float:
    """The reward a response of ``length`` tokens (``text``) trains with, from its ``verifiable``
    reward under the ``task`` section and the generation limit ``max_len`` (rollout.max_new_tokens):
    the cosine reward (correct: verifiable == 1, as the authors' code decides) or the verifiable
    reward itself, plus the overlong punishment. Unshaped, exactly ``verifiable``."""
    s = shaped(task)
    base = s.obj(verifiable == 1.0, length, max_len, task[s.settings], text) if s else verifiable
    if task.overlong_buffer == 0:
        return base
    return base + overlong_penalty(length, max_len, task.overlong_buffer, task.overlong_penalty)


class Scorer:
    """The rewards of responses under a config: ``(verifiable, training)`` of one response.
    ``timeouts`` counts the calls whose verifier ran past its deadline (scored 0.0;
    ``otbflow.algorithms.rewards.reward_timeouts``)."""

    def __init__(self, cfg) -> None:
        self.task, self.max_len = cfg.task, cfg.rollout.max_new_tokens
        self.verify = get_reward(verifier(cfg.task))
        self.timeouts = 0

    def __call__(self, text: str, answer: str, length: int) -> tuple[float, float]:
        before = reward_timeouts()
        verifiable = self.verify(text, answer)
        self.timeouts += reward_timeouts() - before
        return verifiable, training_reward(self.task, self.max_len, verifiable, length, text)
