"""The rules that relate several keys of a loaded config (each key's own bounds are in its metadata,
``otbflow.config.fields``): ``validate`` runs both; ``check_requirements`` what each chosen entry of a
registry requires of the rest; ``validate_workflow`` what the whole workflow needs beyond what each
stage checks."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from otbflow import schemas
from otbflow.algorithms.estimators import ESTIMATORS, estimator_parameters
from otbflow.algorithms.losses import LOSS_AGGREGATIONS, POLICY_LOSSES
from otbflow.algorithms.lr_schedule import SCHEDULES
from otbflow.algorithms.rollout_is import ROLLOUT_IS_LEVELS, weighting_levels
from otbflow.algorithms.shaping import SHAPED_REWARDS
from otbflow.config.fields import ConfigError, check_fields, require, require_path_text
from otbflow.config.sections import Config
from otbflow.engines import BACKENDS
from otbflow.models.architectures import ARCHITECTURES, TOKENIZERS
from otbflow.models.tasks import DATASET_FORMATS, TASKS, chat_setting
from otbflow.runtime.policy_folder import check_policy_folder


def validate_workflow(cfg: DictConfig) -> None:
    """What the whole workflow needs beyond what each stage checks: the bootstrap builds policies
    for the built-in task only, so a dataset run needs its policy in model.path (a stage alone,
    such as `otbflow shard` on a dataset, does not), and that folder must hold a config.json and a
    tokenizer (an experiment checks its members before their shared policy exists; a stage alone
    refuses a tokenizer far smaller than the model where it loads it)."""
    require(
        TASKS[cfg.task.name].bootstrap or cfg.model.path is not None,
        "model.path",
        f"a local HF causal-LM folder when task.name is '{cfg.task.name}' (the bootstrap builds policies for the "
        "built-in task only)",
        cfg.model.path,
    )
    if cfg.model.path is not None:  # config.json and the tokenizer's files, before any job (no torch)
        try:
            check_policy_folder(cfg.model.path)
        except ValueError as e:
            raise ConfigError(f"config key 'model.path': {e}") from None


def validate(cfg: DictConfig, explicit: frozenset[str] | None = None) -> None:
    """Reject impossible values: each field's declared bounds, then the rules between keys.
    ``explicit``: the dotted keys the user set (``load_config``); None: every key counts as set."""
    check_fields(Config, cfg)
    check_rules(cfg, explicit)


def check_staleness(cfg: DictConfig, explicit: frozenset[str] | None) -> None:
    """Stale rollouts (rollout.staleness >= 1) need a behaviour weight, and TRM's thresholds, set
    for the engine mismatch, would mask most of a lagged batch (algorithms.md §10)."""
    s, tr = cfg.rollout.staleness, cfg.train
    if cfg.rollout.take_newer != "none":
        require(
            s >= 1,
            "rollout.take_newer",
            "'none' when rollout.staleness is 0 (an on-policy rollout's policy is the newest there is)",
            cfg.rollout.take_newer,
        )
    if cfg.rollout.stream:
        require(
            s >= 1,
            "rollout.stream",
            "false when rollout.staleness is 0 (a streamed group may lag by up to rollout.staleness iterations)",
            True,
        )
        require(
            cfg.rollout.take_newer == "step",
            "rollout.take_newer",
            "'step' with rollout.stream (a carried response continues under the newest policy: each token's "
            "version is recorded; 'trajectory' would need the policy it started on)",
            cfg.rollout.take_newer,
        )
        require(
            not cfg.rollout.filter_groups,
            "rollout.filter_groups",
            "false with rollout.stream (a streamed rollout takes the first complete groups; dynamic sampling's "
            "rounds are not built for it yet)",
            True,
        )
    if s == 0:
        return
    levels = weighting_levels()
    require(
        tr.rollout_is in levels,
        "train.rollout_is",
        f"{' or '.join(levels)} when rollout.staleness is {s}: stale samples need the truncated behaviour "
        "weight min(pi_prox / pi_behav, C) of decoupled PPO (algorithms.md §10)",
        tr.rollout_is,
    )
    unset = [k for k in ("mismatch.max_k2", "mismatch.mean_k3") if explicit is not None and k not in explicit]
    if tr.trm and unset:
        raise ConfigError(
            f"config key 'train.trm': must be false when rollout.staleness is {s} unless {' and '.join(unset)} "
            "are set explicitly: TRM's defaults are sized for the engine mismatch, and a lag of one "
            "iteration gives a k3 many times mismatch.mean_k3 (docs/results.md, 'Pipelined iterations') "
            "(got True)"
        )


def check_rules(cfg: DictConfig, explicit: frozenset[str] | None = None) -> None:
    """The rules that relate several keys (each key's own bounds are in its metadata)."""
    m, t, a, tr = cfg.model, cfg.task, cfg.advantages, cfg.train
    require_path_text("results_dir", cfg.results_dir)
    check_staleness(cfg, explicit)
    chat = chat_setting(cfg)
    require(m.n_embd % m.n_head == 0, "model.n_head", "a divisor of model.n_embd", m.n_head)
    require(
        m.n_kv_head == 0 or m.n_head % m.n_kv_head == 0,
        "model.n_kv_head",
        "0 or a divisor of model.n_head",
        m.n_kv_head,
    )
    require(chat in ("auto", "true", "false"), "task.chat", "one of auto, true, false", t.chat)
    require(t.min_terms <= t.max_terms, "task.min_terms", "in [1, task.max_terms]", t.min_terms)
    max_len = cfg.rollout.max_new_tokens
    if t.reward_model.path is not None:
        from otbflow.models.reward_model import check_reward_model  # reads config.json only, no torch

        try:
            check_reward_model(t.reward_model.path)
        except ValueError as e:
            raise ConfigError(f"config key 'task.reward_model.path': {e}") from None
    require(
        not cfg.rollout.filter_groups or cfg.rollout.group_size >= 2,
        "rollout.group_size",
        ">= 2 with rollout.filter_groups (a group of one always has equal rewards)",
        cfg.rollout.group_size,
    )
    require(t.overlong_buffer <= max_len, "task.overlong_buffer", "<= rollout.max_new_tokens", t.overlong_buffer)
    require(
        "{prompt}" in t.prompt_template,
        "task.prompt_template",
        "a text containing {prompt} (replaced by each prompt)",
        t.prompt_template,
    )
    # an old format-string template doubles every literal '{'; a lone '}}' closes nested LaTeX
    require(
        "{{" not in t.prompt_template,
        "task.prompt_template",
        "free of '{{' escapes: braces other than {prompt} are literal now (write \\boxed{}, not \\boxed{{}})",
        t.prompt_template,
    )
    require(
        t.system_prompt is None or chat != "false",
        "task.system_prompt",
        "null when task.chat is false (a system message needs the chat template)",
        t.system_prompt,
    )
    check_requirements(cfg)
    chosen = [("advantages.estimator", a.estimator)]
    chosen += [(f"advantages.compare[{i}]", n) for i, n in enumerate(a.compare)]
    for key, name in chosen:
        for column in ESTIMATORS[name].needs:
            flag = schemas.WRITTEN_WITH.get(column)
            require(
                column in schemas.FEATURES.columns,
                key,
                f"another estimator: {name} reads the column {column}, which the features stage does not write",
                name,
            )
            require(
                flag is None or bool(OmegaConf.select(cfg, flag)),
                key,
                f"another estimator unless {flag} is true ({name} reads the column {column}, written only then)",
                name,
            )
    if a.baseline_shift != 0 and "baseline_shift" not in estimator_parameters(a.estimator):
        raise ConfigError(
            f"config key 'advantages.baseline_shift': must be 0 when advantages.estimator is "
            f"'{a.estimator}', which takes no shift ({ESTIMATORS[a.estimator].doc}) "
            f"(got {a.baseline_shift!r})"
        )
    require(
        tr.mini_batch_size >= tr.micro_batch_size and tr.mini_batch_size % tr.micro_batch_size == 0,
        "train.mini_batch_size",
        "a multiple of train.micro_batch_size",
        tr.mini_batch_size,
    )
    # DeepSpeed with bf16 and no ZeRO updates bf16 weights in place (no fp32 master): small steps vanish
    require(not tr.bf16 or tr.zero_stage >= 1, "train.bf16", "false unless train.zero_stage >= 1", tr.bf16)
    for i, name in enumerate(cfg.variance.estimators):
        for column in ESTIMATORS[name].needs:
            require(
                column in schemas.VARIANCE_STUDY_COLUMNS,
                f"variance.estimators[{i}]",
                f"another estimator: {name} reads the column {column}, which the variance study's pool does not have",
                name,
            )


# The registries whose chosen entry's requirements are checked, with the key that chooses it.
CHOSEN = (
    (ARCHITECTURES, "model.arch"),
    (TOKENIZERS, "model.tokenizer"),
    (TASKS, "task.name"),
    (DATASET_FORMATS, "task.format"),
    (SHAPED_REWARDS, "task.reward"),
    (BACKENDS, "rollout.backend"),
    (POLICY_LOSSES, "train.loss_type"),
    (LOSS_AGGREGATIONS, "train.loss_agg_mode"),
    (ROLLOUT_IS_LEVELS, "train.rollout_is"),
    (SCHEDULES, "train.lr_schedule"),
)


def check_requirements(cfg: DictConfig) -> None:
    """What each chosen entry of a registry requires of the rest of the config (its
    ``Requirement``s), for every registry in CHOSEN: no choice is known here by name."""
    for registry, key in CHOSEN:
        name = OmegaConf.select(cfg, key)
        entry = registry.get(name)
        for req in entry.requires if entry else ():
            value = OmegaConf.select(cfg, req.key)
            require(req.test(value, cfg), req.key, f"{req.allowed} with {key} {name}", value)
