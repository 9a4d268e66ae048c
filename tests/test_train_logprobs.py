"""The train stage's log-probs (otbflow.training.logprobs) and the batches they are computed over
(otbflow.models.logits.pack): equal to the features stage's and to each sequence's full logits,
in chunks under activation checkpointing, padded and packed (train.packing), and the packing
checks on the policy and the reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import train_helpers
from train_helpers import (
    MODES,
    TEMPERATURE,
    load_model,
    make_cfg,
    plain_token_stats,
    random_advantages,
    write_advantages,
)

from otbflow import schemas
from otbflow.algorithms.losses import aggregate_loss
from otbflow.algorithms.tensors import padded
from otbflow.io import read_table
from otbflow.models import logits
from otbflow.models.policy import build_char_tokenizer, build_tiny_model
from otbflow.stages.train import Args, run
from otbflow.training.logprobs import policy_logprobs, response_token_stats, to_padded

# the module-scoped fixtures of train_helpers: this file's own policy and features
policy_dir = train_helpers.policy_dir
features_path = train_helpers.features_path


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
