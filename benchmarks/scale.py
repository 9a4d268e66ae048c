"""docs/scale.md, computed: what a long otbflow run costs on a cluster, on paper.

For Qwen2.5-0.5B-, 7B- and 32B-shaped policies (benchmarks/shapes/), 512 prompts x 16 samples,
4,096-token responses (the limit: an upper bound), 200-token prompts and 100 iterations:

- **jobs**: counted by Snakemake itself (a dry run of this workflow with these settings), and the
  sbatch submissions they make with the slurm/ profile, with and without grouping an iteration's
  {features, advantages, train} into one Slurm job;
- **disk**: ``otbflow.ops.disk.estimate`` at the peak and at the end, per retention setting and staleness;
- **start-up per job** (interpreter and imports, model load, vLLM engine build, DeepSpeed
  initialisation, the optimizer state read and written, the next policy written): measured on CPU
  for two shapes by ``benchmarks/bench_startup.py`` (its JSON, ``--startup``), extrapolated to the
  large shapes linearly in the bytes each step moves (method below);
- **work per job**: FLOPs (forward 2 per multiplied weight + 4 n_layer context d_model per token,
  ``forward_flops``; backward twice the forward) over GPUs x peak x MFU. The train MFU is the range
  measured on one H100 at the 0.5B shape (``measured_train_mfu``: the records ``MFU_RECORDS`` of
  benchmarks/measured/), the rollout and features MFU stated ranges (ASSUMPTIONS), not measured. The
  start-up share is start-up / (start-up + work), a range from that of the MFU;
- what grouping, retention and staleness change.

    python benchmarks/scale.py                # writes docs/scale.md
    python benchmarks/scale.py --check        # fails if docs/scale.md is not what it would write
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from otbflow.config import DEFAULT_CONFIG, load_config  # noqa: E402
from otbflow.ops.disk import count_parameters, estimate, gib, optimizer_bytes_per_parameter  # noqa: E402
from otbflow.ops.jobgroups import CHAIN as GROUPED  # noqa: E402  the rules of one grouped Slurm job per iteration

DOC = REPO / "docs" / "scale.md"
STARTUP = REPO / "benchmarks" / "measured" / "startup.json"
SNAKEMAKE = str(Path(sys.executable).with_name("snakemake"))

ITERATIONS, PROMPTS, GROUP, RESPONSE, PROMPT_TOKENS = 100, 512, 16, 4096, 200
SHARDS, EVALUATE_EVERY = 8, 10
# Where each stage runs (GPUs per job), per shape: rollout shards on one engine each (32B: tensor
# parallel over 2), the features pass one GPU per shard (32B: its bf16 weights would fit one 80 GB
# GPU, but today's load_policy loads fp32 first: the document says so), training on one node (32B:
# four, ZeRO-3).
LAYOUT = {
    "qwen2.5-0.5b": {"rollout_gpus": 1, "features_gpus": 1, "train_gpus": 8, "zero_stage": 1},
    "qwen2.5-7b": {"rollout_gpus": 1, "features_gpus": 1, "train_gpus": 8, "zero_stage": 1},
    "qwen2.5-32b": {"rollout_gpus": 2, "features_gpus": 1, "train_gpus": 32, "zero_stage": 3},
}
# Not measured here: an H100 SXM's dense bf16 peak (NVIDIA's datasheet) and the rollout and
# features model-FLOPs utilisation ranges: decoding is memory-bound (low), a teacher-forced forward
# compute-bound. The train MFU is measured (``measured_train_mfu``). The start-up shares below span
# these ranges.
ASSUMPTIONS = {
    "gpu": "H100 SXM",
    "peak_tflops": 989.0,
    "mfu": {"rollout": (0.05, 0.20), "features": (0.30, 0.50)},
}
# The train step's MFU as measured on one H100 (Qwen2.5-0.5B shape, config/examples/gpu_qwen2.5-0.5b.yaml:
# 512 sequences of ~200 tokens per step, ZeRO-1, bf16): benchmarks/bench_train_mfu.py's steps in
# these records (docs/measurements.md, the anchors of the same names), 6 x parameters x non-pad
# tokens / step time / 989 TFLOP/s.
MFU_RECORDS = ("iteration_h100", "iteration_workers_h100")
# A GPU vLLM build, cited (not measured here): torch.compile took about 39 s of a cold start of over
# five minutes (about 142 s reading weights) for an NVFP4 35B MoE model on one DGX Spark, local NVMe.
CITED_BUILD = {
    "compile_s": 39.0,
    "source": "https://route179.dev/2026/06/30/optimizing-vllm-cold-start-with-model-streaming-and-compile-caching/",
}
RETENTION = [  # (policy_every, optimizer): keep everything, every policy, the default, sparse
    (0, "all"),
    (1, "last"),
    (10, "last"),
    (50, "last"),
]


def overrides(shape: str, policy_every: int = 10, optimizer: str = "last", staleness: int = 0) -> list[str]:
    lay = LAYOUT[shape]
    out = [
        f"iterations={ITERATIONS}",
        f"rollout.prompts_per_iteration={PROMPTS}",
        f"rollout.group_size={GROUP}",
        f"rollout.max_new_tokens={RESPONSE}",
        f"train.zero_stage={lay['zero_stage']}",
        "train.bf16=true",
        "model.dtype=bfloat16",
        f"retention.policy_every={policy_every}",
        f"retention.optimizer={optimizer}",
    ]
    return out + ([f"rollout.staleness={staleness}", "train.rollout_is=token"] if staleness else [])


# ------------------------------------------------------------------------------------------
# Jobs
# ------------------------------------------------------------------------------------------


def planned_jobs() -> dict[str, int]:
    """Jobs per rule of the whole run, as Snakemake plans them (a dry run in an empty folder)."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [SNAKEMAKE, "-s", str(REPO / "Snakefile"), "--directory", tmp, "-n", "--quiet", "rules", "host"]
        cmd += ["--cores", "2", "--config", f"iterations={ITERATIONS}", f"shard={{n_shards: {SHARDS}}}"]
        cmd += [f"evaluate={{every: {EVALUATE_EVERY}}}"]
        res = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if res.returncode != 0:
        raise SystemExit(f"dry run failed:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
    table = res.stdout.split("Job stats:", 1)[1].split("\n\n", 1)[0]
    return {m[1]: int(m[2]) for m in re.finditer(r"^(\w+)\s+(\d+)$", table, re.M) if m[1] != "total"}


def submissions(jobs: dict[str, int], grouped: bool) -> dict[str, float]:
    """sbatch calls of the run with the slurm/ profile: local rules (prune, all) none, an
    iteration's rollout shards one job array, with grouping one job per iteration for GROUPED.
    The bootstrap job is not counted: a real model (model.path) needs none."""
    per_rule = {r: n for r, n in jobs.items() if r not in ("prune", "all", "bootstrap")}
    per_rule["rollout"] = ITERATIONS
    if grouped:
        for r in GROUPED:
            per_rule.pop(r)
        per_rule["+".join(GROUPED)] = ITERATIONS
    return per_rule


# ------------------------------------------------------------------------------------------
# Start-up (measured, extrapolated) and work (FLOPs)
# ------------------------------------------------------------------------------------------


def shape_config(shape: str) -> dict:
    return json.loads((REPO / "benchmarks" / "shapes" / f"{shape}.json").read_text())


def startup_model(measured: dict) -> dict:
    """Per measured start-up step, (stage, step) -> the default shape's time (the fixed part) and
    seconds per GB of what it moves, through the two measured shapes (none for imports; a step
    that took less on the larger shape gets no per-GB part)."""
    small, large = measured["shapes"]["default"], measured["shapes"]["qwen2.5-0.5b"]
    weights = lambda e: 4 * e["parameters"]  # noqa: E731  fp32 files, as saved
    optimizer = lambda e: e["train"]["optimizer_bytes"]  # noqa: E731
    moves = {"model_load_s": weights, "deepspeed_init_s": weights, "policy_save_s": weights, "engine_build_s": weights}
    moves |= {"optimizer_load_s": optimizer, "optimizer_save_s": optimizer}
    out = {}
    for stage in ("advantages", "features", "train", "vllm"):
        for step in small.get(stage, {}):
            if not step.endswith("_s") or step == "process_s" or stage not in large:
                continue
            t0, t1 = small[stage][step], large[stage][step]
            nbytes = moves.get(step)
            slope = max(0.0, (t1 - t0) / (nbytes(large) - nbytes(small)) * 1e9) if nbytes else 0.0
            kind = "none" if nbytes is None else "optimizer state" if nbytes is optimizer else "fp32 weights"
            out[(stage, step)] = {"t_small": t0, "t_large": t1, "fixed_s": t0, "s_per_gb": slope, "bytes": kind}
    return out


def rank_optimizer_bytes(n_params: int, optimizer_bytes: float, ranks: int, zero_stage: int, bf16: bool) -> float:
    """Optimizer-state bytes one train rank reads and writes: at ZeRO-0/1/2 the module's weights
    (bf16 or fp32; one file that rank 0 writes and every rank reads) whole, the rest (fp32 master
    weights and moments) its 1/ranks share; at ZeRO-3 a 1/ranks share of all."""
    if zero_stage == 3:
        return optimizer_bytes / ranks
    module = (2 if bf16 else 4) * n_params
    return module + (optimizer_bytes - module) / ranks


def job_startup(fits: dict, stage: str, n_params: int, optimizer_bytes: float) -> float:
    """Extrapolated start-up of one job of ``stage`` (seconds, the slowest rank). Every rank loads
    the whole fp32 policy (at ZeRO-3 rank 0 reads it and hands the others their shares) and reads
    and writes ``optimizer_bytes`` of the optimizer state (one rank's, ``rank_optimizer_bytes``;
    the ranks in parallel); rank 0 writes the next policy. The
    rollout job: vLLM's import and reading the weights at the features job's rate; its engine build
    is not included (the document adds the cited compile)."""
    weights = 4 * n_params

    def t(st: str, step: str, nbytes: float = 0.0, fixed: bool = True) -> float:
        f = fits[(st, step)]
        return (f["fixed_s"] if fixed else 0.0) + f["s_per_gb"] * nbytes / 1e9

    if stage == "rollout":
        return t("vllm", "import_s") + t("features", "model_load_s", weights, fixed=False)
    if stage == "advantages":
        return t("advantages", "import_s")
    if stage == "features":
        return t("features", "import_s") + t("features", "model_load_s", weights)
    return (
        t("train", "import_s")
        + t("train", "model_load_s", weights)
        + t("train", "deepspeed_init_s", weights)
        + t("train", "optimizer_load_s", optimizer_bytes)
        + t("train", "optimizer_save_s", optimizer_bytes)
        + t("train", "policy_save_s", weights)
    )


def worker_startup(fits: dict, stage: str, n_params: int, optimizer_bytes: float) -> float:
    """Extrapolated start-up of one job of ``stage`` served by a warm worker (docs/workers.md): no
    interpreter, import, engine build or DeepSpeed initialisation; the generation and features
    workers copy a new policy's weights into their resident module (the read of the weights, the
    per-GB part of a model load), the train worker goes on with its engine and AdamW state and
    writes the next policy; the AdamW state it writes after the job returned (``background_write``).
    The advantages job has no worker."""
    weights = 4 * n_params

    def t(st: str, step: str, nbytes: float = 0.0, fixed: bool = True) -> float:
        f = fits[(st, step)]
        return (f["fixed_s"] if fixed else 0.0) + f["s_per_gb"] * nbytes / 1e9

    if stage in ("rollout", "features"):
        return t("features", "model_load_s", weights, fixed=False)
    if stage == "advantages":
        return t("advantages", "import_s")
    return t("train", "policy_save_s", weights)


def background_write(fits: dict, optimizer_bytes: float) -> float:
    """The train worker's write of the AdamW state after its job returned (extrapolated as the
    job's own write): it overlaps the next iteration's rollout and features."""
    f = fits[("train", "optimizer_save_s")]
    return f["fixed_s"] + f["s_per_gb"] * optimizer_bytes / 1e9


def stage_gpus(shape: str) -> dict[str, int]:
    """GPUs of all the jobs of a stage in one iteration (the shards' together)."""
    lay = LAYOUT[shape]
    return {
        "rollout": SHARDS * lay["rollout_gpus"],
        "features": SHARDS * lay["features_gpus"],
        "train": lay["train_gpus"],
    }


def measured_train_mfu() -> tuple[float, float]:
    """(lowest, highest) MFU of the train steps in the records ``MFU_RECORDS`` (every step, the
    first of a fresh process and the warm worker's alike)."""
    steps = []
    for name in MFU_RECORDS:
        raw = json.loads((REPO / "benchmarks" / "measured" / f"{name}.json").read_text())["raw"]["mfu"]
        steps += [s["mfu"] for s in raw["cold"] + (raw.get("warm") or [])]
    return min(steps), max(steps)


def mfu_ranges() -> dict[str, tuple[float, float]]:
    """(low, high) MFU per GPU stage: rollout and features assumed, train measured."""
    return {**ASSUMPTIONS["mfu"], "train": measured_train_mfu()}


def forward_flops(n_params: int, hf: dict, context: float) -> float:
    """Forward FLOPs of one token that attends to ``context`` tokens: 2 per weight it multiplies
    (every parameter but an untied input embedding, a lookup) and, per layer, 2 context d for the
    attention logits and 2 context d for their weighted sum (Hoffmann et al. 2022, appendix F;
    Kaplan et al. 2020 count the logits only)."""
    lookup = 0 if hf.get("tie_word_embeddings") else hf["vocab_size"] * hf["hidden_size"]
    return 2 * (n_params - lookup) + 4 * hf["num_hidden_layers"] * context * hf["hidden_size"]


def attention_share(shape: str, context: float) -> float:
    """The share of attention over the context in a token's forward FLOPs (``forward_flops``)."""
    hf = shape_config(shape)
    n = count_parameters(hf)
    return 1 - forward_flops(n, hf, 0) / forward_flops(n, hf, context)


def work_seconds(shape: str, n_params: int) -> dict[str, tuple[float, float]]:
    """(fastest, slowest) work of one job per stage, over the MFU ranges."""
    hf = shape_config(shape)
    responses = PROMPTS * GROUP
    mid = PROMPT_TOKENS + RESPONSE / 2  # a response token's mean context
    decode = responses * RESPONSE * forward_flops(n_params, hf, mid)
    prefill = PROMPTS * PROMPT_TOKENS * forward_flops(n_params, hf, PROMPT_TOKENS / 2)  # once per prompt (prefix cache)
    teacher = responses * (
        PROMPT_TOKENS * forward_flops(n_params, hf, PROMPT_TOKENS / 2) + RESPONSE * forward_flops(n_params, hf, mid)
    )
    flops = {"rollout": decode + prefill, "features": teacher, "train": 3 * teacher}
    gpus = stage_gpus(shape)
    peak = ASSUMPTIONS["peak_tflops"] * 1e12
    mfu = mfu_ranges()
    return {s: (f / (gpus[s] * peak * mfu[s][1]), f / (gpus[s] * peak * mfu[s][0])) for s, f in flops.items()}


# ------------------------------------------------------------------------------------------
# The document
# ------------------------------------------------------------------------------------------


def span(lo: float, hi: float, fmt: str = "{:.0f}") -> str:
    a, b = fmt.format(lo), fmt.format(hi)
    return a if a == b else f"{a}–{b}"


def render(measured: dict, jobs: dict[str, int]) -> str:
    m = measured["machine"]
    model = startup_model(measured)
    L: list[str] = []
    add = L.append
    add("# What a long run costs: jobs, disk, start-up (a model on paper)\n")
    add(
        "Written by `python benchmarks/scale.py` (do not edit by hand; `--check` is run by the tests). "
        f"The run: Qwen2.5-shaped policies, {PROMPTS} prompts × {GROUP} samples per iteration, "
        f"{RESPONSE:,}-token responses (the limit: every figure below is an upper bound for shorter ones), "
        f"{PROMPT_TOKENS}-token prompts, {ITERATIONS} iterations, {SHARDS} rollout shards, evaluation every "
        f"{EVALUATE_EVERY}th policy, `train.bf16: true`. Disk and jobs come from otbflow's own code (the disk "
        "estimate, Snakemake's plan); start-up was measured on CPU for two small shapes and is extrapolated; "
        "GPU work is FLOPs over a throughput: the train step's as measured on one H100 at the 0.5B shape, "
        "the rollout's and the features pass's assumed.\n"
    )
    add("## Jobs\n")
    add(
        f"Snakemake's plan of the whole run (`snakemake -n --config iterations={ITERATIONS} "
        f"'shard={{n_shards: {SHARDS}}}' 'evaluate={{every: {EVALUATE_EVERY}}}'`; the shape changes no job):\n"
    )
    add("| rule | jobs | sbatch, ungrouped | sbatch, grouped |\n| --- | ---: | ---: | ---: |")
    plain, grouped = submissions(jobs, False), submissions(jobs, True)
    for rule, n in jobs.items():
        if rule == "all":
            continue
        g = grouped.get(rule, "in the group" if rule in GROUPED else 0)
        add(f"| {rule} | {n} | {plain.get(rule, 0)} | {g} |")
    group_name = "+".join(GROUPED)
    add(f"| {group_name} (one group job per iteration) | | | {grouped[group_name]} |")
    tp, tg = sum(plain.values()), sum(grouped.values())
    add(f"| **total** | **{sum(n for r, n in jobs.items() if r != 'all')}** | **{tp}** | **{tg}** |\n")
    add(
        f"Per iteration: {tp / ITERATIONS:.1f} sbatch submissions ungrouped, {tg / ITERATIONS:.1f} grouped. "
        "`prune` runs in the head process (a local rule), the rollout shards of an iteration go out as one "
        "job array (`slurm-array-jobs`), and the bootstrap job is not counted (a real model, `model.path`, "
        "needs none). Grouping puts the features shards, the advantages and the train job of an iteration in "
        "one Slurm job: the rollouts stay outside it, so at `rollout.staleness ≥ 1` the next rollouts still "
        "run while the group trains. Inside the group job the members run one after another (the Slurm "
        "executor plugin's group jobs run one job at a time), each still its own process: grouping saves "
        "queue waits, not start-up, and the features shards no longer run side by side.\n"
    )
    add("## Disk\n")
    add(
        "`otbflow disk` (`otbflow.ops.disk.estimate`): policy 2 B/parameter (published in bf16: `model.dtype: "
        "bfloat16` with `train.bf16`; fp32 otherwise, 4 B), optimizer state 14 B/parameter "
        "(ZeRO-1/2, bf16) or 12 (ZeRO-3), the data tables' per-token widths (uncompressed: an upper bound). "
        "`policy_every: 0` keeps every policy; the last `staleness + 1` policies are always kept.\n"
    )
    add(
        "| shape | parameters | retention (policy_every, optimizer) | end, s = 0 | peak, s = 0 | end, s = 1 "
        "| peak, s = 1 |"
    )
    add("| --- | ---: | --- | ---: | ---: | ---: | ---: |")
    n_params, default_vs_all = {}, {}
    for shape in LAYOUT:
        n_params[shape] = count_parameters(shape_config(shape))
        for every, opt in RETENTION:
            e0 = estimate(
                load_config(DEFAULT_CONFIG, overrides(shape, every, opt, 0)), n_params[shape], None, PROMPT_TOKENS
            )
            e1 = estimate(
                load_config(DEFAULT_CONFIG, overrides(shape, every, opt, 1)), n_params[shape], None, PROMPT_TOKENS
            )
            if (every, opt) in ((0, "all"), (10, "last")):
                default_vs_all.setdefault(shape, [0, 0])[(every, opt) == (0, "all")] = e0["bytes"]["final"]
            name = {(0, "all"): "keep everything", (10, "last"): "10, last (default)"}.get(
                (every, opt), f"{every}, {opt}"
            )
            add(
                f"| {shape} | {n_params[shape] / 1e9:.2f} B | {name} | {gib(e0['bytes']['final'])} | "
                f"{gib(e0['bytes']['peak'])} | {gib(e1['bytes']['final'])} | {gib(e1['bytes']['peak'])} |"
            )
    add("")
    add(
        f"The AdamW state written every iteration (`train.optimizer_every: 1`, the default without a train "
        f"worker) or every 5th (`null`'s value with Slurm train workers, `otbflow.runtime.adamw`), default "
        f"retention, s = 0, per {ITERATIONS} iterations: the states written are the disk's write traffic; "
        "with N = 5 the two newest checkpoints are kept (a longer run's first jobs read them), one state more "
        "at the end.\n"
    )
    add("| shape | N | AdamW states written | bytes written | end | peak |")
    add("| --- | ---: | ---: | ---: | ---: | ---: |")
    for shape in LAYOUT:
        for n in (1, 5):
            cfg = load_config(DEFAULT_CONFIG, [*overrides(shape), f"train.optimizer_every={n}"])
            e = estimate(cfg, n_params[shape], None, PROMPT_TOKENS)
            add(
                f"| {shape} | {n} | {e['optimizer_writes']} | {gib(e['bytes']['optimizer_written'])} | "
                f"{gib(e['bytes']['final'])} | {gib(e['bytes']['peak'])} |"
            )
    add("")
    add("## Start-up per job\n")
    add(
        f"Measured by `{measured['command']}` on {m['cpu']} ({m['cores']} cores, {m['threads']} threads per job, "
        f"torch {m['torch']}, {measured['date'][:10]}; page cache hot; load average "
        f"{measured['load_average_before'][0]:.1f} before, {measured['load_average_after'][0]:.1f} after), "
        "each step in a fresh process. Default: the default config's built model; 0.5B: a random "
        "Qwen2.5-0.5B-shaped model saved in fp32. A step that moves bytes (model load, DeepSpeed "
        "initialisation, optimizer state, policy written) is extrapolated as fixed + seconds per GB × GB "
        "through these two points; imports are fixed. DeepSpeed is initialised as the default config does "
        "(ZeRO-0, fp32, one rank, on CPU: no NCCL, no copy to a GPU, no partitioning), so its figure is a "
        "lower bound for a multi-rank GPU job. The machine was not idle (the load averages above, on "
        f"{m['cores']} cores) and each step ran once, so the two-point slopes are noisy: reading the same fp32 "
        f"weights took {model[('features', 'model_load_s')]['s_per_gb']:.2f} s per GB in the features job and "
        f"{model[('train', 'model_load_s')]['s_per_gb']:.2f} in the train job.\n"
    )
    add("| stage | step | default (s) | 0.5B (s) | fixed (s) | s per GB | scales with |")
    add("| --- | --- | ---: | ---: | ---: | ---: | --- |")
    for (stage, step), f in model.items():
        add(
            f"| {stage} | {step.removesuffix('_s')} | {f['t_small']:.2f} | {f['t_large']:.2f} | {f['fixed_s']:.2f} | "
            f"{f['s_per_gb']:.2f} | {'CPU only: not extrapolated' if step == 'engine_build_s' else f['bytes']} |"
        )
    add("")
    add(
        "Extrapolated per job at scale: every train rank loads the whole fp32 policy, initialises "
        "DeepSpeed, reads and writes the optimizer state's module weights whole and its 1/ranks share of "
        "the rest (ZeRO-3: a share of all; the ranks in parallel, each at the rate measured here), and "
        "rank 0 writes the next policy. The rollout job's figure is vLLM's import plus reading the weights "
        "at the features job's rate, plus at most a cited GPU compile (below): on CPU the build profiles "
        "and compiles the model on the CPU (the table's last row, "
        f"{model[('vllm', 'engine_build_s')]['t_small']:.0f} s even for the default's "
        f"{measured['shapes']['default']['parameters'] / 1e6:.1f} M parameters), which says nothing about a GPU "
        "build (torch.compile for the "
        "GPU and CUDA-graph capture; its compile cache, `~/.cache/vllm/torch_compile_cache`, keyed by config "
        "and code rather than weights, lets a shared cache folder spare later iterations the compilation). "
        "One public report gives the order of a GPU build: an NVFP4-quantised 35B MoE model (about 20 GB) "
        "on one DGX Spark from local NVMe, vLLM, reading the weights about 142 s and torch.compile about "
        f"{CITED_BUILD['compile_s']:.0f} s of a cold start over five minutes ({CITED_BUILD['source']}). The "
        "rollout rows below range from no compile (a warm compile cache) to that compile added; CUDA-graph "
        "capture and the memory profiling are in neither end, and the train rows are lower bounds (the "
        "DeepSpeed initialisation above). "
        "Loads are from a hot page cache; reading "
        "cold from a shared filesystem adds the bytes over its bandwidth (7B: "
        f"{4 * n_params['qwen2.5-7b'] / 1e9:.0f} GB of fp32 weights, "
        f"{2 * n_params['qwen2.5-7b'] / 1e9:.0f} s at 2 GB/s). "
        "Each figure is one run of the benchmark, not repeated.\n"
    )
    add("## Start-up against work, per iteration\n")
    mfu = mfu_ranges()
    mid = PROMPT_TOKENS + RESPONSE / 2  # a response token's mean context (work_seconds)
    add(
        f"Work of one job on {ASSUMPTIONS['gpu']}s at {ASSUMPTIONS['peak_tflops']:.0f} TFLOP/s (dense bf16) × MFU: "
        f"rollout {mfu['rollout'][0]}–{mfu['rollout'][1]} (decoding), features {mfu['features'][0]}–"
        f"{mfu['features'][1]} (both assumed, not measured), train {span(*mfu['train'], '{:.3f}')} (measured: "
        "the train step on one H100 at the 0.5B shape, 512 sequences of about 200 tokens, ZeRO-1, bf16, "
        "from the first step of a fresh process to a warm worker's; "
        + " and ".join(f"docs/measurements.md#{r}" for r in MFU_RECORDS)
        + "). That MFU counts 6 · parameters per token, where the FLOPs here add attention over the context "
        f"(at the 0.5B shape {100 * attention_share('qwen2.5-0.5b', 100):.0f}% of them at the measured steps' "
        f"mean context of about 100 tokens, {100 * attention_share('qwen2.5-0.5b', mid):.0f}% at this run's "
        f"{mid:,.0f}): applied to them, the train rows assume attention runs at the rest's MFU. The larger shapes' "
        "wider matrix products usually run at a higher MFU than this small shape's, so their train rows are "
        "likely upper bounds. GPUs per job: "
        + "; ".join(
            f"{s}: rollout {lay['rollout_gpus']}, features {lay['features_gpus']}, "
            f"train {lay['train_gpus']} (ZeRO-{lay['zero_stage']})"
            for s, lay in LAYOUT.items()
        )
        + ". The advantages job is CPU work (its estimator runs at tens of millions of tokens/s, "
        "`benchmarks/bench_advantages.py`; its Parquet I/O at this size is not measured): only its start-up is given.\n"
    )
    add("| shape | stage | start-up per job (s) | work per job (s) | start-up share | start-up GPU-s per iteration |")
    add("| --- | --- | ---: | ---: | ---: | ---: |")
    periods = {}
    for shape, lay in LAYOUT.items():
        n = n_params[shape]
        cfg = load_config(DEFAULT_CONFIG, overrides(shape))
        opt_bytes = optimizer_bytes_per_parameter(cfg.train) * n
        rank_bytes = rank_optimizer_bytes(n, opt_bytes, lay["train_gpus"], lay["zero_stage"], cfg.train.bf16)
        work = work_seconds(shape, n)
        gpus = stage_gpus(shape)
        path = {}
        for stage in ("rollout", "features", "advantages", "train"):
            s = job_startup(model, stage, n, rank_bytes)
            if stage == "advantages":
                add(f"| {shape} | advantages | {s:.1f} | not modelled (CPU) | | 0 |")
                path[stage] = (s, s)
                continue
            lo, hi = work[stage]
            path[stage] = (s + lo, s + hi)
            top = s + (CITED_BUILD["compile_s"] if stage == "rollout" else 0)  # the cited compile
            at_least = "≥ " if stage in ("rollout", "train") else ""  # graph capture; DeepSpeed on GPUs
            share = span(100 * s / (s + hi), 100 * top / (top + lo))
            add(
                f"| {shape} | {stage} | {at_least}{span(s, top)} | {span(lo, hi)} | {at_least}{share} % | "
                f"{at_least}{span(s * gpus[stage], top * gpus[stage], '{:,.0f}')} |"
            )
        periods[shape] = path
    add("")
    add("## With warm workers\n")
    add(
        "Warm workers (`otbflow worker`, docs/workers.md) keep the imports, the policy and the train job's "
        "DeepSpeed engine with its AdamW state between jobs; a job then pays only what moves: the generation "
        "and features workers read each new policy's weights into their resident module, the train worker "
        "writes the next policy (it no longer reads it back, nor the AdamW state) and writes the AdamW state "
        "after the job returned, while the next iteration's rollout and features run (the last column: it "
        "delays the next train job only where it takes longer than they do). Start-up per job, "
        "extrapolated as above (rollout: its engine, vLLM's too, is built once per worker and takes each new "
        "policy's weights in place), and what the workers cost: each holds its GPUs for "
        "the whole run, so at `rollout.staleness: 0`, where the stages run one after another, the GPUs of the "
        "kinds not running sit idle for the rest of the iteration (per iteration, at the slow end of the work "
        "ranges above):\n"
    )
    add(
        "| shape | stage | start-up per job (s) | with a worker (s) | GPUs held "
        "| held idle at s = 0 (GPU-s per iteration) | AdamW write in the background (s) |"
    )
    add("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for shape, lay in LAYOUT.items():
        n = n_params[shape]
        cfg = load_config(DEFAULT_CONFIG, overrides(shape))
        opt_bytes = optimizer_bytes_per_parameter(cfg.train) * n
        rank_bytes = rank_optimizer_bytes(n, opt_bytes, lay["train_gpus"], lay["zero_stage"], cfg.train.bf16)
        work = work_seconds(shape, n)
        gpus = stage_gpus(shape)
        warm = {st: worker_startup(model, st, n, rank_bytes) for st in ("rollout", "features", "advantages", "train")}
        iteration = sum(warm[st] + (work[st][1] if st in work else 0.0) for st in warm)
        for stage in ("rollout", "features", "train"):
            busy = warm[stage] + work[stage][1]
            add(
                f"| {shape} | {stage} | {job_startup(model, stage, n, rank_bytes):.1f} | {warm[stage]:.1f} | "
                f"{gpus[stage]} | {gpus[stage] * (iteration - busy):,.0f} | "
                + (f"{background_write(model, rank_bytes):.1f} |" if stage == "train" else "— |")
            )
    add(
        "\nThe idle GPU-seconds are the price of the warm state at s = 0; at s ≥ 1 the rollout workers generate "
        "while the chain trains, and the idle time is that of the shorter side. A stage's workers can share "
        "GPUs with another's where memory allows. A train job of several processes (`resources.train.tasks` "
        "> 1) runs on a train worker of as many ranks, each keeping its engine and AdamW shard (docs/workers.md).\n"
    )
    add("## Iteration time: what staleness and grouping change\n")
    add(
        "Per iteration, each job taking start-up (the lower end) + work (the ranges above), Q the queue "
        "wait of one Slurm submission on the critical path. At `rollout.staleness: 0` an iteration waits "
        "for rollout, features, advantages and train in turn; at s ≥ 1 the rollouts run on their own GPUs "
        "while the chain trains, and an iteration takes the longer of the two. Grouping removes the queue "
        "waits inside the chain, "
        f"and runs its {SHARDS} features jobs one after another.\n"
    )
    saved, break_even, idle = {}, {}, {}
    add("| shape | s = 0, ungrouped | s = 0, grouped | s = 1, ungrouped | s = 1, grouped |")
    add("| --- | --- | --- | --- | --- |")
    for shape, p in periods.items():
        chain = [p["features"][i] + p["advantages"][i] + p["train"][i] for i in (0, 1)]
        serial = [SHARDS * p["features"][i] + p["advantages"][i] + p["train"][i] for i in (0, 1)]  # grouped
        s0 = [p["rollout"][i] + chain[i] for i in (0, 1)]
        s0_grouped = [p["rollout"][i] + serial[i] for i in (0, 1)]
        saved[shape] = [min(p["rollout"][i], chain[i]) for i in (0, 1)]
        break_even[shape] = [(s0_grouped[i] - s0[i]) / 2 for i in (0, 1)]  # 2 queue waits saved at s = 0
        lay = LAYOUT[shape]  # the group holds the train job's GPUs through the features shards and advantages
        idle[shape] = [
            (lay["train_gpus"] - lay["features_gpus"]) * SHARDS * p["features"][i]
            + lay["train_gpus"] * p["advantages"][i]
            for i in (0, 1)
        ]
        rollout = span(*p["rollout"])
        add(
            f"| {shape} | {span(*s0)} s + 4Q | {span(*s0_grouped)} s + 2Q | max({rollout} s + Q, "
            f"{span(*chain)} s + 3Q) | max({rollout} s + Q, {span(*serial)} s + Q) |"
        )
    add("")
    add("## What each knob changes\n")
    add(
        "- **Grouping** (`--group-iterations` of otbflow submit, or the slurm/ profile's `groups`): sbatch "
        f"submissions {tp / ITERATIONS:.1f} → "
        f"{tg / ITERATIONS:.1f} per iteration ({tp} → {tg} for the run); two queue waits per iteration instead "
        "of four at s = 0. It saves no start-up (every stage is still its own process in the group job); the "
        "group job holds the largest of its members' resources (the train job's GPUs) for the whole chain, "
        "the features shards run one after another on one of them and the advantages step on none. At s = 0 "
        "it shortens an iteration only where one queue wait Q is longer than half of what the serial features "
        "pass adds: "
        + ", ".join(f"{shape} Q > {span(*(b / 60 for b in break_even[shape]), '{:.1f}')} min" for shape in break_even)
        + ". Meanwhile the GPUs the group job holds beyond what its running member uses sit idle: "
        + ", ".join(f"{shape} {span(*idle[shape], '{:,.0f}')} GPU-s" for shape in idle)
        + " per iteration.\n"
        "- **Retention**: the default keeps "
        + ", ".join(f"{shape} at {100 * d[0] / d[1]:.0f} %" for shape, d in default_vs_all.items())
        + " of keeping everything at the end of the run. The optimizer state is the largest item per "
        "iteration (3.0× the fp32 policy at ZeRO-1 with bf16).\n"
        "- **Staleness**: one more policy kept per unit of s (the peak columns), the same jobs, and an "
        "iteration as long as the longer of rollout and the training chain instead of their sum: it saves the "
        "shorter of the two, "
        + ", ".join(f"{shape} {span(*saved[shape])} s" for shape in saved)
        + " per iteration by the ranges above (before queue waits).\n"
        "- **Memory while the train job loads**: at ZeRO-1/2 every rank loads the whole fp32 policy "
        "(memory-mapped from the checkpoint: page cache that the ranks of a node share) and DeepSpeed moves "
        "the whole module to its GPU, as those stages keep the weights whole on every GPU anyway. At ZeRO-3 "
        "the policy is partitioned while it loads (`deepspeed.zero.Init` through transformers' DeepSpeed "
        "integration; docs/training.md): each GPU keeps its 1/ranks share, "
        + ", ".join(
            f"{shape} {2 * n_params[shape] / lay['train_gpus'] / 1e9:,.1f} GB in bf16 (each module is built whole "
            f"on the GPU and then partitioned: a moment's peak of the largest, the embedding, "
            f"{2 * shape_config(shape)['vocab_size'] * shape_config(shape)['hidden_size'] / 1e9:.1f} GB)"
            for shape, lay in LAYOUT.items()
            if lay["zero_stage"] == 3
        )
        + ", where a whole module would take "
        f"{4 * n_params['qwen2.5-32b'] / 1e9:.0f} GB (fp32) or {2 * n_params['qwen2.5-32b'] / 1e9:.0f} GB "
        "(bf16) of one GPU before it is partitioned. The features pass loads the fp32 policy on the host and "
        "casts it to the trainer's precision there, before the move (`load_policy`): with bf16 its GPU holds "
        f"{2 * n_params['qwen2.5-32b'] / 1e9:.0f} GB at 32B, the host {4 * n_params['qwen2.5-32b'] / 1e9:.0f} GB "
        "while it loads.\n"
        "- **Start-up**: where the rollout engine's build and the train job's optimizer-state read and write "
        "are large against the work, the one-job-per-stage design pays it every iteration; an in-process "
        "trainer pays it once per run.\n"
    )
    return "\n".join(L).rstrip() + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--startup", default=str(STARTUP), help="bench_startup.py's JSON (default: %(default)s)")
    p.add_argument("--out", default=str(DOC), help="the document (default: %(default)s)")
    p.add_argument("--check", action="store_true", help="compare with --out instead of writing it")
    ns = p.parse_args()
    text = render(json.loads(Path(ns.startup).read_text()), planned_jobs())
    if ns.check:
        if Path(ns.out).read_text() != text:
            sys.stderr.write(f"{ns.out} is not what benchmarks/scale.py writes: run it and commit the result\n")
            return 1
        print(f"{ns.out} is up to date")
        return 0
    Path(ns.out).write_text(text)
    print(f"wrote {ns.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
