"""The train stage: PPO-clip loss, loss aggregation under gradient accumulation, and an end-to-end
DeepSpeed update on CPU of a tiny policy (single process)."""

from __future__ import annotations

import os

import numpy as np
import polars as pl
import pytest
import torch

from otbflow import features, schemas
from otbflow.config import load_config
from otbflow.io import read_table, write_parquet
from otbflow.model import build_char_tokenizer, build_tiny_model
from otbflow.train import Args, aggregate_loss, policy_logprobs, ppo_clip_loss, run

MODEL = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.n_positions=64"]
TEMPERATURE = 0.8  # not 1, so that a missing temperature shows
N_SEQ = 8


def make_cfg(*overrides: str):
    return load_config(None, MODEL + [f"rollout.temperature={TEMPERATURE}", "train.lr=1e-2", *overrides])


@pytest.fixture(autouse=True)
def clean_env():
    """run() sets RANK, MASTER_PORT...; keep them out of other tests (and ignore a Slurm job
    the tests themselves may run in)."""
    saved = dict(os.environ)
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID"):
        os.environ.pop(k, None)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    tok = build_char_tokenizer()
    model = build_tiny_model(make_cfg().model, tok, seed=0)
    path = tmp_path_factory.mktemp("policy") / "policy"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def features_path(policy_dir, tmp_path_factory):
    """N_SEQ rollouts with random responses of 1-12 tokens, through the real features stage (so
    `logprobs` is pi_old at the initial weights)."""
    rng = np.random.default_rng(0)
    tok = build_char_tokenizer()
    prompts = [f"{a}+{b}=" for a, b in rng.integers(0, 10, size=(N_SEQ, 2))]
    prompt_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    responses = [rng.integers(3, len(tok), size=int(rng.integers(1, 13))).tolist() for _ in range(N_SEQ)]
    rollouts = pl.DataFrame({
        "iteration": [0] * N_SEQ, "shard": [0] * N_SEQ, "seed": [0] * N_SEQ,
        "prompt_id": list(range(N_SEQ)), "group_id": [i // 4 for i in range(N_SEQ)],
        "sample_idx": [i % 4 for i in range(N_SEQ)], "prompt": prompts, "answer": ["0"] * N_SEQ,
        "prompt_ids": prompt_ids, "response_ids": responses,
        "response_text": [tok.decode(r) for r in responses],
        "rollout_logprobs": [[-1.0] * len(r) for r in responses],
        "response_length": [len(r) for r in responses], "finish_reason": ["length"] * N_SEQ,
        "reward": rng.random(N_SEQ).tolist(),
    }, schema=schemas.ROLLOUTS.columns)
    tmp = tmp_path_factory.mktemp("data")
    write_parquet(rollouts, tmp / "rollouts.parquet")
    out = tmp / "features.parquet"
    features.run(make_cfg(), features.Args(rollouts=str(tmp / "rollouts.parquet"), policy=str(policy_dir),
                                           out=str(out)))
    return out


def write_advantages(features_path, path, advantages: list[list[float]]):
    df = read_table(features_path, schemas.FEATURES)
    df = df.with_columns(pl.lit("test").alias("estimator"),
                         pl.Series("advantages", advantages, dtype=schemas.F32L),
                         pl.Series("baselines", [[0.0] * len(a) for a in advantages], dtype=schemas.F32L))
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
        logp, mask = policy_logprobs(model, df["prompt_ids"].to_list(), df["response_ids"].to_list(),
                                     TEMPERATURE, build_char_tokenizer().pad_token_id)
    return (logp * mask).sum(-1)


def full_batch_grad_norm(model, df, mode: str, cfg) -> tuple[float, float]:
    """(loss, gradient norm) of the whole table as one batch, in plain torch."""
    model.zero_grad()
    logp, mask = policy_logprobs(model, df["prompt_ids"].to_list(), df["response_ids"].to_list(),
                                 TEMPERATURE, build_char_tokenizer().pad_token_id)
    pad = lambda col: torch.tensor([x + [0.0] * (mask.shape[1] - len(x)) for x in df[col].to_list()])  # noqa: E731
    token_loss, _ = ppo_clip_loss(logp, pad("logprobs"), pad("advantages"), cfg.train.clip_ratio_low,
                                  cfg.train.clip_ratio_high)
    loss = aggregate_loss(token_loss, mask, mode, int(mask.sum()), int((mask.sum(-1) > 0).sum()))
    loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]))
    return float(loss.detach()), float(norm)


# ------------------------------------------------------------------------------------------
# Pure pieces
# ------------------------------------------------------------------------------------------


def test_policy_logprobs_match_features(policy_dir, features_path):
    df = read_table(features_path, schemas.FEATURES)
    model = load_model(policy_dir)
    logp, mask = policy_logprobs(model, df["prompt_ids"].to_list(), df["response_ids"].to_list(), TEMPERATURE,
                                 build_char_tokenizer().pad_token_id)
    assert logp.requires_grad
    assert mask.sum(-1).tolist() == df["response_length"].to_list()
    for i, stored in enumerate(df["logprobs"].to_list()):
        torch.testing.assert_close(logp[i, :len(stored)], torch.tensor(stored), atol=1e-5, rtol=0)
        assert (logp[i, len(stored):] == 0).all()


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_aggregate_loss_accumulation_equals_full_batch(mode):
    torch.manual_seed(0)
    lengths = torch.tensor([3, 7, 1, 0, 5, 8, 2, 6])  # one empty response
    mask = torch.arange(8)[None, :] < lengths[:, None]
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(8, 8)
    tokens, seqs = int(mask.sum()), int((lengths > 0).sum())

    (full_grad,) = torch.autograd.grad(aggregate_loss(w * x, mask, mode, tokens, seqs), w)
    w.grad = None
    total = 0.0
    for rows in ([0, 1, 2], [3, 4], [5, 6, 7]):  # uneven micro-batches, trimmed to their longest response
        width = int(lengths[rows].max())
        part = aggregate_loss((w * x)[rows, :width], mask[rows, :width], mode, tokens, seqs)
        part.backward()
        total += float(part.detach())
    torch.testing.assert_close(w.grad, full_grad, atol=1e-5, rtol=0)
    assert abs(total - float(aggregate_loss(w * x, mask, mode, tokens, seqs).detach())) < 1e-5


def test_aggregate_loss_values():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert float(aggregate_loss(loss, mask, "token-mean", 4, 2)) == pytest.approx(10 / 4)
    assert float(aggregate_loss(loss, mask, "seq-mean-token-sum", 4, 2)) == pytest.approx((6 + 4) / 2)
    assert float(aggregate_loss(loss, mask, "seq-mean-token-mean", 4, 2)) == pytest.approx((2 + 4) / 2, rel=1e-6)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        aggregate_loss(loss, mask, "token-sum", 4, 2)


def test_ppo_clip_loss_by_hand():
    # ratios 1.5, 0.5, 1.1, 0.5, 1.5 with clip range [0.8, 1.28]
    ratio = torch.tensor([1.5, 0.5, 1.1, 0.5, 1.5])
    adv = torch.tensor([2.0, 2.0, 2.0, -1.0, -1.0])
    old = torch.full((5,), -2.0)
    loss, clipped = ppo_clip_loss(old + ratio.log(), old, adv, 0.2, 0.28)
    # A > 0, r = 1.5 > 1.28: max(-3, -2.56) = -2.56, clipped (no gradient to push r further up)
    # A > 0, r = 0.5 < 0.8: max(-1, -1.6) = -1, not clipped (the loss still pulls r back up)
    # A > 0, r = 1.1 inside the range: -2.2, not clipped
    # A < 0, r = 0.5 < 0.8: max(0.5, 0.8) = 0.8, clipped
    # A < 0, r = 1.5 > 1.28: max(1.5, 1.28) = 1.5, not clipped
    torch.testing.assert_close(loss, torch.tensor([-2.56, -1.0, -2.2, 0.8, 1.5]))
    assert clipped.tolist() == [True, False, False, True, False]


def test_ppo_clip_loss_gradient_vanishes_when_clipped():
    logp = torch.tensor([0.5, 0.0], requires_grad=True)  # r = e^0.5 (clipped), r = 1
    loss, clipped = ppo_clip_loss(logp, torch.zeros(2), torch.ones(2), 0.2, 0.2)
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
    args = Args(advantages=str(tmp_path / "adv.parquet"), policy=str(policy_dir), out=str(tmp_path / "next"),
                metrics=str(tmp_path / "metrics.parquet"), iteration=3)
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


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_run_gradient_equals_full_batch_gradient(policy_dir, features_path, tmp_path, mode):
    """Micro-batches of 3 (uneven: 3+3+2) accumulate to the full-batch loss and gradient norm."""
    df = write_advantages(features_path, tmp_path / "adv.parquet", random_advantages(features_path))
    cfg = make_cfg("train.mini_batch_size=9", "train.micro_batch_size=3", f"train.loss_agg_mode={mode}")
    args = Args(advantages=str(tmp_path / "adv.parquet"), policy=str(policy_dir), out=str(tmp_path / "next"),
                metrics=str(tmp_path / "metrics.parquet"))
    run(cfg, args)
    row = read_table(args.metrics, schemas.TRAIN_METRICS).row(0, named=True)
    loss, norm = full_batch_grad_norm(load_model(policy_dir), df, mode, cfg)
    assert row["loss"] == pytest.approx(loss, rel=1e-5, abs=1e-7)
    assert row["grad_norm"] == pytest.approx(norm, rel=1e-5)


def test_run_is_reproducible_with_partial_mini_batches(policy_dir, features_path, tmp_path):
    write_advantages(features_path, tmp_path / "adv.parquet", random_advantages(features_path))
    cfg = make_cfg("train.mini_batch_size=6", "train.micro_batch_size=2", "train.ppo_epochs=2", "seed=7")
    weights, tables = [], []
    for name in ("a", "b"):
        args = Args(advantages=str(tmp_path / "adv.parquet"), policy=str(policy_dir), out=str(tmp_path / name),
                    metrics=str(tmp_path / f"{name}.parquet"), iteration=1)
        run(cfg, args)
        weights.append(load_model(args.out).state_dict())
        tables.append(read_table(args.metrics, schemas.TRAIN_METRICS))
    for k in weights[0]:
        assert torch.equal(weights[0][k], weights[1][k]), k
    m = tables[0]
    assert m["step"].to_list() == [0, 1, 2, 3] and m["sequences"].to_list() == [6, 2, 6, 2]
    assert m["approx_kl"][1:].max() > 0  # later steps see a policy that moved
    assert m.drop("step_time_s").equals(tables[1].drop("step_time_s"))
