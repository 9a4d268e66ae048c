import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO

from otbflow.cli import STAGES
from otbflow.config import DEFAULT_CONFIG, Config, ConfigError, json_schema, load_config


def test_default_config_file_and_schema_defaults_agree():
    """config/config.yaml and the dataclass defaults (what `--help`, `otbflow config --help-keys`
    and the JSON schema show) give the same value for every key the file sets."""
    from omegaconf import OmegaConf

    raw = yaml.safe_load(DEFAULT_CONFIG.read_text())
    schema = OmegaConf.to_container(OmegaConf.structured(Config))

    def differ(file: dict, defaults: dict, prefix: str = ""):
        for key, value in file.items():
            if isinstance(value, dict):
                yield from differ(value, defaults[key], f"{prefix}{key}.")
            elif value != defaults[key]:
                yield f"{prefix}{key}: file {value!r}, schema {defaults[key]!r}"

    assert list(differ(raw, schema)) == []
    assert load_config(DEFAULT_CONFIG) == load_config(None)  # schema defaults alone give the default config


@pytest.mark.parametrize(
    "override, key, allowed",
    [
        ("rollout.group_size=0", "rollout.group_size", ">= 1"),
        ("advantages.estimator=foo", "advantages.estimator", "grpo"),
        ("rollout.temperature=0", "rollout.temperature", "> 0"),
        ("rollout.temperature=-1.5", "rollout.temperature", "> 0"),
        ("rollout.top_p=1.5", "rollout.top_p", "(0, 1]"),
        ("train.zero_stage=4", "train.zero_stage", "0, 1, 2, 3"),
        ("train.mini_batch_size=10", "train.mini_batch_size", "multiple"),
        ("advantages.compare=[otb,nope]", "advantages.compare[1]", "otb"),
        ("train.bf16=true", "train.bf16", "zero_stage >= 1"),
        ("advantages.estimator=otb_tir", "advantages.estimator", "loss_mask"),
        ("advantages.compare=[grpo,otb_tir]", "advantages.compare[1]", "loss_mask"),
        ("advantages.compare=[eob]", "advantages.compare[0]", "features.exact_grad_norm"),
        ("variance.estimators=[otb_tir]", "variance.estimators[0]", "loss_mask"),
        ("advantages.baseline_shift=nan", "advantages.baseline_shift", "finite"),
    ],
)
def test_impossible_values_name_the_key(override, key, allowed):
    with pytest.raises(ConfigError) as e:
        load_config(DEFAULT_CONFIG, [override])
    assert f"'{key}'" in str(e.value) and allowed in str(e.value)


def test_baseline_shift_is_refused_where_it_has_no_meaning():
    with pytest.raises(ConfigError) as e:
        load_config(DEFAULT_CONFIG, ["advantages.estimator=reinforce_pp_baseline", "advantages.baseline_shift=-0.1"])
    assert "'advantages.baseline_shift'" in str(e.value) and "reinforce_pp_baseline" in str(e.value)
    assert "whitened" in str(e.value)  # says why
    # as a compared estimator it runs without the shift (the comparison table records 0), so the
    # config is valid; so are a zero shift and the estimators that take one
    load_config(
        DEFAULT_CONFIG,
        [
            "advantages.estimator=rloo",
            "advantages.baseline_shift=-0.1",
            "advantages.compare=[reinforce_pp_baseline,grpo]",
        ],
    )
    load_config(DEFAULT_CONFIG, ["advantages.estimator=reinforce_pp_baseline"])
    load_config(DEFAULT_CONFIG, ["advantages.compare=[eob]", "features.exact_grad_norm=true"])


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
    with pytest.raises(Exception):  # noqa: B017 (omegaconf's ReadonlyConfigError)
        cfg.rollout.group_size = 2


def test_json_schema_file_is_in_sync():
    on_disk = yaml.safe_load((REPO / "workflow" / "schemas" / "config.schema.yaml").read_text())
    assert on_disk == json_schema(), "regenerate: otbflow config --json-schema > workflow/schemas/config.schema.yaml"


def test_schema_doc_is_in_sync():
    from otbflow.schemas import schema_markdown

    assert (REPO / "docs" / "schema.md").read_text().strip() == schema_markdown().strip(), (
        "regenerate: otbflow schema-doc > docs/schema.md"
    )


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
    if example.name.startswith("zero"):  # the GPU training examples
        assert cfg.train.bf16 and cfg.train.zero_stage in (2, 3) and cfg.resources.train.gpu >= 1
    elif example.name == "qwen2_bpe_chat.yaml":
        assert (cfg.model.arch, cfg.model.tokenizer, cfg.task.chat) == ("qwen2", "bpe", "auto")
    else:
        assert example.name == "vllm_cpu.yaml" and cfg.rollout.backend == "vllm" and cfg.rollout.kv_cache_gib > 0


def test_a_dataset_workflow_needs_a_model_folder(tmp_path):
    """The shard stage alone takes a dataset without a model; the workflow, whose bootstrap builds
    policies for the built-in task only, stops before any job and names model.path."""
    data = tmp_path / "x.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    load_config(DEFAULT_CONFIG, ["task.name=dataset", f"task.path={data}"])
    res = subprocess.run(
        [
            str(Path(sys.executable).with_name("snakemake")),
            "-s",
            str(REPO / "Snakefile"),
            "-n",
            "--config",
            f"task={{name: dataset, path: {data}}}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert res.returncode != 0
    assert "'model.path': must be a local HF causal-LM folder when task.name is 'dataset'" in res.stdout + res.stderr


def test_snakemake_config_strings_are_typed_by_the_schema():
    """Snakemake parses `--config 'rollout={group_size: 8}'` with YAML's BaseLoader: the values
    inside arrive as strings. The typed schema must read them as the README's overrides mean."""
    from otbflow.config import from_snakemake

    raw = {
        "rollout": {"group_size": "8"},
        "train": {"lr": "0.0001"},
        "advantages": {"estimator": "grpo", "std_normalize": "false", "compare": ["grpo", "otb"]},
        "model": {"path": "null"},
        "task": {"prompt_template": "null {prompt}"},
        "seed": 3,
    }
    cfg = load_config(DEFAULT_CONFIG, extra=from_snakemake(raw))
    assert cfg.rollout.group_size == 8 and cfg.train.lr == 0.0001 and cfg.advantages.std_normalize is False
    assert cfg.model.path is None and cfg.task.prompt_template == "null {prompt}" and cfg.seed == 3
    assert list(cfg.advantages.compare) == ["grpo", "otb"]
    with pytest.raises(ConfigError, match="rollout.group_size"):
        load_config(DEFAULT_CONFIG, extra=from_snakemake({"rollout": {"group_size": "eight"}}))
