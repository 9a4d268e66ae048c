import subprocess
import sys

import pytest
import yaml

from otbflow.cli import STAGES
from otbflow.config import DEFAULT_CONFIG, ConfigError, json_schema, load_config

from conftest import REPO


def test_default_config_loads_and_matches_schema_defaults():
    cfg = load_config(DEFAULT_CONFIG)
    assert cfg.rollout.group_size == 4
    assert cfg.advantages.estimator == "otb"
    assert load_config(None).seed == 0  # schema defaults alone are valid


@pytest.mark.parametrize("override, key, allowed", [
    ("rollout.group_size=0", "rollout.group_size", ">= 1"),
    ("advantages.estimator=foo", "advantages.estimator", "grpo"),
    ("rollout.temperature=0", "rollout.temperature", "> 0"),
    ("rollout.temperature=-1.5", "rollout.temperature", "> 0"),
    ("rollout.top_p=1.5", "rollout.top_p", "(0, 1]"),
    ("train.zero_stage=4", "train.zero_stage", "0, 1, 2, 3"),
    ("train.mini_batch_size=10", "train.mini_batch_size", "multiple"),
    ("advantages.compare=[otb,nope]", "advantages.compare[1]", "otb"),
    ("train.bf16=true", "train.bf16", "zero_stage >= 1"),
])
def test_impossible_values_name_the_key(override, key, allowed):
    with pytest.raises(ConfigError) as e:
        load_config(DEFAULT_CONFIG, [override])
    assert f"'{key}'" in str(e.value) and allowed in str(e.value)


def test_unknown_key_names_key_and_allowed_keys():
    with pytest.raises(ConfigError) as e:
        load_config(DEFAULT_CONFIG, ["rollout.groupsize=4"])
    msg = str(e.value)
    assert "rollout.groupsize" in msg and "unknown key" in msg and "group_size" in msg
    with pytest.raises(ConfigError, match="'colour'"):
        load_config(DEFAULT_CONFIG, extra={"colour": "red"})


def test_wrong_type_names_key():
    with pytest.raises(ConfigError, match="rollout.group_size"):
        load_config(DEFAULT_CONFIG, ["rollout.group_size=many"])


def test_snakemake_style_dotted_keys_are_nested():
    cfg = load_config(DEFAULT_CONFIG, extra={"advantages.estimator": "grpo", "rollout": {"group_size": 8}})
    assert cfg.advantages.estimator == "grpo" and cfg.rollout.group_size == 8
    assert cfg.rollout.temperature == 1.0  # the rest of the section keeps its defaults


def test_config_is_read_only():
    cfg = load_config(DEFAULT_CONFIG)
    with pytest.raises(Exception):
        cfg.rollout.group_size = 2


def test_json_schema_file_is_in_sync():
    on_disk = yaml.safe_load((REPO / "workflow" / "schemas" / "config.schema.yaml").read_text())
    assert on_disk == json_schema(), "regenerate: otbflow config --json-schema > workflow/schemas/config.schema.yaml"


def test_schema_doc_is_in_sync():
    from otbflow.schemas import schema_markdown

    assert (REPO / "docs" / "schema.md").read_text().strip() == schema_markdown().strip(), \
        "regenerate: otbflow schema-doc > docs/schema.md"


def _otbflow(*args):
    return subprocess.run([sys.executable, "-m", "otbflow", *args], capture_output=True, text=True, cwd=REPO)


def test_cli_bad_config_exits_nonzero_with_key():
    res = _otbflow("shard", "--out-dir", "/nonexistent", "rollout.group_size=0")
    assert res.returncode == 2
    assert "rollout.group_size" in res.stderr


@pytest.mark.parametrize("stage", list(STAGES))
def test_every_stage_has_help(stage):
    res = _otbflow(stage, "--help")
    assert res.returncode == 0, res.stderr
    assert "--config" in res.stdout and "config keys read by this stage" in res.stdout


def test_config_command_prints_resolved_yaml():
    res = _otbflow("config", "rollout.group_size=8")
    assert res.returncode == 0
    assert yaml.safe_load(res.stdout)["rollout"]["group_size"] == 8


@pytest.mark.parametrize("example", sorted((REPO / "config" / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_example_configs_are_valid(example):
    cfg = load_config(DEFAULT_CONFIG, extra=yaml.safe_load(example.read_text()))
    assert cfg.train.bf16 and cfg.train.zero_stage in (2, 3) and cfg.resources.train.gpu >= 1
