"""What the variance study (otbflow.variance) compares, and which config keys it reads: the
estimators and their options. Free of torch, so that the Snakefile's rerun trigger of the
variance rule (workflow/rules/common.smk) costs no torch import at every Snakemake start."""

from __future__ import annotations

from omegaconf import DictConfig

from otbflow.advantages import estimator_options


def studied(cfg: DictConfig) -> list[str]:
    """The estimators of the study: REINFORCE ('none'), variance.estimators, the oracle ('eob')."""
    return list(dict.fromkeys(["none", *cfg.variance.estimators, "eob"]))


def study_options(cfg: DictConfig, name: str) -> dict:
    """An estimator's options in the study: its ``advantages.*`` options, except that the study
    compares baselines at one scale (grpo without std normalisation) and without a shift."""
    options = estimator_options(cfg, name) | ({"std_normalize": False} if name == "grpo" else {})
    options.pop("baseline_shift", None)
    return options


def read_keys(cfg: DictConfig) -> list[str]:
    """The config keys the study reads (the variance rule's rerun trigger)."""
    options = {
        f"advantages.{k}"
        for name in studied(cfg)
        for k in study_options(cfg, name)
        if not (name == "grpo" and k == "std_normalize")
    }
    return ["seed", "variance", "rollout.temperature", "features.chunk_size", *sorted(options)]
