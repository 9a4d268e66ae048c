"""Loading a config: ``load_config`` merges the YAML file, Snakemake's ``config``
(``from_snakemake``) and ``key.sub=value`` overrides onto the schema (``otbflow.config.sections``),
so that an unknown key or a wrong type fails at once, naming the key (``describe_merge_error``), then
validates it (``otbflow.config.rules``); and what callers read off a loaded config (``to_yaml``,
``to_container``, ``section_digest``, ``evaluated_iterations``)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import typing
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from otbflow.config.fields import ConfigError, _hints
from otbflow.config.rules import validate
from otbflow.config.sections import Config

DEFAULT_CONFIG = Path(__file__).resolve().parents[3] / "config" / "config.yaml"

RENAMED = {"scaling.bootstrap": "scaling.ci_resamples"}
"""Keys that were renamed: given under the old name, the error names the new one."""


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, extra: dict | None = None
) -> DictConfig:
    """Merge ``path`` (a YAML file; None: only the schema defaults), then ``extra`` (a nested
    or dotted-key dict, e.g. Snakemake's ``config``), then ``key=value`` overrides onto the
    schema, and validate. Raises ConfigError naming the key on any problem. The keys of every
    layer but the schema and config/config.yaml count as set explicitly (``check_staleness``)."""
    schema = OmegaConf.structured(Config)
    try:
        layers, explicit = [schema], set()
        if path is not None:
            p = Path(path)
            if not p.is_file():
                raise ConfigError(f"config file not found: {p}")
            layers.append(OmegaConf.load(p))
            if p.resolve() != DEFAULT_CONFIG:
                explicit |= leaf_keys(layers[-1])
        if extra:
            layers.append(OmegaConf.create(nest(extra)))
            explicit |= leaf_keys(layers[-1])
        if overrides:
            layers.append(OmegaConf.from_dotlist(list(overrides)))
            explicit |= leaf_keys(layers[-1])
        cfg = OmegaConf.merge(*layers)
    except OmegaConfBaseException as e:
        raise ConfigError(describe_merge_error(e)) from None
    validate(cfg, frozenset(explicit))
    OmegaConf.set_readonly(cfg, True)
    return cfg


def from_snakemake(config: dict) -> dict:
    """Snakemake's ``config`` made ready for ``load_config(extra=...)``.

    Snakemake parses ``--config 'rollout={group_size: 8}'`` with YAML's BaseLoader, so every value
    inside such a mapping arrives as a string ('8', '0.0001', 'false', 'null'); top-level
    ``key=value`` pairs and ``--configfile`` values arrive typed. The typed schema converts
    '8', '0.0001' and 'false' itself when it merges them; this function only turns the strings
    'null' and '~' into None where the schema allows None (``model={path: null}``), and nests
    dotted keys. Validation then runs on the typed, resolved config, whatever the source."""

    def walk(node: Any, cls: Any) -> Any:
        if not isinstance(node, dict):
            return node
        out = {}
        hints = typing.get_type_hints(cls) if dataclasses.is_dataclass(cls) else {}
        for key, value in node.items():
            tp = typing.get_args(cls)[1] if typing.get_origin(cls) is dict else hints.get(key)
            if isinstance(value, dict):
                value = walk(value, tp)
            elif (
                isinstance(value, str)
                and value in ("null", "~", "Null", "NULL")
                and typing.get_origin(tp) is typing.Union
                and type(None) in typing.get_args(tp)
            ):
                value = None
            out[key] = value
        return out

    return walk(nest(dict(config)), Config)


def nest(flat: dict) -> dict:
    """{'a.b': 1, 'c': {'d': 2}} -> {'a': {'b': 1}, 'c': {'d': 2}}."""
    out: dict = {}
    for key, value in flat.items():
        node = out
        parts = str(key).split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        if isinstance(value, dict):
            value = nest(value)
            if isinstance(node.get(parts[-1]), dict):
                node[parts[-1]].update(value)
                continue
        node[parts[-1]] = value
    return out


def describe_merge_error(
    e: OmegaConfBaseException, root: type | None = None, renamed: typing.Mapping[str, str] = RENAMED
) -> str:
    """The error of a merge onto the schema ``root`` (default Config), naming the key: an unknown
    key lists the keys allowed beside it, a renamed one its new name."""
    key = getattr(e, "full_key", None) or "?"
    msg = str(e).splitlines()[0]
    if "ConfigKeyError" in type(e).__name__ or "not in struct" in msg or "Key '" in msg:
        if key in renamed:
            return f"config key '{key}' was renamed to '{renamed[key]}'"
        parent = key.rsplit(".", 1)[0] if "." in key else ""
        keys = _allowed_keys(parent, root or Config)
        return f"config key '{key}': unknown key. Allowed here: {', '.join(keys)}"
    return f"config key '{key}': {msg}"


def _allowed_keys(dotted_parent: str, root: type) -> list[str]:
    node: Any = root
    for part in filter(None, dotted_parent.split(".")):
        if typing.get_origin(node) is dict:  # name -> section (resources): any name
            node = typing.get_args(node)[1]
            continue
        hints = _hints(node) if dataclasses.is_dataclass(node) else {}
        node = hints.get(part)
    return [f.name for f in dataclasses.fields(node)] if dataclasses.is_dataclass(node) else []


def evaluated_iterations(cfg: DictConfig) -> list[int]:
    """Iterations whose policy the workflow evaluates (evaluate.every; the last one always)."""
    every, last = cfg.evaluate.every, cfg.iterations - 1
    return [k for k in range(cfg.iterations) if (k + 1) % every == 0 or k == last]


def leaf_keys(node: Any, prefix: str = "") -> set[str]:
    """The dotted keys of every leaf of a (nested) mapping."""
    if not isinstance(node, (dict, DictConfig)):
        return {prefix}
    return {k for key, value in node.items() for k in leaf_keys(value, f"{prefix}.{key}" if prefix else str(key))}


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)


def to_container(cfg: DictConfig) -> dict:
    """The resolved config as plain Python values (for the JSON-schema check)."""
    return OmegaConf.to_container(cfg, resolve=True)


def section_digest(cfg: DictConfig, *keys: str) -> str:
    """A short stable digest of some config sections, for Snakemake params (rerun triggers)."""

    def plain(v: Any) -> Any:
        return OmegaConf.to_container(v, resolve=True) if isinstance(v, DictConfig | ListConfig) else v

    data = {k: plain(OmegaConf.select(cfg, k)) for k in keys}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]
