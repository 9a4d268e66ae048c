"""Throughput of every estimator, polars table in -> polars table out (list columns both ways).

Builds a synthetic batch of >= 1M tokens (ragged lengths 1..512, groups of 8) and prints JSON:
tokens/s per estimator (best of --repeats), plus a reference: OTB as a per-group loop of torch
ops over padded [batch, max_len] tensors (the shape of a straightforward trainer-side port).

    python benchmarks/bench_advantages.py [--tokens 1000000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np
import polars as pl
import pyarrow as pa
import torch

from otbflow.algorithms.estimators import ESTIMATORS, compute_advantages

OPTIONS = {"length_power": {"exponent": 1.58}}


def make_table(n_tokens: int, group_size: int = 8, max_len: int = 512, seed: int = 0) -> pl.DataFrame:
    rng = np.random.default_rng(seed)
    n_seq = int(np.ceil(n_tokens / ((max_len + 1) / 2) / group_size)) * group_size
    lengths = rng.integers(1, max_len + 1, n_seq)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    total = int(offsets[-1])
    logp = np.log(rng.uniform(0.05, 1.0, total)).astype(np.float32)
    spp = (np.exp(logp) ** 2 + 0.1 * rng.uniform(0, 1, total)).astype(np.float32)

    def lst(values):
        return pl.Series(pa.ListArray.from_arrays(pa.array(offsets), pa.array(values)))

    return pl.DataFrame(
        {
            "group_id": np.repeat(np.arange(n_seq // group_size), group_size),
            "reward": rng.integers(0, 2, n_seq).astype(np.float64),
            "logprobs": lst(logp),
            "sum_pi_sq": lst(spp),
            "grad_sq_norm": rng.uniform(0.1, 5.0, n_seq),
        }
    )


def torch_loop_otb(table: pl.DataFrame) -> pl.DataFrame:
    """Reference: pad to [B, T], then loop over groups with torch ops (algorithms.md §1.12)."""
    lengths = table["logprobs"].list.len().to_numpy().astype(np.int64)
    B, T = len(lengths), int(lengths.max())
    mask = torch.arange(T)[None, :] < torch.from_numpy(lengths)[:, None]
    flat_lp = torch.from_numpy(table["logprobs"].explode().to_numpy().astype(np.float32))
    flat_sp = torch.from_numpy(table["sum_pi_sq"].explode().to_numpy().astype(np.float32))
    lp = torch.zeros(B, T)
    sp = torch.zeros(B, T)
    lp[mask], sp[mask] = flat_lp, flat_sp
    m = mask.float()
    pi = lp.exp()
    w = ((1 - pi) ** 2 + (sp - pi**2)).clamp_min(0)
    W = (w * m).cumsum(-1)
    G = torch.from_numpy(table["reward"].to_numpy()).float()[:, None] * m
    A = torch.zeros(B, T)
    gid = table["group_id"].to_numpy()
    starts = np.flatnonzero(np.r_[True, gid[1:] != gid[:-1]])
    ends = np.r_[starts[1:], B]
    for s, e in zip(starts, ends):
        num = (G[s:e] * W[s:e] * m[s:e]).sum(0)
        den = (W[s:e] * m[s:e]).sum(0)
        A[s:e] = (G[s:e] - num / (den + 1e-8)) * m[s:e]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return table.with_columns(
        pl.Series("advantages", pa.ListArray.from_arrays(pa.array(offsets), pa.array(A[mask].numpy())))
    )


def best_time(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1_000_000)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    table = make_table(args.tokens)
    n_tok = int(table["logprobs"].list.len().sum())
    results = {}
    for name in sorted(ESTIMATORS):
        if name == "otb_tir":
            continue  # needs loss_mask; timed below
        sec = best_time(lambda name=name: compute_advantages(table, name, **OPTIONS.get(name, {})), args.repeats)
        results[name] = {"seconds": round(sec, 4), "tokens_per_s": round(n_tok / sec)}
    with_mask = table.with_columns(pl.col("logprobs").list.eval(pl.element() > -2.5).alias("loss_mask"))
    sec = best_time(lambda: compute_advantages(with_mask, "otb_tir"), args.repeats)
    results["otb_tir"] = {"seconds": round(sec, 4), "tokens_per_s": round(n_tok / sec)}
    sec = best_time(lambda: torch_loop_otb(table), args.repeats)
    print(
        json.dumps(
            {
                "benchmark": "advantages",
                "tokens": n_tok,
                "sequences": table.height,
                "group_size": 8,
                "max_len": 512,
                "cpus": os.cpu_count(),
                "torch_threads": torch.get_num_threads(),
                "python": platform.python_version(),
                "estimators": results,
                "reference_torch_group_loop_otb": {"seconds": round(sec, 4), "tokens_per_s": round(n_tok / sec)},
                "otb_speedup_vs_reference": round(sec / results["otb"]["seconds"], 2),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
