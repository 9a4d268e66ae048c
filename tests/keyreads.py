"""A read-only view of a config that records the dotted key of every value read through it.

``run(RecordingConfig(cfg), args)`` runs a stage as usual; ``.reads`` then holds every leaf key
the stage (and every library function it passed the config or a section to) read by attribute,
item, ``get`` or ``items``. Listing the keys of a section or testing ``key in section`` reads no
value and records nothing; nor do OmegaConf's own functions (``OmegaConf.select``, the config
digests), which reach the wrapped node through its private attributes.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from otbflow.pipeline import EVERY_STAGE_EXECUTION, STAGES


class RecordingConfig:
    def __init__(self, node: DictConfig, prefix: str = "", reads: set[str] | None = None):
        object.__setattr__(self, "_node", node)
        object.__setattr__(self, "_prefix", prefix)
        object.__setattr__(self, "reads", set() if reads is None else reads)

    def _wrap(self, key: str, value: Any) -> Any:
        path = f"{self._prefix}{key}"
        if isinstance(value, DictConfig):
            return RecordingConfig(value, f"{path}.", self.reads)
        self.reads.add(path)
        return list(value) if isinstance(value, ListConfig) else value

    def __getattr__(self, key: str) -> Any:
        if key.startswith("__"):
            raise AttributeError(key)
        if key.startswith("_"):  # OmegaConf's internals (select, digests): not a read of a key
            return getattr(self._node, key)
        return self._wrap(key, getattr(self._node, key))

    def __getitem__(self, key: str) -> Any:
        return self._wrap(key, self._node[key])

    def get(self, key: str, default: Any = None) -> Any:
        return self._wrap(key, self._node[key]) if key in self._node else default

    def items(self):
        return [(k, self[k]) for k in self._node]

    def values(self):
        return [self[k] for k in self._node]

    def keys(self):
        return list(self._node.keys())

    def __iter__(self):
        return iter(self._node)

    def __contains__(self, key: str) -> bool:
        return key in self._node

    def __len__(self) -> int:
        return len(self._node)

    def __setattr__(self, key: str, value: Any) -> None:
        raise TypeError("the config is read-only")


# ------------------------------------------------------------------------------------------
# A stage's reads against the stage table (tests/test_stage_keys.py; a stage's own test may check its reads too)
# ------------------------------------------------------------------------------------------


def declared(stage: str, cfg: DictConfig) -> tuple[set[str], set[str]]:
    """The stage's (output-changing, execution-only) keys, sections expanded to their leaves."""

    def leaves(key: str) -> set[str]:
        node = OmegaConf.select(cfg, key)
        if isinstance(node, DictConfig):
            return {f"{key}.{k}" for k in node if not isinstance(node[k], DictConfig)}
        return {key}

    s = STAGES[stage]
    outputs = set().union(*(leaves(k) for k in s.outputs(cfg)))
    return outputs, set().union(*(leaves(k) for k in (*s.execution, *EVERY_STAGE_EXECUTION)))


def data_dependent(cfg: DictConfig) -> set[str]:
    """Declared keys that a short run may not reach: read only once the data make it so.
    length_decay checks for a surge only after length_baseline_steps + patience steps, and sets
    the halving period and the floor only once it found one. The cosine reward reads a branch's
    values only for a response in that branch (the variance pool's few responses may all be wrong)."""
    keys = set()
    if cfg.train.lr_schedule == "length_decay":
        keys |= {"train.length_surge_factor", "train.length_period_factor", "train.lr_min_ratio"}
    if cfg.task.reward == "cosine":
        keys |= {f"task.cosine.{k}" for k in ("correct_min", "correct_max", "wrong_min", "wrong_max")}
        keys |= {"task.cosine.repetition_ngram", "task.cosine.repetition_max"}
    return keys


def check(stage: str, column: str, cfg: DictConfig, reads: set[str]) -> list[str]:
    outputs, execution = declared(stage, cfg)
    problems = []
    if missing := sorted(reads - outputs - execution):
        problems.append(f"{stage} [{column}] reads keys its declaration lacks: {missing}")
    if unread := sorted(outputs - reads - data_dependent(cfg)):
        problems.append(f"{stage} [{column}] declares keys it never reads: {unread}")
    return problems


def run_recorded(stage: str, cfg: DictConfig, **args) -> set[str]:
    """The keys ``stage`` reads. The train stage digests its own declared keys (the identity of
    its resumable checkpoints, otbflow.pipeline.trigger): that digest reads the config unrecorded,
    or every declared key would count as read."""
    import importlib
    from unittest import mock

    from otbflow import pipeline

    mod = importlib.import_module(STAGES[stage].module)
    recorded = RecordingConfig(cfg)
    unrecorded = pipeline.trigger
    with mock.patch.object(pipeline, "trigger", lambda c, name: unrecorded(getattr(c, "_node", c), name)):
        mod.run(recorded, mod.Args(**args))
    return recorded.reads
