"""One shape for every list of choices that a config key names by name (the advantage estimators,
the policy losses and loss aggregations, the learning-rate schedules, the verifiable and the
shaped rewards, the rollout IS levels, the generation backends, the built models' architectures
and tokenizers, the tasks and the dataset layouts): a ``Registry`` maps a name to an ``Entry``,
which says

- ``options``: the keys of the registry's config section that the choice reads besides the key
  that chooses it. The rerun triggers of the stages that run it hold them (``otbflow.pipeline``);
- ``requires``: what it needs of the rest of the config, each a ``Requirement``: a key, what its
  value must be (in words, for the message) and the test. ``otbflow.config`` checks the
  requirements of every chosen entry, and knows no entry by name.

A choice is added with its registry's decorator, e.g. ``@SCHEDULES.register("name", options=...)``;
the config's list of allowed values is the registry itself, so a choice registered later (a user's
own estimator, imported before the config loads) is allowed too. Imports nothing of otbflow."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Requirement:
    """The config key ``key`` must hold a value that passes ``test(value, cfg)``; ``allowed`` says
    what that is, for the message of a config that fails it."""

    key: str
    allowed: str
    test: Callable[[Any, Any], bool]


@dataclass(frozen=True)
class Entry:
    """A registered choice: ``obj`` (a function or a class), the options it reads (keys of the
    registry's section), what it requires of the rest of the config, and its one-line doc."""

    name: str
    obj: Any
    options: tuple[str, ...] = ()
    requires: tuple[Requirement, ...] = ()
    doc: str = ""


class Registry(dict):
    """Name -> entry, for the choices of one config key. ``what`` names a choice in messages
    ("LR schedule"), ``section`` is the config section its options live in ("train")."""

    def __init__(self, what: str, section: str, entry: type = Entry) -> None:
        super().__init__()
        self.what, self.section, self.entry = what, section, entry

    def register(self, name: str, *, options=(), requires=(), doc=None, **fields) -> Callable[[Any], Any]:
        """Decorator: register the decorated function or class as ``name``; returns it unchanged.
        ``doc``: the entry's one-line doc (default: the first line of the object's docstring).
        ``fields`` are the entry type's own (an estimator's ``needs``, a loss's ``is_mode``)."""

        def decorate(obj: Any) -> Any:
            if name in self:
                raise ValueError(f"{self.what} {name!r} is registered twice")
            line = doc if doc is not None else ((obj.__doc__ or "").strip().splitlines() or [""])[0]
            self[name] = self.entry(
                name=name, obj=obj, options=tuple(options), requires=tuple(requires), doc=line, **fields
            )
            return obj

        return decorate

    def option_keys(self, name: str) -> list[str]:
        """The full config keys that choice ``name`` reads (``section.option``)."""
        return [f"{self.section}.{option}" for option in self[name].options]
