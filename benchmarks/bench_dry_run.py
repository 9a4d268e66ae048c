"""How long Snakemake takes to plan a long run (a dry run), and whether planning imports torch.

    python benchmarks/bench_dry_run.py --iterations 500 --repeats 3

Runs ``snakemake -n --cores 2 --config iterations=N`` in a fresh temporary folder (nothing done
yet, so every job is planned) under ``python -X importtime``, twice per repeat: with ``-q`` (the
plan and its job counts: what a head job does before it submits anything) and without (the
listing of every planned job, which Snakemake's printing dominates). Prints JSON: the wall times,
the number of planned jobs and whether planning imported torch.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def dry_run(iterations: int, quiet: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-X", "importtime", "-m", "snakemake", "-s", str(REPO / "Snakefile")]
        cmd += ["--directory", tmp, "-n", "--cores", "2", "--config", f"iterations={iterations}"]
        cmd += ["-q"] if quiet else []
        t0 = time.perf_counter()
        res = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        seconds = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"dry run failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    imported = {line.rsplit("|", 1)[-1].strip() for line in res.stderr.splitlines() if line.startswith("import time:")}
    jobs = re.search(r"^total\s+(\d+)", res.stdout, flags=re.M)
    return {"seconds": round(seconds, 2), "jobs": int(jobs.group(1)) if jobs else None, "torch": "torch" in imported}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=500)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    quiet = [dry_run(a.iterations, quiet=True) for _ in range(a.repeats)]
    listing = [dry_run(a.iterations, quiet=False) for _ in range(a.repeats)]

    def median(runs: list[dict]) -> float:
        return sorted(r["seconds"] for r in runs)[len(runs) // 2]

    out = {
        "iterations": a.iterations,
        "jobs": listing[0]["jobs"],
        "plan_seconds": [r["seconds"] for r in quiet],
        "plan_median_seconds": median(quiet),
        "listing_seconds": [r["seconds"] for r in listing],
        "listing_median_seconds": median(listing),
        "torch_imported": any(r["torch"] for r in quiet + listing),
        "cpus": os.cpu_count(),
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
