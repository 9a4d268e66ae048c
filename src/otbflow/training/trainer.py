"""The training loop of one iteration (``Trainer``): micro-batches, optimizer steps and their metrics."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl
import torch
from omegaconf import DictConfig

from otbflow import schemas
from otbflow.algorithms.estimators import total_power, variance_proxies
from otbflow.algorithms.losses import aggregate_loss, loss_scale, low_var_kl, policy_token_loss, trm_keep
from otbflow.algorithms.tensors import padded
from otbflow.algorithms.vocab_pruning import PRUNING_STATS
from otbflow.io import check_finite, read_table
from otbflow.models.logits import pack
from otbflow.training.distributed import all_reduce, grads_finite, param_grad_norm
from otbflow.training.logprobs import response_token_stats, to_padded

SUMS = ("loss", "clipped", "entropy", "k3", "kl_ref", "is_w", "power", "bad", *PRUNING_STATS)

MAXES = ("is_w", "log_ratio")


@dataclass
class Trainer:
    """The policy updates of one iteration on one rank: a DeepSpeed ``engine``, the iteration's rows
    (``load_rows``), the config, the pad id of the policy's tokenizer, this rank among
    ``world_size``, and the frozen reference policy of the KL term (None: no KL term)."""

    engine: Any
    data: dict
    cfg: DictConfig
    pad_id: int
    rank: int = 0
    world_size: int = 1
    ref_model: Any = None
    before_update: Callable[[], None] | None = None
    """Called before the optimizer's state or learning rate changes (a warm worker's AdamW write
    of the job before may still read them: forward and backward do not change them)."""
    waited_s: float = 0.0
    """The seconds ``before_update`` took, summed: not the step's."""

    def step(self, mini: list[int], lr: float) -> dict:
        """One optimizer step on the mini-batch ``mini`` (row indices; every rank gets the same list
        and takes every world_size-th row) at learning rate ``lr``; returns the step's metrics."""
        engine, data, tc, world_size = self.engine, self.data, self.cfg.train, self.world_size
        mask_sums = [sum(data["loss_mask"][i]) for i in mini]
        global_tokens = int(sum(mask_sums))  # pre-TRM counts: masked sequences count, as the paper's 1/N
        global_seqs = sum(1 for s in mask_sums if s > 0)
        local = mini[self.rank :: world_size]
        n_micro = math.ceil(math.ceil(len(mini) / world_size) / tc.micro_batch_size)  # the same on every rank
        sums = dict.fromkeys(SUMS, 0.0)
        maxes = dict.fromkeys(MAXES, 0.0)
        norm_before_step = None
        for j in range(n_micro):
            rows = local[j * tc.micro_batch_size : (j + 1) * tc.micro_batch_size]
            last = j == n_micro - 1
            engine.set_gradient_accumulation_boundary(last)
            out, mx = self._micro(rows or mini[:1], 1.0 if rows else 0.0, global_tokens, global_seqs)
            sums = {k: sums[k] + out[k] for k in SUMS}
            maxes = {k: max(maxes[k], mx[k]) for k in MAXES}
            if last:
                if tc.zero_stage == 0 and not grads_finite(engine.module):
                    sums["bad"] += 1.0
                norm_before_step = param_grad_norm(engine.module)  # fp32 without ZeRO reports no norm
        sums = dict(zip(SUMS, all_reduce([sums[k] for k in SUMS], world_size, engine.device)))
        maxes = dict(zip(MAXES, all_reduce([maxes[k] for k in MAXES], world_size, engine.device, op="max")))
        if self.before_update is not None:
            t0 = time.perf_counter()
            self.before_update()
            self.waited_s += time.perf_counter() - t0
        for group in engine.optimizer.param_groups:
            group["lr"] = lr
        if sums["bad"] and tc.zero_stage == 0:
            engine.zero_grad()  # discard the step; ZeRO >= 1 runs its own overflow check in step()
            skipped, norm = True, float("nan")
        else:
            before = engine.skipped_steps
            engine.step()
            skipped = engine.skipped_steps > before
            norm = engine.get_global_grad_norm()
            norm = float(norm) if norm is not None else norm_before_step
            norm = float("nan") if norm is None or skipped else norm
        tokens = max(global_tokens, 1)
        accept = np.asarray([data["accept"][i] for i in mini])
        return {
            "loss": sums["loss"],
            "clip_fraction": sums["clipped"] / tokens,
            "grad_norm": norm,
            "lr": float(engine.get_lr()[0]),  # what the optimizer used
            "entropy": sums["entropy"] / tokens,
            "approx_kl": sums["k3"] / tokens,
            "max_abs_log_ratio": maxes["log_ratio"],
            "kl_ref": sums["kl_ref"] / tokens,
            "is_weight_mean": sums["is_w"] / tokens,
            "is_weight_max": maxes["is_w"],
            "trm_acceptance": float(accept.mean()),
            "log_ppl_abs_diff": float(np.mean([data["log_ppl_abs_diff"][i] for i in mini])),
            "pruned_vocab_fraction": sums["pruned_fraction"] / tokens,
            "pruned_mass": sums["pruned_mass"] / tokens,
            "forced_tokens": int(round(sums["forced"])),
            "tokens": global_tokens,
            "nonpad_tokens": sum(len(data["prompt_ids"][i]) + len(data["response_ids"][i]) for i in mini),
            "response_tokens": sum(len(data["response_ids"][i]) for i in mini),  # the head's, masked ones too
            "sequences": len(mini),
            "mean_response_length": float(np.mean([len(data["response_ids"][i]) for i in mini])),
            **variance_proxies(sums["power"] / len(mini), norm, len(mini)),
            "skipped": skipped,
        }

    def _micro(
        self, rows: list[int], weight: float, global_tokens: int, global_seqs: int
    ) -> tuple[dict[str, float], dict[str, float]]:
        """Forward and backward of one micro-batch; returns its sums and its maxima (largest IS
        weight, largest |log pi_theta - log pi_old|) for the step's metrics. ``global_tokens`` and
        ``global_seqs`` count the whole step's batch (``aggregate_loss``). ``weight`` 0 turns it
        into a no-op that still runs the collectives (empty rank slice)."""
        engine, data, cfg = self.engine, self.data, self.cfg
        tc = cfg.train
        dev = engine.device
        prompts, responses = [data["prompt_ids"][i] for i in rows], [data["response_ids"][i] for i in rows]
        batch = pack(prompts, responses, self.pad_id, dev, tc.packing_row_tokens if tc.packing else 0)
        min_p = cfg.rollout.min_p
        flat_logp, flat_entropy, flat_pruning = engine(
            batch["input_ids"],
            batch.get("attention_mask"),
            batch["rows"],
            batch["pos"],
            batch["targets"],
            cfg.rollout.temperature,
            tc.entropy_coef > 0,
            min_p,
            batch.get("position_ids"),
        )
        logp = to_padded(flat_logp, batch, len(rows))
        width = logp.shape[1]

        def column(name: str) -> torch.Tensor:
            return padded([data[name][i] for i in rows], 0.0, width, dtype=torch.float32, device=dev)

        old_logp, adv = column("logprobs"), column("advantages")
        mask = column("loss_mask") * weight
        keep = torch.tensor([[data["keep"][i]] for i in rows], dtype=torch.float32, device=dev)
        token_loss, clipped, is_w = policy_token_loss(tc, logp, old_logp, column("rollout_logprobs"), adv, mask)
        entropy = to_padded(flat_entropy, batch, len(rows))
        if tc.entropy_coef > 0:
            token_loss = token_loss - tc.entropy_coef * entropy
        kl_ref = torch.zeros_like(mask)
        if self.ref_model is not None:
            with torch.no_grad():
                ref_flat, _, _ = response_token_stats(
                    self.ref_model,
                    batch["input_ids"],
                    batch.get("attention_mask"),
                    batch["rows"],
                    batch["pos"],
                    batch["targets"],
                    cfg.rollout.temperature,
                    tc.logprob_chunk_size,
                    min_p=min_p,
                    position_ids=batch.get("position_ids"),
                )
            kl_ref = low_var_kl(logp, to_padded(ref_flat, batch, len(rows)))
            token_loss = token_loss + tc.kl_coef * kl_ref
        scale = loss_scale(cfg)  # Dr.GRPO's constant C, read only where it is used
        loss = aggregate_loss(token_loss * keep, mask, tc.loss_agg_mode, global_tokens, global_seqs, scale)
        # DeepSpeed averages gradients over ranks, and scale_wrt_gas=False stops it from also
        # dividing by the accumulation steps: the step-wide normalisers already did both.
        engine.backward(loss * self.world_size, scale_wrt_gas=False)

        with torch.no_grad():
            log_ratio = torch.clamp(logp - old_logp, -20.0, 20.0)
            k3 = torch.exp(log_ratio) - 1.0 - log_ratio  # r - 1 - log r, r = pi_theta / pi_old
            n_tok = mask.sum(-1)
            t = n_tok.clamp_min(1e-12)
            w_hat = (column("proxy") * mask).sum(-1)
            abar = (adv * mask).sum(-1) / t
            rho = (is_w * mask).sum(-1) / t if tc.rollout_is != "none" else None
            to_np = lambda x: x.double().cpu().numpy()  # noqa: E731
            power = total_power(to_np(w_hat), to_np(abar), None if rho is None else to_np(rho)) * len(rows) * weight
            sums = {
                "loss": float(loss.detach()),
                "clipped": float((clipped * mask).sum()),
                "entropy": float((entropy * mask).sum()),
                "k3": float((k3 * mask).sum()),
                "kl_ref": float((kl_ref * mask).sum()),
                "is_w": float((is_w * mask).sum()),
                "power": power,
                "bad": 0.0 if math.isfinite(float(loss.detach())) else 1.0,
            }
            valid = mask > 0
            for j, k in enumerate(PRUNING_STATS):  # per valid token; 0 with rollout.min_p 0
                sums[k] = float(to_padded(flat_pruning[:, j], batch, len(rows))[valid].sum())
            maxes = {
                "is_w": float(is_w[valid].max()) if valid.any() else 0.0,
                "log_ratio": float((logp - old_logp).abs()[valid].max()) if valid.any() else 0.0,
            }
        return sums, maxes


SEQUENCE_FLOATS = ("log_ppl_abs_diff", "seq_max_k2", "seq_mean_k3")


def load_rows(path: str, cfg: DictConfig) -> dict:
    """The columns training uses, as Python lists and arrays; loss_mask is all ones when
    absent. ``accept`` is the TRM verdict of each sequence, ``keep`` what the loss uses (all
    ones unless train.trm). A float column it reads that holds a NaN or an infinity is refused
    before any work, naming the row, its group and the token (``otbflow.io.check_finite``)."""
    df = read_table(path, schemas.ADVANTAGES)
    check_finite(df, ["logprobs", "rollout_logprobs", "advantages", "proxy", *SEQUENCE_FLOATS], path)
    check_versions(df, cfg.rollout.staleness, path)
    data = {
        c: df[c].to_list()
        for c in ("prompt_ids", "response_ids", "logprobs", "rollout_logprobs", "advantages", "proxy")
    }
    if "loss_mask" in df.columns:
        data["loss_mask"] = df["loss_mask"].cast(pl.List(pl.Float64)).to_list()
    else:
        data["loss_mask"] = [[1.0] * len(r) for r in data["response_ids"]]
    data["log_ppl_abs_diff"] = df["log_ppl_abs_diff"].to_list()
    data["accept"] = trm_keep(
        df["seq_max_k2"].to_numpy(), df["seq_mean_k3"].to_numpy(), cfg.mismatch.max_k2, cfg.mismatch.mean_k3
    )
    data["keep"] = data["accept"] if cfg.train.trm else np.ones(df.height)
    return data


def check_versions(df: pl.DataFrame, staleness: int, path: str) -> None:
    """Refuse, before any work, a row with a token sampled by a policy more than ``staleness``
    (rollout.staleness) iterations older than the row's iteration, or newer than it: its
    behaviour_iteration, and with rollout.take_newer each token's (token_versions)."""
    oldest, newest = [pl.col("behaviour_iteration")], [pl.col("behaviour_iteration")]
    if "token_versions" in df.columns:
        oldest.append(pl.col("token_versions").list.min())
        newest.append(pl.col("token_versions").list.max())
    spans = df.select(
        (pl.col("iteration") - pl.min_horizontal(oldest)).alias("lag"),
        (pl.max_horizontal(newest) - pl.col("iteration")).alias("ahead"),
    )
    bad = ((spans["lag"] > staleness) | (spans["ahead"] > 0)).arg_true()
    if len(bad):
        i = int(bad[0])
        raise ValueError(
            f"{path}: row {i} (group {df['group_id'][i]}) of iteration {df['iteration'][i]} holds tokens sampled "
            f"{spans['lag'][i]} iterations before it and {spans['ahead'][i]} after it: a rollout of iteration k may "
            f"use the policies of iterations k - rollout.staleness .. k (rollout.staleness is {staleness}); "
            f"{len(bad)} of {df.height} rows are outside"
        )


def mini_batches(n: int, tc: DictConfig, seed: int) -> list[list[int]]:
    """Every optimizer step's row indices: ppo_epochs passes, each in a seeded shuffled order."""
    order_rng = torch.Generator().manual_seed(seed)
    plan = []
    for _ in range(tc.ppo_epochs):
        order = torch.randperm(n, generator=order_rng).tolist()
        plan += [order[s : s + tc.mini_batch_size] for s in range(0, n, tc.mini_batch_size)]
    return plan
