"""Features: one teacher-forced forward pass of the training model over stored rollouts, storing
per response token log pi, entropy, sum pi^2, the Logit-Gradient Proxy energy, the trainer/rollout
mismatch (k1, k2, k3) and optionally the exact gradient norm and the rollout IS weights. With
rollout.min_p > 0 all of them are those of the pruned policy pi_S, and each sequence gets its
pruning statistics. Columns, precision and memory: docs/features.md."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import polars as pl
from omegaconf import DictConfig

from otbflow import schemas
from otbflow.algorithms.mismatch import is_weights_column, mismatch_columns
from otbflow.algorithms.vocab_pruning import PRUNING_STATS
from otbflow.io import read_table, write_parquet
from otbflow.models.logits import STAT_COLUMNS, check_head_logits, exact_grad_sq_norms, sequence_token_stats
from otbflow.models.policy import load_policy, set_threads, trainer_dtype
from otbflow.progress import Progress
from otbflow.runtime import resident

log = logging.getLogger("otbflow.features")


@dataclass
class Args:
    rollouts: str
    """Rollouts Parquet (table 'rollouts')."""
    policy: str
    """HF folder of the training model: the policy the iteration starts from, pi_old of its update
    (pi_prox). On-policy it is the one that sampled these rollouts; with rollout.staleness s >= 1
    they were sampled by the policy of iteration k - s (the rollouts' behaviour_iteration) and this
    is the proximal policy of decoupled PPO."""
    out: str
    """Output features Parquet."""


def run(cfg: DictConfig, args: Args) -> None:
    set_threads()
    df = read_table(args.rollouts, schemas.ROLLOUTS)
    resident.LAST_LOAD.clear()
    # pi_old at the trainer's precision (fp32, or DeepSpeed's bf16 cast with train.bf16), so that
    # the first PPO ratio of the train stage is 1; model.dtype is the rollout/evaluate dtype
    model, tok = load_policy(args.policy, "float32", cast_to=trainer_dtype(cfg.train))
    # log pi comes from the output head: refuse logits it cannot reproduce (here at the trainer's
    # precision, 2e-2 at bf16; the train job checks the same policy at fp32, 1e-4)
    check_head_logits(model)
    f = cfg.features
    min_p = cfg.rollout.min_p
    stats: list[dict[str, list[float]]] = []
    progress = Progress(log, "features", df.height, "sequences")
    for start in range(0, df.height, f.batch_size):
        part = df[start : start + f.batch_size]
        stats += sequence_token_stats(
            model,
            part["prompt_ids"].to_list(),
            part["response_ids"].to_list(),
            cfg.rollout.temperature,
            f.chunk_size,
            tok.pad_token_id,
            f.vocab_chunk_size,
            min_p,
        )
        progress.update(part.height)
    df = df.with_columns(*(pl.Series(k, [s[k] for s in stats], dtype=schemas.F32L) for k in STAT_COLUMNS))
    if min_p > 0:
        df = df.with_columns(*pruning_columns(stats))
    if f.exact_grad_norm:
        df = df.with_columns(
            pl.Series(
                "grad_sq_norm",
                exact_grad_sq_norms(
                    model,
                    df["prompt_ids"].to_list(),
                    df["response_ids"].to_list(),
                    cfg.rollout.temperature,
                    tok.pad_token_id,
                    Progress(log, "exact gradient norms", df.height, "sequences"),
                    min_p,
                ),
                dtype=pl.Float64,
            )
        )
    tc = cfg.train
    if tc.rollout_is != "none":
        df = df.with_columns(
            is_weights_column(df["logprobs"], df["rollout_logprobs"], tc.rollout_is, tc.rollout_is_threshold)
        )
    df = mismatch_columns(df).select(schemas.FEATURES.present(df.columns))
    meta = {"temperature": cfg.rollout.temperature, "policy": args.policy, "policy_load": dict(resident.LAST_LOAD)}
    if min_p > 0:
        meta["min_p"] = min_p
    if tc.rollout_is != "none":
        meta |= {"rollout_is": tc.rollout_is, "rollout_is_threshold": tc.rollout_is_threshold}
    write_parquet(df, args.out, metadata=meta)
    if df.height == 0:  # a shard that dynamic sampling left empty (rollout.filter_groups)
        log.warning("no sequences: an empty table written")
        return
    log.info(
        "%d sequences, %d tokens; mean proxy %.4f, mean k3 %.2e, max k2 %.2e",
        df.height,
        df["response_length"].sum(),
        df["proxy"].explode().mean(),
        df["seq_mean_k3"].mean(),
        df["seq_max_k2"].max(),
    )
    if min_p > 0:
        log.info(
            "min_p %.3g: %.4f of the vocabulary pruned per token, pruned mass %.2e, %d sampled tokens force-included",
            min_p,
            df["pruned_fraction"].mean(),
            df["pruned_mass"].mean(),
            df["forced_tokens"].sum(),
        )


def pruning_columns(stats: list[dict[str, list[float]]]) -> list[pl.Series]:
    """The per-sequence pruning columns (schemas.FEATURES) of ``sequence_token_stats``'s per-token
    ``PRUNING_STATS``: the means of the pruned fraction and mass over the sequence's tokens, and
    the count of force-included sampled tokens."""
    fraction, mass, forced = PRUNING_STATS

    def mean(values: list[float]) -> float:
        return sum(values) / len(values) if values else 0.0

    return [
        pl.Series("pruned_fraction", [mean(s[fraction]) for s in stats], dtype=pl.Float64),
        pl.Series("pruned_mass", [mean(s[mass]) for s in stats], dtype=pl.Float64),
        pl.Series("forced_tokens", [int(sum(s[forced])) for s in stats], dtype=pl.Int64),
    ]
