"""The experiment file (``config/experiments/*.yaml``): its schema, loader and member configs.

An experiment has ``experiment`` (its name), ``seeds``, ``base`` (a config layered over
config/config.yaml for every member), ``runs`` (name -> config overrides) and an optional
``analysis`` section. The schema is a tree of dataclasses like the run config's
(``otbflow.config``): the docstring under each field documents it, its metadata declares its
bounds, unknown keys are refused with the keys allowed beside them, and every error names the
key in the same words (``config key 'analysis.plateau_window': must be >= 1 (got 0)``). Each
member's config is validated by the run config's loader. Torch-free: workflow/experiment.smk
and ``otbflow experiment-member`` import it.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from otbflow.config import (
    DEFAULT_CONFIG,
    ConfigError,
    check_fields,
    describe_merge_error,
    load_config,
    nest,
    opt,
    require,
    require_path_text,
    to_yaml,
)
from otbflow.io import write_text

RENAMED: dict[str, str] = {}
"""Experiment keys that were renamed: given under the old name, the error names the new one."""

REMOVED = {
    "analysis.bootstrap": "intervals are now t-intervals over the seeds (no resampling)",
    "analysis.ci_resamples": "intervals are now t-intervals over the seeds (no resampling)",
    "analysis.target_fraction": "the target is now a fixed avg@k, analysis.target",
    "analysis.reference": "the target is now a fixed avg@k, analysis.target, not a run's final value",
}
"""Experiment keys that were removed: given, the error says why and what replaces them."""


@dataclass
class AnalysisConfig:
    target: float = opt(0.5, gt=0, le=1)
    """The target avg@k at which tokens_to_target is read: a fixed value chosen before the runs
    (not derived from any run's result). Seeds that never reach it are reported as censored."""
    pairs: list[list[str]] = field(default_factory=list)
    """Pairs [a, b] of two different runs, compared seed by seed (pairs.parquet)."""
    confidence: float = opt(0.95, gt=0, lt=1)
    """Confidence level of every interval: t-intervals over the seeds, which assume each run's
    per-seed values (and each pair's per-seed differences) are normally distributed."""
    plateau_window: int = opt(4, ge=1)
    """A run's late_gain is its avg@k gain over its last this many iterations."""
    plateau_margin: float = opt(0.02, gt=0)
    """A run is on a plateau only when the interval of its late_gain lies inside +- this margin (avg@k
    units; an equivalence test), not merely when it holds 0. 0.02 is about one held-out prompt of
    64 (1/64 = 0.016) over the window: a smaller margin is below what the evaluation resolves, a
    larger one would call a run that still gains +0.03 per window flat."""


@dataclass
class ExperimentConfig:
    experiment: str = MISSING
    """The experiment's name: its members run in results/<experiment>."""
    seeds: list[int] = MISSING
    """Seeds of every run (the first one also seeds the shared policy and prompt set)."""
    base: Optional[dict[str, Any]] = MISSING
    """A config layered over config/config.yaml for every member and the shared stages."""
    runs: dict[str, Any] = MISSING
    """Run name -> config overrides layered over ``base``; ``advantages.exponent: scaling`` takes
    the length-power exponent that the shared scaling stage measured."""
    analysis: AnalysisConfig = field(default_factory=AnalysisConfig)
    """How the report compares the runs."""


FREE_FORM = ("base", "runs")
"""Sections passed on as they are (each member's config is validated by ``load_config``)."""


def _merge(a: dict, b: dict) -> dict:
    out = copy.deepcopy(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def load_experiment(path: str | Path) -> dict:
    """The experiment file as a plain dict, checked: its keys and their bounds, the rules between
    them (the reference and pairs are runs) and every member's config (validated by the same
    loader as any config). Errors start with the file and name the key (and the run)."""
    return check_experiment(yaml.safe_load(Path(path).read_text()) or {}, str(path))


def check_experiment(data: dict, path: str) -> dict:
    """``load_experiment`` of an experiment already read (``path`` names its source in errors)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: an experiment is a mapping with the keys experiment, seeds, base, runs, analysis")
    if data.get("analysis", {}) is None:
        data.pop("analysis")
    for key in data["analysis"] if isinstance(data.get("analysis"), dict) else {}:
        if f"analysis.{key}" in REMOVED:
            raise ConfigError(f"{path}: config key 'analysis.{key}' was removed: {REMOVED[f'analysis.{key}']}")
    # base and runs are checked as mappings here, as configs below: the schema types their keys, not OmegaConf
    typed = {k: {} if k in FREE_FORM and isinstance(v, dict) else v for k, v in data.items()}
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(ExperimentConfig), OmegaConf.create(typed))
        missing = [k for k in ExperimentConfig.__dataclass_fields__ if k in OmegaConf.missing_keys(cfg)]
        if missing:
            raise ConfigError(
                f"config key '{missing[0]}': missing (an experiment needs experiment, seeds, base and runs)"
            )
        check_fields(ExperimentConfig, cfg)
    except OmegaConfBaseException as e:
        raise ConfigError(f"{path}: {describe_merge_error(e, ExperimentConfig, RENAMED)}") from None
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    exp = {
        "experiment": cfg.experiment,
        "seeds": list(cfg.seeds),
        "base": data["base"],
        "runs": data["runs"],
        "analysis": OmegaConf.to_container(cfg.analysis),
    }
    for name in exp["runs"]:
        for seed in exp["seeds"]:
            try:
                load_config(DEFAULT_CONFIG, extra=member_config(exp, name, seed, "/shared/policy", 1.0))
            except ConfigError as e:
                raise ConfigError(f"{path}: run '{name}': {e}") from None
    try:
        check_experiment_rules(exp)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    return exp


def check_experiment_rules(exp: dict) -> None:
    """The rules between keys of an experiment (each key's own bounds are in its metadata). The
    experiment's name and its runs' are folder names (results/<experiment>/<run>/seed_<seed>)."""
    require_path_text("experiment", exp["experiment"], name=True)
    require(len(exp["seeds"]) > 0, "seeds", "a non-empty list of integers", exp["seeds"])
    runs = list(exp["runs"] or {})
    require(len(runs) > 0, "runs", "a mapping of run names to config overrides", exp["runs"])
    for run in runs:
        require_path_text(f"runs.{run}", run, name=True)
    a = exp["analysis"]
    for i, pair in enumerate(a["pairs"]):
        require(
            len(pair) == 2 and all(r in runs for r in pair) and pair[0] != pair[1],
            f"analysis.pairs[{i}]",
            f"a pair [a, b] of two different runs of {', '.join(runs)}",
            pair,
        )


def shared_config(exp: dict) -> dict:
    """The shared part: base config, first seed (bootstrap, prompts, scaling, variance)."""
    return _merge(nest(exp.get("base") or {}), {"seed": exp["seeds"][0]})


def member_config(exp: dict, run: str, seed: int, policy: str, exponent: float) -> dict:
    """One member's config: base, then the run's overrides, then its seed, the shared policy
    and prompt seed; ``advantages.exponent: scaling`` becomes the measured ``exponent``."""
    cfg = _merge(
        _merge(nest(exp.get("base") or {}), nest(exp["runs"][run] or {})),
        {"seed": seed, "model": {"path": policy}, "task": {"seed": exp["seeds"][0]}},
    )
    if cfg.get("advantages", {}).get("exponent") == "scaling":
        cfg["advantages"]["exponent"] = float(exponent)
    return cfg


def write_member_config(experiment: str, run: str, seed: int, policy: str, scaling: str, out: str) -> None:
    """The member's resolved config YAML (the exponent read from the shared scaling summary)."""
    exp = load_experiment(experiment)
    slope = json.loads(Path(scaling).read_text())["grad_sq_norm_slope"]
    if slope is None or not math.isfinite(slope):
        raise ValueError(
            f"{scaling}: the shared scaling fit has no slope (all responses of one length?); "
            "the length-power exponent cannot be derived from it"
        )
    cfg = load_config(DEFAULT_CONFIG, extra=member_config(exp, run, seed, str(Path(policy).resolve()), slope))
    write_text(to_yaml(cfg), out)
