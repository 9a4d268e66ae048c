"""The one validated configuration shared by Snakemake and every ``otbflow <stage>`` CLI.

The schema is a tree of dataclasses (OmegaConf structured configs, ``sections``). The docstring under
each field is its documentation: ``otbflow config --help-keys`` prints them, and they are the CLI
help of every stage. Each field declares its bounds or choices where it is declared, in its
metadata (``opt(8, ge=1)``, ``opt("hf", choices=...)``, the choices imported from the registry
that owns them; ``fields``). ``load_config`` (``loading``) merges the YAML file and ``key.sub=value``
overrides onto the schema, so an unknown key or a wrong type fails at once; ``check_fields`` then
enforces every field's metadata and ``check_rules`` (``rules``) the few rules that relate several
keys. The JSON schema (``json_schema``, ``schema``) carries the same bounds. Every error names the
key and what is allowed.

The package's interface is what this module imports: ``from otbflow.config import load_config``.
"""

from otbflow.config.fields import (
    ConfigError,
    Names,
    allowed,
    check_fields,
    opt,
    require,
    require_path_text,
    within,
)
from otbflow.config.loading import (
    DEFAULT_CONFIG,
    RENAMED,
    describe_merge_error,
    evaluated_iterations,
    from_snakemake,
    leaf_keys,
    load_config,
    nest,
    section_digest,
    to_container,
    to_yaml,
)
from otbflow.config.rules import CHOSEN, check_requirements, check_rules, check_staleness, validate, validate_workflow
from otbflow.config.schema import describe_all, describe_section, field_docs, json_schema, schema_bounds
from otbflow.config.sections import (
    DTYPES,
    ESTIMATOR_NAMES,
    WANDB_MODES,
    AdvantagesConfig,
    BootstrapConfig,
    Config,
    CosineConfig,
    EvaluateConfig,
    FeaturesConfig,
    JobResources,
    MismatchConfig,
    ModelConfig,
    RetentionConfig,
    RewardModelConfig,
    RolloutConfig,
    ScalingConfig,
    ShardConfig,
    TaskConfig,
    TrackingConfig,
    TrainConfig,
    VarianceConfig,
    WandbConfig,
    WorkersConfig,
)

__all__ = [
    "CHOSEN",
    "DEFAULT_CONFIG",
    "DTYPES",
    "ESTIMATOR_NAMES",
    "RENAMED",
    "WANDB_MODES",
    "AdvantagesConfig",
    "BootstrapConfig",
    "Config",
    "ConfigError",
    "CosineConfig",
    "EvaluateConfig",
    "FeaturesConfig",
    "JobResources",
    "MismatchConfig",
    "ModelConfig",
    "Names",
    "RetentionConfig",
    "RewardModelConfig",
    "RolloutConfig",
    "ScalingConfig",
    "ShardConfig",
    "TaskConfig",
    "TrackingConfig",
    "TrainConfig",
    "VarianceConfig",
    "WandbConfig",
    "WorkersConfig",
    "allowed",
    "check_fields",
    "check_requirements",
    "check_rules",
    "check_staleness",
    "describe_all",
    "describe_merge_error",
    "describe_section",
    "evaluated_iterations",
    "field_docs",
    "from_snakemake",
    "json_schema",
    "leaf_keys",
    "load_config",
    "nest",
    "opt",
    "require",
    "require_path_text",
    "schema_bounds",
    "section_digest",
    "to_container",
    "to_yaml",
    "validate",
    "validate_workflow",
    "within",
]
