"""Wall time per RL iteration of the policy chain, on-policy and pipelined, against TRL.

The policy chain is rollout -> features -> advantages -> train, the jobs that make the next policy
(evaluation, scaling and the variance study are not run). Each setting runs the real workflow
(``snakemake --cores N``, the default config otherwise) in its own folder, from one shared initial
policy (the default bootstrap, built once, untimed, and given as ``model.path``) and prompt shards:

- ``grpo_s0``, ``grpo_s1``: ``advantages.estimator=grpo`` at ``rollout.staleness`` 0 and 1
  (s = 1 adds ``train.rollout_is=token``, which it requires);
- ``otb_s0``, ``otb_s1``: the same with the default estimator, OTB;
- ``trl``: TRL's ``GRPOTrainer`` on the same work (``benchmarks/trl_peer.py``: same initial
  policy, prompts, reward, batch sizes and loss, in a venv it sets up), one process with
  ``--cores`` threads.

A setting may carry its own number of iterations (``--settings grpo_s0_workers:4,grpo_s0:2``: a warm
setting's steady state needs more than the cold one's; ``--iterations`` for the others).

Per setting with workers: ``workers_peak_rss_gb``, each worker's peak resident set (VmHWM) when it
was stopped, and their sum, an upper bound on the peak of all of them together.

Per setting: ``wall_s`` (the Snakemake run of its iterations, from its start to its end),
``per_iteration_s`` (wall / iterations) and ``period_s`` (the mean time between consecutive train
jobs' ends: the steady state, without the first iteration's fill). Per stage, from the jobs' own
records: ``job_s`` (Snakemake's benchmark file: the whole job), ``work_s`` (the stage's
own timer, "<stage> finished in X s": its ``run``, model load included) and ``startup_s`` = job -
work (interpreter, imports, config; the process's exit); ``timer_s``: the GPU-bound part inside the
work, from the job's own records -- the rollout's generation and the features' forward pass (from
their progress lines' final rate: the time from the first batch's start to the last's end) and
the train job's optimizer steps (``step_time_s`` in its metrics); per job, as ``job_s``, and each
job's in ``timers_s``. ``outside_timers_s`` per setting: the mean over iterations 1 on of each
period minus the timers of that iteration's jobs on the chain it waits for (the slowest shard's;
each in ``outside_timers_per_iteration_s``): loads, start-up, writes and hand-overs. (Records
before 2026-11-29 took ``period_s`` minus every job's mean timers, the cold iteration 0's
included, which read low by a share of that iteration's longer steps.) ``period_max_s``: the
longest period. ``learning``: per iteration, the share of non-zero advantages, the elements that
changed, what each reader read of its policy (bytes, seconds, elements set from a delta) and the
train job's phases and publication (bytes written, the delta's bytes and elements). ``chain_s``:
the sum over the stages one iteration must wait for of their mean job time (s = 0: rollout,
features, advantages, train; s >= 1: features, advantages, train, the rollout being off that path)
-- the critical path if every job started the moment its inputs existed; ``period_s - chain_s`` is
then what scheduling and shared cores add. ``job_seconds_per_iteration``: the jobs' seconds summed over an iteration;
``core_floor_s`` = that / ``--cores``, the shortest period those jobs allow with every core busy
(at s = 1 the binding bound on a small machine; it counts a job as one core, true of the default
``resources``, one thread per job); ``periods_s``: each time between consecutive train jobs'
ends (``periods_with_a_write_s``: those during which an AdamW state is written, the iteration's
before, ``adamw_written``: ``train.optimizer_every``; ``crash``: the last train job run again
without the workers, which replays from a checkpoint); ``rollout_engines_idle_share``: over those
periods, the share of the time each generation engine ran no rollout job (a warm worker, by its
name; else a shard's own jobs); ``core_floor`` and ``chain_floor`` in the
s1-over-s0 ratios bound what overlap can reach (``ratios``). Threads per job: the config's
``resources`` (printed); GPUs per job too, but Snakemake runs here without ``--resources``, so
jobs that ask for a GPU share the machine's GPU.
``--list-settings`` prints the settings this script knows, one a line (benchmarks/gpu/check.sh
runs those it finds). The JSON names the command, the date, the CPU and the GPU.

Prints JSON (and writes it to ``--out``). The default, 4 iterations of each setting and TRL, takes
about 15 minutes on a 2-core CPU; run it with nothing else on the machine::

    python benchmarks/bench_iteration.py                               # all settings, 4 iterations
    python benchmarks/bench_iteration.py --settings grpo_s0,grpo_s1 --iterations 2 --no-trl \\
        --configfile config/tiny.yaml                                  # a quick check of the script
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

from machine import run_record  # benchmarks/machine.py (this folder is on sys.path)

from otbflow.config import DEFAULT_CONFIG, load_config
from otbflow.runtime import adamw

REPO = Path(__file__).resolve().parents[1]
SNAKEMAKE = str(Path(sys.executable).with_name("snakemake"))
SETTINGS = {
    "grpo_s0": ["advantages.estimator=grpo"],
    "grpo_s1": ["advantages.estimator=grpo", "rollout.staleness=1", "train.rollout_is=token"],
    "otb_s0": [],
    "otb_s1": ["rollout.staleness=1", "train.rollout_is=token"],
}
# A setting that learns from any policy, a random one included: the digit_share reward (the share of
# a response's characters that are digits) differs between a random policy's responses where the
# task's verifier gives 0 to all of them, so the advantages are not 0 and the weights change every
# iteration; at the CPU size: 4 prompts x 2 responses x 8 tokens, one shard, one step, at the
# learning rate of RL on a pretrained checkpoint (1e-6; the default 3e-4 is the tiny policy's), under
# which the share of bf16 elements an update changes is what a real run's is.
SETTINGS["grpo_s0_shaped"] = [
    "advantages.estimator=grpo",
    "task.reward=digit_share",
    "train.lr=1e-6",
    "rollout.prompts_per_iteration=4",
    "rollout.group_size=2",
    "rollout.max_new_tokens=8",
    "shard.n_shards=1",
    "train.mini_batch_size=8",
    "train.micro_batch_size=8",
]
# the same in bf16 (ZeRO-1): the policy a train job publishes is bf16, half the bytes every reader moves,
# its fp32 master weights in the AdamW state (docs/training.md, "The next policy")
SETTINGS["grpo_s0_shaped_bf16"] = [
    *SETTINGS["grpo_s0_shaped"],
    "model.dtype=bfloat16",
    "train.bf16=true",
    "train.zero_stage=1",
]
# the same with the AdamW state written every 5th iteration (train.optimizer_every; otbflow.runtime.adamw):
# the next train job reads the second-newest checkpoint, so that no update waits for a write
SETTINGS["grpo_s0_shaped_bf16_every5"] = [*SETTINGS["grpo_s0_shaped_bf16"], "train.optimizer_every=5"]
# one step off the policy with the hf backend's refilled batches (rollout.hf_refill_below: a batch
# goes on with new rows when a quarter of its rows are still decoding), and with
# the newer policy taken between decode steps (rollout.take_newer): Laminar's issue measures them on
# config/examples/long_tail.yaml (--configfile), against grpo_s1
SETTINGS["grpo_s1_refill"] = [*SETTINGS["grpo_s1"], "rollout.hf_refill_below=0.25"]
SETTINGS["grpo_s1_newer"] = [*SETTINGS["grpo_s1"], "rollout.take_newer=step"]
SETTINGS["grpo_s1_newer_refill"] = [*SETTINGS["grpo_s1_refill"], "rollout.take_newer=step"]
# Laminar's streaming rollouts (rollout.stream): each rollout continues its shard's stream and takes the
# first complete groups, its batch refilled, the newer policy taken between decode steps; at s = 1, and at
# s = 2, where a response carried on may land up to two iterations after its first token's policy
SETTINGS["grpo_stream_s1"] = [*SETTINGS["grpo_s1_newer_refill"], "rollout.stream=true"]
SETTINGS["grpo_stream_s2"] = [o for o in SETTINGS["grpo_stream_s1"] if o != "rollout.staleness=1"]
SETTINGS["grpo_stream_s2"].append("rollout.staleness=2")
SETTINGS |= {f"{name}_workers": overrides for name, overrides in SETTINGS.items()}
WORKERS = {name for name in SETTINGS if name.endswith("_workers")}  # warm workers serve the stages
# the rollout is off the policy chain
PIPELINED = {name for name, o in SETTINGS.items() if any(re.fullmatch(r"rollout\.staleness=[1-9]\d*", x) for x in o)}
STAGES = ("rollout", "features", "advantages", "train")
FINISHED = re.compile(r"^(\S+ \S+) otbflow INFO (\S+) finished in ([\d.]+) s$", re.M)
STARTED = re.compile(r"^(\S+ \S+) otbflow INFO (\S+) started ([\d.]+) s ago$", re.M)
RUNS_ON = re.compile(r"INFO worker (\S+) runs rollout \(job ")  # a warm generation worker's job
# the final line of a stage's Progress (otbflow.progress): items done over the rate is its timer
DONE = {
    "rollout": re.compile(r"INFO generation \(\d+ per prompt\): (\d+)/\d+ \S+ \(100%\), ([\d.e+]+) \S+, done$", re.M),
    "features": re.compile(r"INFO features: (\d+)/\d+ \S+ \(100%\), ([\d.e+]+) \S+, done$", re.M),
}


def snakemake_config(overrides: list[str]) -> list[str]:
    """key=value overrides as Snakemake's --config (one YAML mapping per top-level key)."""
    sections: dict[str, list[str]] = {}
    flat = []
    for o in overrides:
        key, value = o.split("=", 1)
        if "." in key:
            top, rest = key.split(".", 1)
            sections.setdefault(top, []).append(f"{rest}: {value}")
        else:
            flat.append(o)
    return flat + [f"{top}={{{', '.join(items)}}}" for top, items in sections.items()]


CONFIGFILE: list[str] = []  # --configfile FILE, layered over config/config.yaml in every run
ENGINE: list[str] = []
"""rollout.python resolved against the folder the script runs in (each setting's run has its own
working directory, where config/examples/vllm_cpu.yaml's relative path would not resolve)."""


def smk(workdir: Path, overrides: list[str], targets: list[str], cores: int) -> float:
    cmd = [SNAKEMAKE, "-s", str(REPO / "Snakefile"), "--directory", str(workdir), "--cores", str(cores)]
    cmd += [*targets, *CONFIGFILE, "--config", *snakemake_config([*ENGINE, *overrides])]
    start = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return time.perf_counter() - start


def shard_files(n_shards: int) -> list[str]:
    return [f"results/data/train/shard_{s}.parquet" for s in range(n_shards)]


def prepare(work: Path, cores: int, n_shards: int, policy: Path | None) -> tuple[Path, list[Path]]:
    """The initial policy (the bootstrap's, unless ``policy`` is given) and the prompt shards, built
    once (untimed)."""
    base = work / "base"
    if policy is None:
        smk(base, [], ["results/bootstrap/policy", *shard_files(n_shards)], cores)
        policy = base / "results/bootstrap/policy"
    else:
        smk(base, [f"model.path={policy.resolve()}"], shard_files(n_shards), cores)
    return policy.resolve(), [base / f for f in shard_files(n_shards)]


def timer(results: Path, stage: str, k: int, text: str) -> float | None:
    """The GPU-bound seconds inside a job (the module docstring's ``timer_s``); None where the job has
    no such record (the advantages, a rollout that generated nothing)."""
    if stage in DONE:
        m = DONE[stage].search(text)
        return int(m.group(1)) / float(m.group(2)) if m else None
    if stage == "train":
        import polars as pl

        metrics = results / f"iter_{k}" / "train" / "metrics.parquet"
        return float(pl.read_parquet(metrics)["step_time_s"].sum()) if metrics.is_file() else None
    return None


def stamp(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def jobs(results: Path) -> list[dict]:
    """Every stage job of the run: stage, iteration, its start and end (epoch seconds: its process's
    start, or its start on a warm worker), job, work and timer seconds, and its ``engine``: the warm
    generation worker a rollout ran on, else its shard's (a rollout job of its own)."""
    out = []
    for stage in STAGES:
        for log in sorted((results / "logs" / stage).glob("*.log")):
            text = log.read_text()
            m = FINISHED.search(text)
            bench = results / "benchmarks" / stage / f"{log.stem}.tsv"
            if not m or not bench.is_file():
                continue
            job_s = float(bench.read_text().splitlines()[1].split("\t")[0])
            end = stamp(m.group(1))
            started = STARTED.search(text)
            k = int(re.match(r"iter_(\d+)", log.stem).group(1))
            worker = RUNS_ON.search(text)
            out.append(
                {
                    "stage": stage,
                    "iteration": k,
                    "start": stamp(started.group(1)) - float(started.group(3)) if started else end - float(m.group(3)),
                    "end": end,
                    "engine": worker.group(1) if worker else log.stem.split("_", 2)[-1],
                    "job_s": job_s,
                    "work_s": float(m.group(3)),
                    "timer_s": timer(results, stage, k, text),
                }
            )
    return out


def start_workers(results: Path, n_shards: int) -> tuple[list[subprocess.Popen], float]:
    """One generation and one features worker per shard and one train worker for the run in
    ``results`` (``otbflow worker``; the generation workers with the run's rollout.python, where its
    resolved config ``results/config.yaml`` sets one: vLLM's environment), and the seconds until
    all had registered (their imports)."""
    sys.path.insert(0, str(REPO / "src"))
    import yaml

    from otbflow.ops.dispatch import live_workers

    engine = yaml.safe_load((results / "config.yaml").read_text())["rollout"].get("python") or sys.executable
    kinds = ["generate"] * n_shards + ["features"] * n_shards + ["train"]
    start = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    procs = [
        subprocess.Popen(
            [
                engine if kind == "generate" else sys.executable,
                "-m",
                "otbflow",
                "worker",
                kind,
                "--results",
                str(results),
            ],
            env=env,
            stdout=open(results / f"worker_{kind}_{i}.log", "w"),
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        for i, kind in enumerate(kinds)
    ]
    while sum(len(live_workers(results, k)) for k in set(kinds)) < len(kinds):
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a worker ended before it registered: see {results}/worker_*.log")
        time.sleep(0.1)
    return procs, time.perf_counter() - start


def peak_rss_gb(pid: int) -> float | None:
    """The process's peak resident set (VmHWM of /proc/PID/status) in GB, None where it is gone."""
    try:
        line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return None
    return int(line.split()[1]) * 1024 / 1e9


def stop_workers(procs: list[subprocess.Popen]) -> list[float | None]:
    """Stop the workers; returns each one's peak resident set before it stopped (``peak_rss_gb``)."""
    peaks = [peak_rss_gb(p.pid) for p in procs]
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait(timeout=60)
    return peaks


def run_setting(work: Path, name: str, policy: Path, iterations: int, cores: int, n_shards: int) -> dict:
    folder = work / name
    shutil.rmtree(folder, ignore_errors=True)
    given = [o.split("=", 1)[1] for o in SETTINGS[name] if o.startswith("shard.n_shards=")]
    n_shards = int(given[-1]) if given else n_shards  # a setting's own shards (the shaped ones: one)
    # the target is the last policy: no prune job runs, every policy stays to be compared (``learning``)
    overrides = [f"model.path={policy}", f"iterations={iterations}", *SETTINGS[name]]
    smk(folder, overrides, shard_files(n_shards), cores)
    procs, workers_s = start_workers(folder / "results", n_shards) if name in WORKERS else ([], 0.0)
    peaks: list[float | None] = []
    try:
        wall = workers_s + smk(folder, overrides, [f"results/iter_{iterations - 1}/train/policy"], cores)
    finally:
        peaks = stop_workers(procs)
    js = jobs(folder / "results")
    # after the run's own records are read: the job run again replaces the last train job's
    every = any(o.startswith("train.optimizer_every=") for o in overrides)
    crash = replay_cost(folder, overrides, iterations, cores) if name in WORKERS and every else None
    stages = {}
    for stage in STAGES:
        mine = [j for j in js if j["stage"] == stage]
        if not mine:
            raise RuntimeError(f"{folder}: no finished {stage} job in the logs")
        job_s, work_s = sum(j["job_s"] for j in mine) / len(mine), sum(j["work_s"] for j in mine) / len(mine)
        timers = [j["timer_s"] for j in mine if j["timer_s"] is not None]
        stages[stage] = {
            "jobs": len(mine),
            "job_s": job_s,
            "work_s": work_s,
            "startup_s": job_s - work_s,
            "timer_s": sum(timers) / len(timers) if timers else 0.0,  # per job, as job_s
            "timers_s": [j["timer_s"] for j in sorted(mine, key=lambda j: (j["iteration"], j["end"]))],
        }
    ends = sorted(j["end"] for j in js if j["stage"] == "train")
    periods = [b - a for a, b in zip(ends, ends[1:])]
    on_path = STAGES[1:] if name in PIPELINED else STAGES
    # per iteration k >= 1 (the period it ends): what its chain's jobs spent outside their timers
    outside = [p - chain_timers(js, on_path, k + 1) for k, p in enumerate(periods)]
    # periods[i] is iteration i+1's: the AdamW state iteration i wrote is written during it
    written = adamw.written(load_config(DEFAULT_CONFIG, overrides))
    period = sum(periods) / len(periods) if periods else wall
    chain = sum(stages[s]["job_s"] for s in on_path)
    job_seconds = sum(stages[s]["job_s"] * stages[s]["jobs"] for s in STAGES) / iterations
    return {
        "overrides": SETTINGS[name],
        "workers": len(procs),
        "workers_startup_s": workers_s,
        # each worker's own peak resident set; their sum bounds the peak of all together from above
        "workers_peak_rss_gb": peaks,
        "workers_peak_rss_sum_gb": sum(x for x in peaks if x) if peaks else None,
        "wall_s": wall,
        "per_iteration_s": wall / iterations,
        "period_s": period,
        "period_max_s": max(periods) if periods else None,
        "periods_s": periods,
        # each generation engine's idle share over those periods (engines_idle; none with one period)
        "rollout_engines_idle_share": engines_idle(js, (ends[0], ends[-1])) if len(ends) > 1 else {},
        "adamw_written": written,
        "periods_with_a_write_s": {i + 1: p for i, p in enumerate(periods) if i in written},
        "chain_s": chain,
        "chain_stages": list(on_path),
        "scheduling_and_sharing_s": period - chain,
        "iterations": iterations,
        "outside_timers_s": sum(outside) / len(outside) if outside else None,
        "outside_timers_per_iteration_s": outside,
        "job_seconds_per_iteration": job_seconds,
        "core_floor_s": job_seconds / cores,
        "stages": stages,
        "startup_s_per_iteration": sum(stages[s]["startup_s"] * stages[s]["jobs"] for s in STAGES) / iterations,
        "learning": learning(folder / "results", iterations, policy),
        "crash": crash,
        **trained_tokens(folder / "results", iterations, periods),
    }


def engines_idle(js: list[dict], window: tuple[float, float]) -> dict[str, float]:
    """Each generation engine's idle share of ``window`` (the measured periods: the first train
    job's end to the last's): one minus the share that its rollout jobs cover (their union); an
    engine that ran rollouts only outside it, 1."""
    lo, hi = window
    spans: dict[str, list[tuple[float, float]]] = {j["engine"]: [] for j in js if j["stage"] == "rollout"}
    for j in js:
        if j["stage"] == "rollout" and j["end"] > lo and j["start"] < hi:
            spans[j["engine"]].append((max(j["start"], lo), min(j["end"], hi)))
    idle = {}
    for engine, mine in sorted(spans.items()):
        busy, reach = 0.0, lo
        for a, b in sorted(mine):
            busy += max(0.0, b - max(a, reach))
            reach = max(reach, b)
        idle[engine] = 1 - busy / (hi - lo)
    return idle


def trained_tokens(results: Path, iterations: int, periods: list[float]) -> dict:
    """The response tokens each iteration trains on (its rollouts' response_length, every shard),
    and over iterations 1 on, those tokens per second of the periods that end them (the issue's
    throughput: trained tokens per second)."""
    import polars as pl

    tokens = [
        int(sum(pl.read_parquet(p, columns=["response_length"])["response_length"].sum() for p in files))
        for files in (sorted(results.glob(f"iter_{k}/rollout/shard_*.parquet")) for k in range(iterations))
    ]
    per_s = sum(tokens[1:]) / sum(periods) if periods else None
    return {"trained_tokens_per_iteration": tokens, "trained_tokens_per_s": per_s}


def chain_timers(js: list[dict], on_path, k: int) -> float:
    """The timers of iteration k's jobs on the chain (``on_path``), the slowest shard's of each."""
    return sum(
        max((j["timer_s"] or 0.0 for j in js if j["stage"] == st and j["iteration"] == k), default=0.0)
        for st in on_path
    )


def replay_cost(folder: Path, overrides: list[str], iterations: int, cores: int) -> dict:
    """What a lost train worker costs (train.optimizer_every >= 2): the last train job run again
    once the workers are gone (``--forcerun``), which builds its engine from its declared AdamW state
    and replays the updates after it; the iterations it replayed, its wall time (Snakemake's
    benchmark file) and the seconds from its start to its last replayed update."""
    k = iterations - 1
    target = f"results/iter_{k}/train/policy"
    smk(folder, overrides, [target, "--forcerun", target], cores)
    text = (folder / "results/logs/train" / f"iter_{k}.log").read_text()
    stamp = re.compile(r"^(\S+ \S+) otbflow\S* INFO (?:train started|replayed iteration (\d+) )", re.M)
    found = [(datetime.strptime(t, "%Y-%m-%d %H:%M:%S,%f").timestamp(), j) for t, j in stamp.findall(text)]
    bench = folder / "results/benchmarks/train" / f"iter_{k}.tsv"
    return {
        "iteration": k,
        "replayed": [int(j) for _, j in found if j],
        "job_s": float(bench.read_text().splitlines()[1].split("\t")[0]),
        "start_to_last_replayed_s": found[-1][0] - found[0][0] if len(found) > 1 else 0.0,
    }


def weight_changes(before: Path, after: Path) -> dict:
    """How many of the weight elements of the policy folder ``after`` differ from ``before``'s
    (the tensors both hold, by name): as written (both cast to ``after``'s dtype) and cast to bf16,
    with the bytes a bf16 element delta would move (2 a changed element, indices not counted)."""
    import torch
    from safetensors import safe_open

    def tensors(folder: Path) -> dict:
        found = {}
        for file in sorted(folder.glob("*.safetensors")):
            with safe_open(file, "pt") as f:
                found |= {name: (file, name) for name in f.keys()}
        return found

    def read(where) -> torch.Tensor:
        with safe_open(where[0], "pt") as f:
            return f.get_tensor(where[1])

    old, new = tensors(before), tensors(after)
    elements = changed = changed_bf16 = 0
    for name in sorted(old.keys() & new.keys()):
        a, b = read(old[name]), read(new[name])
        elements += b.numel()
        changed += int((a.to(b.dtype) != b).sum())
        changed_bf16 += int((a.to(torch.bfloat16) != b.to(torch.bfloat16)).sum())
    return {
        "elements": elements,
        "changed_share": changed / elements if elements else None,
        "changed_bf16_share": changed_bf16 / elements if elements else None,
        "bf16_delta_bytes": 2 * changed_bf16,
    }


def policy_loads(results: Path, k: int) -> dict:
    """What iteration k's rollout and features jobs read of their policy, summed over shards (their
    tables' ``policy_load`` metadata: the bytes read, whether the manifest was trusted, seconds)."""
    from otbflow.io import read_metadata

    out = {}
    for stage in ("rollout", "features"):
        loads = [read_metadata(p).get("policy_load") for p in sorted((results / f"iter_{k}/{stage}").glob("*.parquet"))]
        loads = [x for x in loads if x]
        out[stage] = {
            "bytes": sum(x["bytes"] or 0 for x in loads),
            "seconds": sum(x["seconds"] for x in loads),
            "trusted": all(x["trusted"] for x in loads) if loads else None,
            # set from the folder's element-level delta (otbflow.runtime.delta), where every shard was
            "delta_elements": sum(x["delta_elements"] for x in loads)
            if loads and all("delta_elements" in x for x in loads)
            else None,
        }
    return out


def train_record(results: Path, k: int) -> dict:
    """Iteration k's train job as its metrics' metadata records it: where its seconds went
    (``phases_s``: load, setup, steps, publish, state) and what it wrote (``publish``: the policy's
    bytes, the seconds, the delta's bytes and elements)."""
    from otbflow.io import read_metadata

    meta = read_metadata(results / f"iter_{k}/train/metrics.parquet")
    return {"phases_s": meta.get("phases_s"), "publish": meta.get("publish")}


def learning(results: Path, iterations: int, initial: Path) -> dict:
    """Whether the setting's weights changed, per iteration: the share of responses with a non-zero
    advantage (iteration k's advantages.parquet) and the policy iteration k wrote against the one it
    started from (``weight_changes``). A period measured while ``weights_changed`` is false is no
    iteration's cost: the warm jobs found their weights already resident. The runs keep every
    iteration's policy and AdamW state (7.4 GB an iteration at the 0.5B shape in fp32)."""
    import polars as pl

    rows, before = [], initial
    for k in range(iterations):
        adv = pl.read_parquet(results / f"iter_{k}/advantages/advantages.parquet", columns=["advantages"])
        nonzero = adv.select(pl.col("advantages").list.eval(pl.element() != 0).list.any().mean()).item()
        after = results / f"iter_{k}/train/policy"
        rows.append(
            {
                "iteration": k,
                "nonzero_advantage_share": nonzero,
                **weight_changes(before, after),
                "policy_loads": policy_loads(results, k),
                "train": train_record(results, k),
            }
        )
        before = after
    warm = rows[1:]  # iteration 0's readers load the initial policy whole
    return {
        "per_iteration": rows,
        "weights_changed": all((r["changed_share"] or 0) > 0 for r in rows),
        # what crossed between the stages per iteration, from iteration 1 on: the bytes each reader
        # read of its policy (rollout and features, every shard), the train job's publication
        "reader_bytes": [sum(x["bytes"] for x in r["policy_loads"].values()) for r in warm],
        "published_bytes": [(r["train"]["publish"] or {}).get("bytes") for r in warm],
        "delta_bytes": [(r["train"]["publish"] or {}).get("delta_bytes") for r in warm],
        "publish_s": [(r["train"]["publish"] or {}).get("seconds") for r in warm],
    }


def ratios(result: dict) -> dict:
    """s = 1 against s = 0 and each setting against TRL, on two bases: wall / iterations (one-off
    costs included: Snakemake's start, TRL's imports and model load, the pipeline's fill) and the
    steady state (the period between iterations' ends). Two floors for s = 1 over s = 0, each
    against s = 0's measured period: every core busy (``core_floor``: s = 1's job-seconds over the
    cores) and unlimited cores (``chain_floor``: the chain s = 1 waits for, features -> advantages
    -> train, at s = 0's job times, where no job shares a core with a rollout). Both come from mean
    job times over all iterations, the period from iterations 1 on, so a measured ratio can fall a
    little below them."""
    s, out = result["settings"], {}
    for est in ("grpo", "otb"):
        if f"{est}_s0" in s and f"{est}_s1" in s:
            s0, s1 = s[f"{est}_s0"], s[f"{est}_s1"]
            out[f"{est}_s1_over_s0"] = {
                "wall_per_iteration": s1["per_iteration_s"] / s0["per_iteration_s"],
                "steady": s1["period_s"] / s0["period_s"],
                "core_floor": s1["core_floor_s"] / s0["period_s"],
                "chain_floor": sum(s0["stages"][st]["job_s"] for st in s1["chain_stages"]) / s0["period_s"],
            }
        for st in ("s0", "s1"):
            if f"{est}_{st}" in s and f"{est}_{st}_workers" in s:
                w, o = s[f"{est}_{st}_workers"], s[f"{est}_{st}"]
                out[f"{est}_{st}_workers_over_{st}"] = {
                    "wall_per_iteration": w["per_iteration_s"] / o["per_iteration_s"],
                    "steady": w["period_s"] / o["period_s"],
                }
            if "trl" in result and f"{est}_{st}_workers" in s:
                out[f"{est}_{st}_workers_over_trl"] = {
                    "wall_per_iteration": s[f"{est}_{st}_workers"]["per_iteration_s"]
                    / result["trl"]["wall_per_iteration_s"],
                    "steady": s[f"{est}_{st}_workers"]["period_s"] / result["trl"]["period_s"],
                }
        for st in ("s0", "s1"):
            if "trl" in result and f"{est}_{st}" in s:
                out[f"{est}_{st}_over_trl"] = {
                    "wall_per_iteration": s[f"{est}_{st}"]["per_iteration_s"] / result["trl"]["wall_per_iteration_s"],
                    "steady": s[f"{est}_{st}"]["period_s"] / result["trl"]["period_s"],
                }
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--settings",
        default=",".join(SETTINGS),
        help="comma-separated, each NAME or NAME:ITERATIONS; names: " + ", ".join(SETTINGS),
    )
    p.add_argument("--iterations", type=int, default=4)
    p.add_argument("--cores", type=int, default=os.cpu_count() or 2, help="snakemake --cores, and TRL's threads")
    p.add_argument("--no-trl", action="store_true", help="skip the TRL GRPOTrainer peer")
    p.add_argument("--work", type=Path, default=REPO / "benchmarks" / "out" / "iteration")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    p.add_argument(
        "--configfile",
        type=Path,
        nargs="+",
        help="YAML files layered in order over config/config.yaml (e.g. config/tiny.yaml), as Snakemake's --configfile",
    )
    p.add_argument("--policy", type=Path, help="initial HF policy folder (default: build the config's bootstrap)")
    p.add_argument("--list-settings", action="store_true", help="print the known settings, one a line, and exit")
    p.add_argument(
        "--drop-weights",
        action="store_true",
        help="delete each setting's policies and optimizer states once it is measured (8 GB per iteration at 0.5B)",
    )
    ns = p.parse_args(argv)
    if ns.list_settings:
        print("\n".join(SETTINGS))
        return {"settings": list(SETTINGS)}
    runs = [(name, n or str(ns.iterations)) for name, _, n in (s.partition(":") for s in ns.settings.split(","))]
    unknown = [name for name, _ in runs if name not in SETTINGS]
    if unknown:
        p.error(f"unknown settings {', '.join(unknown)}; known: {', '.join(SETTINGS)}")
    if not all(n.isdigit() and int(n) >= 1 for _, n in runs):
        p.error(f"--settings {ns.settings}: a setting's iterations (NAME:ITERATIONS) must be a whole number, 1 or more")
    runs = [(name, int(n)) for name, n in runs]
    sys.path.insert(0, str(REPO / "src"))
    from omegaconf import OmegaConf

    from otbflow.config import DEFAULT_CONFIG, load_config
    from otbflow.pipeline import job_resources

    files = ns.configfile or []
    extra = OmegaConf.to_container(OmegaConf.merge(*[OmegaConf.load(f) for f in files])) if files else None
    cfg = load_config(DEFAULT_CONFIG, extra=extra)
    if files:
        CONFIGFILE[:] = ["--configfile", *(str(f.resolve()) for f in files)]
    if cfg.rollout.python:
        ENGINE[:] = [f"rollout.python={Path(cfg.rollout.python).absolute()}"]
    r = {stage: job_resources(cfg, stage) for stage in ("rollout", "features", "advantages", "train")}
    ns.work.mkdir(parents=True, exist_ok=True)
    policy, shards = prepare(ns.work, ns.cores, cfg.shard.n_shards, ns.policy)
    record = run_record()
    result: dict = {
        **record,
        "machine": {**record["machine"], "cores": ns.cores},
        "iterations": ns.iterations,
        "configfile": [str(f) for f in files] or None,
        "policy": str(policy),
        "threads_per_job": {
            "rollout": r["rollout"]["threads"],
            "features": r["features"]["threads"],
            "advantages": 1,
            "train": r["train"]["cpus_per_task"] * r["train"]["tasks"],
        },
        # Snakemake runs here without --resources: jobs that ask for a GPU share the one GPU
        "gpus_per_job": {name: r[name].get("gpu", 0) for name in ("rollout", "features", "advantages", "train")},
        "settings": {},
    }
    for name, iterations in runs:
        result["settings"][name] = run_setting(ns.work, name, policy, iterations, ns.cores, cfg.shard.n_shards)
        print(json.dumps({name: result["settings"][name]["per_iteration_s"]}), file=sys.stderr)
        if ns.drop_weights:  # the train jobs' folders (policy/, optimizer/) and their checkpoints
            results = ns.work / name / "results"
            for folder in [*results.glob("iter_*/train/*"), results / "checkpoints"]:
                if folder.is_dir():
                    shutil.rmtree(folder)
        if ns.out:  # rewritten after each setting: a run stopped part-way keeps those it finished
            ns.out.write_text(json.dumps(result, indent=1))
    if not ns.no_trl:
        sys.path.insert(0, str(REPO / "benchmarks"))
        from trl_peer import run_trl

        trl = run_trl(policy, shards, ns.iterations, ns.cores)
        trl["wall_s"] = trl["startup_s"] + sum(trl["per_iteration_s"])
        trl["wall_per_iteration_s"] = trl["wall_s"] / ns.iterations
        # otbflow's period leaves out iteration 0 (the time between train ends): so does TRL's
        later = trl["per_iteration_s"][1:] or trl["per_iteration_s"]
        trl["period_s"] = sum(later) / len(later)
        result["trl"] = trl
    result["ratios"] = ratios(result)
    text = json.dumps(result, indent=1)
    print(text)
    if ns.out:
        ns.out.write_text(text)
    return result


if __name__ == "__main__":
    main()
