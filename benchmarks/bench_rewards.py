"""Per-call time of a reward on typical GSM8K/MATH-style responses, in the calling thread.

Builds ``--responses`` chain-of-thought responses (seeded): GSM8K solutions with ``<<a+b=c>>``
notes ending in ``#### x``, the same ending in ``\\boxed{x}``, and ones that end in "The answer is
x." with no marker; half right, half wrong. Scores them all with the reward (``--reward``, default
``math``) after one warm-up call (which starts math-verify: imports, and a worker where there is
one), and prints JSON: the warm-up time, the mean and median per-call time, the accuracy.

    python benchmarks/bench_rewards.py --responses 2000 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

from otbflow.algorithms.rewards import get_reward


def responses(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """(response, reference answer) pairs: GSM8K-style working, three endings, half of them wrong."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b, c = rng.randint(2, 900), rng.randint(2, 900), rng.randint(2, 12)
        total = (a + b) * c
        answer = total if i % 2 == 0 else total + rng.randint(1, 9)
        work = (
            f"Tom has {a} apples and buys {b} more, so he has {a}+{b}=<<{a}+{b}={a + b}>>{a + b} apples.\n"
            f"Each apple costs ${c}, so he pays {a + b}*{c}=<<{a + b}*{c}={total}>>{total} dollars.\n"
        )
        ending = [f"#### {answer:,}", f"The answer is $\\boxed{{{answer}}}$.", f"The answer is {answer}."][i % 3]
        out.append((work + ending, str(total)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--responses", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--reward", default="math")
    args = p.parse_args()
    fn = get_reward(args.reward)
    pairs = responses(args.responses)
    t0 = time.perf_counter()
    fn(*pairs[0])
    warmup = time.perf_counter() - t0
    means, medians, scores = [], [], []
    for _ in range(args.repeats):
        times, scores = [], []
        for r, a in pairs:
            t = time.perf_counter()
            scores.append(fn(r, a))
            times.append(time.perf_counter() - t)
        means.append(statistics.fmean(times))
        medians.append(statistics.median(times))
    out = {
        "reward": args.reward,
        "responses": len(pairs),
        "warmup_s": round(warmup, 3),
        "mean_ms_per_call": [round(1e3 * m, 3) for m in means],
        "median_ms_per_call": [round(1e3 * m, 3) for m in medians],
        "accuracy": statistics.fmean(scores),
        "expected_accuracy": 0.5,
        "cpus": os.cpu_count(),
        "load_average_1min": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
