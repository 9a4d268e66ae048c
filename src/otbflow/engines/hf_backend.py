"""The hf backend ('hf', ``rollout.backend``): transformers on the policy loaded once, sampling
through ``otbflow.engines.hf.hf_generate``, or, with ``rollout.hf_refill_below``, through
``otbflow.engines.hf_stream.StreamDecoder``, which gives a finished row's place to a waiting
one before the batch's longest response ends (continuous batching at segment granularity). Both
sample the same tokens: a row's noise is keyed by its seed, prompt, sample and position."""

from __future__ import annotations

import logging
from typing import Any

from omegaconf import DictConfig

from otbflow.engines import Sample, Sampling, stop_token_ids
from otbflow.engines.hf import decode_mode, hf_generate, row_keys
from otbflow.engines.hf_stream import StreamDecoder, Trajectory
from otbflow.models.policy import load_policy
from otbflow.progress import Progress

log = logging.getLogger("otbflow.generate")


class FixedWeights:
    """The one policy of a job: version 0, never a newer one (``hf_stream.Weights``)."""

    version = 0

    def newer(self) -> bool:
        return False

    def take(self, model) -> int:
        raise AssertionError("a fixed policy has no newer version")


class HFBackend:
    """transformers ``generate`` on the policy loaded once (``model.dtype``, default device)."""

    name = "hf"

    def __init__(self, cfg: DictConfig, policy: str):
        self.model, self.tok = load_policy(policy, cfg.model.dtype)
        self.stops = stop_token_ids(self.tok, policy)
        self.batch_size = cfg.rollout.batch_size
        self.refill_below = cfg.rollout.hf_refill_below
        self.decode = decode_mode(cfg.rollout.hf_decode, self.model.device)

    def generate(self, prompt_ids: list[list[int]], sampling: Sampling) -> list[Sample]:
        s = sampling
        label = "greedy generation" if s.greedy else f"generation ({s.n} per prompt)"
        if self.refill_below:
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
        refills its batch when ``refill_below`` rows are still decoding."""
        n = 1 if s.greedy else s.n
        keys = row_keys(s.seed, range(len(prompt_ids)), n, "cpu").tolist()
        rows = (
            Trajectory(i, j, keys[i * n + j], ids, s.max_new_tokens)
            for i, ids in enumerate(prompt_ids)
            for j in range(n)
        )
        decoder = StreamDecoder(
            self.model,
            self.tok,
            FixedWeights(),
            self.stops,
            s.temperature,
            s.top_p,
            s.min_p,
            batch_size=self.batch_size * n,
            refill_below=self.refill_below,
            decode=self.decode,
            greedy=s.greedy,
        )
        out, left = [], [n] * len(prompt_ids)
        for t in decoder.run(rows):
            text = self.tok.decode(t.response_ids, skip_special_tokens=True)
            out.append(
                Sample(t.prompt_index, t.sample_idx, t.prompt_ids, t.response_ids, t.logprobs, t.finish_reason, text)
            )
            left[t.prompt_index] -= 1
            if not left[t.prompt_index]:
                progress.update(1)
        st = decoder.stats
        log.info(
            "refilled batches: %d segments, %d tokens prefilled again, rows busy %.0f%% of the decode steps",
            st.segments,
            st.refill_prefill_tokens,
            100 * st.busy_row_steps / max(st.row_steps, 1),
        )
        return sorted(out, key=lambda x: (x.prompt_index, x.sample_idx))

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
            "refill_below": self.refill_below,
        }
