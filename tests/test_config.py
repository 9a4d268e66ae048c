import copy
import dataclasses
import functools
import json
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml
from conftest import REPO

from otbflow.config import DEFAULT_CONFIG, Config, ConfigError, json_schema, load_config
from otbflow.pipeline import STAGES


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
        ("rollout.group_size=0", "rollout.group_size", "in [1, 1000000]"),
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
        ("task.prompt_template='Answer: {{prompt}}'", "task.prompt_template", "braces other than {prompt} are literal"),
        ("task.prompt_template='Use \\boxed{{}}. {prompt}'", "task.prompt_template", "are literal now"),
        ("task.prompt_template='Answer:'", "task.prompt_template", "containing {prompt}"),
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


def test_staleness_needs_a_behaviour_weight_and_explicit_trm_thresholds(tmp_path):
    """At rollout.staleness >= 1 the stale samples need decoupled PPO's behaviour weight, and TRM's
    engine-mismatch defaults would mask a lagged batch: both are refused, naming the key."""
    stale = ["rollout.staleness=1", "train.rollout_is=token"]
    with pytest.raises(ConfigError, match=r"'train.rollout_is': must be token or sequence when rollout.staleness"):
        load_config(DEFAULT_CONFIG, ["rollout.staleness=1"])
    load_config(DEFAULT_CONFIG, ["rollout.staleness=0", "train.trm=true"])  # on-policy: as before
    load_config(DEFAULT_CONFIG, stale)
    with pytest.raises(ConfigError) as e:
        load_config(DEFAULT_CONFIG, [*stale, "train.trm=true"])
    assert "'train.trm'" in str(e.value) and "mismatch.max_k2 and mismatch.mean_k3" in str(e.value)
    # the defaults restated by the user count as chosen, in an override, Snakemake's config or a file
    with pytest.raises(ConfigError, match="mismatch.mean_k3 are set explicitly"):
        load_config(DEFAULT_CONFIG, [*stale, "train.trm=true", "mismatch.max_k2=0.05"])
    load_config(DEFAULT_CONFIG, [*stale, "train.trm=true", "mismatch.max_k2=0.05", "mismatch.mean_k3=0.02"])
    snakemake_config = {"rollout": {"staleness": 2}, "train": {"rollout_is": "sequence", "trm": True}}
    with pytest.raises(ConfigError, match="'train.trm'"):  # the Snakefile's path: Snakemake's config as extra
        load_config(DEFAULT_CONFIG, extra=snakemake_config)
    load_config(DEFAULT_CONFIG, extra=snakemake_config | {"mismatch": {"max_k2": 0.5, "mean_k3": 0.02}})
    mine = tmp_path / "mine.yaml"
    mine.write_text("mismatch: {max_k2: 0.5, mean_k3: 0.02}\n")
    load_config(mine, [*stale, "train.trm=true"])


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
    on_disk = json.loads((REPO / "workflow" / "schemas" / "config.schema.json").read_text())
    assert on_disk == json_schema(), "regenerate: otbflow config --json-schema > workflow/schemas/config.schema.json"


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
    res = _otbflow(STAGES[stage].command, "--help")
    assert res.returncode == 0, res.stderr
    keys = {
        "experiment": "this stage reads no config key",
        # what it keeps comes from the workflow (--keep-* flags, from retention and iterations)
        "prune": "config keys that shape the workflow around it",
        # it renames what the train job wrote: whether there is a state at all is the workflow's
        "publish_optimizer": "config keys that shape the workflow around it",
        # the fp32 weights of its input AdamW state: whether it runs at all is the workflow's
        "export": "config keys that shape the workflow around it",
    }.get(stage, "config keys that change this stage's outputs")
    assert "--config" in res.stdout and keys in res.stdout


def test_stage_help_separates_output_keys_from_execution_keys():
    out = _otbflow("rollout", "--help").stdout
    outputs, execution = out.split("config keys that change how it runs")
    assert "rollout.group_size (default 8)" in outputs and "rollout.python" not in outputs
    # every row draws its own noise: the transformers batch size changes only memory and speed
    assert "rollout.python" in execution and "rollout.batch_size" in execution and "rollout.batch_size" not in outputs
    assert "  train." not in out  # the rollout reads no training option


def test_config_command_prints_resolved_yaml():
    res = _otbflow("config", "rollout.group_size=8")
    assert res.returncode == 0
    assert yaml.safe_load(res.stdout)["rollout"]["group_size"] == 8


@pytest.mark.parametrize("example", sorted((REPO / "config" / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_example_configs_are_valid(example):
    cfg = load_config(DEFAULT_CONFIG, extra=yaml.safe_load(example.read_text()))
    if example.name.startswith("zero"):  # the GPU training examples
        assert cfg.train.bf16 and cfg.train.zero_stage in (2, 3) and cfg.resources.train.gpu >= 1
    elif example.name == "gpu_qwen2.5-0.5b.yaml":  # the GPU check's setting: one step of 64 prompts x 8 per iteration
        assert cfg.train.bf16 and cfg.train.zero_stage == 1 and cfg.model.dtype == "bfloat16"
        assert cfg.rollout.prompts_per_iteration * cfg.rollout.group_size == cfg.train.mini_batch_size == 512
        assert cfg.rollout.batch_size == 64 and cfg.rollout.max_new_tokens == 192 and cfg.shard.n_shards == 1
        assert all(cfg.resources[s].gpu == 1 for s in ("rollout", "features", "train", "evaluate"))
    elif example.name == "qwen2_bpe_chat.yaml":
        assert (cfg.model.arch, cfg.model.tokenizer, cfg.task.chat) == ("qwen2", "bpe", "auto")
    elif example.name == "long_tail.yaml":  # issue 57's setting: min(2 + Geometric(0.35), 24) operands
        assert (cfg.task.min_terms, cfg.task.max_terms, cfg.task.terms_tail) == (2, 24, 0.35)
        assert cfg.rollout.max_new_tokens >= 23 * 8 and cfg.model.n_positions >= 50 + cfg.rollout.max_new_tokens
    elif example.name == "stream.yaml":  # Laminar's streaming rollouts, within two iterations of lag
        assert cfg.rollout.stream and cfg.rollout.staleness == 2 and cfg.rollout.take_newer == "step"
    else:
        assert example.name == "vllm_cpu.yaml" and cfg.rollout.backend == "vllm" and cfg.rollout.enforce_eager


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


# ------------------------------------------------------------------------------------------
# Bounds declared beside the fields (dataclass metadata), enforced and carried by the JSON schema
# ------------------------------------------------------------------------------------------


def _declared(cls=Config, prefix=""):
    """(key, type, metadata) of every field of the schema that declares bounds or choices."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _declared(hints[f.name], f"{prefix}{f.name}.")
        elif typing.get_origin(hints[f.name]) is dict:  # name -> section: the train stage's resources
            yield from _declared(typing.get_args(hints[f.name])[1], f"{prefix}{f.name}.train.")
        elif f.metadata:
            yield f"{prefix}{f.name}", hints[f.name], dict(f.metadata)


DECLARED = {key: (tp, meta) for key, tp, meta in _declared()}
# Overrides that a value needs to pass the rules between keys (which this test does not exercise)
CONTEXT = {
    "model.n_embd=1": ["model.n_head=1"],
    "task.max_terms=1": ["task.min_terms=1"],
    "train.mini_batch_size=1": ["train.micro_batch_size=1"],
    "task.name=dataset": ["task.path=prompts.jsonl"],
    "advantages.estimator=eob": ["features.exact_grad_norm=true"],
    "advantages.compare=[eob]": ["features.exact_grad_norm=true"],
    # the upper bounds (issue 35), where a rule relates the key to another
    "model.n_head=100000": ["model.n_embd=100000"],
    "model.n_kv_head=100000": ["model.n_head=100000", "model.n_embd=100000", "model.arch=llama"],
    "task.min_terms=10000": ["task.max_terms=10000"],
    "train.micro_batch_size=100000000": ["train.mini_batch_size=100000000"],
    "task.overlong_buffer=100000000": ["rollout.max_new_tokens=100000000"],
    "rollout.staleness=1000000": ["train.rollout_is=token"],
    "rollout.take_newer=step": ["rollout.staleness=1", "train.rollout_is=token"],
    "rollout.take_newer=trajectory": ["rollout.staleness=1", "train.rollout_is=token"],
    "rollout.stream=true": ["rollout.staleness=1", "train.rollout_is=token", "rollout.take_newer=step"],
}
# Values inside the declared choices that a rule between keys always refuses
REFUSED = {"advantages.estimator=otb_tir", "advantages.compare=[otb_tir]", "variance.estimators=[otb_tir]"}


@functools.cache
def _schema():
    from omegaconf import OmegaConf

    return OmegaConf.structured(Config)


def _check(override: str) -> None:
    """load_config's merge and validation, without re-reading the default file (faster)."""
    from omegaconf import OmegaConf

    from otbflow.config import validate

    validate(OmegaConf.merge(_schema(), OmegaConf.from_dotlist([override, *CONTEXT.get(override, [])])))


def _cases(key, tp, meta):
    """(override, named key or None when it must pass) around each declared bound or choice."""
    if typing.get_origin(tp) is typing.Union:  # Optional[X]: X's bounds
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    if "choices" in meta or "item_choices" in meta:
        choices = meta.get("choices", meta.get("item_choices"))
        bad = max(choices) + 1 if tp is int else "not-a-choice"
        if "item_choices" in meta:
            yield f"{key}=[{bad}]", f"{key}[0]"
            yield from ((f"{key}=[{c}]", None) for c in choices)
        else:
            yield f"{key}={bad}", key
            yield from ((f"{key}={c}", None) for c in choices)
        return
    step = 1 if tp is int else 1e-6
    if "ge" in meta:
        yield f"{key}={meta['ge'] - step}", key
        yield f"{key}={meta['ge']}", None
    if "gt" in meta:
        yield f"{key}={meta['gt']}", key
        yield f"{key}={meta['gt'] + step}", None
    if "le" in meta:
        yield f"{key}={meta['le'] + step}", key
        yield f"{key}={meta['le']}", None
    if "lt" in meta:
        yield f"{key}={meta['lt']}", key
        yield f"{key}={meta['lt'] - step}", None
    if meta.get("finite"):
        yield f"{key}=nan", key
        yield f"{key}=inf", key
        yield f"{key}=-0.5", key if ("ge" in meta or "gt" in meta) and -0.5 < meta.get("ge", meta.get("gt")) else None


def test_bounds_are_declared_for_the_options_that_had_checks():
    assert len(DECLARED) >= 90
    assert DECLARED["rollout.group_size"][1] == {"ge": 1, "le": 1_000_000}
    assert DECLARED["rollout.top_p"][1] == {"gt": 0, "le": 1}
    assert DECLARED["resources.train.gpu"][1] == {"ge": 0, "le": 1_000_000}
    assert DECLARED["scaling.ci_resamples"][1] == {"ge": 10, "le": 100_000_000}


@pytest.mark.parametrize("key", sorted(DECLARED))
def test_every_declared_bound_is_enforced(key):
    """Just outside each declared bound (or choice list) fails naming the key, on or just inside
    it passes."""
    tp, meta = DECLARED[key]
    cases = list(_cases(key, tp, meta))
    assert cases, f"{key}: metadata {meta} declares nothing this test knows"
    for override, named in cases:
        if override in REFUSED:
            continue
        if named is None:
            _check(override)
            continue
        with pytest.raises(ConfigError) as e:
            _check(override)
        assert str(e.value).startswith(f"config key '{named}': must be "), (override, str(e.value))
    if "doc_allowed" in meta:
        assert meta["doc_allowed"] in str(e.value)


def test_bound_messages():
    for override, message in [
        ("rollout.group_size=0", "config key 'rollout.group_size': must be in [1, 1000000] (got 0)"),
        ("rollout.top_p=0", "config key 'rollout.top_p': must be in (0, 1] (got 0.0)"),
        ("bootstrap.slip_rate=1", "config key 'bootstrap.slip_rate': must be in [0, 1) (got 1.0)"),
        ("train.rollout_is=all", "config key 'train.rollout_is': must be one of none, token, sequence (got 'all')"),
        ("rollout.backend=sglang", "config key 'rollout.backend': must be one of hf, vllm (got 'sglang')"),
        ("resources.train.nodes=0", "config key 'resources.train.nodes': must be in [1, 1000000] (got 0)"),
        # issue 35: sizes and the learning rate bounded above, finite
        (
            "rollout.group_size=100000000000000000000",
            "config key 'rollout.group_size': must be in [1, 1000000] (got 100000000000000000000)",
        ),
        ("train.lr=inf", "config key 'train.lr': must be in (0, 1] (got inf)"),
        ("rollout.temperature=inf", "config key 'rollout.temperature': must be > 0 and finite (got inf)"),
        ("iterations=10000000", "config key 'iterations': must be in [1, 1000000] (got 10000000)"),
    ]:
        with pytest.raises(ConfigError) as e:
            load_config(DEFAULT_CONFIG, [override])
        assert str(e.value) == message


def test_json_schema_carries_the_bounds():
    import jsonschema

    props = json_schema()["properties"]
    rollout, train = props["rollout"]["properties"], props["train"]["properties"]
    assert (rollout["group_size"]["minimum"], rollout["group_size"]["maximum"]) == (1, 1_000_000)
    assert (train["lr"]["exclusiveMinimum"], train["lr"]["maximum"]) == (0, 1)
    assert (rollout["top_p"]["exclusiveMinimum"], rollout["top_p"]["maximum"]) == (0, 1)
    assert props["bootstrap"]["properties"]["slip_rate"]["exclusiveMaximum"] == 1
    assert rollout["backend"]["enum"] == ["hf", "vllm"]
    assert train["rollout_is"]["enum"] == ["none", "token", "sequence"]
    assert train["lr_schedule"]["enum"] == ["constant", "cosine", "length_decay"]
    assert train["loss_type"]["enum"] == ["ppo_clip", "reinforce"]
    assert train["loss_agg_mode"]["enum"] == [
        "token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum-norm",
    ]
    assert train["zero_stage"]["enum"] == [0, 1, 2, 3]
    assert props["task"]["properties"]["format"]["enum"] == ["auto", "prompt_answer", "verl", "gsm8k", "math"]
    estimators = ["eob", "grpo", "length_power", "none", "opo", "otb", "otb_tir", "reinforce_pp_baseline", "rloo"]
    assert props["advantages"]["properties"]["estimator"]["enum"] == estimators
    assert props["variance"]["properties"]["estimators"]["items"]["enum"] == estimators
    assert props["resources"]["additionalProperties"]["properties"]["gpu"]["minimum"] == 0
    assert props["scaling"]["properties"]["ci_resamples"]["minimum"] == 10
    # what Snakemake's validate does with it: the default config passes, an out-of-bounds value fails
    from otbflow.config import to_container

    good = to_container(load_config(DEFAULT_CONFIG))
    jsonschema.validate(good, json_schema())
    for key, value in [("group_size", 0), ("group_size", 10**20), ("backend", "sglang"), ("top_p", 0)]:
        bad = copy.deepcopy(good)
        bad["rollout"][key] = value
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, json_schema())


def test_a_renamed_key_names_its_new_name(tmp_path):
    old = tmp_path / "old.yaml"
    old.write_text("scaling:\n  bootstrap: 100\n")
    for how in (
        {"overrides": ["scaling.bootstrap=100"]},
        {"extra": {"scaling": {"bootstrap": 100}}},
        {"extra": {"scaling.bootstrap": 100}},
        {"path": old},
    ):
        with pytest.raises(ConfigError) as e:
            load_config(**({"path": DEFAULT_CONFIG} | how))
        assert str(e.value) == "config key 'scaling.bootstrap' was renamed to 'scaling.ci_resamples'"
    assert load_config(DEFAULT_CONFIG, ["scaling.ci_resamples=100"]).scaling.ci_resamples == 100
    res = _otbflow("config", "scaling.bootstrap=100")
    assert res.returncode == 2 and "'scaling.bootstrap' was renamed to 'scaling.ci_resamples'" in res.stderr


def test_every_field_has_a_docstring():
    """The metadata helper keeps the docstring-under-field convention (field_docs reads both)."""
    from otbflow.config import field_docs

    hints = typing.get_type_hints(Config)
    for cls in {Config, *(t for t in hints.values() if dataclasses.is_dataclass(t))}:
        for klass in [cls, *(t for t in typing.get_type_hints(cls).values() if dataclasses.is_dataclass(t))]:
            if klass is Config:
                continue
            docs = field_docs(klass)
            assert {f.name for f in dataclasses.fields(klass)} <= set(docs), klass.__name__
    assert "Most responses measured" in field_docs(type(Config().scaling))["max_sequences"]


def test_a_choice_registered_later_is_checked_by_what_it_declares():
    """Every list of choices is a Registry of one shape (otbflow.registry). A learning-rate schedule
    registered after the config module loaded is allowed, its options enter the train stage's
    rerun trigger, and the config checks its requirement without knowing it by name."""
    from otbflow import engines
    from otbflow.algorithms import estimators, losses, lr_schedule, rewards, rollout_is, shaping
    from otbflow.models import architectures, tasks
    from otbflow.registry import Registry, Requirement

    for registry in (
        estimators.ESTIMATORS,
        losses.POLICY_LOSSES,
        losses.LOSS_AGGREGATIONS,
        lr_schedule.SCHEDULES,
        rewards.REWARDS,
        shaping.SHAPED_REWARDS,
        rollout_is.ROLLOUT_IS_LEVELS,
        engines.BACKENDS,
        architectures.ARCHITECTURES,
        architectures.TOKENIZERS,
        tasks.TASKS,
        tasks.DATASET_FORMATS,
    ):
        assert isinstance(registry, Registry) and registry, registry

    @lr_schedule.SCHEDULES.register(
        "after_warmup",
        options=("lr_min_ratio",),
        requires=(Requirement("train.lr_warmup_steps", ">= 2", lambda steps, cfg: steps >= 2),),
    )
    class AfterWarmup(lr_schedule.Constant):
        """A test schedule: lr_min_ratio x lr after the warm-up."""

        @staticmethod
        def lr(t, s, k):
            return t.lr_min_ratio * t.lr

    try:
        with pytest.raises(ConfigError, match=r"'train.lr_warmup_steps': must be >= 2 with train.lr_schedule"):
            load_config(DEFAULT_CONFIG, ["train.lr_schedule=after_warmup"])
        cfg = load_config(DEFAULT_CONFIG, ["train.lr_schedule=after_warmup", "train.lr_warmup_steps=2"])
        assert "train.lr_min_ratio" in STAGES["train"].outputs(cfg)
        schedule = lr_schedule.LRSchedule(cfg.train)
        rates = []
        for _ in range(3):
            rates.append(schedule.lr())
            schedule.observe(10.0)
        lr = cfg.train.lr
        assert rates == [lr / 2, lr, cfg.train.lr_min_ratio * lr]  # two warm-up steps, then the schedule
    finally:
        del lr_schedule.SCHEDULES["after_warmup"]


def test_a_shaped_reward_registered_later_is_a_task_reward():
    """task.reward takes a shaped reward registered after the config module loaded; the rollout's
    scorer then trains with it, on the verifier its settings name, and evaluation's keys stay the
    verifier's."""
    from otbflow.algorithms import shaping

    def halved(correct, length, max_len, values, text):
        """A test shaped reward: half the verifiable reward."""
        return 0.5 * float(correct)

    shaping.SHAPED_REWARDS.register("halved", options=("cosine",), settings="cosine")(halved)
    try:
        cfg = load_config(DEFAULT_CONFIG, ["task.reward=halved"])
        assert shaping.Scorer(cfg)("#12", "12", 3) == (1.0, 0.5)  # arithmetic: the text after '#'
        assert "task.cosine.verifier" in shaping.verifier_keys(cfg.task)
        assert "task.cosine" in shaping.shaping_keys(cfg.task)
    finally:
        del shaping.SHAPED_REWARDS["halved"]
    with pytest.raises(ConfigError, match="task.reward"):
        load_config(DEFAULT_CONFIG, ["task.reward=halved"])


def _registries():
    from otbflow import engines
    from otbflow.algorithms import losses, rollout_is
    from otbflow.models import architectures, tasks

    return {
        "model.arch": architectures.ARCHITECTURES,
        "model.tokenizer": architectures.TOKENIZERS,
        "task.name": tasks.TASKS,
        "task.format": tasks.DATASET_FORMATS,
        "rollout.backend": engines.BACKENDS,
        "train.loss_agg_mode": losses.LOSS_AGGREGATIONS,
        "train.rollout_is": rollout_is.ROLLOUT_IS_LEVELS,
    }


@pytest.mark.parametrize("key", list(_registries()))
def test_a_choice_registered_later_is_allowed_and_its_requirement_checked(key):
    """A choice registered in the registry of ``key`` after the config module loaded is allowed,
    refused once removed, and the config checks its requirement, naming the required key."""
    from omegaconf import OmegaConf

    from otbflow.registry import Requirement

    registry = _registries()[key]
    needs_seed_7 = Requirement("seed", "7", lambda seed, cfg: seed == 7)
    registry.register("later_test", requires=(needs_seed_7,), doc="a test choice")(object())
    try:
        with pytest.raises(ConfigError) as e:
            load_config(DEFAULT_CONFIG, [f"{key}=later_test", "seed=3"])
        assert str(e.value) == f"config key 'seed': must be 7 with {key} later_test (got 3)"
        assert OmegaConf.select(load_config(DEFAULT_CONFIG, [f"{key}=later_test", "seed=7"]), key) == "later_test"
    finally:
        del registry["later_test"]
    with pytest.raises(ConfigError, match=f"config key '{key}': must be one of "):
        load_config(DEFAULT_CONFIG, [f"{key}=later_test", "seed=7"])


def test_the_built_in_requirements_name_their_key():
    """The rules that belong to one choice are that choice's requirements: the message names the
    required key and the choice."""
    for overrides, message in [
        (
            ["model.n_kv_head=2"],
            "config key 'model.n_kv_head': must be 0 (no grouped-query attention) with model.arch gpt2 (got 2)",
        ),
        (
            ["task.chat=true"],
            "config key 'task.chat': must be 'auto' or 'false' when the bootstrap builds the policy (it has no "
            "chat template) with model.tokenizer char (got 'True')",
        ),
        (
            ["task.name=dataset"],
            "config key 'task.path': must be a JSONL or Parquet file with task.name dataset (got None)",
        ),
    ]:
        with pytest.raises(ConfigError) as e:
            load_config(DEFAULT_CONFIG, overrides)
        assert str(e.value) == message
    load_config(DEFAULT_CONFIG, ["model.n_kv_head=2", "model.arch=llama"])
    load_config(DEFAULT_CONFIG, ["task.chat=true", "model.tokenizer=bpe"])
    load_config(DEFAULT_CONFIG, ["task.chat=true", "task.name=dataset", "task.path=x.jsonl"])


def test_a_loss_aggregation_registered_later_trains_with_its_option():
    """train.loss_agg_mode takes an aggregation registered later; aggregate_loss runs it, and the
    option it declares (loss_scale_factor) reaches it as the scale and enters the train stage's keys."""
    import torch

    from otbflow.algorithms import losses

    @losses.LOSS_AGGREGATIONS.register("token-sum-scaled", options=("loss_scale_factor",))
    def token_sum_scaled(per_seq, m, global_tokens, global_seqs, scale, seq_tokens):
        """sum_{i,t} m L / scale."""
        return per_seq.sum() / scale

    try:
        cfg = load_config(DEFAULT_CONFIG, ["train.loss_agg_mode=token-sum-scaled", "train.loss_scale_factor=4"])
        scale = losses.loss_scale(cfg)
        loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
        mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
        assert scale == 4 and float(losses.aggregate_loss(loss, mask, "token-sum-scaled", 3, 2, scale)) == 7 / 4
        assert losses.LOSS_AGGREGATIONS.option_keys("token-sum-scaled") == ["train.loss_scale_factor"]
    finally:
        del losses.LOSS_AGGREGATIONS["token-sum-scaled"]
    assert losses.loss_scale(load_config(DEFAULT_CONFIG, ["train.loss_scale_factor=4"])) == 1.0


def test_a_rollout_is_level_registered_later_weights_and_serves_stale_rollouts():
    """A level registered later that reads the truncation C is a level that weights: the
    rollout IS weights are its, and rollout.staleness >= 1 accepts it."""
    import torch

    from otbflow.algorithms import rollout_is

    @rollout_is.ROLLOUT_IS_LEVELS.register("flat_test", options=("rollout_is_threshold",))
    def flat(log_rho, m, threshold):
        """C / 2 on every token."""
        return m * threshold / 2

    try:
        load_config(DEFAULT_CONFIG, ["rollout.staleness=1", "train.rollout_is=flat_test"])
        mask = torch.tensor([[1.0, 0.0]])
        w = rollout_is.rollout_is_weights(torch.zeros(1, 2), mask, "flat_test", 3.0)
        assert w.tolist() == [[1.5, 0.0]]
        with pytest.raises(ConfigError, match="must be token or sequence or flat_test when rollout.staleness is 1"):
            load_config(DEFAULT_CONFIG, ["rollout.staleness=1"])
    finally:
        del rollout_is.ROLLOUT_IS_LEVELS["flat_test"]


def test_a_backend_registered_later_names_its_sample_and_run_keys():
    """A backend's options are the rollout.* keys it reads; those it declares as changing its
    samples enter the rollout stage's keys, the others are how it runs."""
    from otbflow.engines import BACKENDS

    BACKENDS.register("later_backend", options=("top_p", "batch_size"), samples=("top_p",), doc="a test")("x:Y")
    try:
        cfg = load_config(DEFAULT_CONFIG, ["rollout.backend=later_backend"])
        entry = BACKENDS["later_backend"]
        assert (entry.target, entry.sample_keys, entry.run_keys) == ("x:Y", ("rollout.top_p",), ("rollout.batch_size",))
        assert "rollout.top_p" in STAGES["rollout"].outputs(cfg)
    finally:
        del BACKENDS["later_backend"]


def test_a_task_and_a_layout_registered_later_give_the_prompts(tmp_path):
    """task.name takes a task registered later, whose splits the shard stage's prompt_splits
    returns and whose options are its keys; one the bootstrap cannot build a policy for needs
    model.path in the workflow. task.format takes a layout registered later, which reads the file
    after its columns are checked."""
    import polars as pl

    from otbflow.config import validate_workflow
    from otbflow.models import tasks

    @tasks.TASKS.register("fixed_test", options=("n_eval",))
    def fixed(cfg):
        """Two fixed prompts."""
        rows = pl.DataFrame({"prompt": ["1+1=", "2+2="], "answer": ["2", "4"]})
        return rows[1:], rows[:1]

    @tasks.DATASET_FORMATS.register("qa_test", columns=("q", "a"))
    def qa(df, path, prompt_template, source):
        """Columns q, a."""
        return tasks._text_rows(df["q"].to_list(), df["a"].to_list(), source, prompt_template)

    try:
        cfg = load_config(DEFAULT_CONFIG, ["task.name=fixed_test"])
        train, ev = tasks.prompt_splits(cfg)
        assert (train["prompt"].to_list(), ev["prompt"].to_list()) == (["2+2="], ["1+1="])
        with pytest.raises(
            ConfigError, match="'model.path': must be a local HF causal-LM folder when task.name is 'fixed_test'"
        ):
            validate_workflow(cfg)
        data = tmp_path / "qa.jsonl"
        data.write_text('{"q": "3+4=", "a": "7"}\n')
        load_config(DEFAULT_CONFIG, ["task.name=dataset", f"task.path={data}", "task.format=qa_test"])
        rows = tasks.load_dataset_file(data, "qa_test")
        assert rows.select("prompt", "answer", "data_source").rows() == [("3+4=", "7", "qa_test")]
        with pytest.raises(Exception, match="missing column 'a' \\(the qa_test layout needs q, a\\)"):
            (tmp_path / "q.jsonl").write_text('{"q": "3+4="}\n')
            tasks.load_dataset_file(tmp_path / "q.jsonl", "qa_test")
    finally:
        del tasks.TASKS["fixed_test"], tasks.DATASET_FORMATS["qa_test"]
