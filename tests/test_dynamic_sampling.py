"""DAPO's dynamic sampling (rollout.filter_groups) in the rollout stage: no group whose verifiable
rewards are all equal is kept, the job samples further rounds from a deterministic stream until
it holds its share or rollout.max_gen_batches rounds are spent, and says what happened."""

from __future__ import annotations

import logging

import polars as pl
import pytest
from conftest import tiny_config

from otbflow import schemas
from otbflow.algorithms.rewards import REWARDS, register
from otbflow.io import read_metadata, read_table


@pytest.fixture(autouse=True, scope="module")
def test_verifiers():
    """Verifiers only these tests know (the rollout stage runs in-process), removed afterwards so
    that the registry the config's choices come from is the package's again: the untrained tiny
    policy writes random characters, so a length rule gives mixed groups and 'never' none."""
    # 2 of 5 lengths score 1: the first round leaves some group uniform, the shard's 16 prompts give
    # at least 4 informative groups (with the Philox sampler; "0 of 5" gave 3 of 16)
    register("length_mod5")(lambda text, answer: float(len(text) % 5 in (0, 1)))
    register("never")(lambda text, answer: 0.0)
    register("times_out_mod3")(times_out_mod3)
    yield
    for name in ("length_mod5", "never", "times_out_mod3"):
        REWARDS.pop(name)


TIMED_OUT: list[str] = []


def times_out_mod3(text: str, answer: str) -> float:
    """A verifier whose calls on responses of a length divisible by 3 run past the deadline: it
    counts them as the math reward's worker does (otbflow.algorithms.rewards.reward_timeouts) and scores 0."""
    from otbflow.algorithms import rewards

    if len(text) % 3:
        return float(len(text) % 3 == 1)
    TIMED_OUT.append(text)
    rewards._WORKER.timeouts += 1
    return 0.0


def roll(tiny_policy, data_dir, path, *overrides):
    from otbflow.stages import rollout

    cfg = tiny_config("rollout.filter_groups=true", "task.reward=length_mod5", *overrides)
    args = rollout.Args(prompts=str(data_dir / "train" / "shard_0.parquet"), policy=str(tiny_policy), out=str(path))
    rollout.run(cfg, args)
    return read_table(path, schemas.ROLLOUTS), read_metadata(path)["dynamic_sampling"]


def uniform(df: pl.DataFrame) -> int:
    return df.group_by("group_id").agg(pl.col("verifiable_reward").n_unique() == 1)["verifiable_reward"].sum()


def test_rounds_until_the_share_is_full_trimmed_to_it(tiny_policy, data_dir, tmp_path):
    """Share 4 groups of 4 (prompts_per_iteration 8 over 2 shards), no round limit: exactly 4
    informative groups; the tokens count every round's; a job limited to one round samples the
    same first round (the same seed and prompts), keeping its informative groups only."""
    df, stats = roll(tiny_policy, data_dir, tmp_path / "all.parquet", "rollout.max_gen_batches=0")
    assert uniform(df) == 0 and df["group_id"].n_unique() == 4 and df.height == 16
    assert stats["reached"] and stats["groups_kept"] == 4 and stats["groups_informative"] >= 4
    assert stats["groups_generated"] == 4 * stats["rounds"]  # 16 prompts: every round draws a full share
    assert stats["rounds"] == len(stats["round_seeds"]) == len(set(stats["round_seeds"]))
    assert stats["tokens_generated"] > df["response_length"].sum()  # the dropped groups' tokens count
    assert stats["rounds"] >= 2, "the length rule should leave some group uniform in the first round"

    one, first = roll(tiny_policy, data_dir, tmp_path / "one.parquet", "rollout.max_gen_batches=1")
    assert first["rounds"] == 1 and first["round_seeds"][0] == stats["round_seeds"][0]
    assert uniform(one) == 0 and one["group_id"].n_unique() == first["groups_kept"] == first["groups_informative"]
    assert not first["reached"] and first["groups_kept"] < 4  # the unlimited job needed a second round
    # the first round's kept groups come first in the unlimited job's table, row for row
    assert df.head(one.height).drop("seed").equals(one.drop("seed"))
    assert set(one["seed"].to_list()) == {stats["round_seeds"][0]}


def test_a_job_short_of_its_share_trains_on_what_it_has_and_says_so(tiny_policy, data_dir, tmp_path, caplog):
    """A share of 16 groups on a 16-prompt shard: one round uses every prompt, the uniform groups go
    and nothing is left to draw from: fewer than 16 groups, 'reached' false, a warning."""
    with caplog.at_level(logging.WARNING, logger="otbflow.rollout"):
        df, stats = roll(tiny_policy, data_dir, tmp_path / "short.parquet", "rollout.prompts_per_iteration=32")
    assert stats["rounds"] == 1 and stats["groups_generated"] == 16
    assert 0 < stats["groups_kept"] < 16 and not stats["reached"] and uniform(df) == 0
    assert df["group_id"].n_unique() == stats["groups_kept"]
    assert "training on these" in caplog.text


def test_a_shard_without_informative_groups_writes_an_empty_table(tiny_policy, data_dir, tmp_path):
    """Every group uniform ('never' scores nothing right): the job spends its rounds and writes an
    empty table, short of its share; the advantages stage refuses an iteration whose shards are all
    empty, naming the way out."""
    df, stats = roll(tiny_policy, data_dir, tmp_path / "none.parquet", "task.reward=never", "rollout.max_gen_batches=2")
    assert df.height == 0 and stats["rounds"] == 2 and stats["groups_kept"] == 0 and not stats["reached"]
    assert stats["tokens_generated"] > 0
    from otbflow.stages import advantages, features

    cfg = tiny_config("rollout.filter_groups=true", "task.reward=never")
    feats = tmp_path / "features.parquet"
    features.run(cfg, features.Args(rollouts=str(tmp_path / "none.parquet"), policy=str(tiny_policy), out=str(feats)))
    assert read_table(feats, schemas.FEATURES).height == 0
    args = advantages.Args(
        features=[str(feats)], out=str(tmp_path / "a.parquet"), comparison=str(tmp_path / "c.parquet")
    )
    with pytest.raises(ValueError, match="rollout.max_gen_batches"):
        advantages.run(cfg, args)
    assert not (tmp_path / "a.parquet").exists()


def test_a_group_of_one_is_refused_with_filtering():
    from otbflow.config import ConfigError

    with pytest.raises(ConfigError, match="config key 'rollout.group_size'"):
        tiny_config("rollout.filter_groups=true", "rollout.group_size=1")


def test_reward_timeouts_are_counted_over_every_round_and_warned_of(tiny_policy, data_dir, tmp_path, caplog):
    """Issue 35: a reward call past its deadline scores 0 silently no more. The rollout's metadata
    counts the calls of every round (dropped groups' included), the job's log says how many, and
    the report's rollouts table sums them per iteration."""
    TIMED_OUT.clear()
    with caplog.at_level(logging.WARNING, logger="otbflow.rollout"):
        df, stats = roll(
            tiny_policy, data_dir, tmp_path / "t.parquet", "task.reward=times_out_mod3", "rollout.max_gen_batches=0"
        )
    meta = read_metadata(tmp_path / "t.parquet")
    kept = int((df["response_text"].str.len_chars() % 3 == 0).sum())
    assert stats["rounds"] >= 2 and len(TIMED_OUT) > kept  # some of them in dropped groups
    assert meta["reward_timeouts"] == len(TIMED_OUT)
    assert f"{len(TIMED_OUT)} reward calls ran past the reward's deadline and scored 0" in caplog.text


def test_the_report_sums_the_reward_timeouts_per_iteration(rollouts_path, tmp_path):
    from otbflow.io import write_parquet
    from otbflow.stages import report

    roll = pl.read_parquet(rollouts_path)
    paths = []
    for k, shard, meta in [(0, 0, {"reward_timeouts": 2}), (0, 1, {"reward_timeouts": 3}), (1, 0, {"seed": 1})]:
        table = roll.with_columns(pl.lit(k, pl.Int64).alias("iteration"), pl.lit(shard, pl.Int64).alias("shard"))
        paths.append(str(write_parquet(table, tmp_path / f"r{k}_{shard}.parquet", metadata=meta)))
    out = report.rollout_table(paths)
    assert out.columns[-1] == "reward_timeouts"  # appended: the table's other columns keep their places
    assert out["reward_timeouts"].to_list() == [5, 0]  # a file written before the count: none
