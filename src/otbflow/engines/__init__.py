"""The generation-backend interface shared by the rollout, evaluate and bootstrap stages: ``Sample``
(one generated response), ``Sampling`` (what to generate), ``Backend`` (implemented by
``otbflow.engines.hf`` and ``otbflow.engines.vllm``, which depend on this module, never the other
way round; ``BACKENDS`` names them and ``open_backend`` builds one by name) and stop tokens
(``stop_token_ids``). The prompts they generate from are rendered and checked against the policy's
positions by ``otbflow.engines.prompts``; ``otbflow.engines.sampling`` drives them to sample
groups. What a policy folder holds and the checks of it before any job reads it:
``otbflow.runtime.policy_folder``. Stop tokens: docs/data.md, "A real model and dataset"."""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from omegaconf import DictConfig

from otbflow.registry import Entry, Registry


@dataclass(frozen=True)
class BackendEntry(Entry):
    """A generation backend: ``obj`` is where its class lives, "module:Class" (loaded by name: vLLM
    is not importable in every environment); its options are the rollout.* keys it reads, and
    ``samples`` those of them that change its samples (the others change only how it runs).
    otbflow.pipeline's rollout, evaluate and variance_pool stages read ``sample_keys`` and
    ``run_keys``."""

    samples: tuple[str, ...] = ()

    @property
    def target(self) -> str:
        return self.obj

    @property
    def sample_keys(self) -> tuple[str, ...]:
        return tuple(f"rollout.{k}" for k in self.samples)

    @property
    def run_keys(self) -> tuple[str, ...]:
        return tuple(f"rollout.{k}" for k in self.options if k not in self.samples)


BACKENDS = Registry("backend", "rollout", entry=BackendEntry)
"""The generation engines by ``rollout.backend`` name (the config takes its choices from here, so
this module imports neither the config nor the engines). Add one with
``BACKENDS.register("name", options=..., samples=..., doc=...)("module:Class")``."""
# every row draws its own noise: the batch size changes memory and speed (samples only by rounding)
# and so does the decode loop (rollout.hf_decode)
BACKENDS.register(
    "hf", options=("batch_size", "hf_decode", "hf_refill_below"), doc="transformers' generate, CPU or GPU"
)("otbflow.engines.hf_backend:HFBackend")
# tensor parallelism changes the reductions' order
BACKENDS.register(
    "vllm",
    options=("tensor_parallel_size", "gpu_memory_utilization", "kv_cache_gib", "enforce_eager"),
    samples=("tensor_parallel_size",),
    doc="vLLM, GPU only, own environment",
)("otbflow.engines.vllm:VLLMBackend")

HF_DECODE_MODES = ("auto", "eager", "static", "compiled")
"""The hf backend's decode loops (``rollout.hf_decode``; ``otbflow.engines.hf.generation_config``)."""


@dataclass
class Sample:
    prompt_index: int
    sample_idx: int
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str
    versions: list[int] | None = None
    """The policy version (iteration) that sampled each response token, where a rollout took newer
    policies while it decoded (rollout.take_newer); None: all by the one policy."""


@dataclass(frozen=True)
class Sampling:
    n: int = 1
    """Samples per prompt (1 when greedy)."""
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 48
    greedy: bool = False
    seed: int = 0
    min_p: float = 0.0
    """rho of min-p sampling after the temperature (rollout.min_p; otbflow.algorithms.vocab_pruning). 0: none."""

    def label(self) -> str:
        """What a generation with these options is called in its progress lines."""
        return "greedy generation" if self.greedy else f"generation ({self.n} per prompt)"


class Backend(Protocol):
    name: str
    stops: list[int]
    """Token ids that end a response (``stop_token_ids`` of the policy)."""

    def generate(self, prompt_ids: list[list[int]], sampling: Sampling) -> list[Sample]:
        """Responses to each prompt, ordered by (prompt_index, sample_idx)."""

    def metadata(self, sampling: Sampling) -> dict[str, Any]:
        """Versions and engine/sampling arguments, for the output's Parquet metadata."""


def open_backend(cfg: DictConfig, policy: str) -> Backend:
    """The ``rollout.backend`` engine over the HF folder ``policy`` (model loaded once)."""
    module, cls = BACKENDS[cfg.rollout.backend].target.split(":")
    return getattr(importlib.import_module(module), cls)(cfg, policy)


def stop_token_ids(tok, policy: str | Path | None = None) -> list[int]:
    """The tokenizer's eos id, then the eos ids of ``policy``'s generation_config.json."""
    gen = Path(policy) / "generation_config.json" if policy is not None else None
    eos = json.loads(gen.read_text()).get("eos_token_id") if gen is not None and gen.is_file() else None
    return stops_of(tok, eos, policy)


def stops_of(tok, generation_eos: int | list[int] | None, where: Any = "the policy") -> list[int]:
    """The tokenizer's eos id, then ``generation_eos`` (a generation config's eos_token_id: an id,
    a list of them or None), without repeats."""
    ids = [tok.eos_token_id] if tok.eos_token_id is not None else []
    ids += (
        generation_eos if isinstance(generation_eos, list) else [generation_eos] if generation_eos is not None else []
    )
    if not ids:
        raise ValueError(f"{where}: the tokenizer has no eos token and generation_config.json no eos_token_id")
    return list(dict.fromkeys(int(i) for i in ids))


def truncate_at_stop(tokens: list[int], stops: set[int] | list[int]) -> tuple[int, str]:
    """(length, finish reason): up to and including the first stop token ('stop'), else all ('length')."""
    for i, t in enumerate(tokens):
        if t in stops:
            return i + 1, "stop"
    return len(tokens), "length"
