"""Shared fixtures: a tiny validated config, a tiny (untrained) policy, prompt shards."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from otbflow.config import DEFAULT_CONFIG, load_config

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "config" / "tiny.yaml"
os.environ.setdefault("OTBFLOW_THREADS", "2")


def tiny_config(*overrides: str):
    """config/config.yaml with config/tiny.yaml layered on top, plus overrides."""
    return load_config(DEFAULT_CONFIG, list(overrides), extra=yaml.safe_load(TINY.read_text()))


@pytest.fixture(scope="session")
def cfg():
    return tiny_config()


@pytest.fixture(scope="session")
def tiny_policy(tmp_path_factory, cfg):
    """An untrained tiny char-level GPT-2 saved as an HF folder."""
    from otbflow.model import build_char_tokenizer, build_tiny_model

    path = tmp_path_factory.mktemp("policy") / "policy"
    tok = build_char_tokenizer()
    model = build_tiny_model(cfg.model, tok, seed=0)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory, cfg):
    from otbflow import shard

    out = tmp_path_factory.mktemp("data")
    shard.run(cfg, shard.Args(out_dir=str(out)))
    return out


@pytest.fixture(scope="session")
def rollouts_path(tmp_path_factory, cfg, tiny_policy, data_dir):
    from otbflow import rollout

    out = tmp_path_factory.mktemp("rollout") / "shard_0.parquet"
    rollout.run(cfg, rollout.Args(prompts=str(data_dir / "train" / "shard_0.parquet"), policy=str(tiny_policy),
                                  out=str(out), iteration=0))
    return out


@pytest.fixture(scope="session")
def features_path(tmp_path_factory, cfg, tiny_policy, rollouts_path):
    from otbflow import features

    out = tmp_path_factory.mktemp("features") / "shard_0.parquet"
    features.run(cfg, features.Args(rollouts=str(rollouts_path), policy=str(tiny_policy), out=str(out)))
    return out
