"""Every Parquet table the pipeline writes: columns, dtypes and meaning.

This module is the single source of truth: stages check their inputs against it
(``otbflow.io.read_table``) and ``docs/schema.md`` is generated from it
(``otbflow schema-doc``; a test keeps the two in sync).

Longer than 700 lines as a catalog: one declaration per table, each read alone; cut, it would scatter.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import polars as pl

F32L = pl.List(pl.Float32)
I64L = pl.List(pl.Int64)


@dataclass(frozen=True)
class TableSchema:
    name: str
    where: str
    doc: str
    columns: dict[str, pl.DataType]
    meaning: dict[str, str]
    optional: frozenset[str] = frozenset()
    ragged: dict[str, str] = field(default_factory=dict)
    """per-token list column -> the column its length must match."""

    def extend(
        self,
        name: str,
        where: str,
        doc: str,
        cols: list[tuple[str, pl.DataType, str]],
        ragged: dict[str, str] | None = None,
        optional: tuple[str, ...] = (),
    ) -> "TableSchema":
        columns = dict(self.columns) | {c: t for c, t, _ in cols}
        meaning = dict(self.meaning) | {c: m for c, _, m in cols}
        return TableSchema(
            name, where, doc, columns, meaning, self.optional | frozenset(optional), dict(self.ragged) | (ragged or {})
        )

    def present(self, available: list[str]) -> list[str]:
        """The table's columns in order, optional ones only where ``available``."""
        return [c for c in self.columns if c not in self.optional or c in available]

    @property
    def floats(self) -> list[str]:
        """The float columns and per-token float list columns (``otbflow.io.check_finite``)."""
        return [c for c, t in self.columns.items() if t in (pl.Float32, pl.Float64, F32L, pl.List(pl.Float64))]

    @property
    def required(self) -> dict[str, pl.DataType]:
        """The columns every such table has (the optional ones left out), with their dtypes."""
        return {c: t for c, t in self.columns.items() if c not in self.optional}


def _table(name, where, doc, cols, optional=(), ragged=None) -> TableSchema:
    return TableSchema(
        name, where, doc, {c: t for c, t, _ in cols}, {c: m for c, _, m in cols}, frozenset(optional), ragged or {}
    )


PROMPTS = _table(
    "prompts",
    "results/data/train/shard_{s}.parquet, results/data/eval.parquet",
    "Prompts with their verifiable answers, split into train shards and one eval set.",
    [
        ("prompt_id", pl.Int64, "stable id of the prompt within its split"),
        ("prompt", pl.String, "raw prompt text (after task.prompt_template; verl layout: the last user message)"),
        (
            "messages",
            pl.String,
            "the prompt as chat messages, a JSON list of {role, content}: one user message "
            "with `prompt`, or verl's messages as given (system messages included); the "
            "chat template renders these (task.chat)",
        ),
        (
            "answer",
            pl.String,
            "reference answer the reward checks against (GSM8K: after '####'; MATH: the "
            "solution's last \\boxed{}; verl: reward_model.ground_truth)",
        ),
        (
            "data_source",
            pl.String,
            "verl's data_source column, else the layout ('arithmetic', 'prompt_answer', 'gsm8k', 'math')",
        ),
        ("split", pl.String, "'train' or 'eval'"),
        ("shard", pl.Int64, "shard index (eval: 0)"),
    ],
)

ROLLOUTS = _table(
    "rollouts",
    "results/iter_{k}/rollout/shard_{s}.parquet",
    "G sampled responses per prompt, scored. Sampling parameters are in the Parquet metadata "
    "(`otbflow.io.read_metadata`).",
    [
        ("iteration", pl.Int64, "RL iteration k that sampled this response"),
        (
            "behaviour_iteration",
            pl.Int64,
            "the iteration whose starting policy sampled it: max(0, k - rollout.staleness); the lag is "
            "iteration - behaviour_iteration",
        ),
        ("shard", pl.Int64, "prompt shard"),
        ("seed", pl.Int64, "seed used for this shard's sampling"),
        ("prompt_id", pl.Int64, "prompt id (see prompts)"),
        ("group_id", pl.Int64, "group of the G responses to one prompt; unique within an iteration"),
        ("sample_idx", pl.Int64, "index of the response within its group, 0..G-1"),
        ("prompt", pl.String, "raw prompt text (see prompts)"),
        ("answer", pl.String, "reference answer"),
        (
            "prompt_ids",
            I64L,
            "token ids of the rendered prompt the policy saw (the chat template's output when "
            "task.chat resolved to true; metadata: chat, system_prompt)",
        ),
        (
            "response_ids",
            I64L,
            "sampled response token ids, ending with the stop token (metadata: stop_token_ids) when one was generated",
        ),
        ("response_text", pl.String, "decoded response (special tokens removed)"),
        (
            "rollout_logprobs",
            F32L,
            "rollout engine's log-prob of each sampled token under the distribution it was sampled from "
            "(logits / temperature, then the min-p safe set and the top-p nucleus; docs/training.md, 'Log-probs')",
        ),
        ("response_length", pl.Int64, "number of response tokens"),
        ("finish_reason", pl.String, "'stop' (a stop token) or 'length' (hit max_new_tokens)"),
        (
            "reward",
            pl.Float64,
            "the outcome reward that trains: verifiable_reward, shaped where the config says so "
            "(task.reward cosine, task.overlong_buffer; otbflow.algorithms.shaping), plus task.reward_model.weight "
            "* rm_score with a reward model",
        ),
        ("verifiable_reward", pl.Float64, "the verifier's score (task.reward or task.cosine.verifier), unshaped"),
        (
            "rm_score",
            pl.Float64,
            "optional (task.reward_model.path; the score stage's output): the learned reward model's "
            "score of (prompt, response); reward includes task.reward_model.weight times it (is only that "
            "with task.reward_model.alone)",
        ),
        (
            "token_versions",
            I64L,
            "optional (rollout.take_newer): the iteration whose starting policy sampled each response token, "
            "from behaviour_iteration to iteration; rollout_logprobs are under those policies. Absent: every "
            "token is behaviour_iteration's",
        ),
    ],
    optional=("rm_score", "token_versions"),
    ragged={
        "response_ids": "response_length",
        "rollout_logprobs": "response_length",
        "token_versions": "response_length",
    },
)

STREAM = _table(
    "stream",
    "results/iter_{k}/rollout/stream_{s}.parquet",
    "rollout.stream: what the rollout of iteration k left of its shard's stream for the rollout of k+1 "
    "(otbflow.engines.laminar): the trajectories still decoding, with their tokens so far, and the finished "
    "responses of groups it did not take. The metadata's next_slot is the stream's next prompt.",
    [
        ("slot", pl.Int64, "the group's place in the shard's stream of prompts: window * prompts per window + index"),
        ("window", pl.Int64, "the iteration whose window of the shard (select_prompts) the prompt comes from"),
        ("prompt_id", pl.Int64, "prompt id (see prompts)"),
        ("sample_idx", pl.Int64, "index of the response within its group, 0..G-1"),
        ("key", pl.Int64, "the row's 63-bit noise key (derive_seed(window's rollout seed, 'row', index, sample_idx))"),
        ("prompt_ids", I64L, "token ids of the rendered prompt"),
        ("response_ids", I64L, "the response's tokens so far"),
        ("rollout_logprobs", F32L, "each token's log-prob under the policy that sampled it"),
        ("token_versions", I64L, "the iteration whose starting policy sampled each token"),
        ("response_length", pl.Int64, "number of response tokens so far"),
        ("finish_reason", pl.String, "'stop' or 'length' once finished; '' while decoding"),
        (
            "completed",
            pl.Int64,
            "the order in which its group finished in the stream (the first complete groups are taken first); "
            "-1 while a response of the group is decoding",
        ),
    ],
    ragged={
        "rollout_logprobs": "response_length",
        "token_versions": "response_length",
        "response_ids": "response_length",
    },
)

FEATURES = ROLLOUTS.extend(
    "features",
    "results/iter_{k}/features/shard_{s}.parquet",
    "Rollouts plus one teacher-forced forward pass of the training model (temperature-scaled "
    "logits, as in the rollout).",
    [
        ("logprobs", F32L, "trainer log pi(y_t) of each sampled token (pi_old)"),
        ("entropy", F32L, "entropy of the trainer's next-token distribution"),
        ("sum_pi_sq", F32L, "sum_v pi_v^2 of the trainer's distribution, via logsumexp"),
        ("proxy", F32L, "Logit-Gradient Proxy energy max(0, 1 - 2 pi + sum_pi_sq) = ||e_y - p||^2"),
        ("log_ratio", F32L, "log r = logprobs - rollout_logprobs (trainer vs rollout engine)"),
        ("k1", F32L, "k1 = -log r"),
        ("k2", F32L, "k2 = (log r)^2 / 2"),
        ("k3", F32L, "k3 = r - 1 - log r (log r clamped to +-20); E_rollout[k3] = KL(rollout || trainer)"),
        ("seq_mean_k1", pl.Float64, "mean over tokens of k1"),
        ("seq_max_k2", pl.Float64, "max over tokens of k2 (TRM's max criterion)"),
        ("seq_mean_k3", pl.Float64, "mean over tokens of k3 (TRM's average criterion)"),
        ("log_ppl_abs_diff", pl.Float64, "|mean_t logprobs - mean_t rollout_logprobs| (TRM's PPL gap)"),
        (
            "pruned_fraction",
            pl.Float64,
            "optional (rollout.min_p > 0): mean over tokens of the fraction of the vocabulary outside the "
            "trainer's safe set; logprobs, entropy, sum_pi_sq and proxy are then those of the pruned, "
            "renormalised pi_S",
        ),
        (
            "pruned_mass",
            pl.Float64,
            "optional (rollout.min_p > 0): mean over tokens of the mass pi gives the pruned tokens, 1 - sum_{V_S} pi",
        ),
        (
            "forced_tokens",
            pl.Int64,
            "optional (rollout.min_p > 0): sampled tokens outside the trainer's safe set, force-included in it "
            "(the hazard of algorithms.md §5.2: the rollout engine's safe set held them)",
        ),
        ("grad_sq_norm", pl.Float64, "optional (features.exact_grad_norm): exact ||grad_theta sum_t log pi(y_t)||^2"),
        (
            "is_weights",
            F32L,
            "optional (train.rollout_is token or sequence): truncated rollout IS weight "
            "min(rho, train.rollout_is_threshold), rho = exp(logprobs - rollout_logprobs) per token, "
            "or exp(sum_t of it) broadcast to the sequence; OTB weights its energy by it squared",
        ),
    ],
    ragged={
        c: "response_length"
        for c in ("logprobs", "entropy", "sum_pi_sq", "proxy", "log_ratio", "k1", "k2", "k3", "is_weights")
    },
    optional=("grad_sq_norm", "is_weights", "pruned_fraction", "pruned_mass", "forced_tokens"),
)

# Any float dtype (Float32 as the features stage writes, Float64 as a user's table may hold).
FLOATL = pl.List(pl.Float64)
WRITTEN_WITH = {"grad_sq_norm": "features.exact_grad_norm"}
"""Optional columns of the features table, each with the boolean config key under which the
features stage writes it (the config refuses an estimator that reads one the run leaves out)."""
VARIANCE_STUDY_COLUMNS = frozenset(ROLLOUTS.columns) | {"logprobs", "sum_pi_sq", "grad_sq_norm"}
"""What the variance study gives every estimator (otbflow.studies.variance_study): the pool's rollout
rows with the initial policy's log-probs, sum_pi_sq and exact squared gradient norms."""

ADVANTAGE_INPUT = _table(
    "advantage input",
    "(any table given to otbflow.algorithms.estimators.compute_advantages)",
    "The columns estimators read (float columns and lists of any float dtype); which optional ones an estimator "
    "needs, it names (otbflow.algorithms.estimators.ESTIMATORS[name].needs).",
    [
        ("group_id", pl.Int64, "prompt group"),
        ("reward", pl.Float64, "outcome reward, finite"),
        ("logprobs", FLOATL, "trainer log-probs of the sampled tokens"),
        ("sum_pi_sq", FLOATL, "sum_v pi_v^2 (OTB; other estimators do not read it)"),
        (
            "loss_mask",
            pl.List(pl.Boolean),
            "optional: false on tokens that are not trained (tool output); required by otb_tir",
        ),
        ("token_rewards", FLOATL, "optional: per-token rewards; the return becomes the reward-to-go"),
        ("is_weights", FLOATL, "optional: truncated rollout IS weights (OTB's energy and P are weighted by them)"),
        ("grad_sq_norm", pl.Float64, "optional: exact per-sequence squared gradient norm (eob)"),
    ],
    ragged={"sum_pi_sq": "logprobs", "loss_mask": "logprobs", "token_rewards": "logprobs", "is_weights": "logprobs"},
    optional=("sum_pi_sq", "loss_mask", "token_rewards", "is_weights", "grad_sq_norm"),
)


ADVANTAGES = FEATURES.extend(
    "advantages",
    "results/iter_{k}/advantages/advantages.parquet",
    "Features of all shards plus the training estimator's per-token advantages and baselines.",
    [
        ("estimator", pl.String, "estimator name that produced advantages"),
        ("advantages", F32L, "per-token advantage A_t (0 on masked tokens)"),
        ("baselines", F32L, "per-token baseline B_t (returns - advantages before masking)"),
    ],
    ragged={"advantages": "response_length", "baselines": "response_length"},
)

COMPARISON = _table(
    "estimator comparison",
    "results/iter_{k}/advantages/comparison.parquet",
    "Variance diagnostics of every estimator in advantages.compare on the same rollouts, all on the "
    "raw-reward scale: an estimator that divides its advantages by a data-dependent scale (std-normalised "
    "GRPO, REINFORCE++'s whitening) enters with advantage x scale = G - baseline (the same baseline, before "
    "the division); its P and E[A^2] as trained are in the *_normalised columns.",
    [
        ("iteration", pl.Int64, "RL iteration"),
        ("estimator", pl.String, "estimator name"),
        (
            "baseline_shift",
            pl.Float64,
            "delta this row used: advantages.baseline_shift for every estimator that "
            "takes one, 0 for reinforce_pp_baseline (its whitening would remove it)",
        ),
        (
            "total_power",
            pl.Float64,
            "P = mean_i W_i * Abar_i^2 (W_i: summed proxy energy; Abar_i: mean raw-scale advantage), times "
            "(mean_t is_weights)^2 per sequence when the features carry is_weights",
        ),
        ("expected_a_squared", pl.Float64, "mean_i Abar_i^2 (raw-reward scale)"),
        ("expected_w", pl.Float64, "mean_i W_i"),
        ("adv_mean", pl.Float64, "mean of per-token raw-scale advantages over valid tokens"),
        ("adv_std", pl.Float64, "std of per-token raw-scale advantages over valid tokens"),
        ("zero_adv_fraction", pl.Float64, "fraction of valid tokens with |A| < 1e-8 (raw scale)"),
        ("baseline_mean", pl.Float64, "mean per-sequence baseline (token-averaged)"),
        ("reward_mean", pl.Float64, "mean reward"),
        ("pessimism", pl.Float64, "reward_mean - baseline_mean (> 0: the baseline is pessimistic)"),
        (
            "normalised",
            pl.Boolean,
            "the estimator, with this row's options, divides its advantages by a data-dependent scale "
            "(declared in its registry entry, otbflow.algorithms.estimators.register)",
        ),
        ("total_power_normalised", pl.Float64, "P of the advantages as trained (normalised); NaN unless normalised"),
        (
            "expected_a_squared_normalised",
            pl.Float64,
            "mean_i Abar_i^2 of the advantages as trained (normalised); NaN unless normalised",
        ),
    ],
)

TRAIN_METRICS = _table(
    "train metrics",
    "results/iter_{k}/train/metrics.parquet",
    "One row per optimizer step of the policy update.",
    [
        ("iteration", pl.Int64, "RL iteration"),
        ("step", pl.Int64, "optimizer step within the iteration"),
        ("loss", pl.Float64, "aggregated policy loss"),
        ("clip_fraction", pl.Float64, "fraction of valid tokens where the PPO clip was active"),
        ("grad_norm", pl.Float64, "global gradient L2 norm before clipping"),
        ("lr", pl.Float64, "learning rate of the step"),
        ("entropy", pl.Float64, "mean token entropy of the current policy"),
        ("approx_kl", pl.Float64, "mean k3 estimate of KL(pi_old || pi_theta) over valid tokens"),
        (
            "max_abs_log_ratio",
            pl.Float64,
            "largest |log pi_theta - log pi_old| over the step's valid tokens (0 "
            "at an iteration's first step: features and train compute log pi alike)",
        ),
        ("kl_ref", pl.Float64, "mean k3 estimate of KL(pi_theta || pi_ref) (0 unless train.kl_coef > 0)"),
        ("is_weight_mean", pl.Float64, "mean truncated rollout IS weight over valid tokens (1: train.rollout_is none)"),
        ("is_weight_max", pl.Float64, "largest rollout IS weight of the step"),
        (
            "trm_acceptance",
            pl.Float64,
            "fraction of the step's sequences inside the TRM trust region "
            "(mismatch.max_k2, mismatch.mean_k3); the rest are masked with train.trm",
        ),
        ("log_ppl_abs_diff", pl.Float64, "mean |log-PPL gap| trainer vs rollout engine of the step's sequences"),
        (
            "pruned_vocab_fraction",
            pl.Float64,
            "mean over the step's valid tokens of the fraction of the vocabulary outside pi_theta's safe set "
            "(rollout.min_p; 0 when off)",
        ),
        (
            "pruned_mass",
            pl.Float64,
            "mean over the step's valid tokens of the probability pi_theta gives the pruned tokens, "
            "1 - sum over the safe set of pi (rollout.min_p; 0 when off)",
        ),
        (
            "forced_tokens",
            pl.Int64,
            "sampled tokens of the step outside pi_theta's safe set, force-included in it (rollout.min_p)",
        ),
        ("tokens", pl.Int64, "valid response tokens in the step (before TRM masking)"),
        ("sequences", pl.Int64, "sequences in the step"),
        ("mean_response_length", pl.Float64, "mean response length of the step (the length_decay trigger's input)"),
        ("proxy1_signal_strength", pl.Float64, "S = grad_norm^2 (verl's variance proxy 1)"),
        ("proxy2_total_power", pl.Float64, "P = mean_i W_i Abar_i^2 over the step's sequences (x mean IS weight^2)"),
        ("proxy3_pure_noise", pl.Float64, "V = max(0, (P - S) / (N - 1))"),
        ("skipped", pl.Boolean, "true: non-finite loss or gradient, no update was made"),
        ("event", pl.String, "what happened at this step: a skip, an LR schedule trigger or halving ('' if nothing)"),
        ("step_time_s", pl.Float64, "wall time of the step"),
        ("nonpad_tokens", pl.Int64, "the step's sequences' prompt and response tokens (padding not counted)"),
        ("tokens_per_s", pl.Float64, "nonpad_tokens / step_time_s"),
        (
            "mfu",
            pl.Float64,
            "model FLOPs utilisation: the step's model FLOPs (otbflow.training.hardware.step_flops: 6 x the "
            "body's parameters x nonpad_tokens + 6 x the output head's x response tokens, 8 for each with a "
            "reference policy) / step_time_s / (the GPUs' dense bf16 peak, otbflow.training.hardware.PEAKS); "
            "NaN on CPU or a GPU not in the table",
        ),
    ],
)

EVAL_SAMPLES = _table(
    "eval samples",
    "results/{policy}/eval/samples.parquet",
    "Every evaluation response: one greedy and evaluate.n_samples sampled per held-out prompt.",
    [
        ("policy", pl.String, "evaluated policy: 'initial' or 'iter_{k}'"),
        ("prompt_id", pl.Int64, "eval prompt id"),
        ("mode", pl.String, "'greedy' or 'sampled'"),
        ("sample_idx", pl.Int64, "sample index (0 for greedy)"),
        ("response_text", pl.String, "decoded response"),
        ("response_length", pl.Int64, "response tokens"),
        ("reward", pl.Float64, "reward of the response"),
    ],
)

EVAL_SUMMARY = _table(
    "eval summary",
    "results/{policy}/eval/summary.parquet",
    "One row: accuracy and length of one policy on the held-out prompts.",
    [
        ("policy", pl.String, "'initial' or 'iter_{k}'"),
        ("iteration", pl.Int64, "-1 for the initial policy, else the iteration that trained it"),
        ("greedy_accuracy", pl.Float64, "mean reward of greedy responses"),
        ("sampled_accuracy", pl.Float64, "avg@k: mean reward over k sampled responses per prompt"),
        ("k", pl.Int64, "samples per prompt for avg@k"),
        ("mean_response_length", pl.Float64, "mean sampled response length (tokens)"),
        ("n_prompts", pl.Int64, "held-out prompts"),
    ],
)

PROGRESS = EVAL_SUMMARY.extend(
    "progress",
    "results/report/progress.parquet",
    "Eval summaries of every evaluated policy in order (evaluate.every), with the token accounting of the run so far.",
    [
        (
            "tokens_generated",
            pl.Int64,
            "rollout tokens generated by all iterations up to this policy, those of groups dynamic sampling "
            "dropped included",
        ),
        ("mean_reward", pl.Float64, "mean rollout reward of the iteration that trained this policy (null: initial)"),
        ("mean_rollout_length", pl.Float64, "mean rollout response length of that iteration"),
        (
            "responses_generated",
            pl.Int64,
            "rollout responses generated by all iterations up to this policy, dropped groups' included (0: initial)",
        ),
    ],
)

METRICS = TRAIN_METRICS.extend(
    "metrics",
    "results/report/metrics.parquet",
    "Train metrics of every iteration, concatenated in order.",
    [("global_step", pl.Int64, "optimizer step counted over all iterations")],
)

SCALING_SEQUENCES = _table(
    "scaling sequences",
    "results/scaling/sequences.parquet",
    "One row per measured response of the length-scaling study (otbflow scaling).",
    [
        ("iteration", pl.Int64, "iteration whose rollouts were measured"),
        ("group_id", pl.Int64, "prompt group"),
        ("sample_idx", pl.Int64, "response index in the group"),
        ("response_length", pl.Int64, "T_i, response tokens"),
        ("reward", pl.Float64, "reward of the response"),
        ("grad_sq_norm", pl.Float64, "exact ||grad_theta sum_t log pi(y_t)||^2 over all parameters"),
        ("w_hat", pl.Float64, "summed proxy energy sum_t (1 - 2 pi_t + sum pi^2)"),
    ],
)

ROLLOUT_SUMMARY = _table(
    "rollout summary",
    "results/report/rollouts.parquet",
    "Per iteration, what its rollout jobs generated and kept (from the rollouts tables and their "
    "metadata): rewards, lengths, tokens, rollout.filter_groups' rounds and dropped groups, rollout.stream's "
    "stale and carried groups, and each token's lag.",
    [
        ("iteration", pl.Int64, "RL iteration"),
        ("mean_reward", pl.Float64, "mean training reward of the kept responses (the rollouts' reward)"),
        ("mean_verifiable_reward", pl.Float64, "mean verifiable reward (rollout accuracy) of the kept responses"),
        ("mean_rollout_length", pl.Float64, "mean length of the kept responses (tokens)"),
        ("mean_rm_score", pl.Float64, "mean learned reward model score of the kept responses (null: no reward model)"),
        ("tokens", pl.Int64, "response tokens generated by the iteration, those of dropped groups included"),
        ("tokens_generated", pl.Int64, "tokens generated by all iterations up to and including this one"),
        ("responses", pl.Int64, "responses generated by the iteration, those of dropped groups included"),
        ("responses_generated", pl.Int64, "responses generated by all iterations up to and including this one"),
        ("groups_kept", pl.Int64, "prompt groups kept for training, over the shards"),
        (
            "groups_dropped",
            pl.Int64,
            "groups dropped by rollout.filter_groups for all-equal verifiable rewards (0 without it)",
        ),
        (
            "groups_stale",
            pl.Int64,
            "rollout.stream: carried groups older than rollout.staleness, dropped or regenerated "
            "(rollout.stale_groups) by the iteration's rollouts (0 without it); responses and tokens count the "
            "dropped ones' and their tokens",
        ),
        (
            "groups_carried",
            pl.Int64,
            "rollout.stream: kept groups that a rollout of an earlier iteration had started (0 without it)",
        ),
        (
            "tokens_by_lag",
            I64L,
            "the kept tokens by lag: entry j counts those sampled by the policy of iteration k - j (token_versions, "
            "else behaviour_iteration)",
        ),
        ("rounds", pl.Int64, "most sampling rounds of one shard's job (1 without rollout.filter_groups)"),
        (
            "shards_short",
            pl.Int64,
            "shards whose job stopped at rollout.max_gen_batches (or the shard's prompts) short of its share",
        ),
        (
            "reward_timeouts",
            pl.Int64,
            "reward calls that ran past the reward's deadline (math: otbflow.algorithms.rewards.MATH_VERIFY_TIMEOUT_S) "
            "and scored 0, over the shards and dynamic sampling's rounds (the rollouts' metadata)",
        ),
    ],
)

MISMATCH = _table(
    "mismatch",
    "results/report/mismatch.parquet",
    "Trainer vs rollout, per iteration (from the features tables): the mismatch dashboard. At lag 0 "
    "it measures the rollout engine against the trainer; at lag >= 1 (rollout.staleness) the behaviour "
    "policy, lag iterations old, against the proximal one: the policy lag plus an engine mismatch "
    "that is then not measured apart.",
    [
        ("iteration", pl.Int64, "RL iteration"),
        ("lag", pl.Int64, "iteration - behaviour_iteration of its rollouts (0: on-policy)"),
        (
            "measures",
            pl.String,
            "'engine' (lag 0: rollout engine vs trainer, same weights) or 'behaviour->proximal' (lag >= 1: "
            "policy lag plus engine mismatch, the latter not measured apart)",
        ),
        ("tokens", pl.Int64, "response tokens"),
        ("log_ratio_mean", pl.Float64, "mean per-token log r = log pi_trainer - log pi_rollout"),
        ("log_ratio_abs_max", pl.Float64, "max |log r| over tokens"),
        ("k3_mean", pl.Float64, "mean token k3: estimate of KL(rollout || trainer)"),
        (
            "truncated_fraction",
            pl.Float64,
            "fraction of tokens whose stored IS weight (features' is_weights: min(pi_old / pi_rollout, "
            "train.rollout_is_threshold), per token or per sequence) is at the threshold; reinforce trains with "
            "pi_theta / pi_rollout instead; NaN with train.rollout_is none",
        ),
        ("log_ppl_abs_diff_mean", pl.Float64, "mean over sequences of the |log-PPL gap| (TRM's PPL gap)"),
        (
            "trm_acceptance",
            pl.Float64,
            "fraction of sequences with max k2 <= mismatch.max_k2 and mean k3 <= mismatch.mean_k3",
        ),
    ],
)

VARIANCE = _table(
    "variance study",
    "results/variance/summary.parquet",
    "Offline variance of the group-averaged policy gradient per estimator (otbflow variance), on "
    "resampled groups of one pool of responses, with exact per-token gradients (CountSketch-compressed).",
    [
        (
            "estimator",
            pl.String,
            "estimator name ('none': REINFORCE, 'eob': the oracle, weights from the same "
            "centred score vectors as g_hat)",
        ),
        (
            "trace_cov",
            pl.Float64,
            "tr Cov of g_hat = (1/N) sum_i sum_t A_it grad log pi over a prompt's "
            "resampled groups, averaged over prompts",
        ),
        ("trace_cov_se", pl.Float64, "standard error of trace_cov over prompts"),
        (
            "trace_cov_diff",
            pl.Float64,
            "paired difference to REINFORCE: mean over prompts of tr Cov_p(g_hat) - "
            "tr Cov_p(g_hat of 'none'), both over the same resampled groups of prompt p",
        ),
        ("trace_cov_diff_se", pl.Float64, "standard error of trace_cov_diff over prompts (0 for 'none')"),
        ("signal", pl.Float64, "||E g_hat||^2 per prompt (Monte-Carlo noise removed), averaged over prompts"),
        ("noise_to_signal", pl.Float64, "trace_cov / signal: scale-free (a self-inclusive baseline shrinks both)"),
        (
            "sq_bias",
            pl.Float64,
            "||E[g_hat - g_hat of REINFORCE]||^2 on the same groups, minus its Monte-Carlo "
            "noise (about 0 for unbiased estimators), averaged over prompts",
        ),
        (
            "sq_bias_noise",
            pl.Float64,
            "the Monte-Carlo noise subtracted from sq_bias: tr Cov(g_hat - g_hat_none) / resamples",
        ),
        ("ratio_to_none", pl.Float64, "trace_cov / trace_cov of REINFORCE"),
    ],
)

EXPERIMENT_SEEDS = _table(
    "experiment seeds",
    "results/<experiment>/seeds.parquet",
    "One row per member (run x seed) of an experiment (otbflow experiment).",
    [
        ("run", pl.String, "run name (config/experiments/*.yaml)"),
        ("seed", pl.Int64, "the member's seed"),
        ("initial_accuracy", pl.Float64, "avg@k of the shared initial policy"),
        ("final_accuracy", pl.Float64, "avg@k after the last iteration"),
        ("final_greedy_accuracy", pl.Float64, "greedy accuracy after the last iteration"),
        (
            "late_gain",
            pl.Float64,
            "avg@k gain over the last analysis.plateau_window iterations, from the last "
            "evaluation at least that many iterations before the final one (NaN: none)",
        ),
        ("min_accuracy", pl.Float64, "lowest avg@k of any evaluated policy of the member"),
        ("target_accuracy", pl.Float64, "analysis.target, the fixed avg@k target"),
        ("reached_target", pl.Boolean, "whether avg@k reached the target at any evaluation"),
        (
            "tokens_to_target",
            pl.Float64,
            "rollout tokens generated when avg@k first reached the target (linear between evaluations; 0: the "
            "initial policy already was there; NaN: never, censored at tokens_generated)",
        ),
        ("tokens_generated", pl.Float64, "rollout tokens generated by all iterations, dropped groups' included"),
        (
            "responses_generated",
            pl.Float64,
            "rollout responses generated by all iterations, dropped groups' included",
        ),
        ("tokens_trained", pl.Float64, "valid tokens in all optimizer steps (x ppo_epochs)"),
        ("final_response_length", pl.Float64, "mean sampled eval response length after the last iteration"),
        (
            "max_length_ratio",
            pl.Float64,
            "largest mean eval response length over the initial one (> 1.5: an explosion, < 0.67: a collapse)",
        ),
        ("max_grad_norm", pl.Float64, "largest finite grad norm of any optimizer step (NaN: none finite)"),
        (
            "nonfinite_steps",
            pl.Int64,
            "optimizer steps whose loss or gradient was not finite (skipped, no update): the instability "
            "signal that max_grad_norm leaves out",
        ),
    ],
)

_T_INTERVAL = "t-interval (`analysis.confidence`; assumes the per-seed values are normally distributed)"

EXPERIMENT_SUMMARY = _table(
    "experiment summary",
    "results/<experiment>/summary.parquet",
    "One row per run of an experiment (otbflow experiment): means over its seeds, with t-intervals over the "
    "seeds (mean +- t_{1-alpha/2, n-1} s / sqrt(n) at `analysis.confidence`, which assume the per-seed values "
    "are normally distributed; by simulation they keep >= 90% coverage for a nominal 95% at 3 and 5 seeds on "
    "bounded, skewed values too).",
    [
        ("run", pl.String, "run name (config/experiments/*.yaml)"),
        ("seeds", pl.Int64, "seeds run"),
        ("initial_accuracy", pl.Float64, "avg@k of the shared initial policy"),
        ("final_accuracy", pl.Float64, "avg@k after the last iteration, mean over seeds"),
        ("final_accuracy_lo", pl.Float64, f"lower end of its {_T_INTERVAL}"),
        ("final_accuracy_hi", pl.Float64, "upper end of that interval"),
        ("final_accuracy_std", pl.Float64, "its std over seeds"),
        ("final_greedy_accuracy", pl.Float64, "greedy accuracy after the last iteration, mean over seeds"),
        ("accuracy_gain", pl.Float64, "final_accuracy - initial_accuracy"),
        ("late_gain", pl.Float64, "avg@k gain over the last analysis.plateau_window iterations, mean over seeds"),
        ("late_gain_lo", pl.Float64, f"lower end of its {_T_INTERVAL}"),
        ("late_gain_hi", pl.Float64, "upper end of that interval"),
        (
            "late_trend",
            pl.String,
            "'plateau': the late_gain interval lies inside +- analysis.plateau_margin (an equivalence test, "
            "each one-sided test at (1 - confidence) / 2); else 'rising' (interval above 0), 'falling' (below 0) "
            "or 'unresolved' (it holds 0 and reaches past the margin: no evidence either way); 'no interval': "
            "under 2 seeds",
        ),
        ("target_accuracy", pl.Float64, "analysis.target, the fixed avg@k target"),
        ("reached_seeds", pl.Int64, "seeds whose avg@k reached the target (of `seeds`)"),
        (
            "tokens_to_target",
            pl.Float64,
            "median over all seeds of the rollout tokens to the target, the seeds that never reached it counted "
            "as more than any (censored); NaN unless more than half of the seeds reached it",
        ),
        ("tokens_to_target_min", pl.Float64, "fewest tokens to the target of a seed that reached it (NaN: none)"),
        ("tokens_to_target_max", pl.Float64, "most tokens to the target of a seed that reached it (NaN: none)"),
        (
            "tokens_generated",
            pl.Float64,
            "rollout tokens generated by all iterations, dropped groups' included, mean over seeds",
        ),
        (
            "responses_generated",
            pl.Float64,
            "rollout responses generated by all iterations, dropped groups' included, mean over seeds",
        ),
        ("tokens_trained", pl.Float64, "valid tokens in all optimizer steps (x ppo_epochs), mean over seeds"),
        ("final_response_length", pl.Float64, "mean sampled eval response length after the last iteration"),
        ("max_length_ratio", pl.Float64, "largest max_length_ratio of any seed"),
        ("min_accuracy", pl.Float64, "lowest avg@k of any seed at any evaluation"),
        ("max_grad_norm", pl.Float64, "largest finite grad norm of any step of any seed"),
        ("nonfinite_steps", pl.Int64, "optimizer steps with a non-finite loss or gradient, summed over seeds"),
    ],
)

EXPERIMENT_PAIRS = _table(
    "experiment pairs",
    "results/<experiment>/pairs.parquet",
    "Paired comparisons of two runs of an experiment over the same seeds (`analysis.pairs`): t-intervals of the "
    "per-seed differences (`analysis.confidence`; they assume the differences are normally distributed). No "
    "sign or permutation test: at 5 seeds their smallest two-sided p-value is 0.0625.",
    [
        ("a", pl.String, "first run"),
        ("b", pl.String, "second run"),
        ("seeds", pl.Int64, "seeds both ran"),
        ("accuracy_diff", pl.Float64, "final avg@k of a minus b, mean over seeds"),
        ("accuracy_diff_lo", pl.Float64, f"lower end of its {_T_INTERVAL}"),
        ("accuracy_diff_hi", pl.Float64, "upper end of that interval"),
        ("a_better_seeds", pl.Int64, "seeds where a ended above b"),
        ("a_first_seeds", pl.Int64, "seeds where a reached the target with fewer tokens than b (or b never did)"),
        ("b_first_seeds", pl.Int64, "seeds where b reached the target with fewer tokens than a (or a never did)"),
        ("neither_seeds", pl.Int64, "seeds where neither reached the target"),
        (
            "undecided_seeds",
            pl.Int64,
            "seeds where both reached it at the same tokens (e.g. both at 0: the initial policy already was "
            "there), or one run ended before the tokens at which the other reached it",
        ),
        (
            "matched_responses",
            pl.Int64,
            "the largest rollout budget in responses generated (dropped groups' included) after which both runs "
            "were evaluated on every seed: the matched_responses_* comparison reads both curves there, without "
            "interpolating (0: no such evaluation; set evaluate.every per run so that one exists; runs with "
            "dynamic sampling generate budgets of their own and rarely have one)",
        ),
        (
            "matched_responses_tokens_a",
            pl.Float64,
            "rollout tokens a had generated at that equal-responses point, mean over seeds (NaN: none)",
        ),
        ("matched_responses_tokens_b", pl.Float64, "rollout tokens b had generated there, mean over seeds"),
        ("matched_responses_diff", pl.Float64, "avg@k of a minus b at that point, mean over seeds"),
        ("matched_responses_diff_lo", pl.Float64, f"lower end of its {_T_INTERVAL}"),
        ("matched_responses_diff_hi", pl.Float64, "upper end of that interval"),
        ("matched_responses_a_better_seeds", pl.Int64, "seeds where a was above b at that point"),
    ],
)

ALL_TABLES = [
    PROMPTS,
    ROLLOUTS,
    STREAM,
    FEATURES,
    ADVANTAGES,
    COMPARISON,
    TRAIN_METRICS,
    EVAL_SAMPLES,
    EVAL_SUMMARY,
    PROGRESS,
    METRICS,
    ROLLOUT_SUMMARY,
    SCALING_SEQUENCES,
    MISMATCH,
    VARIANCE,
    EXPERIMENT_SEEDS,
    EXPERIMENT_SUMMARY,
    EXPERIMENT_PAIRS,
]


def schema_markdown() -> str:
    out = [
        "# Parquet tables",
        "",
        "Generated from `src/otbflow/schemas.py` by `otbflow schema-doc > docs/schema.md`; "
        "every stage checks its inputs against these schemas before it starts work. "
        "Per-token list columns have one entry per response token.",
        "",
    ]
    for t in ALL_TABLES:
        out += [
            f"## {t.name}",
            "",
            f"Path: `{t.where}`",
            "",
            t.doc,
            "",
            "| column | dtype | meaning |",
            "| --- | --- | --- |",
        ]
        out += [f"| `{c}` | `{d}` | {t.meaning[c]} |" for c, d in t.columns.items()]
        out.append("")
    return "\n".join(out)
