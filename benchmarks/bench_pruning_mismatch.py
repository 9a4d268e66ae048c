"""What dynamic vocabulary pruning (rollout.min_p) does to a training-inference mismatch.

One rollout shard sampled by the transformers backend with the policy loaded in bf16
(``model.dtype=bfloat16``, as a bf16 inference engine would), then the features stage's
teacher-forced pass of the same policy in fp32 (the trainer), at each ``--min-p`` value: the mean
and largest per-token |log pi_trainer - log pi_rollout|, the mean k3 (an estimate of
KL(rollout || trainer)), the share of sequences TRM would keep at its default thresholds, and the
pruning's own metrics (vocabulary share pruned, mass pruned, force-included tokens). Prints JSON.

    python benchmarks/bench_pruning_mismatch.py

Defaults: the default run's initial policy and first training shard (``results/``, from
``make run``), 64 prompts x 8 samples, rho in {0, e^-12, 1e-3, 1e-2, 5e-2}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import polars as pl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model  # noqa: E402

from otbflow import schemas  # noqa: E402
from otbflow.config import DEFAULT_CONFIG, load_config  # noqa: E402
from otbflow.io import read_table  # noqa: E402


def measure(policy: str, prompts: str, min_p: float, overrides: list[str], folder: Path) -> dict:
    from otbflow.stages import features, rollout

    cfg = load_config(DEFAULT_CONFIG, ["model.dtype=bfloat16", f"rollout.min_p={min_p}", *overrides])
    roll, feats = folder / f"rollout_{min_p}.parquet", folder / f"features_{min_p}.parquet"
    rollout.run(cfg, rollout.Args(prompts=prompts, policy=policy, out=str(roll)))
    features.run(cfg, features.Args(rollouts=str(roll), policy=policy, out=str(feats)))
    df = read_table(feats, schemas.FEATURES)
    tokens = df.select(pl.col("log_ratio").explode().cast(pl.Float64), pl.col("k3").explode().cast(pl.Float64))
    trm = ((df["seq_max_k2"] <= cfg.mismatch.max_k2) & (df["seq_mean_k3"] <= cfg.mismatch.mean_k3)).mean()
    out = {
        "min_p": min_p,
        "sequences": df.height,
        "tokens": tokens.height,
        "mean_abs_log_ratio": float(tokens["log_ratio"].abs().mean()),
        "max_abs_log_ratio": float(tokens["log_ratio"].abs().max()),
        "mean_k3": float(tokens["k3"].mean()),
        "trm_acceptance": float(trm),
        "mean_reward": float(df["reward"].mean()),
    }
    for col in ("pruned_fraction", "pruned_mass"):
        out[f"mean_{col}"] = float(df[col].mean()) if col in df.columns else 0.0
    out["forced_tokens"] = int(df["forced_tokens"].sum()) if "forced_tokens" in df.columns else 0
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policy", default="results/bootstrap/policy")
    p.add_argument("--prompts", default="results/data/train/shard_0.parquet")
    p.add_argument("--min-p", default=f"0,{math.exp(-12)},1e-3,1e-2,5e-2", help="comma-separated rho values")
    p.add_argument("--prompts-per-shard", type=int, default=64)
    p.add_argument("--group-size", type=int, default=8)
    args = p.parse_args()
    os.environ.setdefault("OTBFLOW_THREADS", "2")
    # the shard's share is prompts_per_iteration / n_shards: one shard, the whole count
    overrides = [
        "shard.n_shards=1",
        f"rollout.prompts_per_iteration={args.prompts_per_shard}",
        f"rollout.group_size={args.group_size}",
    ]
    rows = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for rho in (float(x) for x in args.min_p.split(",")):
            rows.append(measure(args.policy, args.prompts, rho, overrides, Path(tmp)))
    print(
        json.dumps(
            {
                "machine": {"cpu": cpu_model(), "threads": int(os.environ["OTBFLOW_THREADS"])},
                "policy": args.policy,
                "rollout": "transformers backend, policy in bf16; trainer: features stage in fp32",
                "results": rows,
                "seconds": round(time.perf_counter() - t0, 1),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
