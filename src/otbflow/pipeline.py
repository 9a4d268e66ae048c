"""The stage table: every stage of the pipeline declared once.

Each ``Stage`` says what the stage does (its CLI help) and which config keys it depends on, in
three classes:

- ``outputs(cfg)``: keys whose value changes the stage's outputs. They are its rerun trigger
  (the rule's ``cfg`` param is a digest of their values) and its ``--help`` epilogue. They may
  depend on the config (the backend, the loss type, the estimator).
- ``execution``: keys the stage reads that change how it runs, never what it writes (threads,
  memory, the interpreter): changing them reruns nothing.
- ``dag``: keys that shape the workflow (which jobs exist, which files they read) rather than
  what one job computes; the Snakefile reads them (tests/test_pipeline.py changes each and
  compares the rules' jobs in the DAG Snakemake builds).

It also holds the defaults of its jobs' resources (``resources``; the config's
``resources.<stage>`` overrides them key by key), and its flags are its module's ``Args``
(``Stage.flags``). The CLI (``otbflow <stage>``), each rule's command, flags, log, threads,
resources and ``cmd``/``cfg``/``code`` params (workflow/rules/common.smk) and the code versions
(``otbflow.runtime.codeversion``: the stage module and everything it imports) come from here, and
tests/test_stage_keys.py runs every stage with a config that records each key read and checks
it against this table. Importing this module imports no torch (the Snakefile imports it).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Callable

from omegaconf import DictConfig, OmegaConf

from otbflow.algorithms.estimators import estimator_parameters, studied, study_keys
from otbflow.algorithms.losses import LOSS_AGGREGATIONS, POLICY_LOSSES
from otbflow.algorithms.lr_schedule import SCHEDULES
from otbflow.algorithms.rollout_is import ROLLOUT_IS_LEVELS
from otbflow.algorithms.shaping import shaping_keys, verifier_keys
from otbflow.config import ConfigError, section_digest
from otbflow.engines import BACKENDS
from otbflow.models.architectures import ARCHITECTURES, TOKENIZERS
from otbflow.models.tasks import TASKS


@dataclass(frozen=True)
class Stage:
    name: str
    """Stage name: module otbflow.stages.<name>, Snakemake rule <name>, CLI otbflow <name with ->."""
    help: str
    """One line: what the stage does (the CLI's help)."""
    outputs: Callable[[DictConfig], list[str]]
    """Config keys that change the stage's outputs (its rerun trigger), for a given config."""
    execution: tuple[str, ...] = ()
    """Config keys read that change how the stage runs, not what it writes."""
    dag: tuple[str, ...] = ()
    """Config keys that shape the workflow around the stage: which jobs its rule has, the files
    each reads and writes, its environment (tests/test_pipeline.py checks them against the DAG
    Snakemake builds)."""
    engine: bool = False
    """Runs the generation engine (rollout.backend): the rollout.python interpreter, its
    environment, and the engine's run-only keys among its execution keys."""
    resources: str | dict = field(default_factory=dict)
    """The defaults of a job's resources (``mem_mb``, ``runtime`` in minutes, ``threads``,
    ``gpu``, ``cpus_per_gpu``; ``tasks``, ``nodes``, ``cpus_per_task`` for a job of several
    processes), which the config's ``resources.<stage>`` overrides key by key; a threads value
    that names a stage takes that stage's threads. A stage's name instead: that stage's resources
    (the variance pool generates as the rollout does). Empty: a local job of the head."""
    rule: bool = True
    """A rule of the run's workflow, in workflow/rules/<name>.smk (the experiment stage is the
    experiment workflow's, workflow/experiment.smk)."""

    def __post_init__(self) -> None:
        if self.engine:  # the engine's keys; the backend also picks the job's environment
            object.__setattr__(self, "execution", (*ENGINE_EXECUTION, *self.execution))
            object.__setattr__(self, "dag", (*self.dag, "rollout.backend"))

    @property
    def command(self) -> str:
        return self.name.replace("_", "-")

    @property
    def module(self) -> str:
        return f"otbflow.stages.{self.name}"

    @cached_property
    def flags(self) -> tuple[Flag, ...]:
        """The flags of ``otbflow <stage>``: the fields of the stage module's ``Args``, read from
        its source (importing a stage module imports torch, and the Snakefile reads these)."""
        source = Path(__file__).parent / "stages" / f"{self.name}.py"
        tree = ast.parse(source.read_text())
        args = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Args")
        return tuple(
            Flag(node.target.id, ast.unparse(node.annotation), node.value is None)
            for node in args.body
            if isinstance(node, ast.AnnAssign)
        )


@dataclass(frozen=True)
class Flag:
    """One field of a stage's ``Args``: ``--name-with-dashes``, its annotation, whether it is required."""

    name: str
    annotation: str
    required: bool

    @property
    def option(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def is_list(self) -> bool:
        return self.annotation.startswith("list[")

    @property
    def is_switch(self) -> bool:
        return self.annotation == "bool"


# ------------------------------------------------------------------------------------------
# Key groups that several stages share
# ------------------------------------------------------------------------------------------


def sampling_engine(cfg: DictConfig) -> list[str]:
    """What the generation engine reads that changes its samples: the backend, the weights' dtype
    and what the backend's registry entry names (otbflow.engines.BACKENDS)."""
    return ["rollout.backend", "model.dtype", *BACKENDS[cfg.rollout.backend].sample_keys]


def rollout_is_keys(cfg: DictConfig) -> list[str]:
    """The rollout IS weights' level, and their truncation where they are on."""
    return ["train.rollout_is", *ROLLOUT_IS_LEVELS.option_keys(cfg.train.rollout_is)]


# The live curves of a job (otbflow.runtime.tracking): how it reports, never what it writes.
TRACKING = ("tracking.tensorboard", "tracking.wandb")
# What decides which iterations write the AdamW state and which one each train job reads
# (otbflow.runtime.adamw.every: train.optimizer_every, null resolved by the run's train worker).
ADAMW = ("train.optimizer_every", "workers.slurm", "workers.train")
# the export job builds the train stage's engine (its DeepSpeed config, the policy wrapper) to read
# the AdamW state in the layout that wrote it
EXPORT_EXECUTION = tuple(
    f"train.{k}"
    for k in ("bf16", "zero_stage", "lr", "weight_decay", "max_grad_norm", "micro_batch_size", "mini_batch_size")
) + ("train.logprob_chunk_size", "train.packing", "train.packing_row_tokens")
# How prompts are rendered for the policy (the chat template).
RENDERING = ["task.chat", "task.system_prompt"]
# The engine's interpreter and resources: read when the engine starts, no effect on its samples.
ENGINE_EXECUTION = ("rollout.python", *dict.fromkeys(k for b in BACKENDS.values() for k in b.run_keys))


def scoring(cfg: DictConfig) -> list[str]:
    """How sampled responses are scored for training: the verifier and the shaping
    (otbflow.algorithms.shaping). Evaluation reads only the verifier's keys."""
    return [*verifier_keys(cfg.task), *shaping_keys(cfg.task)]


def prompt_set(cfg: DictConfig) -> list[str]:
    """The keys that make the prompts: the task's own options (otbflow.models.tasks.TASKS) and its split."""
    common = ["task.seed", "task.name", "task.n_eval"] + (["seed"] if cfg.task.seed is None else [])
    return common + TASKS.option_keys(cfg.task.name)


# ------------------------------------------------------------------------------------------
# The stages
# ------------------------------------------------------------------------------------------


def _bootstrap(cfg: DictConfig) -> list[str]:
    m = cfg.model
    model = ["model.arch", "model.tokenizer", "model.n_layer", "model.n_embd", "model.n_head", "model.n_positions"]
    model += [*TOKENIZERS.option_keys(m.tokenizer), *ARCHITECTURES.option_keys(m.arch)]
    # the held-out checks avoid the eval split, which depends on the whole synthetic prompt set
    keys = ["seed", *model, "bootstrap", *prompt_set(cfg), *RENDERING, "rollout.max_new_tokens"]
    return list(dict.fromkeys(keys))


def _shard(cfg: DictConfig) -> list[str]:
    return [*prompt_set(cfg), "shard.n_shards"]


def _rollout(cfg: DictConfig) -> list[str]:
    r = ["group_size", "prompts_per_iteration", "temperature", "top_p", "min_p", "max_new_tokens", "filter_groups"]
    r += ["max_gen_batches"] if cfg.rollout.filter_groups else []
    r += ["take_newer", "stream"] + (["stale_groups"] if cfg.rollout.stream else [])
    return ["seed", *(f"rollout.{k}" for k in r), "shard.n_shards", *sampling_engine(cfg), *RENDERING, *scoring(cfg)]


def _score(cfg: DictConfig) -> list[str]:
    # the folder by its path: a reward model whose files change in place is not noticed (docs/rewards.md)
    return [f"task.reward_model.{k}" for k in ("path", "weight", "alone", "dtype")]


def _variance_pool(cfg: DictConfig) -> list[str]:
    r = ["temperature", "top_p", "min_p", "max_new_tokens"]
    pool = ["variance.pool_prompts", "variance.pool_size"]
    return ["seed", *pool, *(f"rollout.{k}" for k in r), *sampling_engine(cfg), *RENDERING, *scoring(cfg)]


def _features(cfg: DictConfig) -> list[str]:
    f = ["features.batch_size", "features.chunk_size", "features.vocab_chunk_size", "features.exact_grad_norm"]
    # pi_old at the trainer's precision (train.bf16), not model.dtype (rollout, evaluate)
    return [*f, "rollout.temperature", "rollout.min_p", "train.bf16", *rollout_is_keys(cfg)]


def _advantages(cfg: DictConfig) -> list[str]:
    a = cfg.advantages
    options = {k for name in [*a.compare, a.estimator] for k in estimator_parameters(name)}
    return ["advantages.estimator", "advantages.compare", *sorted(f"advantages.{k}" for k in options)]


def _train(cfg: DictConfig) -> list[str]:
    t = cfg.train
    keys = ["lr", "weight_decay", "mini_batch_size", "micro_batch_size", "logprob_chunk_size", "ppo_epochs"]
    keys += ["loss_type", "loss_agg_mode", "kl_coef", "entropy_coef", "rollout_is", "trm", "lr_schedule"]
    keys += ["lr_warmup_steps", "max_grad_norm", "max_consecutive_skips", "reset_optimizer", "zero_stage", "bf16"]
    keys += ["packing", *(["packing_row_tokens"] if t.packing else [])]
    aggregation = LOSS_AGGREGATIONS[t.loss_agg_mode].options
    keys += [*POLICY_LOSSES[t.loss_type].options, *SCHEDULES[t.lr_schedule].options, *aggregation]
    keys += ROLLOUT_IS_LEVELS[t.rollout_is].options
    other = ["seed", "rollout.temperature", "rollout.min_p", "mismatch.max_k2", "mismatch.mean_k3"]
    if "loss_scale_factor" in aggregation and t.loss_scale_factor == 0:
        other += ["rollout.max_new_tokens"]  # the scale defaults to the longest response (losses.loss_scale)
    if t.bf16 and not t.reset_optimizer:
        other += ["model.dtype"]  # bfloat16: the policy is published in bf16 (policy_folder.publishes_bf16)
    if "lr_decay_steps" in SCHEDULES[t.lr_schedule].options and t.lr_decay_steps == 0:
        other += ["iterations"]  # the decay's horizon; otherwise more iterations keep the finished ones
    return [*(f"train.{k}" for k in dict.fromkeys(keys)), *other]


def _export(cfg: DictConfig) -> list[str]:
    # the fp32 master weights of its input AdamW state, in its layout (check_optimizer_state)
    return []


def _evaluate(cfg: DictConfig) -> list[str]:
    e = ["evaluate.n_samples", "evaluate.temperature", "evaluate.max_new_tokens"]
    return ["seed", *e, *sampling_engine(cfg), *RENDERING, *verifier_keys(cfg.task)]


def _report(cfg: DictConfig) -> list[str]:
    # the front page names the run's settings (otbflow.stages.report.front_page, metadata)
    front = ["seed", "iterations", "advantages.estimator", "train.loss_type", "train.loss_agg_mode"]
    front += ["rollout.backend", "rollout.prompts_per_iteration", "rollout.group_size", "task.name", "task.path"]
    front += ["model.path"] + ([] if cfg.model.path else ["model.arch", "model.n_layer", "model.n_embd"])
    return ["mismatch.max_k2", "mismatch.mean_k3", *rollout_is_keys(cfg), *front]


def _prune(cfg: DictConfig) -> list[str]:
    # what iteration k keeps is decided by the workflow (otbflow.runtime.retention.decision), passed as
    # flags and the rule's per-job rerun trigger: a longer run reruns only the jobs whose decision changed
    return []


def _publish_optimizer(cfg: DictConfig) -> list[str]:
    # renames what the train job wrote, after checking it is of the policy that job published
    return []


def _scaling(cfg: DictConfig) -> list[str]:
    return ["seed", "scaling.max_sequences", "scaling.ci_resamples", "rollout.temperature", "features.chunk_size"]


def _variance(cfg: DictConfig) -> list[str]:
    options = sorted({f"advantages.{k}" for name in studied(cfg) for k in study_keys(name)})
    v = ["group_size", "resamples", "sketch_dim", "estimators"]
    return ["seed", *(f"variance.{k}" for k in v), "rollout.temperature", "features.chunk_size", *options]


# The resources of a job that may run on GPUs (0 by default: the built-in run is on CPU).
GPU_JOB = {"gpu": 0, "cpus_per_gpu": 8, "mem_mb": 8000}

_STAGES = [
    Stage(
        "bootstrap",
        "build and warm-start the tiny policy (skipped when model.path is set)",
        _bootstrap,
        dag=("model.path",),
        resources={"threads": 2, "mem_mb": 4000, "runtime": 60},
    ),
    Stage(
        "shard",
        "split the prompts into train shards and an eval set",
        _shard,
        # a dataset prompt too long for the model's positions is refused (it changes no output)
        execution=("model.path", "model.n_positions"),
        dag=("shard.n_shards", "task.path", "task.eval_path"),  # a dataset task's files are its inputs
        resources={"mem_mb": 2000, "runtime": 30},
    ),
    Stage(
        "rollout",
        "sample G responses per prompt and score them",
        _rollout,
        # rollout.stream: each rollout continues the stream the one before it left
        dag=("iterations", "shard.n_shards", "model.path", "rollout.staleness", "rollout.stream"),
        engine=True,
        resources={**GPU_JOB, "threads": 1, "runtime": 120},
    ),
    Stage(
        "score",
        "score the rollouts with a learned reward model (task.reward_model) and add it to the reward",
        _score,
        execution=("task.reward_model.batch_size",),
        dag=("iterations", "shard.n_shards", "task.reward_model.path"),  # its rule exists with a reward model
        resources={**GPU_JOB, "threads": 1, "runtime": 60},
    ),
    Stage(
        "features",
        "teacher-forced forward pass: log-probs, entropy, sum pi^2, proxy energy, mismatch",
        _features,
        # with a reward model it reads the score stage's table instead of the rollout's; iteration 0
        # reads the initial policy (model.path, else the bootstrap's)
        dag=("iterations", "shard.n_shards", "task.reward_model.path", "model.path"),
        resources={**GPU_JOB, "threads": 1, "runtime": 60},
    ),
    Stage(
        "advantages",
        "baselines and advantages from stored features, plus estimator diagnostics",
        _advantages,
        dag=("iterations", "shard.n_shards"),
        resources={"mem_mb": 4000, "runtime": 30},
    ),
    Stage(
        "train",
        "DeepSpeed policy update producing the next policy",
        _train,
        # a warm worker's in-job checkpoints and AdamW writes outside the outputs (otbflow.runtime.adamw);
        # the staleness bound its rows are checked against (trainer.check_versions)
        execution=("train.checkpoint_every", *ADAMW, "train.optimizer_every_min", *TRACKING, "rollout.staleness"),
        # iteration 0 and the KL term's reference read the initial policy (model.path, else the bootstrap's);
        # which AdamW state each job reads and which updates it replays (otbflow.runtime.adamw)
        dag=("iterations", "train.reset_optimizer", *ADAMW, "train.kl_coef", "model.path"),
        # tasks > 1: DeepSpeed ranks (srun in a Slurm job, torchrun elsewhere); with GPUs one per GPU
        resources={**GPU_JOB, "runtime": 120, "tasks": 1, "nodes": 1, "cpus_per_task": 1},
    ),
    Stage(
        "publish_optimizer",
        "wait for the AdamW state a train job wrote (a warm worker: in the background) and publish it",
        _publish_optimizer,
        dag=("iterations", "train.reset_optimizer", *ADAMW),
        resources={},
    ),
    Stage(
        "export",
        "the run's last policy in fp32, from its AdamW state's master weights (runs publishing bf16)",
        _export,
        # the train stage's layout and engine: its DeepSpeed config is built as the train job's
        execution=EXPORT_EXECUTION,
        # a run that publishes bf16 policies (policy_folder.publishes_bf16), from its last iteration
        dag=("iterations", "train.reset_optimizer", "train.bf16", "model.dtype"),
        resources="train",
    ),
    Stage(
        "prune",
        "apply the retention policy to an iteration's train outputs (delete the weights not kept)",
        _prune,
        # what each iteration keeps (otbflow.runtime.retention.decision: its --keep-* flags), and who reads them first
        dag=(
            "retention.policy_every",
            "retention.optimizer",
            "iterations",
            "rollout.staleness",
            "evaluate.every",
            "shard.n_shards",
            "train.reset_optimizer",
            *ADAMW,
        ),
        resources={},
    ),
    Stage(
        "evaluate",
        "greedy and avg@k accuracy of a policy on held-out prompts",
        _evaluate,
        execution=TRACKING,
        dag=("iterations", "evaluate.every", "model.path"),
        engine=True,
        resources={**GPU_JOB, "threads": 1, "runtime": 60},
    ),
    Stage(
        "report",
        "collect metrics of all iterations and plot them",
        _report,
        # it waits for the prune jobs (the retention policy's, otbflow.runtime.retention.decision)
        dag=(
            "iterations",
            "evaluate.every",
            "shard.n_shards",
            "task.reward_model.path",
            "retention.policy_every",
            "retention.optimizer",
            "rollout.staleness",
            "train.reset_optimizer",
            *ADAMW,
        ),
        resources={"mem_mb": 2000, "runtime": 15},
    ),
    Stage(
        "scaling",
        "exact squared gradient norm vs response length, and the proxy's agreement with it",
        _scaling,
        dag=("shard.n_shards", "model.path"),
        # forward and backward passes, as in features
        resources={"threads": "features", "mem_mb": 8000, "runtime": 60},
    ),
    Stage(
        "variance_pool",
        "sample the variance study's pool: variance.pool_size responses to variance.pool_prompts prompts",
        _variance_pool,
        dag=("model.path",),
        engine=True,
        resources="rollout",
    ),
    Stage(
        "variance",
        "offline variance of the policy gradient per estimator, on resampled groups with exact gradients",
        _variance,
        dag=("model.path",),
        resources={"threads": "features", "mem_mb": 8000, "runtime": 60},
    ),
    Stage(
        "experiment",
        "compare the runs x seeds of an experiment (workflow/experiment.smk): summary table and plots",
        lambda cfg: [],
        rule=False,
    ),
]
STAGES: dict[str, Stage] = {s.name: s for s in _STAGES}
# Read by every job: where outputs go (the Snakefile's paths) and the threads (OTBFLOW_THREADS).
EVERY_STAGE_EXECUTION = ("results_dir",)


def job_resources(cfg: DictConfig, stage: str) -> dict[str, int]:
    """The resources of one job of ``stage``: its entry's defaults, overridden by the config's
    ``resources.<stage>``; ``threads`` (torch's and Snakemake's) is ``cpus_per_task`` for a job of
    several processes, 1 where the stage names none."""
    spec = STAGES[stage].resources
    if isinstance(spec, str):
        return job_resources(cfg, spec)
    own = cfg.resources.get(stage) or {}
    res = {**spec, **{key: value for key, value in own.items() if value is not None}}
    if isinstance(res.get("threads"), str):
        res["threads"] = job_resources(cfg, res["threads"])["threads"]
    return res | {"threads": res.get("cpus_per_task", res.get("threads", 1))}


def check_resources(cfg: DictConfig) -> None:
    """Refuse a ``resources.<name>`` that is no stage with resources of its own, or a key of it
    that the stage has no default for (a CPU-only stage's ``gpu``), naming the key."""
    own = {name: stage.resources for name, stage in STAGES.items() if isinstance(stage.resources, dict)}
    for name, section in cfg.resources.items():
        if not own.get(name):
            stages = ", ".join(n for n, r in own.items() if r)
            raise ConfigError(f"config key 'resources.{name}': no stage of that name has resources (stages: {stages})")
        for key, value in section.items():
            if value is not None and key not in own[name]:
                takes = ", ".join(own[name])
                raise ConfigError(f"config key 'resources.{name}.{key}': the {name} stage's jobs take {takes}")


def by_command(command: str) -> Stage:
    return STAGES[command.replace("-", "_")]


def trigger(cfg: DictConfig, stage: str) -> str:
    """The rule's ``cfg`` param: a digest of the values of the stage's output-changing keys."""
    keys = STAGES[stage].outputs(cfg)
    if unknown := [k for k in keys if OmegaConf.select(cfg, k, default=_ABSENT) is _ABSENT]:
        raise KeyError(f"stage {stage} declares config keys that do not exist: {unknown}")
    return section_digest(cfg, *keys)


_ABSENT = object()
