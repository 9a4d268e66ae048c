"""The offline variance study (`otbflow variance`) of the default initial policy over several seeds.

The seed changes the pool (the responses the policy samples to the same prompts), the resampled
groups and the CountSketch; the policy and the prompts stay those of the default run (seed 0):
`results/bootstrap/policy` and `results/data/train/shard_0.parquet` of `make run`, built here by
the same stage functions if the output folder does not have them yet (about 4 min on 2 cores).
Each seed then takes one pool rollout and one variance run (about 2 min on 2 cores).
Prints JSON: per seed and estimator the summary row, and per estimator the range over seeds of
tr Cov, of the paired difference to REINFORCE, of its standard error and of noise-to-signal.

    python benchmarks/variance_seeds.py [--out benchmarks/out/variance_seeds] [--seeds 0 1 2 3 4] [--configfile F]

``--configfile`` layers a config over config/config.yaml (the tests run it with config/tiny.yaml).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import polars as pl
import torch
import yaml

from otbflow import schemas
from otbflow.config import DEFAULT_CONFIG, load_config
from otbflow.io import read_metadata, read_table
from otbflow.stages import bootstrap, shard, variance, variance_pool

COLUMNS = (
    "trace_cov",
    "trace_cov_se",
    "trace_cov_diff",
    "trace_cov_diff_se",
    "noise_to_signal",
    "sq_bias",
    "sq_bias_noise",
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/out/variance_seeds")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--configfile", default=None, help="a config layered over config/config.yaml")
    args = ap.parse_args()
    out = Path(args.out)
    layer = yaml.safe_load(Path(args.configfile).read_text()) if args.configfile else None

    def config(*overrides: str):
        return load_config(DEFAULT_CONFIG, list(overrides), extra=layer)

    base = config()
    policy = out / "policy"
    if not (out / "data" / "train" / "shard_0.parquet").is_file():
        shard.run(base, shard.Args(out_dir=str(out / "data")))
    t0 = time.perf_counter()
    if not (policy / "config.json").is_file():
        bootstrap.run(base, bootstrap.Args(out=str(policy), metrics=str(out / "sft_curve.parquet")))
    bootstrap_s = time.perf_counter() - t0
    per_seed, timings = {}, {}
    for seed in args.seeds:
        cfg = config(f"seed={seed}")
        folder = out / f"seed_{seed}"
        pool = folder / "pool.parquet"
        t0 = time.perf_counter()
        if not pool.is_file():
            variance_pool.run(
                cfg,
                variance_pool.Args(
                    prompts=str(out / "data" / "train" / "shard_0.parquet"), policy=str(policy), out=str(pool)
                ),
            )
        t1 = time.perf_counter()
        variance.run(cfg, variance.Args(rollouts=[str(pool)], policy=str(policy), out_dir=str(folder)))
        timings[seed] = {"pool_s": round(t1 - t0, 1), "variance_s": round(time.perf_counter() - t1, 1)}
        summary = read_table(folder / "summary.parquet", schemas.VARIANCE)
        per_seed[seed] = {
            "meta": read_metadata(folder / "summary.parquet"),
            "estimators": {r["estimator"]: {c: r[c] for c in COLUMNS} for r in summary.iter_rows(named=True)},
        }
    names = list(next(iter(per_seed.values()))["estimators"])
    ranges = {}
    for name in names:
        rows = pl.DataFrame([per_seed[s]["estimators"][name] for s in args.seeds])
        ranges[name] = {c: [rows[c].min(), rows[c].max()] for c in COLUMNS}
        ranges[name]["diff_below_minus_2se"] = int((rows["trace_cov_diff"] < -2 * rows["trace_cov_diff_se"]).sum())
        ranges[name]["diff_above_plus_2se"] = int((rows["trace_cov_diff"] > 2 * rows["trace_cov_diff_se"]).sum())
    print(
        json.dumps(
            {
                "benchmark": "variance_seeds",
                "seeds": args.seeds,
                "policy": str(policy),
                "cpus": os.cpu_count(),
                "torch_threads": torch.get_num_threads(),
                "python": platform.python_version(),
                "bootstrap_s": round(bootstrap_s, 1),
                "timings": timings,
                "ranges": ranges,
                "per_seed": per_seed,
            },
            indent=2,
            default=str,
        )
    )


if __name__ == "__main__":
    main()
