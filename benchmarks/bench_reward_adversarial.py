"""The math reward on adversarial responses (issue 35, item 4): the time of the fallback extractor
in the calling thread, now and as its old regexes read them, and of the whole reward (math-verify
and the fallback, in the worker under its deadline).

Payloads of ``n`` characters, each a shape that made an old pattern retry a failed match from
every position (quadratic in n): ``dots`` ('#### ' + n dots + 'x', the issue's 35 s response at
n = 80,000: ``\\.+$``), ``blanks`` ('#### ' + n blanks + 'x': the marker's two blank runs),
``trailing`` ('#### 5' + n blanks + 'x': the blank runs around the closing full stop) and
``macros`` ('#### ' + n / 6 unclosed '\\text{': ``\\text{[^}]*}``). The fallback is timed at each
of ``--sizes``; the old regexes (copied below, as tests/test_tasks_rewards.py holds them) at the
smaller ``--old-sizes`` (at n = 80,000 they take minutes); ``math_reward`` once per payload at the
largest size, with its score and whether a time-out was counted. Prints JSON::

    python benchmarks/bench_reward_adversarial.py
    python benchmarks/bench_reward_adversarial.py --sizes 80000 --old-sizes 5000   # a quick check
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time

from machine import cpu_model  # benchmarks/machine.py (this folder is on sys.path)

from otbflow.algorithms import rewards

OLD_NUM = r"-?(?:\d+(?:,\d{3})*(?:\.\d+)?|\.\d+)"
OLD_GSM8K_MARKER = re.compile(r"####[ \t]*\\?\$?[ \t]*(" + OLD_NUM + r")[ \t]*\.?[ \t]*$", re.MULTILINE)


def old_fallback_parse(text: str) -> str:
    """What the old fallback did with a response before comparing: the marker's findall, then the
    old _normalise's regex steps on the text after the last '####'."""
    if OLD_GSM8K_MARKER.findall(text):
        return "marked"
    s = text.rsplit("####", 1)[1].strip().split("\n")[0].strip()
    s = re.sub(r"\.+$", "", s).strip()
    s = re.sub(r"(?<!\d) | (?!\d)", "", s)
    without_text = re.sub(r"\\(?:text|mbox|mathrm)\{[^}]*\}", "", s)
    return without_text if without_text else re.sub(r"\\(?:text|mbox|mathrm)\{([^}]*)\}", r"\1", s)


PAYLOADS = {
    "dots": lambda n: "#### " + "." * n + "x",
    "blanks": lambda n: "#### " + " " * n + "x",
    "trailing": lambda n: "#### 5" + " " * n + "x",
    "macros": lambda n: "#### " + "\\text{" * (n // 6),
}


def timed(fn, *args) -> tuple[float, object]:
    t = time.perf_counter()
    out = fn(*args)
    return round(time.perf_counter() - t, 4), out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="80000,320000", help="payload sizes for the fallback (comma-separated)")
    p.add_argument("--old-sizes", default="5000,10000,20000", help="payload sizes for the old regexes")
    args = p.parse_args()
    sizes = [int(n) for n in args.sizes.split(",")]
    old_sizes = [int(n) for n in args.old_sizes.split(",") if n]
    out: dict = {"cpu": cpu_model(), "cpus": os.cpu_count(), "load_average_1min": round(os.getloadavg()[0], 2)}
    out["fallback_s"] = {
        name: {n: timed(rewards.fallback_math_reward, make(n), "1")[0] for n in sizes}
        for name, make in PAYLOADS.items()
    }
    out["old_regexes_s"] = {
        name: {n: timed(old_fallback_parse, make(n))[0] for n in old_sizes} for name, make in PAYLOADS.items()
    }
    warmup, _ = timed(rewards.math_reward, "\\boxed{2}", "2")  # starts the worker (imports math-verify)
    out["math_reward_warmup_s"] = warmup
    out["math_reward"] = {}
    for name, make in PAYLOADS.items():
        before = rewards.reward_timeouts()
        took, score = timed(rewards.math_reward, make(max(sizes)), "1")
        out["math_reward"][name] = {
            "n": max(sizes),
            "s": took,
            "score": score,
            "timed_out": rewards.reward_timeouts() > before,
        }
    out["deadline_s"] = rewards.MATH_VERIFY_TIMEOUT_S
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
