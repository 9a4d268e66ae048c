import math

import polars as pl
import pytest
import torch

from otbflow import features, schemas
from otbflow.features import sequence_token_stats, token_stats
from otbflow.io import read_metadata, read_table
from otbflow.model import load_policy
from otbflow.rollout import hf_generate


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
    assert meta["sampling"] == {"n": 4, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 24}


def test_generation_is_reproducible(tiny_policy):
    model, tok = load_policy(tiny_policy)
    a = hf_generate(model, tok, ["1+2=", "3+4+5="], n=3, max_new_tokens=10, seed=7)
    b = hf_generate(model, tok, ["1+2=", "3+4+5="], n=3, max_new_tokens=10, seed=7)
    c = hf_generate(model, tok, ["1+2=", "3+4+5="], n=3, max_new_tokens=10, seed=8)
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    assert [s.response_ids for s in a] != [s.response_ids for s in c]


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_token_stats_match_direct_softmax_and_autograd(temperature):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 5, 50, generator=g, dtype=torch.float64) * 3
    ids = torch.randint(0, 50, (6, 5), generator=g)
    s = token_stats(logits, ids, temperature)
    p = torch.softmax(logits / temperature, -1)
    torch.testing.assert_close(s["logprobs"].double(), p.gather(-1, ids[..., None]).squeeze(-1).log(), atol=1e-5, rtol=0)
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
    expected = torch.log_softmax(logits, -1)[p - 1:-1].gather(-1, torch.tensor(row["response_ids"])[:, None]).squeeze(-1)
    torch.testing.assert_close(torch.tensor(row["logprobs"]), expected, atol=1e-5, rtol=0)


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
        features.run(cfg, features.Args(rollouts=str(tmp_path / "bad.parquet"), policy=str(tiny_policy),
                                        out=str(tmp_path / "f.parquet")))
    assert not (tmp_path / "f.parquet").exists()
