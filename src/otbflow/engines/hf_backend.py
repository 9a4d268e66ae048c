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
from otbflow.engines.hf import decode_mode, hf_generate, row_keys
from otbflow.engines.hf_stream import StreamDecoder, StreamStats, Trajectory, Weights
from otbflow.models.policy import load_policy
from otbflow.progress import Progress
from otbflow.runtime import manifest, resident

log = logging.getLogger("otbflow.generate")


class FixedWeights:
    """The one policy of a job: version 0, never a newer one (``hf_stream.Weights``)."""

    version = 0

    def newer(self) -> bool:
        return False

    def take(self, model) -> int:
        raise AssertionError("a fixed policy has no newer version")


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
        v = self._published()
        path = self.paths[v - self.first - 1]
        listed = manifest.read(path)
        if resident.ENABLED:
            held, _ = load_policy(path, self.dtype)
            if held is not model:
                raise RuntimeError(f"{path}: not a policy of the resident module's architecture and tokenizer")
        else:
            resident.load_weights_in_place(model, path, want=listed["tensors"] if listed else None)
        self.version, self.digests[v] = v, (listed or {}).get("weights")
        log.info("took the policy of iteration %d (%s) between two decode steps", v, path)
        return v


def _mtime(path: Path) -> int | None:
    """``path``'s modification time in ns; None where it does not exist (yet)."""
    try:
        return path.stat().st_mtime_ns
    except FileNotFoundError:
        return None


class HFBackend:
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
        label = "greedy generation" if s.greedy else f"generation ({s.n} per prompt)"
        if self.refill_share or self.weights is not None:
            return self.refilled(prompt_ids, s, Progress(log, label, len(prompt_ids), "prompts"))
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
            Progress(log, label, len(prompt_ids), "prompts"),
            s.min_p,
            self.decode,
        )

    def refilled(self, prompt_ids: list[list[int]], s: Sampling, progress: Progress) -> list[Sample]:
        """``hf_generate``'s samples from a ``StreamDecoder`` of ``batch_size`` prompts' rows that
        refills its batch when ``refill_share`` of its rows are still decoding and takes newer weights
        from ``weights`` (each sample then records its tokens' versions)."""
        n = 1 if s.greedy else s.n
        keys = row_keys(s.seed, range(len(prompt_ids)), n, "cpu").tolist()
        rows = (
            Trajectory(i, j, keys[i * n + j], ids, s.max_new_tokens)
            for i, ids in enumerate(prompt_ids)
            for j in range(n)
        )
        decoder = self.decoder(s)
        out, left = [], [n] * len(prompt_ids)
        for t in decoder.run(rows):
            out.append(self.sample(t))
            left[t.prompt_index] -= 1
            if not left[t.prompt_index]:
                progress.update(1)
        self.add_stats(decoder.stats)
        return sorted(out, key=lambda x: (x.prompt_index, x.sample_idx))

    def decoder(self, s: Sampling) -> StreamDecoder:
        """A ``StreamDecoder`` of ``batch_size`` prompts' rows with ``s``'s sampling options, taking
        newer weights from ``weights`` (none: the one policy)."""
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

    def sample(self, t: Trajectory) -> Sample:
        """A finished trajectory as a ``Sample``: its text, and its tokens' versions where newer
        policies could be taken."""
        text = self.tok.decode(t.response_ids, skip_special_tokens=True)
        versions = t.versions if self.weights is not None else None
        return Sample(
            t.prompt_index, t.sample_idx, t.prompt_ids, t.response_ids, t.logprobs, t.finish_reason, text, versions
        )

    def add_stats(self, st: StreamStats) -> None:
        """Add one decoder's ``st`` to ``stats`` and log them."""
        for name, value in vars(st).items():
            setattr(self.stats, name, getattr(self.stats, name) + value)
        log.info(
            "stream decode: %d segments, %d weight switches, %d tokens prefilled again for them and %d to refill, "
            "rows busy %.0f%% of the decode steps",
            st.segments,
            st.switches,
            st.switch_prefill_tokens,
            st.refill_prefill_tokens,
            100 * st.busy_row_steps / max(st.row_steps, 1),
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
