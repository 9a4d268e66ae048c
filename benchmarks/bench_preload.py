"""What the preload server (otbflow.ops.preload) saves a local run on CPU.

The tiny workflow (``config/tiny.yaml``: 2 iterations, 23 jobs) runs from scratch in a fresh
folder once per mode and repeat:

- ``own``: every job in its own process (``OTBFLOW_PRELOAD=0``);
- ``cold``: preloaded, with no server running (the first job runs in its own process; the second
  starts the server and waits for it, as do the jobs that come while it starts);
- ``warm``: preloaded, the server of the previous run still up.

Per mode: the wall time of ``snakemake``, and the CPU time of everything it ran (Snakemake and its
jobs, from the children's rusage, plus the server's own and its forked jobs', from /proc). Prints
JSON (lists: one value per repeat). About 3 minutes per repeat on a 2-core CPU with nothing else
running::

    python benchmarks/bench_preload.py --repeats 3
    python benchmarks/bench_preload.py --target results/data/eval.parquet --repeats 1   # a quick check
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import run_record  # benchmarks/machine.py (this folder is on sys.path)

REPO = Path(__file__).resolve().parents[1]

MODES = ("own", "cold", "warm")


def server_cpu(folder: Path) -> float:
    """CPU seconds of the servers recorded in ``folder``: their own and their reaped children's."""
    total = 0.0
    for record in folder.glob("*.json"):
        pid = json.loads(record.read_text())["pid"]
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
        except OSError:
            continue
        total += sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    return total


def starting(folder: Path) -> bool:
    """Whether a server in ``folder`` holds its lock without a socket yet (it is importing). A run
    of one job starts none (otbflow.ops.preload.WINDOW_S)."""
    import fcntl

    for lock in folder.glob("*.lock"):
        if (folder / f"{lock.stem}.sock").exists():
            continue
        with open(lock) as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return True
    return False


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_once(work: Path, env: dict, target: list[str], preload_dir: Path) -> dict:
    before = children_cpu() + server_cpu(preload_dir)
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "snakemake", *target, "-s", str(REPO / "Snakefile"), "--directory", str(work)]
    cmd += ["--cores", "2", "--quiet", "all", "--configfile", str(REPO / "config" / "tiny.yaml")]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    if res.returncode != 0:
        raise SystemExit(f"snakemake failed in {work}:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return {"wall_s": round(wall, 2), "cpu_s": round(children_cpu() + server_cpu(preload_dir) - before, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--target", nargs="*", default=[], help="Snakemake targets (default: the whole workflow)")
    args = ap.parse_args()
    from otbflow.ops import preload

    out = {mode: {"wall_s": [], "cpu_s": []} for mode in MODES}
    with tempfile.TemporaryDirectory(prefix="bench-preload-") as tmp:
        tmp = Path(tmp)
        for repeat in range(args.repeats):
            preload_dir = tmp / f"preload-{repeat}"  # a folder per repeat: "cold" finds no server
            env = dict(os.environ, OTBFLOW_PRELOAD_DIR=str(preload_dir))
            env["PYTHONPATH"] = str(REPO / "src")
            env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
            for mode in MODES:
                work = tmp / f"{mode}-{repeat}"  # the run's folder: its results/ and .snakemake/
                mode_env = {**env, "OTBFLOW_PRELOAD": "0" if mode == "own" else "1"}
                got = run_once(work, mode_env, args.target, preload_dir)
                for k, v in got.items():
                    out[mode][k].append(v)
                if mode == "cold":  # a server the cold run started: ready (its imports done) before "warm"
                    deadline = time.monotonic() + 120
                    while starting(preload_dir) and time.monotonic() < deadline:
                        time.sleep(0.2)
                shutil.rmtree(work / "results", ignore_errors=True)
            preload.stop(preload_dir)
    result = {
        **run_record(),
        "workflow": "config/tiny.yaml" + (f" {' '.join(args.target)}" if args.target else ""),
        "repeats": args.repeats,
        **out,
        "warm_over_own": {
            k: round(sum(out["warm"][k]) / sum(out["own"][k]), 3) for k in ("wall_s", "cpu_s") if sum(out["own"][k])
        },
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
