"""Bitwise fingerprints of a finished run: one SHA-256 per policy's weights and per table's data.

A refactor that claims "behaviour unchanged" records the fingerprints of a run before the change
and checks the same run after it (same machine key, below):

    python tests/fingerprint.py results                     # print the fingerprints as JSON
    python tests/fingerprint.py results --check FILE.json   # exit 1 naming what differs
    python tests/fingerprint.py results --recorded default  # against this machine's recorded run

Weights: every tensor of every policy folder (name, dtype, shape and bytes, in name order).
Tables: every Parquet file of the run (prompts, rollouts, features, advantages, train metrics,
evaluations, report, scaling, variance), every column in order except wall times (``time_s``, ``*_time_s``)
and the columns added after the fixtures were recorded (``ADDED``, each with the test that checks
its values); not the Parquet key-value metadata (versions, paths, timestamps).

The fingerprints hold for one machine key (``cpu_key``): the CPU's family and model, the kernels
torch picks on it, the torch version and the jobs' threads. Another instruction set or thread
count adds floating-point sums in another order (docs/running.md, "What a seed fixes"); a model
name alone ("AMD EPYC") covers CPUs of several instruction sets.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent / "data" / "fingerprints"
"""tests/data/fingerprints: one folder per machine key, one JSON per run (tiny, default)."""
JOB_THREADS = 2
"""The most torch threads one job of the built-in configs asks for (the bootstrap's; every other
stage's job runs on one): Snakemake's --cores caps it."""


def cpu_key(cores: int = 2) -> str:
    """The machine key of fingerprints: the CPU's model name, family and model number (from
    /proc/cpuinfo), torch's CPU capability (the vector kernels it dispatches to: AVX2, AVX512...),
    torch's version, and the most threads of one job (``JOB_THREADS`` capped by Snakemake's
    ``cores``), e.g. x86-64-amd-epyc-family25-model1-avx2-torch2.13.0-cpu-threads2."""
    import torch

    info: dict[str, str] = {}
    try:
        block = Path("/proc/cpuinfo").read_text().split("\n\n")[0]  # the first processor's
        info = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in block.splitlines())}
    except OSError:
        pass
    parts = [platform.machine(), info.get("model name") or platform.processor() or "unknown"]
    if "cpu family" in info and "model" in info:
        parts.append(f"family{info['cpu family']}-model{info['model']}")
    parts += [torch.backends.cpu.get_cpu_capability(), f"torch{torch.__version__}", f"threads{min(cores, JOB_THREADS)}"]
    key = "-".join(parts)
    return "-".join(w for w in "".join(c if c.isalnum() or c == "." else "-" for c in key).lower().split("-") if w)


def recorded(run: str, cores: int = 2, root: Path = ROOT) -> Path | None:
    """The recorded fingerprints of run ``run`` (tiny, default) for this machine's key under
    ``root``; None when there are none."""
    path = root / cpu_key(cores) / f"{run}.json"
    return path if path.is_file() else None


SAFETENSORS_DTYPES = (
    {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
    | {f"{k}{b}": f"{n}{b}" for k, n in (("I", "int"), ("U", "uint")) for b in (8, 16, 32, 64)}
    | {"BOOL": "bool"}
)


def weights_digest(policy_dir: Path) -> str:
    """The weights' bytes by tensor name, read from the safetensors layout itself (an 8-byte
    header length, a JSON header, the data), so that every dtype, bfloat16 included, is read."""
    h = hashlib.sha256()
    for path in sorted(policy_dir.glob("*.safetensors")):
        data = path.read_bytes()
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + n])
        header.pop("__metadata__", None)
        for name in sorted(header):
            entry = header[name]
            start, end = entry["data_offsets"]
            dtype = SAFETENSORS_DTYPES.get(entry["dtype"], entry["dtype"].lower())
            h.update(f"{name}:{dtype}:{tuple(entry['shape'])}".encode())
            h.update(data[8 + n + start : 8 + n + end])
    return h.hexdigest()


# Columns that did not exist when tests/data/fingerprints/ were recorded, by the tables (path globs
# under results/) that gained them: the digests leave them out there, so that the recorded fixtures
# still pin every other column. What checks each one's values: tests/test_workflow.py
# (behaviour_iteration), tests/test_shaping.py (verifiable_reward),
# tests/test_bootstrap_evaluate_report.py (the mismatch table's), tests/test_pruning.py (the
# train metrics' pruning columns) and tests/test_dynamic_sampling.py (reward_timeouts).
ADDED = {
    "behaviour_iteration": (
        "iter_*/rollout/*.parquet",
        "iter_*/features/*.parquet",
        "iter_*/advantages/advantages.parquet",
        "variance/pool.parquet",
    ),
    "verifiable_reward": (
        "iter_*/rollout/*.parquet",
        "iter_*/features/*.parquet",
        "iter_*/advantages/advantages.parquet",
        "variance/pool.parquet",
    ),
    "lag": ("report/mismatch.parquet",),
    "measures": ("report/mismatch.parquet",),
    "truncated_fraction": ("report/mismatch.parquet",),
    # the responses generated (issue 34): tests/test_workflow.py::test_the_tiny_workflow_with_the_seeds_systems
    "responses": ("report/rollouts.parquet",),
    "responses_generated": ("report/rollouts.parquet", "report/progress.parquet"),
    # dynamic vocabulary pruning (rollout.min_p; 0 in the fixtures): tests/test_pruning.py
    **dict.fromkeys(
        ("pruned_vocab_fraction", "pruned_mass", "forced_tokens"),
        ("iter_*/train/metrics.parquet", "report/metrics.parquet"),
    ),
    # reward calls past the reward's deadline (issue 35; 0 in the fixtures)
    "reward_timeouts": ("report/rollouts.parquet",),
    # rollout.stream's counts and the kept tokens by lag (issue 57):
    # tests/test_workflow.py::test_the_tiny_workflow_runs_one_iteration_stale
    **dict.fromkeys(("groups_stale", "groups_carried", "tokens_by_lag"), ("report/rollouts.parquet",)),
    # the train step's throughput (issue 36): tests/test_train_logprobs.py::test_packed_steps_equal_padded_steps;
    # tokens_per_s is a wall-time figure, mfu NaN on CPU
    **dict.fromkeys(
        ("nonpad_tokens", "tokens_per_s", "mfu"),
        ("iter_*/train/metrics.parquet", "report/metrics.parquet"),
    ),
}


def added(path: Path, name: str, results: Path | None) -> bool:
    """Whether column ``name`` of the table at ``path`` is one of ADDED's (paths relative to ``results``)."""
    rel = path.relative_to(results) if results is not None else path
    return any(rel.match(glob) for glob in ADDED.get(name, ()))


def table_digest(path: Path, results: Path | None = None) -> str:
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    h = hashlib.sha256()
    for name in table.column_names:
        if name == "time_s" or name.endswith("_time_s") or added(path, name, results):
            continue
        column = table.column(name).combine_chunks()
        h.update(f"{name}:{column.type}".encode())
        for buffer in column.buffers():
            h.update(b"-" if buffer is None else buffer.to_pybytes())
    return h.hexdigest()


def fingerprints(results: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for policy in sorted(results.glob("**/policy")):
        if any(p.suffix == ".safetensors" for p in policy.iterdir()):
            out[f"weights:{policy.relative_to(results)}"] = weights_digest(policy)
    for path in sorted(results.glob("**/*.parquet")):
        out[f"table:{path.relative_to(results)}"] = table_digest(path, results)
    return out


def compare(want: dict[str, str], results: Path) -> int:
    """Print what differs between the recorded fingerprints ``want`` and the run in ``results``,
    then "N of M fingerprints equal"; the number that differ."""
    found = fingerprints(results)
    # a policy whose weights the retention policy deleted (PRUNED.json) has nothing to compare
    pruned = {k for k in want if k.startswith("weights:") and (results / k[8:] / "PRUNED.json").is_file()}
    for key in sorted(pruned):
        print(f"not compared: {key} (its weights were pruned by retention)")
    want = {k: v for k, v in want.items() if k not in pruned}
    bad = sorted(k for k in set(want) | set(found) if want.get(k) != found.get(k))
    for key in bad:
        print(f"differs: {key} (recorded {want.get(key, 'absent')[:12]}, now {found.get(key, 'absent')[:12]})")
    print(f"{len(want) - len(bad)} of {len(want)} fingerprints equal")
    return len(bad)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--check", type=Path, help="a JSON file of recorded fingerprints to compare with")
    which.add_argument(
        "--recorded", metavar="RUN", help="compare with this machine key's recorded run RUN (tiny, default)"
    )
    parser.add_argument("--cores", type=int, default=2, help="Snakemake's --cores for the run (default 2)")
    ns = parser.parse_args(argv)
    if ns.recorded is not None:
        path = recorded(ns.recorded, ns.cores)
        if path is None:
            print(f"fingerprints: none recorded for {cpu_key(ns.cores)} (run {ns.recorded})")
            return 0
        print(f"fingerprints: {path.relative_to(ROOT.parent.parent.parent)}")
        return 1 if compare(json.loads(path.read_text())["fingerprints"], ns.results) else 0
    if ns.check is not None:
        return 1 if compare(json.loads(ns.check.read_text())["fingerprints"], ns.results) else 0
    print(json.dumps({"cpu": cpu_key(ns.cores), "fingerprints": fingerprints(ns.results)}, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
