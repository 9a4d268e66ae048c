"""Prompt sources: the built-in synthetic arithmetic task and local GSM8K/MATH-style files.

The synthetic task is multi-step addition/subtraction with a scratchpad, so response length
grows with the number of operands::

    prompt   : 7+3-5=
    response : 7+3=10;10-5=5;#5<eos>

Everything is generated deterministically from a seed.
"""

from __future__ import annotations

import random
from pathlib import Path

import polars as pl

from otbflow.io import SchemaError


def arithmetic_problem(rng: random.Random, min_terms: int, max_terms: int, max_operand: int) -> str:
    n = rng.randint(min_terms, max_terms)
    parts = [str(rng.randint(0, max_operand))]
    for _ in range(n - 1):
        parts += [rng.choice("+-"), str(rng.randint(0, max_operand))]
    return "".join(parts) + "="


def arithmetic_solution(prompt: str) -> tuple[str, str]:
    """(scratchpad response, answer) for a prompt like '7+3-5='."""
    expr = prompt.rstrip("=")
    tokens: list[str] = []
    num = ""
    for ch in expr:
        if ch in "+-" and num:
            tokens += [num, ch]
            num = ""
        else:
            num += ch
    tokens.append(num)
    acc = int(tokens[0])
    steps = []
    for op, b in zip(tokens[1::2], tokens[2::2]):
        new = acc + int(b) if op == "+" else acc - int(b)
        steps.append(f"{acc}{op}{b}={new};")
        acc = new
    return "".join(steps) + f"#{acc}", str(acc)


def arithmetic_prompts(n: int, seed: int, min_terms: int, max_terms: int, max_operand: int,
                       exclude: set[str] | None = None) -> list[dict]:
    """``n`` distinct problems (prompt, answer, target) from ``seed``, none in ``exclude``."""
    rng = random.Random(seed)
    seen = set(exclude or ())
    out: list[dict] = []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise ValueError(f"cannot draw {n} distinct arithmetic problems with max_terms={max_terms}, "
                             f"max_operand={max_operand}: raise task.max_terms or task.max_operand")
        p = arithmetic_problem(rng, min_terms, max_terms, max_operand)
        if p in seen:
            continue
        seen.add(p)
        target, answer = arithmetic_solution(p)
        out.append({"prompt": p, "answer": answer, "target": target})
    return out


def load_dataset_file(path: str | Path) -> pl.DataFrame:
    """A local JSONL or Parquet file with string columns ``prompt`` and ``answer``."""
    path = Path(path)
    if not path.is_file():
        raise SchemaError(f"{path}: dataset file not found")
    if path.suffix in (".jsonl", ".json"):
        df = pl.read_ndjson(path)
    elif path.suffix == ".parquet":
        df = pl.read_parquet(path)
    else:
        raise SchemaError(f"{path}: unsupported dataset format '{path.suffix}' (use .jsonl or .parquet)")
    for col in ("prompt", "answer"):
        if col not in df.columns:
            raise SchemaError(f"{path}: missing column '{col}' (a dataset needs prompt and answer)")
    return df.select(pl.col("prompt").cast(pl.String), pl.col("answer").cast(pl.String))
