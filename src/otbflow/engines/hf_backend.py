"""The hf backend ('hf', ``rollout.backend``): transformers on the policy loaded once, sampling
through ``otbflow.engines.hf.hf_generate``, or, with ``rollout.hf_refill_below`` or a rollout's
newer policies (``rollout.take_newer``, ``PublishedPolicies``), through
``otbflow.engines.hf_stream.StreamDecoder``, which gives a finished row's place to a waiting
one before the batch's longest response ends (continuous batching at segment granularity) and
takes newer weights between decode steps. Under one policy both sample the same tokens: a row's
noise is keyed by its seed, prompt, sample and position."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from otbflow.engines import Sample, Sampling, stop_token_ids
from otbflow.engines.hf import decode_mode, hf_generate
from otbflow.engines.hf_stream import FixedWeights, StreamDecoder, StreamingBackend, StreamStats, Weights
from otbflow.models.policy import load_policy
from otbflow.progress import Progress
from otbflow.runtime import manifest, resident

log = logging.getLogger("otbflow.generate")


class PublishedPolicies:
    """``hf_stream.Weights`` over the policies a rollout may take after the one it starts from
    (version ``first``, the folder ``start``): those of iterations first + 1, first + 2, ...
    (``paths``, in order), each once its train job has published it: the folder is renamed into
    place whole, its manifest in it, after the policy before it was published. A folder whose
    manifest is not newer than the held policy's is left from an earlier run and about to be
    trained again (a rerun after a change upstream): it is not taken. ``take`` loads the newest
    published one into the model in place: in a warm worker through the resident module (only
    what changed is read, checked against the manifest), otherwise every tensor, each checked
    against the manifest as it is read. ``digests``: the weights identity of each version taken
    (its manifest's), by version."""

    def __init__(self, paths: list[str], first: int, start: str, dtype: str, keep_version: bool = False):
        self.paths, self.first, self.version, self.dtype = [Path(p) for p in paths], first, first, dtype
        self.keep_version = keep_version  # rollout.take_newer 'trajectory' (hf_stream.StreamDecoder's)
        self.digests = {first: (manifest.read(start) or {}).get("weights")}
        self.stamps = {first: _mtime(Path(start) / manifest.MANIFEST) or _mtime(Path(start) / "config.json") or 0}

    def _published(self) -> int:
        """The newest version published, counting on from the one held, each after the one before."""
        v = self.version
        while v - self.first < len(self.paths):
            at = _mtime(self.paths[v - self.first] / manifest.MANIFEST)
            if at is None or at <= self.stamps[v]:
                break
            self.stamps[v + 1] = at
            v += 1
        return v

    def newer(self) -> bool:
        return self._published() > self.version

    def take(self, model) -> int:
        v, path = self.newest()
        listed = manifest.read(path)
        if resident.ENABLED:
            held, _ = load_policy(path, self.dtype)
            if held is not model:
                raise RuntimeError(f"{path}: not a policy of the resident module's architecture and tokenizer")
        else:
            resident.load_weights_in_place(model, path, want=listed["tensors"] if listed else None)
        return self.held(v, path)

    def newest(self) -> tuple[int, Path]:
        """The newest version published and its folder (an engine that loads weights its own way,
        vLLM's, loads them from there and then calls ``held``)."""
        v = self._published()
        return v, self.paths[v - self.first - 1]

    def held(self, v: int, path: Path) -> int:
        """Version ``v`` (the folder ``path``) is now the engine's."""
        self.version, self.digests[v] = v, (manifest.read(path) or {}).get("weights")
        log.info("took the policy of iteration %d (%s) between two decode steps", v, path)
        return v


def _mtime(path: Path) -> int | None:
    """``path``'s modification time in ns; None where it does not exist (yet)."""
    try:
        return path.stat().st_mtime_ns
    except FileNotFoundError:
        return None


class HFBackend(StreamingBackend):
    """transformers ``generate`` on the policy loaded once (``model.dtype``, default device)."""

    name = "hf"

    def __init__(self, cfg: DictConfig, policy: str):
        self.model, self.tok = load_policy(policy, cfg.model.dtype)
        self.stops = stop_token_ids(self.tok, policy)
        self.batch_size = cfg.rollout.batch_size
        self.refill_share = cfg.rollout.hf_refill_below
        self.decode = decode_mode(cfg.rollout.hf_decode, self.model.device)
        self.weights: Weights | None = None
        """A rollout's newer policies (``PublishedPolicies``), set by its sampler; None: the one policy."""
        self.stats = StreamStats()
        """What the stream decodes of this backend's calls did, summed."""

    def generate(self, prompt_ids: list[list[int]], sampling: Sampling) -> list[Sample]:
        s = sampling
        if self.refill_share or self.weights is not None:
            return self.refilled(prompt_ids, s)
        return hf_generate(
            self.model,
            self.tok,
            prompt_ids,
            s.n,
            s.temperature,
            s.top_p,
            s.max_new_tokens,
            s.greedy,
            self.batch_size,
            s.seed,
            self.stops,
            Progress(log, s.label(), len(prompt_ids), "prompts"),
            s.min_p,
            self.decode,
        )

    def decoder(self, s: Sampling, length: int | None = None) -> StreamDecoder:
        """A ``StreamDecoder`` of ``batch_size`` prompts' rows with ``s``'s sampling options, taking
        newer weights from ``weights`` (none: the one policy). (``length``, the most tokens of a
        row, sizes vLLM's cache; this backend's cache grows with its rows.)"""
        n = 1 if s.greedy else s.n
        return StreamDecoder(
            self.model,
            self.tok,
            self.weights or FixedWeights(),
            self.stops,
            s.temperature,
            s.top_p,
            s.min_p,
            batch_size=self.batch_size * n,
            refill_below=int(self.refill_share * self.batch_size * n),
            keep_version=getattr(self.weights, "keep_version", False),
            decode=self.decode,
            greedy=s.greedy,
        )

    def metadata(self, sampling: Sampling) -> dict[str, Any]:
        import transformers

        s = sampling
        return {
            "transformers_version": transformers.__version__,
            "sampling": {
                "n": 1 if s.greedy else s.n,
                "temperature": s.temperature,
                "top_p": s.top_p,
                "top_k": 0,
                "min_p": s.min_p,
                "max_new_tokens": s.max_new_tokens,
                "greedy": s.greedy,
            },
            "seeds": "per row: derive_seed(seed, 'row', i, j, bits=63), Gumbel-max with Philox4x32-10 noise"
            " (otbflow.engines.hf.RowSampler)",
            "decode": self.decode,
            "refill_below": self.refill_share,
        }
