"""What the train stage's tests (tests/test_train*.py) share: a tiny GPT-2 policy and the features
of random rollouts at its initial weights (module-scoped fixtures: a test file that takes them
builds its own), random advantages, the train stage run on them, and a sequence's log-probs
from the model's full logits."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
import torch

from otbflow import schemas
from otbflow.config import load_config
from otbflow.io import read_table, write_parquet
from otbflow.models.policy import build_char_tokenizer, build_tiny_model
from otbflow.stages import features
from otbflow.stages.train import Args, run

MODEL = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.n_positions=64"]


TEMPERATURE = 0.8  # not 1, so that a missing temperature shows


N_SEQ = 8


WALL = ("step_time_s", "tokens_per_s")  # the metrics' wall-time columns


MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


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


def plain_token_stats(model, prompt: list[int], response: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(log pi(y_t) [T], log-softmax [T, V]) of one sequence from the model's full logits: no
    padding, no chunks, the obvious computation."""
    ids = torch.tensor([prompt + response])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(response)].float() / TEMPERATURE
    logp_all = torch.log_softmax(logits, -1)
    return logp_all[torch.arange(len(response)), torch.tensor(response)], logp_all


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
