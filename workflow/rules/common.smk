# Helpers shared by the stage modules (validated config, paths, code versions).
import atexit
import os
import sys
from pathlib import Path
from shlex import quote
from types import SimpleNamespace

from snakemake.utils import validate

import otbflow
from otbflow.runtime.codeversion import code_version
from otbflow.ops.dispatch import KIND_OF
from otbflow.ops.workerjobs import STAGE_OF_KIND, Supervisor, WorkerJob, sbatch_options, site_settings
from otbflow.ops.workerjobs import script as worker_script
from otbflow.pipeline import STAGES, check_resources, job_resources, trigger
from otbflow.config import (
    DEFAULT_CONFIG,
    evaluated_iterations,
    from_snakemake,
    load_config,
    to_container,
    to_yaml,
    validate_workflow,
)
from otbflow.ops.guard import guard as guard_head
from otbflow.ops.jobgroups import size_group_jobs
from otbflow.io import write_text_if_changed
from otbflow.runtime import adamw
from otbflow.runtime.policy_folder import publishes_bf16
from otbflow.runtime.retention import decision as retention_decision, pruned_inputs, refusal as retention_refusal
from snakemake.exceptions import WorkflowError

# Snakemake's `config` holds what --configfile/--config gave (`--config 'rollout={group_size: 8}'`,
# merged section by section; values inside such a mapping arrive as strings). It is layered over the
# default YAML by the same loader every `otbflow <stage>` CLI uses, which types and validates it (errors
# name the key); the typed, resolved config is then checked against the JSON schema.
CFG = load_config(DEFAULT_CONFIG, extra=from_snakemake(config))
validate_workflow(CFG)
check_resources(CFG)
validate(to_container(CFG), workflow.source_path("../schemas/config.schema.json"), set_default=False)
R = CFG.results_dir
# One head per results folder, which it holds while it runs (R/.otbflow-head.json). A killed run
# (kill -9, node failure, its head job requeued) is continued by the same command: once its head
# is gone, its jobs are stopped, its locks removed and its incomplete outputs redone
# (otbflow.ops.guard). Dry runs change nothing. The config's input paths are given for the Slurm
# executor's check (its sbatch --wrap reads $ and backticks in a job's command line as syntax).
guard_head(
    workflow,
    R,
    job_paths=[p for p in (CFG.model.path, CFG.task.path, CFG.task.eval_path, CFG.task.reward_model.path) if p],
)
ITERATIONS = list(range(CFG.iterations))
EVALUATED = evaluated_iterations(CFG)  # evaluate.every; the last iteration always
SHARDS = list(range(CFG.shard.n_shards))
ENV = "../../envs/otbflow.yaml"
# Scheduling priority of features -> advantages -> train, the chain that makes the next policy;
# rollouts one below it (with rollout.staleness >= 1 they can wait), evaluation and the studies 0.
CHAIN_PRIORITY = 2


RESOLVED_CONFIG = f"{R}/config.yaml"


def front_page():
    """The HTML report's description: the report stage's front.rst once the run has written it
    (its path absolute: a relative one would be read beside the Snakefile), else a note that it
    has not."""
    front = os.path.join(R, "report", "front.rst")
    return os.path.abspath(front) if os.path.exists(front) else "workflow/report/workflow.rst"


def write_resolved_config():
    """The resolved config the jobs read, written by the Snakefile's ``onstart`` (real executions
    with jobs to run; not -n, --lint, --summary, --list-changes or --report, which therefore write
    nothing under results/); rewritten only when it changes (no spurious mtimes). Nothing reads it
    to decide what reruns: the rules' ``cfg`` params carry the digests."""
    write_text_if_changed(RESOLVED_CONFIG, to_yaml(CFG))


# Jobs run the same source tree the Snakefile imported, with this interpreter (or the
# environment's `python` under --sdm conda). Every path and interpreter that reaches a shell is
# quoted (shlex.quote here, {input:q}/{output:q}/{log:q}/{params.x:q} in the rules): a results_dir
# or an interpreter path with a space, a quote or $(...) is a name, never shell syntax.
_SRC = str(Path(otbflow.__file__).resolve().parents[1])
_PY = "python" if "conda" in str(workflow.deployment_settings.deployment_method).lower() else sys.executable
PYTHONPATH = f"PYTHONPATH={quote(_SRC)}${{PYTHONPATH:+:$PYTHONPATH}}"


def stage_cmd(stage):
    """Start of the shell command of one stage: the CLI with the resolved config; the engine's
    interpreter (rollout.python) for a stage that generates; for the stages workers run, the worker
    client (otbflow.ops.dispatch), which runs the job itself where no worker does, under a launcher of
    several processes where the stage's resources ask for tasks (train). A function of the job's
    input, which Snakemake counts as derived, not as a rerun trigger: the interpreter, the launcher and the
    checkout's path change how a job runs, never what it writes. Not of its ``threads`` (that
    evaluates every job's resources: half of a long run's dry run); the rules' shell commands pass
    them (OTBFLOW_THREADS={threads})."""
    python = CFG.rollout.python if STAGES[stage].engine else None
    res = job_resources(CFG, stage)
    tasks = res.get("tasks", 1)
    if dispatched(stage):  # the client starts the launcher itself where it runs the job
        cli = f"{PYTHONPATH} {quote(python or _PY)} -m otbflow.ops.dispatch --results {quote(R)} --code {code_version(stage)}"
        if tasks > 1:
            cli += f" --tasks {tasks} --cpus-per-task {res['cpus_per_task']}"
        if on_slurm_workers(stage):  # a local job of the head: waits for a worker, never runs the stage here
            cli += f" --wait-min {CFG.workers.wait_min:g} --threads {stage_threads(stage)}"
    else:
        cli = f"{PYTHONPATH} {quote(python or _PY)} -m otbflow"
    command = f"{cli} {STAGES[stage].command} --config {quote(RESOLVED_CONFIG)}"
    return lambda wildcards, input: command


def stage_threads(stage):
    """The rule's threads: torch's threads of its job (otbflow.pipeline.job_resources)."""
    return job_resources(CFG, stage)["threads"]


def on_slurm_workers(stage):
    """Whether the stage's jobs go to the run's Slurm worker jobs (workers.slurm, and workers of
    its kind asked for): its rule is then a local job of the head that waits for a worker."""
    w = CFG.workers
    return w.slurm and dispatched(stage) and getattr(w, KIND_OF[stage]) > 0


def worker_supervisor():
    """The run's worker jobs (workers.slurm): one WorkerJob per kind its rules hand jobs to, sized
    from its stage's resources and the profile's settings of that rule (otbflow.ops.workerjobs)."""
    kinds = sorted({KIND_OF[stage] for stage in SLURM_WORKER_RULES})
    w, jobs = CFG.workers, []
    for kind in kinds:
        stage = STAGE_OF_KIND[kind]
        res = job_resources(CFG, stage)
        retire_min = max(w.time_min / 2, w.time_min - res["runtime"])
        jobs.append(
            WorkerJob(
                kind=kind,
                count=getattr(w, kind),
                sbatch=sbatch_options(
                    R, kind, SimpleNamespace(**res), site_settings(workflow, stage), w.time_min, Path(R, "logs/workers")
                ),
                # the generation engine's interpreter (rollout.python: vLLM's environment)
                script=worker_script(
                    (kind == "generate" and CFG.rollout.python) or _PY,
                    _SRC,
                    kind,
                    R,
                    w.idle_exit_min * 60,
                    retire_min * 60,
                    res.get("tasks", 1),
                    res.get("cpus_per_task", 1),
                ),
                log_dir=Path(R, "logs/workers"),
            )
        )
    return Supervisor(R, jobs, log=lambda message: print(message, flush=True))


WORKERS = []


def start_slurm_workers():
    """onstart: submit the run's worker jobs and keep them (workers.slurm); refused off Slurm."""
    if not SLURM_WORKER_RULES:
        return
    plugin = getattr(workflow.executor_plugin, "name", "")
    if plugin != "slurm":
        raise WorkflowError(
            f"workers.slurm: the workers are Slurm jobs, and this run's executor is {plugin or 'local'}: "
            "run it with otbflow submit --workers or --workflow-profile slurm, or set workers.slurm: false "
            "(workers started by hand serve any executor: docs/workers.md)"
        )
    supervisor = worker_supervisor()
    supervisor.start()
    WORKERS.append(supervisor)
    atexit.register(stop_slurm_workers)


def stop_slurm_workers():
    """onsuccess, onerror (and at exit): the worker jobs are cancelled."""
    while WORKERS:
        WORKERS.pop().stop()


def dispatched(stage):
    """Whether the stage's jobs go through the worker client (otbflow.ops.dispatch): a job of a kind
    workers run. The client runs the job itself where no worker of its kind (and of its number of
    processes) is live for this results folder: the same outputs either way (docs/workers.md)."""
    return stage in KIND_OF


def stage_trigger(stage):
    """The rule's config trigger: a digest of the keys that change the stage's outputs (otbflow.pipeline)."""
    return trigger(CFG, stage)


def stage_env(stage):
    """The conda environment of a stage: vLLM pins its own torch, so the stages that run the
    generation engine use its environment when it is the backend."""
    return "../../envs/vllm.yaml" if STAGES[stage].engine and CFG.rollout.backend == "vllm" else ENV


def stage_resources(stage):
    """The rule's resources, from its stage's entry (otbflow.pipeline.job_resources): the job's
    runtime grows with each retry (the profile's `retries`: minutes x attempt); a job of several
    processes runs its command itself (`mpi`: it calls srun) with --ntasks, on GPUs one task per GPU."""
    res = job_resources(CFG, stage)
    out = {key: res[key] for key in ("gpu", "cpus_per_gpu", "mem_mb", "tasks", "nodes") if key in res}
    if "runtime" in res:
        out["runtime"] = lambda wildcards, attempt: res["runtime"] * attempt
    if res.get("tasks", 1) > 1:
        out |= {"mpi": "srun"} | ({"tasks_per_gpu": 1} if res["gpu"] else {})
    return out


def stage_log(stage, job):
    """A job's log: logs/<stage>/<job>.log, ``job`` named by the rule's wildcards (iter_{k}_shard_{s})."""
    return f"{R}/logs/{stage}/{job}.log"


def stage_benchmark(stage, job):
    """A job's wall time and memory, as Snakemake measures them: benchmarks/<stage>/<job>.tsv."""
    return f"{R}/benchmarks/{stage}/{job}.tsv"


# Every stage rule's shell command: the stage's CLI (params.cmd) and its flags (params.args).
STAGE_SHELL = "OTBFLOW_THREADS={threads} {params.cmd} {params.args} > {log:q} 2>&1"


def stage_params(stage, trigger=(), **values):
    """The rule's params: the stage's command (``cmd``), its config trigger (``cfg``: a digest of
    the keys that change its outputs), its code version (``code``) and ``args``, the flags of
    ``otbflow <stage>`` (its module's Args, otbflow.pipeline.Stage.flags). Each flag's value is
    the rule's input of that name, else its output of that name, else ``values[name]``: a string
    formatted with the job's wildcards, or a function of them. ``args`` is derived from the job's
    files, so it reruns nothing; the ``values`` named in ``trigger`` are params of their own,
    which rerun the job when they change."""
    return {
        "cmd": stage_cmd(stage),
        "cfg": stage_trigger(stage),
        "code": code_version(stage),
        **{name: values[name] for name in trigger},
        "args": stage_args(stage, values),
    }


def stage_args(stage, values):
    """The ``params.args`` of a stage's rule (stage_params), its flags with every path one shell word."""

    def args(wildcards, input, output):
        files = dict(output.items()) | dict(input.items())
        words = []
        for flag in STAGES[stage].flags:
            if flag.name in files:
                value = files[flag.name]
            elif flag.name in values:
                value = values[flag.name]
                value = value(wildcards) if callable(value) else value
                value = value.format(**wildcards) if isinstance(value, str) else value
            elif flag.required:
                raise WorkflowError(f"the {stage} rule gives no input, output or value for {flag.option}")
            else:
                continue
            if flag.is_switch:
                words += [flag.option] if value else []
            elif value not in ("", [], None):
                words += [flag.option, *(quote(str(v)) for v in (value if isinstance(value, list) else [value]))]
        return " ".join(words)

    return args


# Under workers.slurm the dispatching rules are the head's local jobs (a client that waits).
SLURM_WORKER_RULES = [stage for stage in KIND_OF if on_slurm_workers(stage)]
if SLURM_WORKER_RULES:
    workflow.localrules(*SLURM_WORKER_RULES)
# Slurm group jobs (otbflow submit --group-iterations, the profile's groups:): sized for their members
# run one after another, and refused where they would lose the stale rollouts' overlap or group the
# rules Slurm workers run (otbflow.ops.jobgroups).
size_group_jobs(workflow, CFG.rollout.staleness, SLURM_WORKER_RULES)


def dataset_files():
    """The dataset task's files (task.path, task.eval_path): inputs of the shard, so that editing
    one in place reruns it (its path alone is in the shard's config trigger)."""
    t = CFG.task
    return [p for p in (t.path, t.eval_path) if p] if t.name == "dataset" else []


def initial_policy():
    return CFG.model.path if CFG.model.path else f"{R}/bootstrap/policy"


def start_policy(k):
    """The policy iteration k starts from (pi_prox of its update): the one iteration k-1 trained."""
    return initial_policy() if k == 0 else f"{R}/iter_{k - 1}/train/policy"


def policy_for_iteration(wildcards):
    """Features and train of iteration k use the policy it starts from."""
    return start_policy(int(wildcards.k))


def behaviour_iteration(wildcards):
    """The iteration whose starting policy samples iteration k's rollouts: max(0, k - staleness)."""
    return max(0, int(wildcards.k) - CFG.rollout.staleness)


def policy_for_rollout(wildcards):
    """Iteration k samples from the policy of iteration k - rollout.staleness (k itself when
    on-policy), so that its rollout can run while iterations k-s .. k-1 train."""
    return start_policy(behaviour_iteration(wildcards))


def newer_policies(wildcards):
    """rollout.take_newer: the policies of iterations k - s + 1 .. k, which iteration k's rollout
    takes while it decodes as their train jobs publish them. Not inputs: none need exist when the
    rollout starts (a forced rerun of the rollout is a new sample)."""
    if CFG.rollout.take_newer == "none":
        return []
    return [start_policy(v) for v in range(behaviour_iteration(wildcards) + 1, int(wildcards.k) + 1)]


def stream_output():
    """rollout.stream: what each rollout leaves of its shard's stream for the next (schemas.STREAM)."""
    return {"carry": f"{R}/iter_{{k}}/rollout/stream_{{s}}.parquet"} if CFG.rollout.stream else {}


def stream_carries(wildcards):
    """rollout.stream: every rollout's carry, targets of the run: a run switched to streaming
    finds them missing and reruns its rollouts (Snakemake cannot compare the params of a job
    with an output it has no record of)."""
    return expand(stream_output()["carry"], k=ITERATIONS, s=SHARDS) if CFG.rollout.stream else []


def previous_stream(wildcards):
    """rollout.stream: the rollout of iteration k continues the stream that k - 1's left (none at k = 0)."""
    k = int(wildcards.k)
    return [f"{R}/iter_{k - 1}/rollout/stream_{wildcards.s}.parquet"] if CFG.rollout.stream and k else []


def previous_schedule_state(wildcards):
    """The LR schedule continues from the previous iteration's train stage (none at k = 0)."""
    k = int(wildcards.k)
    return [] if k == 0 else [f"{R}/iter_{k - 1}/train/schedule.json"]


def previous_optimizer_state(wildcards):
    """The AdamW state train job k continues from (otbflow.runtime.adamw.declared): iteration
    k-1's with train.optimizer_every 1, else the second-newest checkpoint before k; none at k = 0,
    with train.reset_optimizer or before that checkpoint."""
    c = adamw.declared(CFG, int(wildcards.k))
    return [] if c is None else [f"{R}/iter_{c}/train/optimizer"]


def replay_inputs(wildcards):
    """What train job k replays where it has no resident engine (train.optimizer_every >= 2,
    otbflow.training.replay): the policy and schedule of its declared state (the initial policy and a
    fresh schedule before the second checkpoint), and the advantages and published policies of the
    iterations after it (only the policies' manifests are read: pruned ones are fine)."""
    k = int(wildcards.k)
    replayed = adamw.replayed(CFG, k)
    if not replayed:
        return {}
    c = adamw.declared(CFG, k)
    return {
        "replay_start": start_policy(replayed[0]),
        "replay_state": [] if c is None else [f"{R}/iter_{c}/train/schedule.json"],
        "replay_advantages": [f"{R}/iter_{j}/advantages/advantages.parquet" for j in replayed],
        "replay_policies": [f"{R}/iter_{j}/train/policy" for j in replayed],
    }


def pending_optimizer_state(wildcards):
    """Where train job k writes the AdamW state for publish_optimizer, where it writes one
    (otbflow.runtime.adamw.writes; not an output: Snakemake would delete it before that job)."""
    k = int(wildcards.k)
    return f"{R}/iter_{k}/train/optimizer.pending" if adamw.writes(CFG, k) else ""


def published_optimizer_states(wildcards):
    """The AdamW states the run writes (otbflow.runtime.adamw.written; retention then prunes the
    ones it does not keep)."""
    return [f"{R}/iter_{k}/train/optimizer" for k in adamw.written(CFG)]


def train_output_readers(wildcards):
    """Every job that reads the policy or the AdamW state iteration k trained: the next
    iteration's features and train, the rollout that samples with it (iteration k+1+staleness),
    its evaluation; the train jobs that declare its AdamW state (and replay from its policy), and
    the publication of the last one's state (a lost one is redone from this one)."""
    k, n = int(wildcards.k), CFG.iterations
    files = [f"{R}/iter_{k + 1}/train/metrics.parquet"] if k + 1 < n else []
    files += [f"{R}/iter_{k + 1}/features/shard_{s}.parquet" for s in SHARDS if k + 1 < n]
    rollout = k + 1 + CFG.rollout.staleness
    files += [f"{R}/iter_{rollout}/rollout/shard_{s}.parquet" for s in SHARDS if rollout < n]
    readers = adamw.readers(CFG, k) if adamw.writes(CFG, k) else []
    files += [f"{R}/iter_{j}/train/metrics.parquet" for j in readers if j != k + 1]
    if readers and adamw.writes(CFG, readers[-1]):
        files += [f"{R}/iter_{readers[-1]}/train/optimizer"]
    return files + ([f"{R}/iter_{k}/eval/summary.parquet"] if k in EVALUATED else [])


def own_optimizer_state(wildcards):
    """The AdamW state iteration k trained, where it writes one (otbflow.runtime.adamw.writes)."""
    return [f"{R}/iter_{wildcards.k}/train/optimizer"] if adamw.writes(CFG, int(wildcards.k)) else []


# Iterations whose train outputs the retention policy prunes (otbflow.runtime.retention): one local
# `prune` job each, once every job that reads them is done.
PRUNED_ITERATIONS = [
    k
    for k, keep in ((k, retention_decision(CFG, k)) for k in ITERATIONS)
    if not (keep.policy and (keep.optimizer or not adamw.writes(CFG, k)))
]


# A run that publishes bf16 policies writes its last one in fp32 too, at its end (the export rule)
EXPORTED = publishes_bf16(CFG)


def refuse_pruned_inputs():
    """Before the first job (onstart): a run whose jobs would read weights the retention policy
    deleted, that none of its jobs makes again, is refused, naming them."""
    found = pruned_inputs(workflow.dag.needrun_jobs())
    if found:
        raise WorkflowError(retention_refusal(found))


def reference_policy(wildcards):
    """The KL term's reference policy (the initial one), only when train.kl_coef > 0."""
    return [initial_policy()] if CFG.train.kl_coef > 0 else []


def policy_by_name(wildcards):
    return initial_policy() if wildcards.policy == "initial" else f"{R}/{wildcards.policy}/train/policy"


def train_state_of_policy(wildcards):
    """The train job's state of an evaluated policy (its optimizer steps and tokens, the live
    curves' axes); none for the initial policy."""
    return [] if wildcards.policy == "initial" else [f"{R}/{wildcards.policy}/train/schedule.json"]


def policy_iteration(wildcards):
    return -1 if wildcards.policy == "initial" else int(wildcards.policy.split("_")[1])
