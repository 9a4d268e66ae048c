"""Verifiable rewards, chosen by name from a registry. A reward is ``fn(response_text, answer) ->
float``; add one with ``@register("name")``. ``arithmetic`` scores the synthetic task (string
methods in the calling process, linear in the response); ``math`` uses math-verify with a small
fallback extractor (its patterns linear in the text), both in a worker process under a hard
deadline whose time-outs score 0 and are counted (``reward_timeouts``): how it parses and
compares, docs/data.md, "A real model and dataset"."""

from __future__ import annotations

import atexit
import json
import os
import re
import select
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from otbflow.registry import Registry

RewardFn = Callable[[str, str], float]
REWARDS = Registry("verifiable reward", "task")
"""The verifiers by name (``task.reward``, ``task.cosine.verifier``): each entry's ``obj`` is
``fn(response_text, answer) -> float``."""


def register(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: register ``fn(response_text, answer) -> float`` as the verifiable reward ``name``."""
    return REWARDS.register(name)


def get_reward(name: str) -> RewardFn:
    try:
        return REWARDS[name].obj
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


@register("digit_share")
def digit_share_reward(response: str, answer: str) -> float:
    """The share of the response's characters that are digits, whatever the answer: a shaped reward
    for benchmarks (benchmarks/bench_iteration.py's shaped settings), under which a random policy's
    responses already differ, so that its advantages are not all 0 and its weights change every
    iteration. It teaches nothing about the task."""
    return sum(c.isdigit() for c in response) / len(response) if response else 0.0


# Every pattern below is read in time linear in the text (the responses are the policy's, up to
# rollout.max_new_tokens tokens of anything): none has two quantifiers that can share a character,
# so a failed match never backtracks over what it read; a number reads one way only.
_BOXED = re.compile(r"\\boxed\{")
_NUM = r"-?(?:\d+(?:,\d{3})*(?:\.\d+)?|\.\d+)"
_NUMBER = re.compile(_NUM + r"(?:/\d+)?")
_NUM_AT = re.compile(_NUM)
_BLANKS = re.compile(r"[ \t]*")
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_TEXT_MACROS = ("\\text{", "\\mbox{", "\\mathrm{")


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


def _drop_thousands(s: str) -> str:
    return s.replace(",", "") if _THOUSANDS.fullmatch(s) else s


def gsm8k_marker_number(line: str) -> str | None:
    """The number of GSM8K's final-answer line, as verl's gsm8k reward reads it: '####', blanks
    (spaces, tabs), an optional '\\' and '$', blanks, a number (thousands separators allowed), and
    nothing after it on the line but blanks and one full stop (so that a markdown heading such as
    '#### 2. Add the costs' is no answer); None where ``line`` (no newline in it) is no such line.
    The '####' is the one that ends at the line's last '#': nothing after the marker may be a '#'."""
    k = line.rfind("#")
    if k < 3 or line[k - 3 : k + 1] != "####":
        return None
    i = _BLANKS.match(line, k + 1).end()
    i += line.startswith("\\", i)
    i += line.startswith("$", i)
    number = _NUM_AT.match(line, _BLANKS.match(line, i).end())
    if number is None or line[number.end() :].strip(" \t") not in ("", "."):
        return None
    return number.group()


def marked_answer(text: str) -> str | None:
    """The answer a response marks as final: the number of its last '#### x' line (GSM8K's
    marker, ``gsm8k_marker_number``; thousands separators dropped), else the content of its last
    \\boxed{} (stripped; possibly empty); None where it has neither."""
    for line in reversed(text.split("\n")):
        found = gsm8k_marker_number(line)
        if found is not None:
            return _drop_thousands(found)
    boxed = last_boxed(text)
    return None if boxed is None else boxed.strip()


def extract_math_answer(text: str) -> str | None:
    """The final answer of a GSM8K/MATH-style response: its marked answer (``marked_answer``),
    else the last number in the text."""
    marked = marked_answer(text)
    if marked is not None:
        return marked
    if "####" in text:  # a '####' line that is not just a number: the fallback reads what follows it
        return text.rsplit("####", 1)[1].strip().split("\n")[0].strip()
    nums = _NUMBER.findall(text)
    return nums[-1] if nums else None


def _normalise(ans: str) -> str:
    """A canonical form for the fallback's comparison: '' where nothing is left (never equal to
    anything). Numbers by value (thousands separators ',' and '{,}' dropped, other commas kept:
    '1,2' is no 12; a leading '.' kept: '.5' is 0.5, no 5; a closing full stop dropped),
    \\frac{a}{b} and a/b by value, $ and spaces dropped (spaces between digits kept), a \\text{}
    unit after a value dropped, a \\text{} answer read as its text."""
    s = ans.strip().replace("\\$", "").replace("$", "").replace("\\!", "").replace("{,}", ",").strip()
    s = s.rstrip(".").strip()
    s = re.sub(r"(?<!\d) | (?!\d)", "", s)
    without_text = _replace_text_macros(s, keep_content=False)
    s = without_text if without_text else _replace_text_macros(s, keep_content=True)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    m = re.fullmatch(r"\\frac\{(-?\d+)\}\{(\d+)\}", s)
    if m:
        s = f"{m.group(1)}/{m.group(2)}"
    s = _drop_thousands(s)
    try:
        if re.fullmatch(r"-?(?:\d+(?:\.\d*)?|\.\d+)(?:/\d+)?", s):
            num, _, den = s.partition("/")
            return repr(round(float(num) / float(den or 1), 6))
    except ZeroDivisionError:
        pass
    return s


def _replace_text_macros(s: str, keep_content: bool) -> str:
    """``s`` with each \\text{...}, \\mbox{...} and \\mathrm{...} (up to the first '}' after it)
    replaced by its content (``keep_content``) or by nothing, left to right, as
    re.sub(r"\\\\(?:text|mbox|mathrm)\\{([^}]*)\\}", ...) does, in one pass: where no '}' follows
    a macro, none follows any later one either. Each macro's next position is searched for
    only once it falls behind, so the searches cover the text once."""
    out, i = [], 0
    upcoming = dict.fromkeys(_TEXT_MACROS, -1)
    while True:
        for macro, at in upcoming.items():
            if 0 <= at < i or at == -1:
                found = s.find(macro, i)
                upcoming[macro] = found if found >= 0 else len(s) + 1
        macro = min(upcoming, key=upcoming.get)
        start = upcoming[macro]
        close = s.find("}", start + len(macro)) if start <= len(s) else -1
        if close < 0:
            break
        out += [s[i:start], s[start + len(macro) : close] if keep_content else ""]
        i = close + 1
    out.append(s[i:])
    return "".join(out)


def fallback_math_reward(response: str, answer: str) -> float:
    """1.0 if the extracted final answer equals the reference after normalisation (``_normalise``:
    numbers by value, \\frac{a}{b} read as a/b; an empty answer equals nothing)."""
    pred = extract_math_answer(response)
    if pred is None:
        return 0.0
    ref = extract_math_answer(answer) if ("####" in answer or "\\boxed" in answer) else answer
    if ref is None:
        return 0.0
    pred, ref = _normalise(pred), _normalise(ref)
    return float(bool(pred) and pred == ref)


MATH_VERIFY_TIMEOUT_S = 5.0
"""Hard deadline of one ``math`` reward call: math-verify (parsing both sides and comparing) and,
where it parses nothing, the fallback extractor, both in the worker. Past it the call scores 0.0
and counts in ``reward_timeouts``."""
WORKER_START_TIMEOUT_S = 120.0
"""How long the math-verify worker may take to start (imports sympy): a slow start is no timeout."""


def _reference_text(answer: str) -> str:
    """A reference as LaTeX for math-verify: a GSM8K/MATH solution's final answer, boxed."""
    if "####" in answer:
        answer = answer.rsplit("####", 1)[1].strip().split("\n")[0].replace(",", "")
    elif "\\boxed" in answer:
        answer = last_boxed(answer) or answer
    return "\\boxed{" + answer.strip() + "}"


def math_verify_score(response: str, answer: str) -> float | None:
    """math-verify's verdict (1.0 or 0.0), None where it parses nothing on either side. The
    reference is parsed as \\boxed{answer}; the response's marked answer (``marked_answer``) as
    \\boxed{marked}, else the whole response with LaTeX (boxed first) and expression extraction.
    math-verify's own time limits are off: run it where a deadline is kept (``math_reward``)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    gold = parse(_reference_text(answer), extraction_config=[LatexExtractionConfig()], parsing_timeout=None)
    marked = marked_answer(response)
    if marked is None:
        configs = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
        pred = parse(response, extraction_config=configs, parsing_timeout=None)
    elif marked:
        pred = parse("\\boxed{" + marked + "}", extraction_config=[LatexExtractionConfig()], parsing_timeout=None)
    else:
        pred = []
    if not gold or not pred:
        return None
    return float(verify(gold, pred, timeout_seconds=None))


class _Timeout(Exception):
    pass


class MathVerifyWorker:
    """A child Python process that runs ``math_verify_score``, one request at a time, over its
    stdin/stdout (JSON lines), so that each call gets a hard deadline in any thread: a call past
    the deadline kills the worker (the next call starts another). math-verify's own limit is
    signal.alarm, which works in the main thread only; in another thread a runaway comparison
    (sympy's big integers) would also hold the GIL, stalling the whole process. One per process (a
    forked child starts its own); POSIX only (poll on a pipe)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.buf = b""
        self.poller = None  # poll, not select.select: no limit on the descriptor's number
        self.lock = threading.Lock()
        self.timeouts = 0
        """Calls that ran past their deadline (or on which the worker died): each scored 0.0."""

    def _start(self) -> None:
        src = str(Path(__file__).resolve().parents[2])  # the folder that holds the otbflow package
        code = f"import sys; sys.path[0] = {src!r}; from otbflow.algorithms.rewards import _serve; _serve()"
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.buf = b""
        self.poller = select.poll()
        self.poller.register(self.proc.stdout.fileno(), select.POLLIN)
        try:
            ready = self._read(WORKER_START_TIMEOUT_S)
        except (_Timeout, EOFError):
            ready = None
        if ready != "ready":
            self.stop()
            raise RuntimeError("the math-verify worker did not start (its error, if any, is above on stderr)")

    def _read(self, timeout: float):
        assert self.proc is not None and self.proc.stdout is not None
        deadline, fd = time.monotonic() + timeout, self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not self.poller.poll(max(1, int(left * 1000))):
                raise _Timeout
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise EOFError
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return json.loads(line)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            proc.kill()
            proc.wait()
            for f in (proc.stdin, proc.stdout):
                if f is not None:
                    f.close()

    def _send(self, request: bytes) -> None:
        for attempt in (0, 1):
            if self.proc is None or self.proc.poll() is not None:
                self.stop()
                self._start()
            assert self.proc is not None and self.proc.stdin is not None
            try:
                self.proc.stdin.write(request)
                self.proc.stdin.flush()
                return
            except BrokenPipeError:  # it died between calls: start another, once
                self.stop()
                if attempt:
                    raise

    def score(self, response: str, answer: str, timeout: float) -> float:
        """``math_score(response, answer)`` in the worker; 0.0 past ``timeout`` seconds or where
        the worker dies on it (counted in ``timeouts``)."""
        request = (json.dumps([response, answer]) + "\n").encode()
        with self.lock:
            self._send(request)
            try:
                return self._read(timeout)
            except (_Timeout, EOFError):
                self.stop()
                self.timeouts += 1
                return 0.0
            except BaseException:  # interrupted: its late reply must not answer the next request
                self.stop()
                raise


_WORKER = MathVerifyWorker()
_PARENTS_WORKERS: list[MathVerifyWorker] = []  # in a forked child: kept as they are, the parent's to use and stop


def _new_worker_after_fork() -> None:
    global _WORKER
    _PARENTS_WORKERS.append(_WORKER)
    _WORKER = MathVerifyWorker()  # its own process and lock


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_worker_after_fork)
atexit.register(lambda: _WORKER.stop())


def reward_timeouts() -> int:
    """Reward calls of this process that ran past their deadline and scored 0.0 (``math``: past
    ``MATH_VERIFY_TIMEOUT_S``); a caller counts its own as the difference before and after."""
    return _WORKER.timeouts


def math_score(response: str, answer: str) -> float:
    """The ``math`` reward without its deadline: ``math_verify_score``, else (math-verify parses
    nothing, or fails) ``fallback_math_reward``. Run where a deadline is kept (``math_reward``)."""
    try:
        score = math_verify_score(response, answer)
    except Exception:  # math-verify catches its own errors; anything else: the fallback decides
        score = None
    return fallback_math_reward(response, answer) if score is None else score


def _serve() -> None:
    """The worker's loop (``MathVerifyWorker``): a JSON [response, answer] line in, a JSON score
    line out (``math_score``); "ready" first, once math-verify is imported and warm."""
    import logging
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; EOF ends this
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # anything printed goes to stderr, not into the replies
    sys.stdout = sys.stderr

    class _QuietTimeoutWarning(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return not record.getMessage().startswith("Timeout is disabled")  # the deadline is ours

    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_QuietTimeoutWarning())
    math_verify_score("\\boxed{\\frac{1}{2}}", "0.5")
    out.write(b'"ready"\n')
    for line in sys.stdin.buffer:
        response, answer = json.loads(line)
        out.write((json.dumps(math_score(response, answer)) + "\n").encode())


@register("math")
def math_reward(response: str, answer: str) -> float:
    """1.0 if math-verify finds the response's final answer equal to the reference
    (``math_verify_score``: the marked answer, '#### x' or the last \\boxed{}, where there is one);
    the fallback extractor where math-verify parses nothing (``math_score``). All of it runs in
    the worker within ``MATH_VERIFY_TIMEOUT_S``, in any thread: 0.0 past it, counted in
    ``reward_timeouts``."""
    return _WORKER.score(response, answer, MATH_VERIFY_TIMEOUT_S)
