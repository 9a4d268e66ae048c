"""A read-only view of a config that records the dotted key of every value read through it.

``run(RecordingConfig(cfg), args)`` runs a stage as usual; ``.reads`` then holds every leaf key
the stage (and every library function it passed the config or a section to) read by attribute,
item, ``get`` or ``items``. Listing the keys of a section or testing ``key in section`` reads no
value and records nothing; nor do OmegaConf's own functions (``OmegaConf.select``, the config
digests), which reach the wrapped node through its private attributes.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, ListConfig


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
