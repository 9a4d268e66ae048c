"""What the interpreter a venv is built on costs the processes otbflow starts: the same packages
(this venv's site-packages and src/) imported by each interpreter given, in fresh processes.

A CPU run, and the test suite even more, is mostly the start-up of short processes: Snakemake (one
per run, one per Slurm job), the stage jobs (torch and transformers). Their imports are Python
running module code and unmarshalling bytecode, so they take longer on an interpreter built
without profile-guided optimisation and link-time optimisation, whose core is a shared libpython
(pyenv's and CPython's default build) than on one built with them (Debian's python3, the
python.org and python-build-standalone builds). ``make setup PYTHON=...`` chooses the interpreter
(.ci/run: the distribution's, where there is one; docs/testing.md, "CI").

Each measurement is one fresh process; its CPU time (user + system, of the process and its
children) is the figure, which other load on the machine changes less than wall time. Measured per
interpreter: ``snakemake`` (``import snakemake.cli``), ``stage`` (``import otbflow.stages.train``:
torch, transformers, DeepSpeed, otbflow), ``python`` (a pure-Python loop: the interpreter alone).
The interpreters must be of this venv's Python version (its packages are built for it); by default
this venv's own base interpreter and ``python3`` on the PATH and ``/usr/bin/python3`` where they
are other builds of that version. Prints JSON (``interpreters``: a list, this venv's base first)::

    python benchmarks/bench_interpreter.py --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from machine import run_record  # noqa: E402

WORK = {
    "snakemake": "import snakemake.cli",
    "stage": "import otbflow.stages.train",
    "python": "sum(i * i % 7 for i in range(3_000_000))",
}
# this venv's packages on another interpreter's path, with their .pth files (the editable otbflow)
PRELUDE = "import site, sys; site.addsitedir({!r}); sys.path.insert(0, {!r}); "
ABOUT = "import json, sys; print(json.dumps([sys.version.split()[0], sys.implementation.cache_tag, sys.executable]))"


def describe(python: str) -> dict:
    """The interpreter's version, bytecode tag, executable (a pyenv shim's: the interpreter it
    starts) and whether it loads libpython as a shared library."""
    out = json.loads(subprocess.run([python, "-I", "-c", ABOUT], capture_output=True, text=True, check=True).stdout)
    maps = subprocess.run(
        [out[2], "-I", "-c", "print(open('/proc/self/maps').read())"], capture_output=True, text=True
    ).stdout
    return {
        "version": out[0],
        "cache_tag": out[1],
        "executable": out[2],
        "libpython_shared_library": "libpython" in maps,
    }


def cpu_seconds(python: str, code: str) -> float:
    """CPU time (user + system) of one fresh process running ``code``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([python, "-I", "-c", code], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return round(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime, 3)


def default_interpreters() -> list[str]:
    found = [getattr(sys, "_base_executable", sys.executable), shutil.which("python3") or "", "/usr/bin/python3"]
    return [python for python in found if python and Path(python).is_file()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", action="append", help="an interpreter (repeat; default: see the docstring)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--work", default=",".join(WORK), help=f"what to measure, of {','.join(WORK)}")
    ns = ap.parse_args()
    prelude = PRELUDE.format(sysconfig.get_paths()["purelib"], str(REPO / "src"))
    works = ns.work.split(",")
    tag = sys.implementation.cache_tag
    interpreters, skipped = [], {}
    for python in ns.python or default_interpreters():
        about = describe(python)
        if os.path.realpath(about["executable"]) in (os.path.realpath(i["executable"]) for i in interpreters):
            continue
        if about["cache_tag"] != tag:
            skipped[python] = f"{about['version']} ({about['cache_tag']}): this venv's packages are for {tag}"
            continue
        times = {w: [cpu_seconds(about["executable"], prelude + WORK[w]) for _ in range(ns.repeats)] for w in works}
        interpreters.append({**about, "cpu_seconds": times, "min_cpu_seconds": {w: min(t) for w, t in times.items()}})
    for about in interpreters:  # each interpreter's least CPU time over the first's (this venv's base)
        first = interpreters[0]["min_cpu_seconds"]
        about["ratio_to_first"] = {w: round(t / first[w], 2) for w, t in about["min_cpu_seconds"].items()}
    out = {"machine": run_record(), "repeats": ns.repeats, "interpreters": interpreters, "skipped": skipped}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
