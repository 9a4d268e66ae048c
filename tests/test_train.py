"""The train stage: losses, loss aggregation under gradient accumulation and over 2 ranks, rollout
correction (IS, TRM), the KL and entropy terms, non-finite steps, kill -9 and resume, and
end-to-end DeepSpeed updates on CPU of a tiny policy."""

from __future__ import annotations

import os
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import polars as pl
import pytest
import torch

from otbflow import schemas
from otbflow.algorithms.losses import (
    POLICY_LOSSES,
    aggregate_loss,
    low_var_kl,
    policy_token_loss,
    ppo_clip_loss,
    register_policy_loss,
    reinforce_loss,
    trm_keep,
)
from otbflow.algorithms.rollout_is import rollout_is_weights
from otbflow.algorithms.tensors import padded
from otbflow.config import ConfigError, load_config
from otbflow.io import SchemaError, read_table, write_parquet
from otbflow.models import logits
from otbflow.models.policy import build_char_tokenizer, build_tiny_model
from otbflow.stages import features
from otbflow.stages.train import Args, run
from otbflow.training import state as train_state
from otbflow.training.distributed import init_distributed_env
from otbflow.training.logprobs import policy_logprobs, response_token_stats, to_padded
from otbflow.training.state import OptimizerStateError

MODEL = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.n_positions=64"]
TEMPERATURE = 0.8  # not 1, so that a missing temperature shows
N_SEQ = 8
WALL = ("step_time_s", "tokens_per_s")  # the metrics' wall-time columns


def clip(low: float, high: float, c: float | None = None) -> SimpleNamespace:
    """The train-section keys ppo_clip_loss reads (c None: no dual clip)."""
    return SimpleNamespace(clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=c)


def make_cfg(*overrides: str):
    return load_config(
        None, MODEL + [f"rollout.temperature={TEMPERATURE}", "train.lr=1e-2", "train.micro_batch_size=4", *overrides]
    )


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    tok = build_char_tokenizer()
    model = build_tiny_model(make_cfg().model, tok, seed=0)
    path = tmp_path_factory.mktemp("policy") / "policy"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def dropout_policy_dir(tmp_path_factory):
    """A GPT-2 with every dropout of a released GPT-2 checkpoint at 0.1."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = build_char_tokenizer()
    torch.manual_seed(1)
    config = GPT2Config(
        vocab_size=len(tok),
        n_positions=64,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_pdrop=0.1,
        summary_first_dropout=0.1,
        bos_token_id=tok.eos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    path = tmp_path_factory.mktemp("dropout_policy") / "policy"
    GPT2LMHeadModel(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def write_rollouts(path):
    """N_SEQ rollouts with random responses of 1-12 tokens."""
    rng = np.random.default_rng(0)
    tok = build_char_tokenizer()
    prompts = [f"{a}+{b}=" for a, b in rng.integers(0, 10, size=(N_SEQ, 2))]
    prompt_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    responses = [rng.integers(3, len(tok), size=int(rng.integers(1, 13))).tolist() for _ in range(N_SEQ)]
    rollouts = pl.DataFrame(
        {
            "iteration": [0] * N_SEQ,
            "behaviour_iteration": [0] * N_SEQ,
            "shard": [0] * N_SEQ,
            "seed": [0] * N_SEQ,
            "prompt_id": list(range(N_SEQ)),
            "group_id": [i // 4 for i in range(N_SEQ)],
            "sample_idx": [i % 4 for i in range(N_SEQ)],
            "prompt": prompts,
            "answer": ["0"] * N_SEQ,
            "prompt_ids": prompt_ids,
            "response_ids": responses,
            "response_text": [tok.decode(r) for r in responses],
            "rollout_logprobs": [[-1.0] * len(r) for r in responses],
            "response_length": [len(r) for r in responses],
            "finish_reason": ["length"] * N_SEQ,
            "reward": rng.random(N_SEQ).tolist(),
            "verifiable_reward": [0.0] * N_SEQ,
        },
        schema=schemas.ROLLOUTS.required,
    )
    write_parquet(rollouts, path)


@pytest.fixture(scope="module")
def features_path(policy_dir, tmp_path_factory):
    """The rollouts through the real features stage (so `logprobs` is pi_old at the initial weights)."""
    tmp = tmp_path_factory.mktemp("data")
    write_rollouts(tmp / "rollouts.parquet")
    out = tmp / "features.parquet"
    features.run(
        make_cfg(), features.Args(rollouts=str(tmp / "rollouts.parquet"), policy=str(policy_dir), out=str(out))
    )
    return out


def write_advantages(features_path, path, advantages: list[list[float]]):
    df = read_table(features_path, schemas.FEATURES)
    df = df.with_columns(
        pl.lit("test").alias("estimator"),
        pl.Series("advantages", advantages, dtype=schemas.F32L),
        pl.Series("baselines", [[0.0] * len(a) for a in advantages], dtype=schemas.F32L),
    )
    write_parquet(df, path)
    return read_table(path, schemas.ADVANTAGES)


def random_advantages(features_path, seed=1) -> list[list[float]]:
    rng = np.random.default_rng(seed)
    lengths = read_table(features_path, schemas.FEATURES)["response_length"].to_list()
    return [[float(rng.normal())] * n for n in lengths]


def load_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True)


def sequence_logprobs(model, df) -> torch.Tensor:
    """Sum of log pi over each response (temperature-scaled)."""
    with torch.no_grad():
        logp, mask = policy_logprobs(
            model,
            df["prompt_ids"].to_list(),
            df["response_ids"].to_list(),
            TEMPERATURE,
            build_char_tokenizer().pad_token_id,
        )
    return (logp * mask).sum(-1)


def full_batch_grad_norm(model, df, mode: str, cfg) -> tuple[float, float]:
    """(loss, gradient norm) of the whole table as one batch, in plain torch (first step: r = 1)."""
    model.zero_grad()
    logp, mask = policy_logprobs(
        model,
        df["prompt_ids"].to_list(),
        df["response_ids"].to_list(),
        TEMPERATURE,
        build_char_tokenizer().pad_token_id,
    )
    pad = lambda col: torch.tensor([x + [0.0] * (mask.shape[1] - len(x)) for x in df[col].to_list()])  # noqa: E731
    token_loss, _ = ppo_clip_loss(logp, pad("logprobs"), pad("advantages"), torch.ones_like(logp), cfg.train)
    loss = aggregate_loss(
        token_loss,
        mask,
        mode,
        int(mask.sum()),
        int((mask.sum(-1) > 0).sum()),
        cfg.train.loss_scale_factor or cfg.rollout.max_new_tokens,
    )
    loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]))
    return float(loss.detach()), float(norm)


def plain_token_stats(model, prompt: list[int], response: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(log pi(y_t) [T], log-softmax [T, V]) of one sequence from the model's full logits: no
    padding, no chunks, the obvious computation."""
    ids = torch.tensor([prompt + response])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(response)].float() / TEMPERATURE
    logp_all = torch.log_softmax(logits, -1)
    return logp_all[torch.arange(len(response)), torch.tensor(response)], logp_all


# ------------------------------------------------------------------------------------------
# Pure pieces
# ------------------------------------------------------------------------------------------


def test_policy_logprobs_match_features(policy_dir, features_path):
    df = read_table(features_path, schemas.FEATURES)
    model = load_model(policy_dir)
    logp, mask = policy_logprobs(
        model,
        df["prompt_ids"].to_list(),
        df["response_ids"].to_list(),
        TEMPERATURE,
        build_char_tokenizer().pad_token_id,
    )
    assert logp.requires_grad
    assert mask.sum(-1).tolist() == df["response_length"].to_list()
    for i, stored in enumerate(df["logprobs"].to_list()):
        torch.testing.assert_close(logp[i, : len(stored)], torch.tensor(stored), atol=1e-5, rtol=0)
        assert (logp[i, len(stored) :] == 0).all()


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_chunked_logprobs_equal_the_full_logits(policy_dir, features_path, entropy_grad):
    """Chunks of 5 tokens (sequences straddle chunks) under activation checkpointing give the
    log-probs, entropies and parameter gradients of the full logits, sequence by sequence."""
    df = read_table(features_path, schemas.FEATURES)
    prompts, responses = df["prompt_ids"].to_list(), df["response_ids"].to_list()
    model = load_model(policy_dir)
    params = list(model.parameters())
    rng = np.random.default_rng(2)
    a, b = (torch.tensor(rng.normal(size=int(df["response_length"].sum())), dtype=torch.float32) for _ in range(2))

    logp_ref, ent_ref = [], []
    for prompt, response in zip(prompts, responses):
        logp, logp_all = plain_token_stats(model, prompt, response)
        logp_ref.append(logp)
        ent_ref.append(-(logp_all.exp() * logp_all).sum(-1))
    logp_ref, ent_ref = torch.cat(logp_ref), torch.cat(ent_ref)
    loss_ref = (a * logp_ref).sum() + ((b * ent_ref).sum() if entropy_grad else 0.0)
    grads_ref = torch.autograd.grad(loss_ref, params)

    batch = logits.pack(prompts, responses, build_char_tokenizer().pad_token_id)
    logp, ent, _ = response_token_stats(
        model,
        batch["input_ids"],
        batch["attention_mask"],
        batch["rows"],
        batch["pos"],
        batch["targets"],
        TEMPERATURE,
        chunk_size=5,
        entropy_grad=entropy_grad,
    )
    torch.testing.assert_close(logp, logp_ref.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ent_ref.detach(), atol=1e-5, rtol=0)
    assert ent.requires_grad == entropy_grad  # logged only: no graph
    loss = (a * logp).sum() + ((b * ent).sum() if entropy_grad else 0.0)
    for g, g_ref in zip(torch.autograd.grad(loss, params), grads_ref):
        torch.testing.assert_close(g, g_ref, atol=1e-5, rtol=1e-5)


MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


@pytest.mark.parametrize("mode", MODES)
def test_aggregate_loss_accumulation_equals_full_batch(mode):
    torch.manual_seed(0)
    lengths = torch.tensor([3, 7, 1, 0, 5, 8, 2, 6])  # one empty response
    mask = torch.arange(8)[None, :] < lengths[:, None]
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(8, 8)
    tokens, seqs = int(mask.sum()), int((lengths > 0).sum())

    (full_grad,) = torch.autograd.grad(aggregate_loss(w * x, mask, mode, tokens, seqs, 48.0), w)
    w.grad = None
    total = 0.0
    for rows in ([0, 1, 2], [3, 4], [5, 6, 7]):  # uneven micro-batches, trimmed to their longest response
        width = int(lengths[rows].max())
        part = aggregate_loss((w * x)[rows, :width], mask[rows, :width], mode, tokens, seqs, 48.0)
        part.backward()
        total += float(part.detach())
    torch.testing.assert_close(w.grad, full_grad, atol=1e-5, rtol=0)
    assert abs(total - float(aggregate_loss(w * x, mask, mode, tokens, seqs, 48.0).detach())) < 1e-5


def test_aggregate_loss_values():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert float(aggregate_loss(loss, mask, "token-mean", 4, 2)) == pytest.approx(10 / 4)
    assert float(aggregate_loss(loss, mask, "seq-mean-token-sum", 4, 2)) == pytest.approx((6 + 4) / 2)
    assert float(aggregate_loss(loss, mask, "seq-mean-token-mean", 4, 2)) == pytest.approx((2 + 4) / 2, rel=1e-6)
    assert float(aggregate_loss(loss, mask, "seq-mean-token-sum-norm", 4, 2, 5.0)) == pytest.approx((6 + 4) / 2 / 5)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        aggregate_loss(loss, mask, "token-sum", 4, 2)


def test_ppo_clip_loss_by_hand():
    # ratios 1.5, 0.5, 1.1, 0.5, 1.5 with clip range [0.8, 1.28]
    ratio = torch.tensor([1.5, 0.5, 1.1, 0.5, 1.5])
    adv = torch.tensor([2.0, 2.0, 2.0, -1.0, -1.0])
    old = torch.full((5,), -2.0)
    loss, clipped = ppo_clip_loss(old + ratio.log(), old, adv, torch.ones(5), clip(0.2, 0.28))
    # A > 0, r = 1.5 > 1.28: max(-3, -2.56) = -2.56, clipped (no gradient to push r further up)
    # A > 0, r = 0.5 < 0.8: max(-1, -1.6) = -1, not clipped (the loss still pulls r back up)
    # A > 0, r = 1.1 inside the range: -2.2, not clipped
    # A < 0, r = 0.5 < 0.8: max(0.5, 0.8) = 0.8, clipped
    # A < 0, r = 1.5 > 1.28: max(1.5, 1.28) = 1.5, not clipped
    torch.testing.assert_close(loss, torch.tensor([-2.56, -1.0, -2.2, 0.8, 1.5]))
    assert clipped.tolist() == [True, False, False, True, False]


def test_ppo_clip_loss_gradient_vanishes_when_clipped():
    logp = torch.tensor([0.5, 0.0], requires_grad=True)  # r = e^0.5 (clipped), r = 1
    loss, clipped = ppo_clip_loss(logp, torch.zeros(2), torch.ones(2), torch.ones(2), clip(0.2, 0.2))
    loss.sum().backward()
    assert clipped.tolist() == [True, False]
    torch.testing.assert_close(logp.grad, torch.tensor([0.0, -1.0]))


# ------------------------------------------------------------------------------------------
# End to end with DeepSpeed on CPU
# ------------------------------------------------------------------------------------------


def test_run_raises_the_logprob_of_a_rewarded_sequence(policy_dir, features_path, tmp_path):
    adv = [[0.0] * n for n in read_table(features_path, schemas.FEATURES)["response_length"].to_list()]
    adv[0] = [1.0] * len(adv[0])  # only sequence 0 has a (positive) advantage, on every token
    df = write_advantages(features_path, tmp_path / "adv.parquet", adv)
    cfg = make_cfg("train.mini_batch_size=8", "train.micro_batch_size=2")
    args = Args(
        advantages=str(tmp_path / "adv.parquet"),
        policy=str(policy_dir),
        out=str(tmp_path / "next"),
        metrics=str(tmp_path / "metrics.parquet"),
        iteration=3,
    )
    run(cfg, args)

    metrics = read_table(args.metrics, schemas.TRAIN_METRICS)
    assert metrics.columns == list(schemas.TRAIN_METRICS.columns)
    row = metrics.row(0, named=True)
    assert metrics.height == 1 and row["iteration"] == 3 and row["step"] == 0
    assert row["tokens"] == df["response_length"].sum() and row["sequences"] == 8
    assert row["lr"] == pytest.approx(1e-2)
    assert row["clip_fraction"] == 0.0 and abs(row["approx_kl"]) < 1e-10  # first step: ratio 1
    assert row["loss"] == pytest.approx(-len(adv[0]) / row["tokens"], rel=1e-5)  # token-mean of -A r
    assert row["grad_norm"] > 0 and row["entropy"] > 0

    before, after = load_model(policy_dir), load_model(args.out)
    assert after.dtype == torch.float32
    assert any(not torch.equal(p, q) for p, q in zip(before.parameters(), after.parameters()))
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(args.out, local_files_only=True).pad_token == "<pad>"
    assert sequence_logprobs(after, df)[0] > sequence_logprobs(before, df)[0] + 1e-3


@pytest.mark.parametrize("mode", MODES)
def test_run_gradient_equals_full_batch_gradient(policy_dir, features_path, tmp_path, mode):
    """Micro-batches of 3 (uneven: 3+3+2) accumulate to the full-batch loss and gradient norm."""
    df = write_advantages(features_path, tmp_path / "adv.parquet", random_advantages(features_path))
    cfg = make_cfg("train.mini_batch_size=9", "train.micro_batch_size=3", f"train.loss_agg_mode={mode}")
    args = Args(
        advantages=str(tmp_path / "adv.parquet"),
        policy=str(policy_dir),
        out=str(tmp_path / "next"),
        metrics=str(tmp_path / "metrics.parquet"),
    )
    run(cfg, args)
    row = read_table(args.metrics, schemas.TRAIN_METRICS).row(0, named=True)
    loss, norm = full_batch_grad_norm(load_model(policy_dir), df, mode, cfg)
    assert row["loss"] == pytest.approx(loss, rel=1e-5, abs=1e-7)
    assert row["grad_norm"] == pytest.approx(norm, rel=1e-5)


def test_packing_fills_rows_in_order_up_to_the_cap():
    """pack with row_tokens: sequences of 10, 7, 13, 9 and 13 tokens, in order, a row closing when
    the next sequence does not fit: [10], [7], [13], [9], [13] at 16; [10, 7], [13], [9], [13] at
    17; one row at 100. Every row is filled to the widest with pad tokens whose positions restart
    every longest-sequence length (13), and each response token's (row, position) is the position
    before it."""
    lengths = [(3, 7), (6, 1), (2, 11), (5, 4), (4, 9)]
    prompts = [[1] * p for p, _ in lengths]
    responses = [[2] * r for _, r in lengths]
    for cap, rows in [
        (16, [[10], [7], [13], [9], [13]]),
        (17, [[10, 7], [13], [9], [13]]),
        (100, [[10, 7, 13, 9, 13]]),
    ]:
        batch = logits.pack(prompts, responses, 0, row_tokens=cap)
        width = max(sum(r) for r in rows)
        assert batch["input_ids"].shape == (len(rows), width) and "attention_mask" not in batch
        for row, sizes in zip(batch["position_ids"].tolist(), rows):
            expected = [t for n in sizes for t in range(n)]
            expected += [t % 13 for t in range(width - len(expected))]
            assert row == expected
        # each response token's (row, position) predicts it: the token at the next position is the target
        ids = batch["input_ids"]
        assert torch.equal(ids[batch["rows"], batch["pos"] + 1], batch["targets"])


@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen2"])
def test_packed_log_probs_and_gradients_equal_each_sequence_alone(arch):
    """Sequences of unequal lengths packed (train.packing): each token's log-prob equals that of
    its sequence run alone through the model's own forward (no padding, no packing:
    plain_token_stats), and the gradient of a token-mean loss over two micro-batches of unequal
    token counts equals the padded path's, both within 1e-6 in fp32, with rows of at most 16
    tokens (several rows, some with filler) and with every sequence in one row."""
    tok = build_char_tokenizer()
    model = build_tiny_model(make_cfg(f"model.arch={arch}", "model.n_layer=2").model, tok, seed=3)
    logits.check_packing(model)  # the start-up check passes for the architectures otbflow builds
    rng = np.random.default_rng(5)
    seqs = [
        (rng.integers(3, len(tok), size=p).tolist(), rng.integers(3, len(tok), size=r).tolist())
        for p, r in [(3, 7), (6, 1), (2, 11), (5, 4), (4, 9)]
    ]

    def logp_of(rows: list[int], row_tokens: int) -> torch.Tensor:
        batch = logits.pack([seqs[i][0] for i in rows], [seqs[i][1] for i in rows], tok.pad_token_id, "cpu", row_tokens)
        logp, _, _ = response_token_stats(
            model,
            batch["input_ids"],
            batch.get("attention_mask"),
            batch["rows"],
            batch["pos"],
            batch["targets"],
            TEMPERATURE,
            position_ids=batch.get("position_ids"),
        )
        return logp

    for row_tokens in (16, 4096):
        got = logp_of(list(range(len(seqs))), row_tokens)
        alone = torch.cat([plain_token_stats(model, p, r)[0] for p, r in seqs])
        assert torch.allclose(got, alone, atol=1e-6, rtol=0), row_tokens

    adv = [rng.standard_normal(len(r)).tolist() for _, r in seqs]
    micro = [[0, 1], [2, 3, 4]]  # 8 and 24 response tokens
    total = sum(len(r) for _, r in seqs)
    results = []
    for row_tokens in (0, 16, 4096):  # padded, then packed
        model.zero_grad()
        loss_sum = 0.0
        for rows in micro:
            a = torch.tensor([x for i in rows for x in adv[i]])
            loss = -(a * logp_of(rows, row_tokens)).sum() / total  # token-mean over the step's tokens
            loss.backward()
            loss_sum += float(loss.detach())
        results.append((loss_sum, {k: p.grad.clone() for k, p in model.named_parameters()}))
    (padded_loss, padded_grad), *packed = results
    for packed_loss, packed_grad in packed:
        assert abs(packed_loss - padded_loss) <= 1e-6
        for k in padded_grad:
            assert torch.allclose(packed_grad[k], padded_grad[k], atol=1e-6, rtol=0), k


def test_packed_steps_equal_padded_steps(policy_dir, features_path, tmp_path):
    """The train stage with train.packing: micro-batches of 3 rows (3 + 3 + 2, unequal token
    counts), token-mean: the step's loss and gradient norm within 1e-6 of the padded stage's;
    nonpad_tokens is the step's prompt and response tokens, counted from the table."""
    df = write_advantages(features_path, tmp_path / "adv.parquet", random_advantages(features_path))
    rows = {}
    for packing in ("false", "true"):
        cfg = make_cfg(
            "train.mini_batch_size=9",
            "train.micro_batch_size=3",
            f"train.packing={packing}",
            "train.packing_row_tokens=24",
        )
        args = Args(
            advantages=str(tmp_path / "adv.parquet"),
            policy=str(policy_dir),
            out=str(tmp_path / f"next_{packing}"),
            metrics=str(tmp_path / f"metrics_{packing}.parquet"),
        )
        run(cfg, args)
        rows[packing] = read_table(args.metrics, schemas.TRAIN_METRICS).row(0, named=True)
    padded_row, packed_row = rows["false"], rows["true"]
    assert packed_row["loss"] == pytest.approx(padded_row["loss"], abs=1e-6, rel=0)
    assert packed_row["grad_norm"] == pytest.approx(padded_row["grad_norm"], abs=1e-6, rel=0)
    tokens = sum(len(p) + len(r) for p, r in zip(df["prompt_ids"].to_list(), df["response_ids"].to_list()))
    assert packed_row["nonpad_tokens"] == padded_row["nonpad_tokens"] == tokens
    assert packed_row["tokens_per_s"] == pytest.approx(tokens / packed_row["step_time_s"])
    assert np.isnan(packed_row["mfu"])  # no GPU peak on a CPU


@pytest.mark.parametrize("mode", MODES)
def test_packed_aggregations_equal_each_sequence_alone(mode):
    """Every loss aggregation (MODES) over two micro-batches of unequal token and sequence counts,
    padded and packed (rows of at most 16 tokens, and one row): the step's loss and gradients equal,
    within 1e-6 in fp32, the same loss written out by hand over each sequence's log-probs from the
    model's own forward on that sequence alone (plain_token_stats), with its masked tokens left out
    of the sums and of T_i."""
    tok = build_char_tokenizer()
    model = build_tiny_model(make_cfg("model.arch=llama", "model.n_layer=2").model, tok, seed=3)
    rng = np.random.default_rng(7)
    lengths = [(1, 7), (6, 1), (2, 11), (5, 4), (4, 9)]  # a one-token prompt among them
    seqs = [
        (rng.integers(3, len(tok), size=p).tolist(), rng.integers(3, len(tok), size=r).tolist()) for p, r in lengths
    ]
    adv = [rng.standard_normal(len(r)).tolist() for _, r in seqs]
    masks = [[1.0] * len(r) for _, r in seqs]
    masks[2][3:6] = [0.0] * 3  # a sequence partly out of the loss
    masks[3] = [0.0] * 4  # and one wholly (it counts in no normaliser)
    tokens, n_seqs, c = int(sum(map(sum, masks))), sum(1 for m in masks if sum(m) > 0), 6.0

    model.zero_grad()
    per_seq = []
    for (p, r), a, m in zip(seqs, adv, masks):
        logp, _ = plain_token_stats(model, p, r)
        terms = -torch.tensor(a) * logp * torch.tensor(m)
        per_seq.append((terms.sum(), sum(m)))
    if mode == "token-mean":
        expected = sum(t for t, _ in per_seq) / tokens
    elif mode == "seq-mean-token-sum":
        expected = sum(t for t, _ in per_seq) / n_seqs
    elif mode == "seq-mean-token-mean":
        expected = sum(t / n for t, n in per_seq if n > 0) / n_seqs
    else:  # seq-mean-token-sum-norm: Dr.GRPO's constant C
        expected = sum(t for t, _ in per_seq) / (n_seqs * c)
    expected.backward()
    ref_grad = {k: q.grad.clone() for k, q in model.named_parameters()}

    for row_tokens in (0, 16, 4096):  # padded, then packed
        model.zero_grad()
        total = 0.0
        for rows in ([0, 1], [2, 3, 4]):
            batch = logits.pack(
                [seqs[i][0] for i in rows], [seqs[i][1] for i in rows], tok.pad_token_id, "cpu", row_tokens
            )
            flat, _, _ = response_token_stats(
                model,
                batch["input_ids"],
                batch.get("attention_mask"),
                batch["rows"],
                batch["pos"],
                batch["targets"],
                TEMPERATURE,
                position_ids=batch.get("position_ids"),
            )
            logp = to_padded(flat, batch, len(rows))
            width = logp.shape[1]
            a = padded([adv[i] for i in rows], 0.0, width, dtype=torch.float32)
            m = padded([masks[i] for i in rows], 0.0, width, dtype=torch.float32)
            loss = aggregate_loss(-a * logp, m, mode, tokens, n_seqs, c)
            loss.backward()
            total += float(loss.detach())
        assert abs(total - float(expected.detach())) <= 1e-6, row_tokens
        for k, g in ref_grad.items():
            assert torch.allclose(dict(model.named_parameters())[k].grad, g, atol=1e-6, rtol=0), (row_tokens, k)


def test_a_response_after_an_empty_prompt_is_refused():
    """pack: nothing precedes a sequence's first token, so no forward of it alone scores a response's
    first token after an empty prompt; both layouts refuse it (before, its position was the previous
    sequence's last token, packed, or the row's last, padded) and name the sequence. A one-token
    prompt is scored as the sequence alone (plain_token_stats), packed after another sequence and
    padded; an empty prompt with an empty response has nothing to score and passes."""
    tok = build_char_tokenizer()
    model = build_tiny_model(make_cfg("model.arch=llama").model, tok, seed=3)
    prompts, responses = [[5, 6, 7], [8]], [[9, 10], [11, 12, 13]]
    for row_tokens in (0, 64):
        with pytest.raises(ValueError, match="sequence 1 of the batch .* empty prompt"):
            logits.pack([prompts[0], []], responses, tok.pad_token_id, "cpu", row_tokens)
        logits.pack([prompts[0], []], [responses[0], []], tok.pad_token_id, "cpu", row_tokens)
        batch = logits.pack(prompts, responses, tok.pad_token_id, "cpu", row_tokens)
        with torch.no_grad():
            got, _, _ = response_token_stats(
                model,
                batch["input_ids"],
                batch.get("attention_mask"),
                batch["rows"],
                batch["pos"],
                batch["targets"],
                TEMPERATURE,
                position_ids=batch.get("position_ids"),
            )
            alone = torch.cat([plain_token_stats(model, p, r)[0] for p, r in zip(prompts, responses)])
        assert torch.allclose(got, alone, atol=1e-6, rtol=0), row_tokens


def test_the_reference_policy_is_checked_for_packing(policy_dir, monkeypatch):
    """load_reference with train.packing: a reference whose forward lets packed sequences see each
    other (it ignores the position ids) is refused as the policy would be (check_packing); a normal
    one is loaded, and its packed log-probs equal each sequence's alone (plain_token_stats). Without
    packing the check is not needed and not made."""
    from otbflow.training import distributed

    packed_cfg = make_cfg("train.packing=true", "train.kl_coef=0.1").train
    ref = distributed.load_reference(str(policy_dir), "cpu", packed_cfg, 1)
    tok = build_char_tokenizer()
    rng = np.random.default_rng(11)
    seqs = [
        (rng.integers(3, len(tok), size=p).tolist(), rng.integers(3, len(tok), size=r).tolist())
        for p, r in [(3, 5), (1, 6), (4, 2)]
    ]
    batch = logits.pack([p for p, _ in seqs], [r for _, r in seqs], tok.pad_token_id, "cpu", 4096)
    with torch.no_grad():
        got, _, _ = response_token_stats(
            ref,
            batch["input_ids"],
            None,
            batch["rows"],
            batch["pos"],
            batch["targets"],
            TEMPERATURE,
            position_ids=batch["position_ids"],
        )
        alone = torch.cat([plain_token_stats(ref, p, r)[0] for p, r in seqs])
    assert torch.allclose(got, alone, atol=1e-6, rtol=0)

    load = distributed.load_fp32

    def mixing(path):
        model = load(path)
        forward = model.base_model.forward
        monkeypatch.setattr(model.base_model, "forward", lambda *a, position_ids=None, **k: forward(*a, **k))
        return model

    monkeypatch.setattr(distributed, "load_fp32", mixing)
    with pytest.raises(ValueError, match="set train.packing false"):
        distributed.load_reference(str(policy_dir), "cpu", packed_cfg, 1)
    distributed.load_reference(str(policy_dir), "cpu", make_cfg("train.kl_coef=0.1").train, 1)


def test_packing_is_refused_for_a_model_that_mixes_packed_sequences(monkeypatch):
    """check_packing: a forward that ignores the position ids (so packed sequences attend to each
    other) is refused with the option to turn off."""
    tok = build_char_tokenizer()
    model = build_tiny_model(make_cfg("model.arch=llama").model, tok, seed=3)
    forward = model.model.forward
    monkeypatch.setattr(model.model, "forward", lambda *a, position_ids=None, **k: forward(*a, **k))
    with pytest.raises(ValueError, match="set train.packing false"):
        logits.check_packing(model)


def test_run_is_reproducible_with_partial_mini_batches(policy_dir, features_path, tmp_path):
    write_advantages(features_path, tmp_path / "adv.parquet", random_advantages(features_path))
    cfg = make_cfg("train.mini_batch_size=6", "train.micro_batch_size=2", "train.ppo_epochs=2", "seed=7")
    weights, tables = [], []
    for name in ("a", "b"):
        args = Args(
            advantages=str(tmp_path / "adv.parquet"),
            policy=str(policy_dir),
            out=str(tmp_path / name),
            metrics=str(tmp_path / f"{name}.parquet"),
            iteration=1,
        )
        run(cfg, args)
        weights.append(load_model(args.out).state_dict())
        tables.append(read_table(args.metrics, schemas.TRAIN_METRICS))
    for k in weights[0]:
        assert torch.equal(weights[0][k], weights[1][k]), k
    m = tables[0]
    assert m["step"].to_list() == [0, 1, 2, 3] and m["sequences"].to_list() == [6, 2, 6, 2]
    assert m["approx_kl"][1:].max() > 0  # later steps see a policy that moved
    assert m.drop(WALL).equals(tables[1].drop(WALL))


# ------------------------------------------------------------------------------------------
# Losses and rollout correction, by hand
# ------------------------------------------------------------------------------------------


def test_dual_clip_caps_the_loss_of_negative_advantages():
    ratio = torch.tensor([5.0, 2.0, 5.0])
    adv = torch.tensor([-1.0, -1.0, 1.0])
    loss, active = ppo_clip_loss(ratio.log(), torch.zeros(3), adv, torch.ones(3), clip(0.2, 0.2, 3.0))
    # A < 0, r = 5: max(5, 1.2) = 5 > 3 -> capped at 3 (no gradient); r = 2: 2 < 3, unchanged;
    # A > 0: the dual clip does not apply (max(-5, -1.2) = -1.2, the ordinary clip)
    torch.testing.assert_close(loss, torch.tensor([3.0, 2.0, -1.2]))
    assert active.tolist() == [True, False, True]


def test_reinforce_loss_weights_are_stop_gradient():
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    w = torch.tensor([2.0, 0.5], requires_grad=True)
    loss, clipped = reinforce_loss(logp, logp.detach(), torch.tensor([1.0, -1.0]), w, None)
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([-2.0, 0.5]))  # -A w
    assert w.grad is None or torch.all(w.grad == 0)
    assert clipped.tolist() == [False, False]


def test_ppo_clip_loss_is_times_the_is_weight():
    logp, adv, w = torch.tensor([0.3, -0.1, 0.0]), torch.tensor([1.0, -1.0, 2.0]), torch.tensor([0.5, 2.0, 1.5])
    plain, active = ppo_clip_loss(logp, torch.zeros(3), adv, torch.ones(3), clip(0.2, 0.2, 3.0))
    weighted, active_w = ppo_clip_loss(logp, torch.zeros(3), adv, w, clip(0.2, 0.2, 3.0))
    torch.testing.assert_close(weighted, plain * w)
    assert active_w.tolist() == active.tolist()


def test_decoupled_ppo_with_a_stale_behaviour_policy_by_hand():
    """algorithms.md §10 on three tokens (a fourth is padding): behaviour pi_b (the rollout, one
    iteration old), proximal pi_p (the features stage's pass), current pi_t; C = 2, clip 0.2."""
    pi_b = torch.tensor([[0.2, 0.5], [0.4, 0.9]])
    pi_p = torch.tensor([[0.5, 0.4], [0.2, 0.9]])
    pi_t = torch.tensor([[0.7, 0.3], [0.3, 0.9]])
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    tc = SimpleNamespace(
        loss_type="ppo_clip", rollout_is="token", rollout_is_threshold=2.0, **vars(clip(0.2, 0.2, 3.0))
    )
    logp = pi_t.log().requires_grad_(True)
    token_loss, clipped, w = policy_token_loss(tc, logp, pi_p.log(), pi_b.log(), adv, mask)
    # w = pi_p / pi_b: 2.5 -> truncated to 2, 0.8, 0.5; r = pi_t / pi_p: 1.4, 0.75, 1.5
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.8], [0.5, 0.0]]))
    # A = +1, r = 1.4: max(-1.4, -1.2) = -1.2 (clipped) x 2 = -2.4; A = +1, r = 0.75: -0.75 x 0.8 = -0.6;
    # A = -1, r = 1.5: max(1.5, 1.2) = 1.5 (under the dual clip's 3) x 0.5 = 0.75
    torch.testing.assert_close((token_loss * mask), torch.tensor([[-2.4, -0.6], [0.75, 0.0]]))
    assert (clipped & (mask > 0)).tolist() == [[True, False], [False, False]]
    loss = aggregate_loss(token_loss, mask, "token-mean", 3, 2)
    assert float(loss) == pytest.approx((-2.4 - 0.6 + 0.75) / 3)
    loss.backward()  # d/d log pi_t of -w A r: 0 where clipped, -0.8 * 0.75 and 0.5 * 1.5, over 3 tokens
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.6 / 3], [0.75 / 3, 0.0]]))
    # REINFORCE is bypass (§6.4): w = min(pi_t / pi_b, C) = 2 (3.5 truncated), 0.6, 0.75; -A w log pi_t
    tc.loss_type = "reinforce"
    token_loss, _, w = policy_token_loss(tc, pi_t.log(), pi_p.log(), pi_b.log(), adv, mask)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.6], [0.75, 0.0]]))
    expected = torch.tensor([[-2.0 * np.log(0.7), -0.6 * np.log(0.3)], [0.75 * np.log(0.3), 0.0]], dtype=torch.float32)
    torch.testing.assert_close(token_loss * mask, expected)


def test_rollout_is_weights_token_and_sequence():
    log_rho = torch.tensor([[0.1, 2.0, 0.0], [0.3, 0.2, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    token = rollout_is_weights(log_rho, mask, "token", 2.0)
    torch.testing.assert_close(
        token, torch.tensor([[np.exp(0.1), 2.0, 0.0], [np.exp(0.3), np.exp(0.2), 2.0]], dtype=torch.float32)
    )
    seq = rollout_is_weights(torch.tensor([[0.1, 0.2, 5.0], [-0.3, -0.2, 0.0]]), mask, "sequence", 2.0)
    torch.testing.assert_close(
        seq, torch.tensor([[np.exp(0.3), np.exp(0.3), 0.0], [np.exp(-0.5)] * 3], dtype=torch.float32)
    )
    torch.testing.assert_close(rollout_is_weights(log_rho, mask, "none", 2.0), mask)


def test_low_var_kl_is_k3_and_zero_at_the_reference():
    logp = torch.tensor([-1.0, -2.0, -0.5])
    ref = torch.tensor([-1.0, -1.0, -3.0])
    d = ref - logp
    torch.testing.assert_close(low_var_kl(logp, ref), torch.exp(d) - d - 1)
    assert float(low_var_kl(logp, ref)[0]) == 0.0 and (low_var_kl(logp, ref) >= 0).all()


def test_trm_keep_needs_both_criteria():
    keep = trm_keep(np.array([0.01, 0.2, 0.01, 0.01]), np.array([1e-4, 1e-4, 0.01, 1e-3]), 0.05, 0.001)
    assert keep.tolist() == [1.0, 0.0, 0.0, 1.0]


def test_slurm_variables_map_to_torch_distributed(monkeypatch):
    for k, v in dict(
        SLURM_PROCID="3", SLURM_LOCALID="1", SLURM_NTASKS="4", SLURM_JOB_ID="20042", SLURM_JOB_NODELIST="node[7-8]"
    ).items():
        monkeypatch.setenv(k, v)
    assert init_distributed_env() == (3, 4)
    assert os.environ["LOCAL_RANK"] == "1" and os.environ["WORLD_SIZE"] == "4"
    assert os.environ["MASTER_PORT"] == str(20000 + 20042 % 20000) and os.environ["MASTER_ADDR"]


# ------------------------------------------------------------------------------------------
# The stage with rollout correction, extra terms and schedules
# ------------------------------------------------------------------------------------------


def run_stage(policy_dir, features_path, tmp_path, *overrides, adv=None, name="run", **kwargs):
    """run() on the test features with ``adv`` (default: random advantages); returns (metrics, args)."""
    if not (tmp_path / "adv.parquet").exists() or adv is not None:
        write_advantages(features_path, tmp_path / "adv.parquet", adv or random_advantages(features_path))
    args = Args(
        advantages=str(tmp_path / "adv.parquet"),
        policy=str(policy_dir),
        out=str(tmp_path / name),
        metrics=str(tmp_path / f"{name}.parquet"),
        checkpoint_dir=str(tmp_path / f"{name}.ckpt"),
        **kwargs,
    )
    run(make_cfg(*overrides), args)
    return read_table(args.metrics, schemas.TRAIN_METRICS), args


def sums(df, col, weights=None):
    """sum over all rows and tokens of a list column (times a per-token list column)."""
    vals = df[col].to_list()
    w = df[weights].to_list() if weights else [[1.0] * len(v) for v in vals]
    return float(sum(np.dot(a, b) for a, b in zip(vals, w)))


def test_mfu_counts_the_model_flops_by_hand(policy_dir, features_path, tmp_path, monkeypatch):
    """The train metrics' mfu against FLOPs counted by hand for the tiny GPT-2 (one layer, d = 32,
    the char vocabulary V, tied head): body = ln_1 2d + c_attn (d x 3d + 3d) + attn c_proj (d^2 + d)
    + ln_2 2d + c_fc (d x 4d + 4d) + mlp c_proj (4d x d + d) + ln_f 2d = 12 d^2 + 15 d = 12,768;
    head = V x d (the tied wte, once); wpe, a lookup, nothing. One step over all rows with the KL
    term's reference (the same policy): 8 x (body x prompt and response tokens + head x response
    tokens), over step_time_s and a peak of 1 TFLOP/s (patched in: a CPU has none). Llama (untied,
    no biases): body = q, k, v, o 4 d^2 + gate, up, down 3 x d x 4d + 2 norms per layer and a final
    one 3d = 16,480, head V x d; its input embedding, a lookup, nothing."""
    from otbflow.stages import train as train_stage
    from otbflow.training import hardware

    V = len(build_char_tokenizer())
    assert hardware.matmul_parameters(load_model(policy_dir)) == (12_768, 32 * V)
    llama = build_tiny_model(make_cfg("model.arch=llama").model, build_char_tokenizer(), seed=0)
    assert hardware.matmul_parameters(llama) == (16_480, 32 * V)

    df = read_table(features_path, schemas.FEATURES)
    prompt = sum(map(len, df["prompt_ids"].to_list()))
    response = sum(map(len, df["response_ids"].to_list()))
    monkeypatch.setattr(train_stage, "device_peak", lambda device: 1.0)
    rows = {}
    for name, extra in [("plain", []), ("kl", ["train.kl_coef=0.5"])]:
        metrics, _ = run_stage(
            policy_dir,
            features_path,
            tmp_path,
            f"train.mini_batch_size={df.height}",
            *extra,
            name=name,
            **({"reference": str(policy_dir)} if extra else {}),
        )
        rows[name] = metrics.row(0, named=True)
        assert rows[name]["sequences"] == df.height and rows[name]["nonpad_tokens"] == prompt + response
    for name, per in [("plain", 6), ("kl", 8)]:
        flops = per * (12_768 * (prompt + response) + 32 * V * response)
        assert rows[name]["mfu"] == pytest.approx(flops / rows[name]["step_time_s"] / 1e12, rel=1e-12)


def test_trm_masks_sequences_but_keeps_the_pre_mask_normaliser(policy_dir, features_path, tmp_path):
    df = read_table(features_path, schemas.FEATURES)
    k2 = float(df["seq_max_k2"].median())
    accept = trm_keep(df["seq_max_k2"].to_numpy(), df["seq_mean_k3"].to_numpy(), k2, 1e9)
    assert 0 < accept.sum() < len(accept)
    adv = random_advantages(features_path)
    m, _ = run_stage(
        policy_dir,
        features_path,
        tmp_path,
        "train.trm=true",
        f"mismatch.max_k2={k2}",
        "mismatch.mean_k3=1e9",
        "train.mini_batch_size=8",
        adv=adv,
    )
    row = m.row(0, named=True)
    tokens = int(df["response_length"].sum())
    expected = -sum(a * sum(x) for a, x in zip(accept, adv)) / tokens  # first step: r = 1, L = -A
    assert row["trm_acceptance"] == pytest.approx(accept.mean())
    assert row["tokens"] == tokens and row["loss"] == pytest.approx(expected, rel=1e-5)
    assert row["log_ppl_abs_diff"] == pytest.approx(df["log_ppl_abs_diff"].mean(), rel=1e-6)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_truncated_is_weights_scale_the_ppo_loss(policy_dir, features_path, tmp_path, level):
    df = read_table(features_path, schemas.FEATURES)
    adv = random_advantages(features_path)
    log_rho = [
        np.asarray(a) - np.asarray(b) for a, b in zip(df["logprobs"].to_list(), df["rollout_logprobs"].to_list())
    ]
    if level == "token":
        w = [np.minimum(np.exp(x), 1.5) for x in log_rho]
    else:
        w = [np.full(len(x), min(np.exp(x.sum()), 1.5)) for x in log_rho]
    m, _ = run_stage(
        policy_dir,
        features_path,
        tmp_path,
        f"train.rollout_is={level}",
        "train.rollout_is_threshold=1.5",
        "train.mini_batch_size=8",
        adv=adv,
    )
    row = m.row(0, named=True)
    tokens = int(df["response_length"].sum())
    assert row["loss"] == pytest.approx(-sum(np.dot(a, x) for a, x in zip(adv, w)) / tokens, rel=1e-5)
    assert row["is_weight_mean"] == pytest.approx(sum(x.sum() for x in w) / tokens, rel=1e-5)
    assert row["is_weight_max"] == pytest.approx(max(x.max() for x in w), rel=1e-6)


def test_reinforce_loss_on_policy_has_the_ppo_gradient(policy_dir, features_path, tmp_path):
    df = read_table(features_path, schemas.FEATURES)
    adv = random_advantages(features_path)
    ppo, _ = run_stage(policy_dir, features_path, tmp_path, "train.mini_batch_size=8", adv=adv, name="ppo")
    rf, _ = run_stage(
        policy_dir, features_path, tmp_path, "train.mini_batch_size=8", "train.loss_type=reinforce", adv=adv, name="rf"
    )
    tokens = int(df["response_length"].sum())
    lp = df["logprobs"].to_list()
    assert rf["loss"][0] == pytest.approx(-sum(np.dot(a, x) for a, x in zip(adv, lp)) / tokens, rel=1e-5)
    # at r = 1 both gradients are -sum A grad log pi / tokens
    assert rf["grad_norm"][0] == pytest.approx(ppo["grad_norm"][0], rel=1e-5)


def test_loss_type_takes_the_registered_losses(policy_dir, features_path, tmp_path):
    """train.loss_type's values are the registry's names: the config refuses a name nobody
    registered, accepts it once a function is registered under it, and the train stage then trains
    with that function; unregistered, the name is refused again."""
    df = read_table(features_path, schemas.FEATURES)
    adv = random_advantages(features_path)
    assert {n: POLICY_LOSSES[n].is_mode for n in ("ppo_clip", "reinforce")} == {
        "ppo_clip": "decoupled",  # rho = pi_old / pi_rollout (algorithms.md §6.5)
        "reinforce": "bypass",  # rho = pi_theta / pi_rollout (algorithms.md §6.4)
    }
    with pytest.raises(ConfigError, match="train.loss_type"):
        make_cfg("train.loss_type=half_reinforce")
    with pytest.raises(ValueError, match="registered twice"):
        register_policy_loss("reinforce", is_mode="bypass")(reinforce_loss)
    with pytest.raises(ValueError, match="is_mode"):
        register_policy_loss("half_reinforce", is_mode="coupled")

    @register_policy_loss("half_reinforce", is_mode="bypass")
    def half_reinforce(logp, old_logp, adv, is_w, tc):
        return -0.5 * adv * logp * is_w.detach(), logp.new_zeros(logp.shape).bool()

    try:
        m, _ = run_stage(
            policy_dir, features_path, tmp_path, "train.mini_batch_size=8", "train.loss_type=half_reinforce", adv=adv
        )
    finally:
        del POLICY_LOSSES["half_reinforce"]
    tokens = int(df["response_length"].sum())
    lp = df["logprobs"].to_list()
    assert m["loss"][0] == pytest.approx(-0.5 * sum(np.dot(a, x) for a, x in zip(adv, lp)) / tokens, rel=1e-5)
    with pytest.raises(ConfigError, match="train.loss_type"):
        make_cfg("train.loss_type=half_reinforce")


def test_kl_and_entropy_terms(policy_dir, features_path, tmp_path):
    adv = random_advantages(features_path)
    base, _ = run_stage(policy_dir, features_path, tmp_path, "train.mini_batch_size=8", adv=adv, name="base")
    ent, _ = run_stage(
        policy_dir, features_path, tmp_path, "train.mini_batch_size=8", "train.entropy_coef=1.0", adv=adv, name="ent"
    )
    assert ent["loss"][0] == pytest.approx(base["loss"][0] - base["entropy"][0], rel=1e-5)
    assert abs(ent["grad_norm"][0] - base["grad_norm"][0]) > 1e-4  # the bonus has a gradient
    with pytest.raises(SchemaError, match="--reference"):
        run_stage(policy_dir, features_path, tmp_path, "train.kl_coef=0.5", adv=adv, name="noref")
    kl, _ = run_stage(
        policy_dir,
        features_path,
        tmp_path,
        "train.mini_batch_size=8",
        "train.ppo_epochs=3",
        "train.kl_coef=0.5",
        adv=adv,
        name="kl",
        reference=str(policy_dir),
    )
    assert kl["kl_ref"][0] == pytest.approx(0.0, abs=1e-9)  # pi_theta = pi_ref before the first update
    assert kl["kl_ref"][1] > 0 and kl["kl_ref"][2] > 0


@pytest.mark.parametrize("rollout_is,mode", [("none", "seq-mean-token-sum-norm"), ("token", "token-mean")])
def test_variance_proxies_against_the_spec(policy_dir, features_path, tmp_path, rollout_is, mode):
    """algorithms.md §1.8, from independent computations: S is the squared norm of the step's
    gradient taken with plain torch autograd, sequence by sequence; P a loop over sequences of
    max(W_i, 0) Abar_i^2 (x (mean_t rho_i,t)^2 with rollout IS), W_i = sum_t 1 - 2 pi + sum_v p_v^2
    from a plain softmax; V = max(0, (P - S) / (N - 1)). Dr.GRPO's constant C = 100 makes S < P,
    so that V is not 0 in the first case."""
    df = read_table(features_path, schemas.FEATURES)
    rng = np.random.default_rng(5)
    adv = [rng.normal(size=n).tolist() for n in df["response_length"].to_list()]  # varies within a sequence
    m, _ = run_stage(
        policy_dir,
        features_path,
        tmp_path,
        "train.mini_batch_size=8",
        f"train.rollout_is={rollout_is}",
        "train.rollout_is_threshold=1.5",
        f"train.loss_agg_mode={mode}",
        "train.loss_scale_factor=100",
        adv=adv,
    )
    row = m.row(0, named=True)

    model = load_model(policy_dir)
    norm = int(df["response_length"].sum()) if mode == "token-mean" else len(adv) * 100.0
    loss, power = torch.zeros(()), []
    for prompt, response, a, old, rollout in zip(
        df["prompt_ids"].to_list(),
        df["response_ids"].to_list(),
        adv,
        df["logprobs"].to_list(),
        df["rollout_logprobs"].to_list(),
    ):
        logp, logp_all = plain_token_stats(model, prompt, response)
        p = logp_all.exp()
        rho = [min(np.exp(o - r), 1.5) if rollout_is == "token" else 1.0 for o, r in zip(old, rollout)]
        loss = loss - sum(float(w) * float(x) * lp for w, x, lp in zip(rho, a, logp)) / norm  # r = 1: L = -w A r
        with torch.no_grad():
            pi = logp.exp()
            w_i = float(sum(1 - 2 * pi[t] + (p[t] ** 2).sum() for t in range(len(response))))
        abar = sum(a) / len(a)
        power.append(max(w_i, 0.0) * abar**2 * (np.mean(rho) ** 2 if rollout_is == "token" else 1.0))
    grads = torch.autograd.grad(loss, [q for q in model.parameters()])
    s = float(sum((g.double() ** 2).sum() for g in grads))
    p_ref = float(np.mean(power))
    assert row["proxy1_signal_strength"] == pytest.approx(s, rel=1e-5)
    assert row["proxy2_total_power"] == pytest.approx(p_ref, rel=1e-4)
    assert row["proxy3_pure_noise"] == pytest.approx(max(0.0, (p_ref - s) / (len(adv) - 1)), rel=1e-4, abs=1e-12)
    assert (row["proxy3_pure_noise"] > 0) == (mode == "seq-mean-token-sum-norm")
    assert row["mean_response_length"] == pytest.approx(df["response_length"].mean())


# ------------------------------------------------------------------------------------------
# Non-finite steps
# ------------------------------------------------------------------------------------------


def overflowing_advantages(features_path):
    """Row 0's advantages are finite but 3e38 (float32's largest is 3.4e38): the loss of the step
    holding it overflows to infinity. (NaN or infinite advantages are refused when the table is
    read: test_non_finite_inputs_are_refused_before_any_work.)"""
    adv = random_advantages(features_path)
    adv[0] = [3e38] * len(adv[0])
    return adv


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_a_non_finite_step_is_skipped(policy_dir, features_path, tmp_path, zero_stage):
    """Row 0's advantages overflow the loss: the step holding it makes no update, the other one does."""
    m, args = run_stage(
        policy_dir,
        features_path,
        tmp_path,
        "train.mini_batch_size=4",
        "train.micro_batch_size=2",
        f"train.zero_stage={zero_stage}",
        adv=overflowing_advantages(features_path),
    )
    assert m["skipped"].sum() == 1 and m.filter(pl.col("skipped"))["event"][0].startswith("skipped")
    assert m.filter(~pl.col("skipped"))["grad_norm"].is_finite().all()
    after = load_model(args.out)
    assert all(torch.isfinite(p).all() for p in after.parameters())
    assert any(not torch.equal(p, q) for p, q in zip(load_model(policy_dir).parameters(), after.parameters()))


def test_consecutive_non_finite_steps_fail_the_job(policy_dir, features_path, tmp_path):
    overrides = ("train.mini_batch_size=8", "train.ppo_epochs=2")
    m, args = run_stage(
        policy_dir,
        features_path,
        tmp_path,
        *overrides,
        "train.max_consecutive_skips=3",
        adv=overflowing_advantages(features_path),
    )
    assert m["skipped"].to_list() == [True, True]
    for p, q in zip(load_model(policy_dir).parameters(), load_model(args.out).parameters()):
        assert torch.equal(p, q)  # nothing was applied
    with pytest.raises(RuntimeError, match="2 consecutive optimizer steps"):
        run_stage(policy_dir, features_path, tmp_path, *overrides, "train.max_consecutive_skips=2", name="fail")
    assert not (tmp_path / "fail").exists() and not (tmp_path / "fail.parquet").exists()


@pytest.mark.parametrize("column, token", [("rollout_logprobs", 1), ("advantages", 0), ("seq_mean_k3", None)])
def test_non_finite_inputs_are_refused_before_any_work(policy_dir, features_path, tmp_path, column, token):
    """Issue 35: a NaN in the train stage's input stops it before the engine starts, naming the
    file, the column, the row, its group and the token; nothing is written."""
    table = write_advantages(features_path, tmp_path / "adv.parquet", random_advantages(features_path))
    row = [i for i, n in enumerate(table["response_length"]) if n > (token or 0)][2]
    values = table[column].to_list()
    if token is None:
        values[row] = float("nan")
    else:
        values[row][token] = float("nan")
    write_parquet(table.with_columns(pl.Series(column, values, dtype=table.schema[column])), tmp_path / "adv.parquet")
    where = rf"row {row} \(group_id {table['group_id'][row]}\)" + (f" token {token}" if token is not None else "")
    with pytest.raises(SchemaError, match=rf"adv.parquet: column '{column}' {where}: nan is not a finite number"):
        run_stage(policy_dir, features_path, tmp_path)
    assert not (tmp_path / "run").exists() and not (tmp_path / "run.parquet").exists()
    assert not (tmp_path / "run.ckpt").exists()


# ------------------------------------------------------------------------------------------
# LR schedule across iterations
# ------------------------------------------------------------------------------------------


def test_schedule_state_survives_iterations(policy_dir, features_path, tmp_path):
    """Warm-up over 6 steps spans two iterations of 2 steps: the second resumes at step 2."""
    overrides = ("train.mini_batch_size=4", "train.micro_batch_size=2", "train.lr_warmup_steps=6")
    m0, a0 = run_stage(policy_dir, features_path, tmp_path, *overrides, name="it0", state=str(tmp_path / "s0.json"))
    m1, _ = run_stage(
        policy_dir,
        features_path,
        tmp_path,
        *overrides,
        name="it1",
        prev_state=str(tmp_path / "s0.json"),
        state=str(tmp_path / "s1.json"),
        iteration=1,
    )
    lrs = m0["lr"].to_list() + m1["lr"].to_list()
    assert lrs == pytest.approx([1e-2 * k / 6 for k in (1, 2, 3, 4)])
    import json

    state = json.loads((tmp_path / "s1.json").read_text())
    assert state["step"] == 4 and len(state["lengths"]) == 4


# ------------------------------------------------------------------------------------------
# The first ratio of an iteration
# ------------------------------------------------------------------------------------------


def features_then_train(cfg, policy_dir, tmp_path):
    """The random rollouts through the real features stage, random advantages, then the real train
    stage: (its metrics table, the features table's path)."""
    write_rollouts(tmp_path / "rollouts.parquet")
    feats = tmp_path / "features.parquet"
    features.run(
        cfg, features.Args(rollouts=str(tmp_path / "rollouts.parquet"), policy=str(policy_dir), out=str(feats))
    )
    write_advantages(feats, tmp_path / "adv.parquet", random_advantages(feats))
    args = Args(
        advantages=str(tmp_path / "adv.parquet"),
        policy=str(policy_dir),
        out=str(tmp_path / "next"),
        metrics=str(tmp_path / "metrics.parquet"),
        checkpoint_dir=str(tmp_path / "ckpt"),
    )
    run(cfg, args)
    return read_table(args.metrics, schemas.TRAIN_METRICS), feats


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_first_ratio_is_one(dropout_policy_dir, tmp_path, precision):
    """A GPT-2 with dropout 0.1 everywhere, through the real features and train stages, with other
    batch shapes in each (features: 5 sequences per pass, chunks of 1024 positions; train: 3
    sequences per micro-batch, chunks of 7): at the first optimizer step log pi_theta - log pi_old
    is 0 to 1e-6 on every token. fp32: a few ulp (4.8e-7 measured; the matmuls round differently
    for other batch shapes); bf16 (ZeRO-1, DeepSpeed's cast; the features stage casts alike): 0,
    bitwise, on the 2-core CPU VM. Before (train mode, features at model.dtype) this model gave
    0.10 (dropout) and 1.5e-3 (bf16 training, fp32 features)."""
    overrides = [
        "train.mini_batch_size=6",
        "train.micro_batch_size=3",
        "features.batch_size=5",
        "train.logprob_chunk_size=7",
    ]
    if precision == "bf16":
        overrides += ["train.bf16=true", "train.zero_stage=1"]
    cfg = make_cfg(*overrides)
    m, feats = features_then_train(cfg, dropout_policy_dir, tmp_path)
    # a bf16 discrepancy would be orders of magnitude above 1e-6 (0 measured: bitwise)
    assert m["max_abs_log_ratio"][0] <= 1e-6 and m["clip_fraction"][0] == 0.0
    assert m["max_abs_log_ratio"][1] > 1e-3  # the metric is live: the second step sees the updated policy


def test_the_first_ratio_is_one_with_pruning(dropout_policy_dir, tmp_path):
    """rollout.min_p on (rho = 0.55: the untrained policy is nearly flat), through the real features
    and train stages with other batch shapes in each: the first step's log pi_theta equals pi_old
    to 1e-6 on every token, the random responses' tokens outside the safe set force-included by
    both stages alike; the step's pruning metrics are live (0 < pruned share < 1, mass > 0,
    force-included tokens counted), and the features stage counted the same force-included tokens."""
    cfg = make_cfg(
        "rollout.min_p=0.55",
        "train.mini_batch_size=8",
        "train.micro_batch_size=4",
        "features.batch_size=5",
        "train.logprob_chunk_size=7",
    )
    m, feats = features_then_train(cfg, dropout_policy_dir, tmp_path)
    assert m["max_abs_log_ratio"][0] <= 1e-6 and m["clip_fraction"][0] == 0.0
    assert 0.0 < m["pruned_vocab_fraction"][0] < 1.0 and m["pruned_mass"][0] > 0.0
    f = read_table(feats, schemas.FEATURES)
    # every row is in the first step (mini_batch_size = N_SEQ): the same tokens force-included
    assert m["forced_tokens"][0] == f["forced_tokens"].sum() > 0


# ------------------------------------------------------------------------------------------
# The optimizer across iterations
# ------------------------------------------------------------------------------------------


def one_engine_reference(cfg, policy_dir, tables: list[Path]) -> dict[str, torch.Tensor]:
    """One DeepSpeed engine (one AdamW) stepping over the mini-batches of every table in turn,
    iteration k's in the train stage's seeded order: the weights one uninterrupted run ends with."""
    from otbflow.seeds import derive_seed
    from otbflow.training.distributed import build_engine
    from otbflow.training.state import full_fp32_state_dict
    from otbflow.training.trainer import Trainer, load_rows, mini_batches

    init_distributed_env()
    engine = build_engine(str(policy_dir), cfg.train, 1)
    pad_id = build_char_tokenizer().pad_token_id
    for k, table in enumerate(tables):
        data = load_rows(str(table), cfg)
        trainer = Trainer(engine, data, cfg, pad_id)
        for mini in mini_batches(len(data["response_ids"]), cfg.train, derive_seed(cfg.seed, "train", k)):
            trainer.step(mini, cfg.train.lr)
    return full_fp32_state_dict(engine, keep=True)


@pytest.mark.parametrize("layout", ["zero0_fp32", "zero1_bf16", "zero3_bf16"])
def test_chained_jobs_continue_one_optimizer(policy_dir, features_path, tmp_path, layout):
    """Two train jobs chained through the stored optimizer state end with the weights of one
    engine that steps over both tables: bitwise (fp32, and bf16 with ZeRO-1 and ZeRO-3 on CPU; ZeRO-3
    also runs the chunked head under its parameter gathering). With train.reset_optimizer the
    second job starts a fresh AdamW and ends elsewhere."""
    overrides = ["train.mini_batch_size=4", "train.micro_batch_size=2", "train.lr=1e-3"]
    if layout != "zero0_fp32":
        overrides += [f"train.zero_stage={layout[4]}", "train.bf16=true", "train.logprob_chunk_size=7"]
    cfg = make_cfg(*overrides)
    tables = [tmp_path / "adv0.parquet", tmp_path / "adv1.parquet"]
    for seed, table in enumerate(tables, start=1):
        write_advantages(features_path, table, random_advantages(features_path, seed=seed))

    def job(k, policy, **kwargs):
        args = Args(
            advantages=str(tables[k]),
            policy=str(policy),
            out=str(tmp_path / f"p{k}"),
            metrics=str(tmp_path / f"m{k}.parquet"),
            checkpoint_dir=str(tmp_path / f"ck{k}"),
            iteration=k,
            state=str(tmp_path / f"s{k}.json"),
            **kwargs,
        )
        run(cfg if "prev_optimizer" in kwargs or k == 0 else make_cfg(*overrides, "train.reset_optimizer=true"), args)
        return load_model(args.out).state_dict()

    job(0, policy_dir, optimizer=str(tmp_path / "opt0"))
    meta = __import__("json").loads((tmp_path / "opt0" / "meta.json").read_text())
    assert meta["optimizer_steps"] == 2 and meta["zero_stage"] == cfg.train.zero_stage
    chained = job(1, tmp_path / "p0", prev_optimizer=str(tmp_path / "opt0"), prev_state=str(tmp_path / "s0.json"))
    reference = one_engine_reference(cfg, policy_dir, tables)
    for name, value in reference.items():
        assert torch.equal(chained[name], value), name
    fresh = job(1, tmp_path / "p0", prev_state=str(tmp_path / "s0.json"))  # train.reset_optimizer=true
    assert max(float((fresh[n] - reference[n]).abs().max()) for n in reference) > 1e-4


def test_a_stored_optimizer_state_that_does_not_fit_is_refused(policy_dir, features_path, tmp_path):
    """Another ZeRO stage or bf16 setting, another policy, a folder without meta.json (an unfinished
    write), or reset_optimizer with a state: a clear error before any training, no outputs."""
    import shutil

    m, first = run_stage(
        policy_dir, features_path, tmp_path, "train.mini_batch_size=8", name="first", optimizer=str(tmp_path / "opt")
    )
    opt = str(tmp_path / "opt")
    cases = [
        (
            ("train.zero_stage=1",),
            first.out,
            opt,
            r"saved by 1 rank\(s\), ZeRO stage 0, bf16 off; this job runs 1 "
            r"rank\(s\), ZeRO stage 1, bf16 off.*train.reset_optimizer=true",
        ),
        (("train.zero_stage=1", "train.bf16=true"), first.out, opt, "ZeRO stage 1, bf16 on"),
        ((), policy_dir, opt, "belongs to another policy than --policy"),
        (("train.reset_optimizer=true",), first.out, opt, "drop one of them"),
    ]
    shutil.copytree(opt, tmp_path / "half")
    (tmp_path / "half" / "meta.json").unlink()
    cases.append(((), first.out, str(tmp_path / "half"), "not a finished optimizer state"))
    for overrides, policy, prev, message in cases:
        with pytest.raises(OptimizerStateError, match=message):
            run_stage(
                policy,
                features_path,
                tmp_path,
                "train.mini_batch_size=8",
                *overrides,
                name="second",
                prev_optimizer=prev,
                optimizer=str(tmp_path / "opt2"),
            )
        assert not (tmp_path / "second").exists() and not (tmp_path / "opt2").exists()
        assert not (tmp_path / "second.ckpt").exists()  # refused before any work


def test_the_checkpoint_fingerprint_covers_the_optimizer_input(policy_dir, features_path, tmp_path):
    from otbflow.training.state import fingerprint

    write_advantages(features_path, tmp_path / "adv.parquet", random_advantages(features_path))
    cfg = make_cfg()
    prints = []
    for name, content in (("a", '{"job_fingerprint": "1"}'), ("b", '{"job_fingerprint": "2"}')):
        (tmp_path / name).mkdir()
        (tmp_path / name / "meta.json").write_text(content)
        prints.append(
            fingerprint(
                cfg,
                Args(
                    advantages=str(tmp_path / "adv.parquet"),
                    policy=str(policy_dir),
                    out="o",
                    metrics="m",
                    prev_optimizer=str(tmp_path / name),
                ),
                1,
            )
        )
    prints.append(
        fingerprint(
            cfg, Args(advantages=str(tmp_path / "adv.parquet"), policy=str(policy_dir), out="o", metrics="m"), 1
        )
    )
    assert len(set(prints)) == 3


# ------------------------------------------------------------------------------------------
# A results folder holds data, never code: a planted pickle is refused, not run
# ------------------------------------------------------------------------------------------


class Planted:
    """What someone who can write a shared results folder could put in a DeepSpeed file: a pickle
    that runs a shell command when it is loaded (here, one that creates ``marker``)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch '{self.marker}'",))


def plant(path: Path, marker: Path) -> None:
    """Replace a file that DeepSpeed wrote with a torch.save'd checkpoint that holds a Planted."""
    assert path.is_file(), sorted(p.name for p in path.parent.iterdir())
    torch.save({"module": Planted(marker), "optimizer_state_dict": {}}, path)


SHARDS = ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"]


@pytest.mark.parametrize("name", SHARDS)
def test_a_planted_pickle_in_an_optimizer_state_is_refused(policy_dir, features_path, tmp_path, name):
    """A file of the stored optimizer state replaced (meta.json untouched: the layout and the
    policy digest still match): the next job refuses it, naming the file, and the pickle never
    runs; no output appears."""
    overrides = ("train.mini_batch_size=8", "train.zero_stage=1")
    _, first = run_stage(policy_dir, features_path, tmp_path, *overrides, name="first", optimizer=str(tmp_path / "opt"))
    target, marker = tmp_path / "opt" / "state" / name, tmp_path / "marker"
    plant(target, marker)
    with pytest.raises(Exception) as refused:
        run_stage(
            first.out,
            features_path,
            tmp_path,
            *overrides,
            name="second",
            prev_optimizer=str(tmp_path / "opt"),
            optimizer=str(tmp_path / "opt2"),
        )
    assert not marker.exists(), "the planted pickle ran"
    assert isinstance(refused.value, train_state.CheckpointFileError), refused.value
    assert str(target) in str(refused.value) and "posix.system" in str(refused.value)
    assert not any((tmp_path / n).exists() for n in ("second", "second.parquet", "opt2", ".opt2.partial"))


@pytest.mark.parametrize("name", SHARDS)
def test_a_planted_pickle_in_a_resumable_checkpoint_is_refused(policy_dir, features_path, tmp_path, monkeypatch, name):
    """A file of the resumable checkpoint that a failed job left (its fingerprint matches the
    rerun's) replaced: the rerun refuses it, naming the file, the pickle never runs and no
    output appears."""
    overrides = ("train.mini_batch_size=4", "train.micro_batch_size=2", "train.zero_stage=1")
    overrides += ("train.checkpoint_every=1",)
    with monkeypatch.context() as m:
        m.setattr(train_state.Checkpoints, "finish", lambda self: None)  # kept, as a failed job keeps them
        _, args = run_stage(policy_dir, features_path, tmp_path, *overrides, name="job")
    for out in (args.out, args.metrics):  # Snakemake deletes a failed job's outputs
        __import__("shutil").rmtree(out) if Path(out).is_dir() else Path(out).unlink()
    ckpt = Path(args.checkpoint_dir)
    target, marker = ckpt / (ckpt / "latest").read_text().strip() / name, tmp_path / "marker"
    plant(target, marker)
    with pytest.raises(Exception) as refused:
        run_stage(policy_dir, features_path, tmp_path, *overrides, name="job")
    assert not marker.exists(), "the planted pickle ran"
    assert isinstance(refused.value, train_state.CheckpointFileError), refused.value
    assert str(target) in str(refused.value) and "posix.system" in str(refused.value)
    assert not Path(args.out).exists() and not Path(args.metrics).exists()


class ByName:
    """What Python 3.11.0-3.11.4 write for an enum member (``getattr(cls, name)``; other versions
    write its value), with any class and name: a checkpoint written on such a Python holds
    ``ByName(ZeroStageEnum, "optimizer_states")``."""

    def __init__(self, cls, name: str):
        self.cls, self.name = cls, name

    def __reduce__(self):
        return (getattr, (self.cls, self.name))


def test_an_enum_member_pickled_by_name_loads_and_nothing_else_getattr_reaches(tmp_path):
    """A DeepSpeed file written on Python 3.11.0-3.11.4 (Debian 12's python3 is 3.11.2) names
    builtins.getattr for its ZeRO stage: it loads, as the member; a getattr of anything else (an
    attribute of an allowed class is a way to its module's globals, and so to running code) is
    refused as any other planted global is, naming the file."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    good = tmp_path / "optim_states.pt"
    torch.save({"zero_stage": ByName(ZeroStageEnum, "optimizer_states"), "step": torch.ones(2)}, good)
    assert b"getattr" in good.read_bytes()
    loaded = train_state.load_checkpoint_file(str(good))
    assert loaded["zero_stage"] is ZeroStageEnum.optimizer_states and loaded["zero_stage"] == 1
    for cls, name in ((LossScaler, "__init__"), (ZeroStageEnum, "__class__"), (ZeroStageEnum, "nothing")):
        bad = tmp_path / f"{name}.pt"
        torch.save({"zero_stage": ByName(cls, name)}, bad)
        with pytest.raises(train_state.CheckpointFileError) as refused:
            train_state.load_checkpoint_file(str(bad))
        assert str(bad) in str(refused.value) and "builtins.getattr" in str(refused.value), refused.value


# ------------------------------------------------------------------------------------------
# Two ranks, and kill -9 then resume (subprocesses: the real CLI)
# ------------------------------------------------------------------------------------------


def cli_run(cfg, policy_dir, tmp_path, name, wait=True, extra=()):
    """``otbflow train`` as a subprocess with ``cfg`` as its YAML (and ``extra`` arguments)."""
    import subprocess
    import sys

    from omegaconf import OmegaConf

    (tmp_path / "cfg.yaml").write_text(OmegaConf.to_yaml(cfg))
    cmd = [
        sys.executable,
        "-m",
        "otbflow",
        "train",
        "--config",
        str(tmp_path / "cfg.yaml"),
        "--advantages",
        str(tmp_path / "adv.parquet"),
        "--policy",
        str(policy_dir),
        "--out",
        str(tmp_path / name),
        "--metrics",
        str(tmp_path / f"{name}.parquet"),
        "--checkpoint-dir",
        str(tmp_path / f"{name}.ckpt"),
        *extra,
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    log = open(tmp_path / f"{name}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    if wait:
        assert proc.wait(timeout=300) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
    return proc


def test_two_ranks_give_the_full_batch_gradient(policy_dir, features_path, tmp_path):
    """torchrun --nproc_per_node 2 on CPU (gloo), one run per aggregation mode: uneven rank slices
    (4 + 4 rows of a 9-row mini-batch) and micro-batches (3 + 1)."""
    import json
    import subprocess
    import sys

    from omegaconf import OmegaConf

    from otbflow.io import read_metadata

    df = write_advantages(features_path, tmp_path / "adv.parquet", random_advantages(features_path))
    jobs, cfgs = [], {}
    for mode in MODES:
        cfgs[mode] = make_cfg("train.mini_batch_size=9", "train.micro_batch_size=3", f"train.loss_agg_mode={mode}")
        (tmp_path / f"{mode}.yaml").write_text(OmegaConf.to_yaml(cfgs[mode]))
        jobs.append(
            {
                "config": str(tmp_path / f"{mode}.yaml"),
                "advantages": str(tmp_path / "adv.parquet"),
                "policy": str(policy_dir),
                "out": str(tmp_path / mode),
                "metrics": str(tmp_path / f"{mode}.parquet"),
            }
        )
    jobs[0]["optimizer"] = str(tmp_path / "opt")  # ZeRO-0 state of 2 ranks
    # with a KL term: the policy and the reference whole on every rank (ZeRO-0), then partitioned
    # while they load (ZeRO-3)
    for zero in (0, 3):
        kl = make_cfg("train.kl_coef=0.5", f"train.zero_stage={zero}", "train.mini_batch_size=8", "train.ppo_epochs=2")
        (tmp_path / f"kl_zero{zero}.yaml").write_text(OmegaConf.to_yaml(kl))
        jobs.append(
            {
                "config": str(tmp_path / f"kl_zero{zero}.yaml"),
                "advantages": str(tmp_path / "adv.parquet"),
                "policy": str(policy_dir),
                "reference": str(policy_dir),
                "out": str(tmp_path / f"kl_zero{zero}"),
                "metrics": str(tmp_path / f"kl_zero{zero}.parquet"),
            }
        )
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["OTBFLOW_THREADS"] = "1"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(Path(__file__).with_name("two_rank_worker.py")),
            str(tmp_path / "jobs.json"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    for mode in MODES:
        assert read_metadata(tmp_path / f"{mode}.parquet")["world_size"] == 2
        row = read_table(tmp_path / f"{mode}.parquet", schemas.TRAIN_METRICS).row(0, named=True)
        loss, norm = full_batch_grad_norm(load_model(policy_dir), df, mode, cfgs[mode])
        assert row["loss"] == pytest.approx(loss, rel=1e-5, abs=1e-7), mode
        assert row["grad_norm"] == pytest.approx(norm, rel=1e-5), mode
    # ZeRO-3: each rank held its half of the policy's and of the reference's elements once loaded
    # (the halves padded to the ranks), and the update is the one of the whole models
    loads = re.findall(r"loaded partitioned \(ZeRO-3\): rank (\d) holds (\d+) of its (\d+) parameter", res.stderr)
    assert sorted(rank for rank, _, _ in loads) == ["0", "0", "1", "1"], res.stderr[-3000:]
    params = list(load_model(policy_dir).parameters())
    total = sum(p.numel() for p in params)
    for _, held, of in loads:  # each parameter's half padded by at most one element
        assert int(of) == total and total / 2 <= int(held) <= total / 2 + len(params)
    whole, partitioned = load_model(tmp_path / "kl_zero0").state_dict(), load_model(tmp_path / "kl_zero3").state_dict()
    assert whole.keys() == partitioned.keys()
    # to within 0.1% of how far the weights moved: ZeRO-3 reduces the gradients in another order
    # (measured: 3.3e-6 at most, on a zero-initialised bias, against moves of 0.02); a rank that
    # trained from anything but the checkpoint's values would be off by the weights themselves
    initial = load_model(policy_dir).state_dict()
    moved = max(float((whole[k] - initial[k]).abs().max()) for k in whole)
    assert moved > 1e-3
    for k in whole:
        assert float((whole[k] - partitioned[k]).abs().max()) <= 1e-3 * moved, k
    kl = [read_table(tmp_path / f"kl_zero{z}.parquet", schemas.TRAIN_METRICS)["kl_ref"] for z in (0, 3)]
    assert kl[0].to_list() == pytest.approx(kl[1].to_list(), rel=1e-6, abs=1e-12) and kl[0].max() > 0
    # a world size that changes between iterations is refused, before any work
    with pytest.raises(OptimizerStateError, match=r"saved by 2 rank\(s\).*this job runs 1 rank\(s\)"):
        run(
            cfgs[MODES[0]],
            Args(
                advantages=str(tmp_path / "adv.parquet"),
                policy=str(tmp_path / MODES[0]),
                out=str(tmp_path / "next"),
                metrics=str(tmp_path / "next.parquet"),
                prev_optimizer=str(tmp_path / "opt"),
            ),
        )


def test_equal_checkpoint_states_write_equal_bytes(tmp_path):
    """Issue 53: pickle writes a string object once and refers back to it, so two equal states
    whose equal strings were one object in one and two in the other (a warm engine's AdamW param
    groups against a loaded state's) wrote different bytes. Through save_checkpoint_file (training.
    state.canonical) they write the same bytes, and load back equal; torch.save alone does not."""
    from collections import OrderedDict

    from otbflow.training.state import load_checkpoint_file, save_checkpoint_file

    exp_avg = torch.arange(6, dtype=torch.float32)

    def state(shared: bool):
        lr = "lr" if shared else "".join(["l", "r"])  # an equal string, another object
        group = {lr: 1e-3, "weight_decay": 0.0, "params": [0]}
        return {
            "optimizer": {"state": {0: {"step": torch.tensor(2.0), "exp_avg": exp_avg}}, "param_groups": [group]},
            "lr_key": "lr",
            "shapes": [OrderedDict([("w", torch.Size([6]))])],
            "pair": ("a", 1),
        }

    raw = []
    for k, shared in enumerate((True, False)):
        torch.save(state(shared), tmp_path / f"raw{k}.pt")
        raw.append((tmp_path / f"raw{k}.pt").read_bytes())
        save_checkpoint_file(state(shared), str(tmp_path / f"{k}.pt"), True)
    assert raw[0] != raw[1]  # the difference this fixes
    assert (tmp_path / "0.pt").read_bytes() == (tmp_path / "1.pt").read_bytes()
    back = load_checkpoint_file(str(tmp_path / "1.pt"))
    assert torch.equal(back["optimizer"]["state"][0]["exp_avg"], exp_avg) and back["pair"] == ("a", 1)
    assert back["optimizer"]["param_groups"] == [{"lr": 1e-3, "weight_decay": 0.0, "params": [0]}]
    assert type(back["shapes"][0]) is OrderedDict and back["shapes"][0]["w"] == torch.Size([6])


def test_kill_9_then_rerun_resumes_to_the_same_weights(policy_dir, features_path, tmp_path, monkeypatch):
    """With an optimizer state carried in from a previous job and one written out: the resumed
    job ends with the weights and metrics of an uninterrupted one. No job compiles or loads a
    torch extension (DeepSpeed's CPU shared-memory op): nothing a killed job could leave locked."""
    import signal
    import time

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "torch_extensions"))

    write_advantages(features_path, tmp_path / "adv.parquet", random_advantages(features_path))
    cfg = make_cfg(
        "train.mini_batch_size=1",
        "train.micro_batch_size=1",
        "train.ppo_epochs=2",
        "train.checkpoint_every=1",
        "train.lr=1e-3",
        "seed=3",
    )
    run(
        make_cfg("train.mini_batch_size=8", "train.lr=1e-3"),
        Args(
            advantages=str(tmp_path / "adv.parquet"),
            policy=str(policy_dir),
            out=str(tmp_path / "prev"),
            metrics=str(tmp_path / "prev.parquet"),
            optimizer=str(tmp_path / "prev.opt"),
        ),
    )
    policy_dir = tmp_path / "prev"

    def io(name):
        return ("--prev-optimizer", str(tmp_path / "prev.opt"), "--optimizer", str(tmp_path / f"{name}.opt"))

    cli_run(cfg, policy_dir, tmp_path, "whole", extra=io("whole"))  # 16 steps, uninterrupted

    proc = cli_run(cfg, policy_dir, tmp_path, "killed", wait=False, extra=io("killed"))
    latest = tmp_path / "killed.ckpt" / "latest"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if latest.is_file() and latest.read_text().strip() >= "step_000004":
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.005)
    assert proc.wait(timeout=60) == -signal.SIGKILL, "the run ended before it could be killed"
    assert not (tmp_path / "killed").exists() and not (tmp_path / "killed.parquet").exists()
    assert not (tmp_path / "killed.opt").exists()

    cli_run(cfg, policy_dir, tmp_path, "killed", extra=io("killed"))  # the rerun: same command
    log = (tmp_path / "killed.log").read_text()
    step = int(__import__("re").search(r"resuming from the checkpoint in .* after step (\d+) of 16", log).group(1))
    assert 4 <= step < 16
    whole, resumed = load_model(tmp_path / "whole").state_dict(), load_model(tmp_path / "killed").state_dict()
    for k in whole:
        assert torch.equal(whole[k], resumed[k]), k
    a = read_table(tmp_path / "whole.parquet", schemas.TRAIN_METRICS).drop(WALL)
    b = read_table(tmp_path / "killed.parquet", schemas.TRAIN_METRICS).drop(WALL)
    assert a.equals(b)
    assert not (tmp_path / "killed.ckpt").exists()  # removed once the outputs are written
    assert (tmp_path / "killed.opt" / "meta.json").is_file() and not list(tmp_path.glob(".*.partial"))
    assert not (tmp_path / "torch_extensions").exists()
    # issue 53: the AdamW state the resumed job wrote (its param groups loaded from the checkpoint)
    # is the uninterrupted one's, byte for byte (training.state.canonical)
    files = sorted(p.relative_to(tmp_path / "whole.opt") for p in (tmp_path / "whole.opt" / "state").rglob("*.pt"))
    assert files and files == sorted(
        p.relative_to(tmp_path / "killed.opt") for p in (tmp_path / "killed.opt" / "state").rglob("*.pt")
    )
    for f in files:
        assert (tmp_path / "whole.opt" / f).read_bytes() == (tmp_path / "killed.opt" / f).read_bytes(), f


# ------------------------------------------------------------------------------------------
# A full disk (a small tmpfs in a user and mount namespace: the real ENOSPC)
# ------------------------------------------------------------------------------------------


def small_tmpfs_works() -> bool:
    import shutil
    import subprocess

    if shutil.which("unshare") is None:
        return False
    probe = "mkdir -p /tmp && mount -t tmpfs -o size=4k tmpfs /mnt"
    return subprocess.run(["unshare", "-rm", "sh", "-c", probe], capture_output=True).returncode == 0


@pytest.mark.skipif(not small_tmpfs_works(), reason="needs unshare -rm to mount a small tmpfs (user namespaces)")
@pytest.mark.parametrize("target", ["checkpoint", "policy", "optimizer"])
def test_a_full_disk_fails_the_train_job_with_enospc_and_leaves_nothing(policy_dir, features_path, tmp_path, target):
    """One of the train job's writes on a 32 KiB tmpfs (the resumable checkpoint, the next policy,
    the optimizer state; everything else on the ordinary disk): the job fails naming errno 28 and
    a path on the full filesystem, not torch's "unexpected pos", and the tmpfs holds no temporary
    file and nothing that looks finished afterwards."""
    import subprocess
    import sys

    from omegaconf import OmegaConf

    write_advantages(features_path, tmp_path / "adv.parquet", random_advantages(features_path))
    cfg = make_cfg("train.mini_batch_size=4", "train.micro_batch_size=2", "train.checkpoint_every=1")
    (tmp_path / "cfg.yaml").write_text(OmegaConf.to_yaml(cfg))
    full = tmp_path / "full"
    full.mkdir()
    paths = {
        "checkpoint": tmp_path / "ckpt",
        "policy": tmp_path / "next",
        "optimizer": tmp_path / "opt",
    }
    paths[target] = full / target
    cmd = [
        sys.executable,
        "-m",
        "otbflow",
        "train",
        "--config",
        str(tmp_path / "cfg.yaml"),
        "--advantages",
        str(tmp_path / "adv.parquet"),
        "--policy",
        str(policy_dir),
        "--out",
        str(paths["policy"]),
        "--metrics",
        str(tmp_path / "metrics.parquet"),
        "--checkpoint-dir",
        str(paths["checkpoint"]),
        "--optimizer",
        str(paths["optimizer"]),
    ]
    # mount, run the job, then list what the tmpfs holds (it is gone with the namespace)
    script = 'mount -t tmpfs -o size=32k tmpfs "$0" && { "$@"; rc=$?; find "$0" -mindepth 1 > "$0.left"; exit $rc; }'
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    res = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script, str(full), *cmd], capture_output=True, text=True, env=env, timeout=300
    )
    log = res.stdout + res.stderr
    assert res.returncode != 0, log[-3000:]
    error = re.search(r"OSError: \[Errno 28\] No space left on device: '([^']+)'", log)
    assert error, log[-3000:]
    assert Path(error.group(1)).is_relative_to(full) and "unexpected pos" not in log
    left = [Path(p).relative_to(full) for p in (tmp_path / "full.left").read_text().split()]
    # the checkpoint folder keeps its fingerprint stamp (written before the first step), nothing else
    assert [str(p) for p in left] == (["checkpoint", "checkpoint/fingerprint"] if target == "checkpoint" else []), left
    assert not (tmp_path / "metrics.parquet").exists()
