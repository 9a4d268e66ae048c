import math

import polars as pl
import pytest
import torch

from otbflow import schemas
from otbflow.algorithms import mismatch
from otbflow.engines import hf
from otbflow.engines.hf import hf_generate
from otbflow.io import read_metadata, read_table
from otbflow.models.logits import sequence_token_stats, token_stats
from otbflow.models.policy import encode, load_policy
from otbflow.stages import features


def test_rollout_table(rollouts_path, cfg):
    df = read_table(rollouts_path, schemas.ROLLOUTS)
    n_prompts = math.ceil(cfg.rollout.prompts_per_iteration / cfg.shard.n_shards)
    assert df.height == n_prompts * cfg.rollout.group_size
    assert df.group_by("group_id").len()["len"].to_list() == [cfg.rollout.group_size] * n_prompts
    assert set(df["finish_reason"]) <= {"stop", "length"}
    assert (df["response_length"] <= cfg.rollout.max_new_tokens).all()
    stopped = df.filter(pl.col("finish_reason") == "stop")
    assert all(ids[-1] == 1 for ids in stopped["response_ids"])  # <eos> id 1 closes a stopped response
    meta = read_metadata(rollouts_path)
    assert meta["sampling"] == {
        "n": 4,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "max_new_tokens": 24,
        "greedy": False,
    }
    assert meta["seeds"].startswith("per row")
    assert meta["backend"] == "hf" and "transformers_version" in meta


def test_generation_is_reproducible(tiny_policy):
    model, tok = load_policy(tiny_policy)
    ids = encode(tok, ["1+2=", "3+4+5="])
    a = hf_generate(model, tok, ids, n=3, max_new_tokens=10, seed=7)
    b = hf_generate(model, tok, ids, n=3, max_new_tokens=10, seed=7)
    c = hf_generate(model, tok, ids, n=3, max_new_tokens=10, seed=8)
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    assert [s.response_ids for s in a] != [s.response_ids for s in c]


def test_samples_are_per_row_independent_of_the_batch(tiny_policy):
    """Each row draws its own noise: four copies of one prompt get different samples, and batch
    sizes 1, 3 and 64 (other padding, other neighbours) give the same samples and log-probs
    (one torch seed per generate call made every batch size a different draw)."""
    model, tok = load_policy(tiny_policy)
    ids = encode(tok, ["1+2=", "1+2=", "1+2=", "1+2=", "13+4+5=", "7*8="])
    runs = [hf_generate(model, tok, ids, n=4, max_new_tokens=12, seed=3, batch_size=b) for b in (64, 3, 1)]
    for other in runs[1:]:
        assert [s.response_ids for s in other] == [s.response_ids for s in runs[0]]
        for a, b in zip(runs[0], other):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    copies = [tuple(s.response_ids) for s in runs[0] if s.prompt_index < 4]
    assert len(set(copies)) == len(copies)


PHILOX_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]
"""Random123's known answers for Philox4x32-10 (its tests/kat_vectors, the three "philox4x32 10"
lines): counter, key, output."""


def philox_by_hand(counter: tuple[int, ...], key: tuple[int, int]) -> tuple[int, ...]:
    """Philox4x32-10 on Python ints, as Salmon et al. (2011) define it: ten rounds of two 32x32 ->
    64-bit products, the key bumped by the Weyl constants between rounds."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(10):
        if r:
            k0, k1 = (k0 + 0x9E3779B9) % 2**32, (k1 + 0xBB67AE85) % 2**32
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 % 2**32, (p0 >> 32) ^ c3 ^ k1, p0 % 2**32
    return c0, c1, c2, c3


def test_the_noise_is_philox_of_row_key_position_and_token():
    """The sampler's counter-based noise: Random123's known answers, and each noise word equal to
    Philox4x32-10 of (the row key's low and high words, the row's position, the token) under the
    key (0, 0), computed on Python ints, its first two words as 52 bits, for 63-bit keys (the
    top bit of the high word set) and positions of their own per row."""
    for counter, key, expected in PHILOX_KAT:
        assert philox_by_hand(counter, key) == expected
        assert [int(w) for w in hf.philox4x32(*(torch.tensor([w]) for w in counter), key=key)] == list(expected)
    keys = torch.cat([hf.row_keys(3, range(4), 2, "cpu"), torch.tensor([2**63 - 1, 2**62 + 5, 0])])
    assert int(hf.row_keys(3, range(4), 2, "cpu").max()) >= 2**32  # the keys use their high word
    positions = torch.tensor([0, 1, 2, 3, 191, 4095, 7, 0, 2**31 + 1, 2**32 - 1, 9])
    tokens = torch.tensor([0, 1, 2, 151_935, 2**32 - 1])
    words = hf.noise_words(keys, positions, tokens)
    for i, (k, at) in enumerate(zip(keys.tolist(), positions.tolist())):
        for j, t in enumerate(tokens.tolist()):
            w = philox_by_hand((k % 2**32, k >> 32, at, t), (0, 0))
            assert int(words[i, j]) == (w[0] << 20) | (w[1] >> 12)


def test_row_noise_is_finite_at_the_extremes():
    """u = (n + 0.5) / 2^52 in fp64 is exact and strictly inside (0, 1) for n = 0 and n = 2^52 - 1,
    so the Gumbel noise is finite at both ends; in fp32 the top words round to u = 1.0 (an
    infinite noise), which is why the noise is fp64."""
    top, bottom = 2**52 - 1, 0
    noise = hf.gumbel_of_words(torch.tensor([bottom, top]))
    assert torch.isfinite(noise).all()
    assert noise.tolist() == [-math.log(-math.log((n + 0.5) / 2**52)) for n in (bottom, top)]  # by hand
    assert (top + 0.5) / 2**52 < 1.0
    assert (torch.tensor([top], dtype=torch.float32) + 0.5) / 2.0**52 == 1.0  # fp32: -log(-log 1) = inf


def chi_square_p(observed: torch.Tensor, expected: torch.Tensor, dof: int) -> float:
    """The p-value of Pearson's statistic, chi-square's survival function by the regularised upper
    incomplete gamma function."""
    stat = float(((observed - expected) ** 2 / expected).sum())
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)))


@pytest.fixture(scope="module")
def draws_of_a_vocabulary_of_8():
    """2^16 rows x 64 positions of Gumbel-max draws from one categorical over 8 tokens, and the
    noise word of token 0 at each (row, position)."""
    rows, positions, vocab = 1 << 16, 64, 8
    logits = torch.log(torch.tensor([0.3, 0.2, 0.15, 0.1, 0.1, 0.08, 0.05, 0.02], dtype=torch.float64))
    keys = hf.row_keys(0, range(rows), 1, "cpu")
    tokens, first = torch.empty(rows, positions, dtype=torch.long), torch.empty(rows, positions, dtype=torch.long)
    for at in range(positions):
        words = hf.noise_words(keys, torch.full_like(keys, at), hf.token_ids(vocab, "cpu"))
        tokens[:, at] = (logits + hf.gumbel_of_words(words)).argmax(-1)
        first[:, at] = words[:, 0]
    return logits.exp(), tokens, first


def test_gumbel_max_draws_the_categorical(draws_of_a_vocabulary_of_8):
    """4.2 million draws over a vocabulary of 8: the counts fit the categorical (chi-square, 7
    degrees of freedom, p > 1e-6), overall and at the first and last positions."""
    p, tokens, _ = draws_of_a_vocabulary_of_8
    for sample in (tokens.flatten(), tokens[:, 0], tokens[:, -1]):
        counts = torch.bincount(sample, minlength=8).double()
        assert chi_square_p(counts, p * len(sample), 7) > 1e-6


def test_no_two_rows_share_a_noise_stream(draws_of_a_vocabulary_of_8):
    """Over 2^16 rows x 64 positions, no (row, position) shares its noise with another: token 0's
    52-bit noise words are all distinct (with independent words, a coincidence among 4.2 million
    has odds of 1 in 500; the murmur hash before Philox had 28 rows sharing a stream at shifted
    steps here). And a row's draws are independent of its next position's and of the next row's
    (8 x 8 tables, chi-square with 49 degrees of freedom, p > 1e-6)."""
    p, tokens, first = draws_of_a_vocabulary_of_8
    assert torch.unique(first.flatten()).numel() == first.numel()
    expected = torch.outer(p, p)
    for a, b in ((tokens[:, :-1], tokens[:, 1:]), (tokens[:-1], tokens[1:])):
        pairs = torch.bincount((a * 8 + b).flatten(), minlength=64).double().view(8, 8)
        assert chi_square_p(pairs, expected * a.numel(), 49) > 1e-6


def test_a_row_keeps_its_own_stream_from_any_starting_position(tiny_policy):
    """A row that starts its response at position 5 draws at its k-th step the noise of position
    5 + k, whatever the other rows' positions (a streaming rollout's rows start at other decode
    steps): the tokens are those of Gumbel-max at that position, and rows of one key at other
    positions draw other noise."""
    keys = hf.row_keys(1, range(2), 2, "cpu")
    starts = torch.tensor([0, 5, 5, 17])
    logits = torch.randn(3, 4, 50, generator=torch.Generator().manual_seed(0))
    sampler = hf.RowSampler(keys, 1.0, 1.0, False, positions=starts)
    for k in range(3):
        chosen = sampler(None, logits[k]).argmax(-1)
        for row in range(4):
            alone = hf.gumbel_argmax(
                logits[k, row : row + 1], keys[row : row + 1], starts[row : row + 1] + k, hf.token_ids(50, "cpu")
            )
            assert int(chosen[row]) == int(alone)
    same_key = keys[:1].repeat(2)
    a, b = hf.noise_words(same_key, torch.tensor([5, 6]), hf.token_ids(50, "cpu"))
    assert not torch.equal(a, b)


def assert_samples_as_eager(model, tok, mode: str, **sampling):
    """hf_generate in decode ``mode`` samples the eager path's tokens (the dynamic cache, no
    compilation), with log-probs within 1e-5, for three prompts."""
    ids = encode(tok, ["1+2=", "13+4+5=", "7*8="])
    eager, other = (hf_generate(model, tok, ids, decode=m, **sampling) for m in ("eager", mode))
    assert [s.response_ids for s in other] == [s.response_ids for s in eager]
    for a, b in zip(eager, other):
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-5)


@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen2"])
def test_the_static_cache_samples_what_the_dynamic_one_does(arch, cfg):
    """rollout.hf_decode 'static' (a static KV cache, left-padded batches) against 'eager' (the
    dynamic cache): the same tokens, log-probs within 1e-5 (the attention runs over the cache's
    full length, so the sums round differently)."""
    from otbflow.models.policy import build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer()
    model = build_tiny_model(cfg.model.copy() | {"arch": arch}, tok, seed=0).eval()
    assert_samples_as_eager(model, tok, "static", n=4, max_new_tokens=12, seed=3)


def test_the_compiled_decode_loop_on_cpu(qwen2_bpe_policy):
    """rollout.hf_decode 'compiled', here on the CPU (inductor's C++ kernels; on a GPU, Triton's
    and CUDA graphs): the fused sampler picks the Gumbel-max token of the eager noise at every
    step and batch size (with Philox of wrapped 64-bit products, Inductor's kernels picked other
    tokens) (rows dynamic: one compilation), its log-probs those of log_softmax; and a
    generate call with the forward compiled samples the eager path's tokens."""
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    keys = hf.row_keys(7, range(6), 4, "cpu")
    for rows, step in [(24, 0), (24, 1), (10, 191)]:
        z = torch.randn(rows, 4099, generator=torch.Generator().manual_seed(step))
        at = torch.arange(rows) + step  # each row at its own position
        # a copy: a view of the 24 rows would add a guard on its base's size (duck sizing), and
        # rows = 10 would compile again
        token, logprob = hf.fused_step()(z, keys[:rows].clone(), at, hf.token_ids(4099, "cpu"))
        assert torch.equal(token, (z.double() + hf.gumbel_noise(keys[:rows], at, 4099)).argmax(-1))
        torch.testing.assert_close(
            logprob, torch.log_softmax(z, -1).gather(-1, token[:, None])[:, 0], rtol=0, atol=1e-5
        )
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 1  # every shape, one compilation
    model, tok = load_policy(qwen2_bpe_policy)
    assert_samples_as_eager(model, tok, "compiled", n=2, max_new_tokens=8, seed=5)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs >= 2  # the sampler and the forward


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.8)])
def test_sampled_first_tokens_follow_the_processed_distribution(tiny_policy, temperature, top_p):
    """3,000 one-token samples of one prompt: their frequencies match softmax(logits / T) restricted
    to the top-p nucleus (computed here by a plain loop over the sorted probabilities) within
    4 standard errors per token, nothing outside the nucleus is drawn, and the recorded log-prob
    of each sample is the nucleus-renormalised one."""
    model, tok = load_policy(tiny_policy)
    (prompt,) = encode(tok, ["12+3="])
    with torch.no_grad():
        p = torch.softmax(model(input_ids=torch.tensor([prompt])).logits[0, -1].double() / temperature, -1)
    nucleus, mass = set(), 0.0
    for t in sorted(range(len(p)), key=lambda t: -p[t].item()):  # most likely first, until top_p is covered
        nucleus.add(t)
        mass += p[t].item()
        if mass >= top_p - 1e-12:
            break
    q = torch.tensor([p[t].item() / mass if t in nucleus else 0.0 for t in range(len(p))], dtype=torch.float64)
    n = 3000
    samples = hf_generate(model, tok, [prompt] * n, n=1, temperature=temperature, top_p=top_p, max_new_tokens=1, seed=1)
    first = torch.tensor([s.response_ids[0] for s in samples])
    freq = torch.bincount(first, minlength=len(p)).double() / n
    assert set(first.tolist()) <= nucleus
    assert ((freq - q).abs() <= 4 * (q * (1 - q) / n).sqrt() + 1e-9).all()
    for s in samples[:50]:
        assert s.logprobs[0] == pytest.approx(math.log(q[s.response_ids[0]].item()), abs=1e-5)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_token_stats_match_direct_softmax_and_autograd(temperature):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 5, 50, generator=g, dtype=torch.float64) * 3
    ids = torch.randint(0, 50, (6, 5), generator=g)
    s = token_stats(logits, ids, temperature)
    p = torch.softmax(logits / temperature, -1)
    torch.testing.assert_close(
        s["logprobs"].double(), p.gather(-1, ids[..., None]).squeeze(-1).log(), atol=1e-5, rtol=0
    )
    torch.testing.assert_close(s["sum_pi_sq"].double(), (p**2).sum(-1), atol=1e-5, rtol=0)
    torch.testing.assert_close(s["entropy"].double(), -(p * p.log()).sum(-1), atol=1e-5, rtol=0)
    # proxy == ||d/dz log softmax(z)_y||^2 with z the temperature-scaled logits
    z = (logits / temperature).float().requires_grad_(True)
    lp = torch.log_softmax(z, -1).gather(-1, ids[..., None]).sum()
    (grad,) = torch.autograd.grad(lp, z)
    torch.testing.assert_close(s["proxy"], (grad**2).sum(-1), atol=1e-5, rtol=0)
    assert (s["proxy"] >= 0).all()


def test_features_match_model_logits_and_rollout(features_path, tiny_policy, cfg):
    df = read_table(features_path, schemas.FEATURES)
    # the trainer and the rollout engine are the same fp32 model here: no mismatch
    assert df["seq_max_k2"].max() < 1e-8
    assert df["log_ppl_abs_diff"].max() < 1e-4
    model, _ = load_policy(tiny_policy)
    row = df.row(3, named=True)
    ids = torch.tensor([row["prompt_ids"] + row["response_ids"]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0] / cfg.rollout.temperature
    p = len(row["prompt_ids"])
    expected = (
        torch.log_softmax(logits, -1)[p - 1 : -1].gather(-1, torch.tensor(row["response_ids"])[:, None]).squeeze(-1)
    )
    torch.testing.assert_close(torch.tensor(row["logprobs"]), expected, atol=1e-5, rtol=0)


def test_features_equal_the_transformers_rollout_logprobs(features_path):
    """At top_p = 1 the log-prob contract's rollout log-prob (transformers backend) and the
    trainer's log pi (features stage) are the same quantity: |delta| <= 1e-5 on every token."""
    df = read_table(features_path, schemas.FEATURES)
    ours = df["logprobs"].explode().to_numpy()
    rollout = df["rollout_logprobs"].explode().to_numpy()
    assert len(ours) > 100 and abs(ours - rollout).max() <= 1e-5


def test_chunking_does_not_change_features(tiny_policy, rollouts_path):
    model, tok = load_policy(tiny_policy)
    df = pl.read_parquet(rollouts_path).head(6)
    args = (model, df["prompt_ids"].to_list(), df["response_ids"].to_list(), 1.3)
    a = sequence_token_stats(*args, chunk_size=7, pad_id=tok.pad_token_id)
    b = sequence_token_stats(*args, chunk_size=4096, pad_id=tok.pad_token_id)
    for x, y in zip(a, b):
        for k in x:
            assert x[k] == pytest.approx(y[k], abs=1e-6)


def test_features_reject_bad_rollouts(tmp_path, rollouts_path, tiny_policy, cfg):
    bad = pl.read_parquet(rollouts_path).drop("rollout_logprobs")
    bad.write_parquet(tmp_path / "bad.parquet")
    with pytest.raises(Exception, match="bad.parquet: missing column 'rollout_logprobs'"):
        features.run(
            cfg,
            features.Args(
                rollouts=str(tmp_path / "bad.parquet"), policy=str(tiny_policy), out=str(tmp_path / "f.parquet")
            ),
        )
    assert not (tmp_path / "f.parquet").exists()


def test_exact_grad_sq_norm_matches_autograd(tiny_policy, rollouts_path):
    from otbflow.models.logits import exact_grad_sq_norms

    model, tok = load_policy(tiny_policy)
    df = pl.read_parquet(rollouts_path).head(3)
    got = exact_grad_sq_norms(model, df["prompt_ids"].to_list(), df["response_ids"].to_list(), 0.8, tok.pad_token_id)
    for row, value in zip(df.iter_rows(named=True), got):
        model.zero_grad()
        ids = torch.tensor([row["prompt_ids"] + row["response_ids"]])
        p = len(row["prompt_ids"])
        logits = model(input_ids=ids).logits[0, p - 1 : -1] / 0.8
        torch.log_softmax(logits, -1).gather(-1, torch.tensor(row["response_ids"])[:, None]).sum().backward()
        expected = sum(float((q.grad.double() ** 2).sum()) for q in model.parameters() if q.grad is not None)
        assert value == pytest.approx(expected, rel=1e-4)
        model.zero_grad()


def test_features_stage_exact_mode_feeds_eob(tmp_path, rollouts_path, tiny_policy):
    from conftest import tiny_config

    from otbflow.algorithms.estimators import compute_advantages

    cfg = tiny_config("features.exact_grad_norm=true")
    features.run(
        cfg, features.Args(rollouts=str(rollouts_path), policy=str(tiny_policy), out=str(tmp_path / "f.parquet"))
    )
    df = read_table(tmp_path / "f.parquet", schemas.FEATURES)
    assert "grad_sq_norm" in df.columns and (df.filter(pl.col("response_length") > 0)["grad_sq_norm"] > 0).all()
    assert "advantages" in compute_advantages(df, "eob").columns


def test_mismatch_columns_are_consistent(features_path):
    df = read_table(features_path, schemas.FEATURES)
    row = df.row(0, named=True)
    lr = torch.tensor(row["log_ratio"], dtype=torch.float64)
    torch.testing.assert_close(torch.tensor(row["k1"], dtype=torch.float64), -lr, atol=1e-7, rtol=0)
    torch.testing.assert_close(torch.tensor(row["k2"], dtype=torch.float64), 0.5 * lr**2, atol=1e-7, rtol=0)
    torch.testing.assert_close(torch.tensor(row["k3"], dtype=torch.float64), lr.exp() - 1 - lr, atol=1e-7, rtol=0)
    assert row["seq_max_k2"] == pytest.approx(max(row["k2"]), abs=1e-12)
    # a perturbed rollout log-prob shows up in every mismatch statistic
    from otbflow.algorithms.mismatch import mismatch_columns

    shifted = df.head(1).with_columns(pl.col("rollout_logprobs").list.eval(pl.element() - 0.1))
    m = mismatch_columns(shifted.drop("log_ratio", "k1", "k2", "k3")).row(0, named=True)
    assert m["seq_mean_k1"] == pytest.approx(-0.1, abs=1e-5)
    assert m["seq_max_k2"] == pytest.approx(0.005, abs=1e-5)
    assert m["seq_mean_k3"] == pytest.approx(math.exp(0.1) - 1.1, abs=1e-5)
    assert m["log_ppl_abs_diff"] == pytest.approx(0.1, abs=1e-5)


@pytest.mark.parametrize("vocab_chunk", [1, 7, 50, 1000])
def test_streaming_over_the_vocabulary_gives_the_same_stats(vocab_chunk):
    from otbflow.models.logits import streamed_token_stats

    g = torch.Generator().manual_seed(3)
    head = torch.nn.Linear(16, 50, bias=True)
    hidden = torch.randn(9, 16, generator=g) * 3
    ids = torch.randint(0, 50, (9,), generator=g)
    with torch.no_grad():
        expected = token_stats(head(hidden), ids, 0.7)
        got = streamed_token_stats(hidden, head, ids, 0.7, vocab_chunk)
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], atol=2e-5, rtol=1e-5)


def test_features_stage_with_vocab_chunks_matches(tmp_path, rollouts_path, tiny_policy, features_path):
    from conftest import tiny_config

    cfg = tiny_config("features.vocab_chunk_size=10", "features.chunk_size=5")
    features.run(
        cfg, features.Args(rollouts=str(rollouts_path), policy=str(tiny_policy), out=str(tmp_path / "f.parquet"))
    )
    a, b = pl.read_parquet(tmp_path / "f.parquet"), pl.read_parquet(features_path)
    for col in ("logprobs", "entropy", "sum_pi_sq", "proxy"):
        diff = (a[col].explode() - b[col].explode()).abs().max()
        assert diff < 2e-5, (col, diff)


@pytest.mark.parametrize(
    "level, expected",
    [
        # rho = exp(logprobs - rollout_logprobs) = (e^0.5, e^-1) per token, truncated at C = 1.5; the
        # sequence weight is exp(0.5 - 1) = e^-0.5 on both tokens; the empty row gets no weight
        ("token", [[1.5, math.exp(-1.0)], []]),
        ("sequence", [[math.exp(-0.5)] * 2, []]),
    ],
)
def test_is_weights_hand_computed(level, expected):
    got = mismatch.is_weights_column(
        pl.Series([[-1.0, -2.0], []], dtype=schemas.F32L), pl.Series([[-1.5, -1.0], []], dtype=schemas.F32L), level, 1.5
    )
    assert got.dtype == schemas.F32L and got.name == "is_weights"
    for g, e in zip(got.to_list(), expected):
        assert g == pytest.approx(e, rel=1e-6)


def test_features_write_is_weights_only_when_rollout_is_is_on(features_path):
    # the default config (train.rollout_is: none) writes no is_weights; the stage with it on is
    # held against verl's weights and OTB in test_advantages.py
    assert "is_weights" not in read_table(features_path, schemas.FEATURES).columns


# ------------------------------------------------------------------------------------------
# Prompts against the policy's positions, before any generation (issue 35, item 6)
# ------------------------------------------------------------------------------------------


def expression(chars: int) -> str:
    """An arithmetic prompt of ``chars`` characters: as many tokens for the char tokenizer."""
    return ("1+" * chars)[: chars - 1] + "="


def write_prompts(path, lengths):
    from otbflow.io import write_parquet
    from otbflow.models.tasks import user_message

    texts = [expression(n) for n in lengths]
    table = pl.DataFrame(
        {
            "prompt_id": list(range(len(texts))),
            "prompt": texts,
            "messages": [user_message(t) for t in texts],
            "answer": ["1"] * len(texts),
            "data_source": ["arithmetic"] * len(texts),
            "split": ["train"] * len(texts),
            "shard": [0] * len(texts),
        },
        schema=schemas.PROMPTS.columns,
    )
    return write_parquet(table, path)


def test_non_finite_rollout_logprobs_are_refused_by_the_rollout(tiny_policy, data_dir, tmp_path, cfg):
    """Issue 53: a policy with NaN weights gave a rollout of all-NaN log-probs that exited 0 (only
    the advantages stage refused it). The rollout refuses it, naming the policy, and writes nothing;
    the counts of a hand-made batch (2 of 5 tokens not finite, in 1 of 2 responses)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from otbflow.engines import Sample
    from otbflow.engines.sampling import check_logprobs
    from otbflow.stages import rollout

    broken = tmp_path / "nan_policy"
    shutil.copytree(tiny_policy, broken)
    weights = load_file(broken / "model.safetensors")
    weights["transformer.ln_f.weight"] = torch.full_like(weights["transformer.ln_f.weight"], float("nan"))
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "rollout.parquet"
    args = rollout.Args(prompts=str(data_dir / "train" / "shard_0.parquet"), policy=str(broken), out=str(out))
    with pytest.raises(
        ValueError, match=rf"policy {broken}: a sampled token's log-prob is nan \(prompt \d+, sample 0, token 0\)"
    ):
        rollout.run(cfg, args)
    assert not out.exists() and not list(tmp_path.glob("rollout*"))
    samples = [
        Sample(0, 0, [1], [2, 3], [-0.5, -1.0], "length", ""),
        Sample(0, 1, [1], [2, 3, 4], [-0.1, float("-inf"), float("nan")], "length", ""),
    ]
    with pytest.raises(
        ValueError,
        match=r"policy p: a sampled token's log-prob is -inf \(prompt 7, sample 1, token 1\); 2 of 5 tokens in 1 of 2 ",
    ):
        check_logprobs(samples, [7], "p")
    check_logprobs(samples[:1], [7], "p")


def test_a_prompt_of_too_many_characters_is_refused_before_it_renders(tiny_policy, tmp_path, cfg, monkeypatch):
    """Issue 53: through the stage CLIs without model.path a 10 MB prompt passed the shard stage
    and the rollout tokenised all of it (17-23 s, 4.2 GB) before refusing it on positions. The
    rollout and the evaluation refuse a prompt of more than 64 characters per position of their
    policy (the built-in GPT-2's n_positions 128: 8,192) before any tokenizer sees it, naming the
    prompt and the policy, writing nothing; 8,192 characters pass that check."""
    from otbflow.engines import prompts as rendering
    from otbflow.stages import evaluate, rollout

    def never(*args, **kwargs):
        raise AssertionError("a prompt was rendered")

    monkeypatch.setattr(rendering, "render_prompts", never)
    prompts = write_prompts(tmp_path / "prompts.parquet", [4, 10_000_000, 8_193])
    want = (
        r"prompt 1: 10,000,000 characters, more than 8,192 \(64 per position of the policy's 128, "
        rf"{tiny_policy}/config.json: n_positions\): no such prompt fits its positions; 2 of 3 prompts are too long"
    )
    out = tmp_path / "rollout.parquet"
    with pytest.raises(ValueError, match=want):
        rollout.run(cfg, rollout.Args(prompts=str(prompts), policy=str(tiny_policy), out=str(out)))
    samples, summary = tmp_path / "s.parquet", tmp_path / "m.parquet"
    args = evaluate.Args(
        prompts=str(prompts), policy=str(tiny_policy), name="initial", samples=str(samples), summary=str(summary)
    )
    with pytest.raises(ValueError, match=want):
        evaluate.run(cfg, args)
    assert not out.exists() and not samples.exists() and not summary.exists()
    rendering.check_prompt_chars(
        read_table(write_prompts(tmp_path / "edge.parquet", [8_192]), schemas.PROMPTS), tiny_policy
    )


def test_a_prompt_longer_than_the_positions_is_refused_before_generation(tiny_policy, tmp_path, cfg):
    """Was: an IndexError in the model's position embedding, mid-generation (203 tokens against 128
    positions). Now the rollout and the evaluation refuse it before the engine starts, naming the
    prompt, its length and the policy's positions; a prompt that just fits is no concern."""
    from otbflow.engines.prompts import check_prompt_lengths
    from otbflow.stages import evaluate, rollout

    assert (cfg.model.n_positions, cfg.rollout.max_new_tokens, cfg.evaluate.max_new_tokens) == (128, 24, 24)
    lengths = [4, 104, 105, 203]  # 104 + 24 = 128 fits exactly; 105 + 24 = 129 does not
    prompts = write_prompts(tmp_path / "prompts.parquet", lengths)
    want = (
        r"prompt 2: 105 tokens rendered \+ {key} 24 = 129 positions, more than the policy's 128 "
        r"\(.*config.json: n_positions\); 2 of 4 prompts are too long \(the longest: 203 tokens\)"
    )
    out = tmp_path / "rollout.parquet"
    with pytest.raises(ValueError, match=want.format(key="rollout.max_new_tokens")):
        rollout.run(cfg, rollout.Args(prompts=str(prompts), policy=str(tiny_policy), out=str(out)))
    args = evaluate.Args(
        prompts=str(prompts),
        policy=str(tiny_policy),
        name="initial",
        samples=str(tmp_path / "s.parquet"),
        summary=str(tmp_path / "m.parquet"),
    )
    with pytest.raises(ValueError, match=want.format(key="evaluate.max_new_tokens")):
        evaluate.run(cfg, args)
    assert not out.exists() and not (tmp_path / "s.parquet").exists() and not (tmp_path / "m.parquet").exists()
    ids = [[0] * n for n in lengths[:2]]
    check_prompt_lengths(ids, [0, 1], 24, "rollout.max_new_tokens", tiny_policy)  # fits: no error
