"""The schema described: the docstrings under the fields (``field_docs``), the help text of a
section or of the whole config (``describe_section``, ``describe_all``: ``otbflow config
--help-keys`` and every stage's ``--help``) and the JSON schema (``json_schema``) with the fields'
bounds (``schema_bounds``), written to workflow/schemas/config.schema.json."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing
from typing import Any

from otbflow.config.fields import _hints
from otbflow.config.sections import Config


def field_docs(cls: type) -> dict[str, str]:
    """The docstrings written under each dataclass field (Python does not keep them itself)."""
    docs: dict[str, str] = {}
    for klass in reversed([c for c in cls.__mro__ if dataclasses.is_dataclass(c)]):  # inherited fields too
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, nxt in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def describe_section(name: str) -> str:
    """Help text for one config section (``name`` dotted for a nested one: 'tracking.wandb'):
    each key, its default and its docstring; a nested section's keys follow its own line."""
    defaults: Any = Config()
    for part in name.split("."):
        defaults = getattr(defaults, part)
    lines = [f"{name}:"]
    for key, doc in field_docs(type(defaults)).items():
        value = getattr(defaults, key)
        if dataclasses.is_dataclass(value):
            lines.append(f"  {name}.{key}: {doc}")
            lines += [f"  {line}" for line in describe_section(f"{name}.{key}").splitlines()[1:]]
        else:
            lines.append(f"  {name}.{key} (default {value!r}): {doc}")
    return "\n".join(lines)


def describe_all() -> str:
    top = field_docs(Config)
    lines = [f"{k} (default {getattr(Config(), k)!r}): {v}" for k, v in top.items()]
    for f in dataclasses.fields(Config):
        tp = _hints(Config)[f.name]
        if dataclasses.is_dataclass(tp):
            lines.append(describe_section(f.name))
        elif typing.get_origin(tp) is dict:  # name -> section (resources)
            section = typing.get_args(tp)[1]
            lines += [f"{f.name}.<stage>:", *(f"  {f.name}.<stage>.{k}: {v}" for k, v in field_docs(section).items())]
    return "\n".join(lines)


def json_schema() -> dict:
    """JSON schema of the config (descriptions, defaults and bounds from the dataclasses), written
    to workflow/schemas/config.schema.json for Snakemake's ``validate`` (JSON: every Snakemake start
    reads it, and Snakemake's YAML reader took 0.2 s for it, the JSON reader under 1 ms)."""

    def kind(tp: Any) -> dict:
        if typing.get_origin(tp) is typing.Union:
            inner = [a for a in typing.get_args(tp) if a is not type(None)][0]
            return {"type": [kind(inner)["type"], "null"]}
        if typing.get_origin(tp) is list:
            return {"type": "array", "items": kind(typing.get_args(tp)[0])}
        return {"type": {bool: "boolean", int: "integer", float: "number", str: "string"}[tp]}

    def walk(cls: type, instance: Any) -> dict:
        hints = typing.get_type_hints(cls)
        docs = field_docs(cls)
        props = {}
        for f in dataclasses.fields(cls):
            value = getattr(instance, f.name)
            if dataclasses.is_dataclass(value):
                props[f.name] = walk(type(value), value)
                props[f.name]["description"] = f"{f.name} options"
            elif typing.get_origin(hints[f.name]) is dict:  # name -> section (resources)
                section = typing.get_args(hints[f.name])[1]
                props[f.name] = {"type": "object", "additionalProperties": walk(section, section())}
                props[f.name] |= {"description": docs.get(f.name, ""), "default": value}
            else:
                props[f.name] = kind(hints[f.name]) | {"description": docs.get(f.name, ""), "default": value}
                props[f.name] |= schema_bounds(f.metadata)
                if "item_choices" in f.metadata:
                    props[f.name]["items"] |= {"enum": list(f.metadata["item_choices"])}
        return {"type": "object", "additionalProperties": False, "properties": props}

    schema = walk(Config, Config())
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["description"] = "otbflow configuration (generated from src/otbflow/config/sections.py; do not edit)"
    return schema


def schema_bounds(meta: typing.Mapping[str, Any]) -> dict:
    """A field's metadata as JSON-schema keywords (minimum, exclusiveMinimum, maximum,
    exclusiveMaximum, enum)."""
    names = {"ge": "minimum", "gt": "exclusiveMinimum", "le": "maximum", "lt": "exclusiveMaximum"}
    out: dict[str, Any] = {names[k]: v for k, v in meta.items() if k in names}
    if "choices" in meta:
        out["enum"] = list(meta["choices"])
    return out
