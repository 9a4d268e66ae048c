"""Verifiable rewards, chosen by name from a registry. A reward is ``fn(response_text, answer) ->
float``; add one with ``@register("name")``. ``arithmetic`` scores the synthetic task, ``math``
uses math-verify with a small fallback extractor: how it parses and compares, README.md, "A real
model and dataset"."""

from __future__ import annotations

import re
import threading
from typing import Callable

RewardFn = Callable[[str, str], float]
REWARDS: dict[str, RewardFn] = {}


def register(name: str) -> Callable[[RewardFn], RewardFn]:
    def deco(fn: RewardFn) -> RewardFn:
        if name in REWARDS:
            raise ValueError(f"reward '{name}' is registered twice")
        REWARDS[name] = fn
        return fn

    return deco


def get_reward(name: str) -> RewardFn:
    try:
        return REWARDS[name]
    except KeyError:
        raise ValueError(f"unknown reward '{name}'; registered: {', '.join(sorted(REWARDS))}") from None


def resolve_reward_name(task_name: str, reward: str) -> str:
    if reward != "auto":
        return reward
    return "arithmetic" if task_name == "arithmetic" else "math"


@register("arithmetic")
def arithmetic_reward(response: str, answer: str) -> float:
    """1.0 if the text after the last '#' is exactly the answer (the synthetic task's format)."""
    if "#" not in response:
        return 0.0
    return float(response.rsplit("#", 1)[1].strip() == answer.strip())


_BOXED = re.compile(r"\\boxed\{")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} in ``text`` (nested braces kept), or None."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    i, depth = starts[-1], 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def extract_math_answer(text: str) -> str | None:
    """The final answer of a GSM8K/MATH-style response: \\boxed{..}, else '#### x', else the
    last number in the text."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    if "####" in text:
        return text.rsplit("####", 1)[1].strip().split("\n")[0].strip()
    nums = _NUMBER.findall(text)
    return nums[-1] if nums else None


def _normalise(ans: str) -> str:
    s = ans.strip().strip("$ .").replace(",", "").replace("\\!", "").replace(" ", "")
    s = re.sub(r"\\text\{[^}]*\}", "", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    m = re.fullmatch(r"\\frac\{(-?\d+)\}\{(\d+)\}", s)
    if m:
        s = f"{m.group(1)}/{m.group(2)}"
    try:
        if "/" in s:
            num, den = s.split("/")
            value = float(num) / float(den)
        else:
            value = float(s)
        return repr(round(value, 6))
    except ValueError:
        return s


def fallback_math_reward(response: str, answer: str) -> float:
    """1.0 if the extracted final answer equals the reference after normalisation (numbers
    compared by value, commas and $ removed, \\frac{a}{b} read as a/b)."""
    pred = extract_math_answer(response)
    if pred is None:
        return 0.0
    ref = extract_math_answer(answer) if ("####" in answer or "\\boxed" in answer) else answer
    return float(ref is not None and _normalise(pred) == _normalise(ref))


MATH_VERIFY_TIMEOUT_S = 5


def _reference_text(answer: str) -> str:
    """A reference as LaTeX for math-verify: a GSM8K/MATH solution's final answer, boxed."""
    if "####" in answer:
        answer = answer.rsplit("####", 1)[1].strip().split("\n")[0].replace(",", "")
    elif "\\boxed" in answer:
        answer = last_boxed(answer) or answer
    return "\\boxed{" + answer.strip() + "}"


@register("math")
def math_reward(response: str, answer: str) -> float:
    """1.0 if math-verify finds the response's final answer equal to the reference (its parse of
    the reference as \\boxed{answer}, of the response with LaTeX and expression extraction); the
    fallback extractor where math-verify parses nothing."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    timeout = MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold = parse(_reference_text(answer), extraction_config=[LatexExtractionConfig()], parsing_timeout=timeout)
    pred = parse(
        response,
        extraction_config=[LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()],
        parsing_timeout=timeout,
    )
    if not gold or not pred:
        return fallback_math_reward(response, answer)
    return float(verify(gold, pred, timeout_seconds=timeout))
