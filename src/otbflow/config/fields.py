"""The field machinery of the config's schema: each option's bounds or choices, declared beside
it in its metadata (``opt``), said in words (``allowed``), tested (``within``) and enforced section
by section (``check_fields``); the one error (``ConfigError``, naming the key) and the checks that
raise it (``require``, ``require_path_text``). Shared by the run's config (``otbflow.config.sections``)
and the experiment files' (``otbflow.studies.experiment_config``)."""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from dataclasses import field
from typing import Any

from otbflow.registry import Registry


class ConfigError(ValueError):
    """A configuration problem, reported with the offending key."""


class Names:
    """The names of registries (and fixed names) as a field's choices, read when a value is
    checked: a name registered after the config module was imported (a user's estimator, loss,
    schedule or reward) is allowed. In order: each source's names, a registry's sorted."""

    def __init__(self, *sources: str | typing.Mapping[str, Any]):
        self.sources = sources

    def __iter__(self) -> typing.Iterator[str]:
        for source in self.sources:
            yield from ([source] if isinstance(source, str) else sorted(source))

    def __contains__(self, name: object) -> bool:
        return any(name == s if isinstance(s, str) else name in s for s in self.sources)


def opt(
    default: Any = dataclasses.MISSING,
    *,
    factory: typing.Callable[[], Any] | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    choices: typing.Iterable[Any] | None = None,
    item_choices: typing.Iterable[Any] | None = None,
    finite: bool = False,
    doc_allowed: str | None = None,
) -> Any:
    """A dataclass field with its bounds in the metadata: ``ge``/``gt``/``le``/``lt`` (numbers),
    ``choices`` (the value is one of them: a tuple; a registry, its names in registration order;
    or ``Names``, read when a value is checked), ``item_choices`` (every item of a list field is one of
    them), ``finite`` (no nan or inf) and ``doc_allowed`` (the text that error messages give
    instead of the generated one). ``factory``: a default factory (lists)."""
    meta: dict[str, Any] = {
        k: v for k, v in {"ge": ge, "gt": gt, "le": le, "lt": lt, "doc_allowed": doc_allowed}.items() if v is not None
    }
    if choices is not None:
        meta["choices"] = choices if isinstance(choices, (Names, Registry)) else tuple(choices)
    if item_choices is not None:
        meta["item_choices"] = item_choices if isinstance(item_choices, (Names, Registry)) else tuple(item_choices)
    if finite:
        meta["finite"] = True
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def allowed(meta: typing.Mapping[str, Any]) -> str:
    """What a field's metadata allows, as error messages say it ('>= 1', 'in (0, 1]', 'one of a, b')."""
    if "doc_allowed" in meta:
        return meta["doc_allowed"]
    if "choices" in meta or "item_choices" in meta:
        return "one of " + ", ".join(str(c) for c in meta.get("choices", meta.get("item_choices")))
    lo = ("[", meta["ge"]) if "ge" in meta else ("(", meta["gt"]) if "gt" in meta else None
    hi = (meta["le"], "]") if "le" in meta else (meta["lt"], ")") if "lt" in meta else None
    finite = " and finite" if meta.get("finite") else ""
    if lo and hi:
        return f"in {lo[0]}{lo[1]}, {hi[0]}{hi[1]}"
    if lo:
        return f"{'>=' if lo[0] == '[' else '>'} {lo[1]}{finite}"
    if hi:
        return f"{'<=' if hi[1] == ']' else '<'} {hi[0]}{finite}"
    return "a finite number" if meta.get("finite") else "anything"


def within(meta: typing.Mapping[str, Any], value: Any) -> bool:
    """Whether ``value`` (a scalar; None passes, for Optional fields) satisfies the metadata."""
    if "choices" in meta:
        return value in meta["choices"]
    if value is None:
        return True
    ok = True
    if "ge" in meta:
        ok = ok and value >= meta["ge"]
    if "gt" in meta:
        ok = ok and value > meta["gt"]
    if "le" in meta:
        ok = ok and value <= meta["le"]
    if "lt" in meta:
        ok = ok and value < meta["lt"]
    if meta.get("finite"):
        ok = ok and math.isfinite(value)
    return bool(ok)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def check_fields(cls: type, node: Any, prefix: str = "") -> None:
    """Check every field of ``node`` (a DictConfig or dict holding a ``cls``) against its metadata,
    section by section; raise ConfigError naming the first key out of bounds."""
    for f in dataclasses.fields(cls):
        key, value, tp = f"{prefix}{f.name}", node[f.name], _hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            check_fields(tp, value, f"{key}.")
            continue
        if typing.get_origin(tp) is dict:  # name -> section (resources)
            for name, section in value.items():
                check_fields(typing.get_args(tp)[1], section, f"{key}.{name}.")
            continue
        meta = f.metadata
        if not meta:
            continue
        if "item_choices" in meta:
            for i, item in enumerate(value or ()):
                require(item in meta["item_choices"], f"{key}[{i}]", allowed(meta), item)
        else:
            require(within(meta, value), key, allowed(meta), value)


def require(ok: bool, key: str, what: str, value: Any) -> None:
    """Raise ConfigError ``config key 'KEY': must be WHAT (got VALUE)`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"config key '{key}': must be {what} (got {value!r})")


def require_path_text(key: str, value: Any, name: bool = False) -> None:
    """A config string that becomes a path (``name``: one folder name, such as an experiment's or
    a run's): refused when empty, with a leading '-' (read as an option by the stages' CLIs), a
    control character or a brace (Snakemake reads braces in a path as a wildcard); a name also
    when it is '.' or '..' or holds a slash (it would leave its parent folder). Other characters,
    spaces, quotes and '$' included, are quoted wherever a path reaches a shell."""
    what = "a folder name" if name else "a path"
    text = value if isinstance(value, str) else None
    for bad, why in [
        (text is None, "a string"),
        (text == "", "not empty"),
        (text and any(ord(c) < 32 or ord(c) == 127 for c in text), "free of control characters"),
        (text and any(c in "{}" for c in text), "free of braces (Snakemake reads them as wildcards)"),
        (text and text.startswith("-"), "not starting with '-' (the stages' CLIs read it as an option)"),
        (name and text and any(c in "/\\" for c in text), "free of slashes (a name, not a path)"),
        (name and text in (".", ".."), "a name other than '.' and '..'"),
    ]:
        if bad:
            raise ConfigError(f"config key '{key}': must be {what}, {why} (got {value!r})")
