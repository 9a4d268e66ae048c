"""Streaming decode on the hf backend: the generation core of Laminar's trajectory-level
asynchrony (arXiv 2510.12633, seed 004; algorithms.md §10-11; issue "Laminar").

A ``StreamDecoder`` keeps up to ``batch_size`` trajectories in flight and decodes them in
*segments* of transformers' ``generate``. A segment ends when every row has finished, when a
newer policy is published (``Weights.newer``, asked between two decode steps), when the rows
still running fall to ``refill_below`` while more trajectories wait, when a row has spent its
budget, or when the consumer holds enough (``run``'s ``enough``: a streamed rollout's share of
complete groups, ``otbflow.engines.laminar``). Between segments:

- finished trajectories leave (``run`` yields them) and waiting ones take their rows;
- the newest policy's weights are loaded into the model in place (``Weights.take``), unless
  ``keep_version``: then no new trajectory starts until those in flight have finished, and the
  switch waits for them;
- every row still in flight is prefilled again (its prompt and the tokens it has), under the
  weights it continues with: after a switch these are the newer ones, so each token is sampled,
  and its log-prob recorded, under the policy current at its decode step. That is AReaL's
  interrupt-and-resubmit on an engine without one; the tokens prefilled again are counted
  (``StreamStats``).

A segment decodes at most as many steps as its row with the least budget left may take:
generate goes on feeding a finished row, its positions growing, and no row may pass the
positions that its prompt and budget were checked against.

Each row keeps its own noise stream: the sampler is keyed by the row's 63-bit key and its
position in its response (``otbflow.engines.hf.RowSampler``), so a trajectory resumed in another
segment, batch or decoder samples what it would have sampled uninterrupted, given the same
weights, up to the logits' rounding (a prefill and an incremental step round differently).
Each token records the version that sampled it (``Trajectory.versions``).

The loop around a segment (admitting, draining, switching) is ``StreamLoop``, which the vllm
backend's ``vllm_stream.VLLMStreamDecoder`` shares with one engine step as its unit."""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from otbflow.algorithms.tensors import padded
from otbflow.engines import Sample, Sampling, truncate_at_stop
from otbflow.engines.hf import WIDTH_BUCKET, RowSampler, decode_mode, fused_sampler, generation_config, row_keys
from otbflow.progress import Progress

log = logging.getLogger("otbflow.generate")


@dataclass
class Trajectory:
    """One response in the making: ``key`` is its row's 63-bit noise key (``hf.row_keys``),
    ``budget`` its most new tokens; the response grows segment by segment."""

    prompt_index: int
    sample_idx: int
    key: int
    prompt_ids: list[int]
    budget: int
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    """The policy version that sampled each response token."""
    finish_reason: str | None = None
    """None while in flight; then 'stop' (a stop token) or 'length' (the budget)."""
    prefills: int = 0
    """Times it was prefilled again to continue (a switch or a refill)."""


class Weights(Protocol):
    """Where the decoder's policy comes from: the version it holds and whether a newer one is
    published (asked between decode steps: cheap), and ``take``, which loads the newest into
    ``model`` in place and returns its version; for an engine that loads weights its own way
    (vLLM's), ``newest`` (the newest version and its folder) and then ``held`` (now loaded)."""

    version: int

    def newer(self) -> bool: ...

    def take(self, model) -> int: ...

    def newest(self) -> tuple[int, Path]: ...

    def held(self, v: int, path: Path) -> int: ...


class FixedWeights:
    """The one policy of a job: version 0, never a newer one (``Weights``)."""

    version = 0

    def newer(self) -> bool:
        return False

    def take(self, model) -> int:
        raise AssertionError("a fixed policy has no newer version")

    def newest(self) -> tuple[int, Path]:
        raise AssertionError("a fixed policy has no newer version")

    def held(self, v: int, path: Path) -> int:
        raise AssertionError("a fixed policy has no newer version")


@dataclass
class StreamStats:
    segments: int = 0
    switches: int = 0
    """Weight switches taken."""
    switch_prefill_tokens: int = 0
    """Tokens prefilled again because the weights changed under rows in flight (prompt + response)."""
    refill_prefill_tokens: int = 0
    """Tokens prefilled again to continue rows in flight beside new ones (same weights)."""
    decode_steps: int = 0
    row_steps: int = 0
    """Decode steps summed over rows, running or idle: ``busy_row_steps / row_steps`` is the batch's use."""
    busy_row_steps: int = 0


class StreamingBackend:
    """What the backends that decode through a stream decoder share (``hf_backend.HFBackend``'s
    ``StreamDecoder``, ``vllm.VLLMBackend``'s ``vllm_stream.VLLMStreamDecoder``): a batch sampled
    through one (``refilled``), a finished trajectory as a ``Sample`` and the decoders' statistics.
    A subclass has ``tok``, ``weights`` (None: the one policy), ``stats`` (a ``StreamStats``) and
    ``decoder(sampling, length)`` (``length``: the most tokens of a row, prompt and response)."""

    tok: object
    weights: Weights | None
    stats: StreamStats

    def refilled(self, prompt_ids: list[list[int]], s: Sampling) -> list[Sample]:
        """The samples of ``prompt_ids`` from one stream decoder, which starts a row as soon as
        another finishes and takes newer weights from ``weights`` (each sample then records its
        tokens' versions). Each row's noise is keyed by ``hf.row_keys`` of ``s.seed``."""
        n = 1 if s.greedy else s.n
        keys = row_keys(s.seed, range(len(prompt_ids)), n, "cpu").tolist()
        rows = (
            Trajectory(i, j, keys[i * n + j], ids, s.max_new_tokens)
            for i, ids in enumerate(prompt_ids)
            for j in range(n)
        )
        decoder = self.decoder(s, max(map(len, prompt_ids), default=0) + s.max_new_tokens)
        progress = Progress(log, s.label(), len(prompt_ids), "prompts")
        out, left = [], [n] * len(prompt_ids)
        for t in decoder.run(rows):
            out.append(self.sample(t))
            left[t.prompt_index] -= 1
            if not left[t.prompt_index]:
                progress.update(1)
        self.add_stats(decoder.stats)
        return sorted(out, key=lambda x: (x.prompt_index, x.sample_idx))

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


class _SegmentEnd:
    """generate's stopping criterion for one segment: per row, its budget; for every row, a newer
    policy (``interrupt``), the running rows falling to ``refill_below``, or the consumer holding
    enough (``enough``, given the rows finished so far, asked when one more finishes). A row's stop
    token is generate's own criterion; this one tracks it too, to count the rows still running."""

    def __init__(self, width, remaining: torch.Tensor, stops: list[int], interrupt, refill_below: int, enough=None):
        self.width, self.remaining, self.interrupt, self.refill_below = width, remaining, interrupt, refill_below
        self.enough = enough
        self.stops = torch.tensor(stops, device=remaining.device)
        self.done = torch.zeros_like(remaining, dtype=torch.bool)
        self.busy = 0
        self.stopped = False
        """Ended by ``enough``: the consumer's, not the rows' or the weights'."""

    def __call__(self, input_ids: torch.Tensor, scores, **_) -> torch.Tensor:
        steps = input_ids.shape[1] - self.width
        self.busy += int((~self.done).sum())
        before = int(self.done.sum())
        self.done |= torch.isin(input_ids[:, -1], self.stops) | (steps >= self.remaining)
        running = int((~self.done).sum())
        if running and self.enough is not None and int(self.done.sum()) > before and self.enough(self.done.tolist()):
            self.stopped = True
            return torch.ones_like(self.done)
        if running and (running <= self.refill_below or self.interrupt()):
            return torch.ones_like(self.done)
        return self.done.clone()


_END = object()  # the iterable of trajectories is spent


class StreamLoop:
    """What both stream decoders do around their unit of decoding (this module's
    ``StreamDecoder``: one ``generate`` segment; ``vllm_stream.VLLMStreamDecoder``: one engine
    step): admit waiting trajectories while fewer than ``batch_size`` are in flight, take the newest
    weights between two units, drain first for ``keep_version``, and end when nothing is left to
    decode or the consumer holds enough. A subclass has ``weights``, ``batch_size``,
    ``keep_version`` and ``stats`` and defines ``_in_flight``, ``_admit``, ``_advance``,
    ``_load_newest`` and ``_continue`` (and ``_close``: what a run leaves, however it ends)."""

    weights: Weights
    batch_size: int
    keep_version: bool
    stats: StreamStats

    def run(self, trajectories: Iterable[Trajectory | None], enough=None) -> Iterator[Trajectory]:
        """Decode ``trajectories`` (taken lazily, as rows free up) and yield each as it finishes.
        The iterable may yield None: no trajectory to start now (asked again after the next unit;
        with nothing in flight the run ends). ``enough(finished)``: asked as rows finish, with the
        trajectories finished in the unit so far (where the unit can stop early), and after a unit
        that finished some, with none (they were yielded first); once it answers True the run
        returns, the others left as they are (their tokens so far recorded). One stream at a time:
        the rows in flight are the decoder's."""
        if self._in_flight():
            raise RuntimeError("this stream decoder is running another stream: one at a time")
        waiting = iter(trajectories)
        nxt = next(waiting, _END)
        try:
            while True:
                if not self._in_flight() and self.weights.newer():  # nothing in flight: new ones start on the newest
                    self._switch([])
                draining = self.keep_version and self.weights.newer()
                while nxt is not _END and nxt is not None and len(self._in_flight()) < self.batch_size and not draining:
                    self._admit(nxt)
                    nxt = next(waiting, _END)
                if not self._in_flight():
                    if nxt is _END or nxt is None:
                        return
                    self._switch([])  # keep_version, drained: the newer weights, then new trajectories
                    continue
                more = nxt is not _END and nxt is not None and not draining
                finished, stopped = self._advance(more, enough)
                yield from finished
                if stopped or (enough is not None and finished and enough([])):
                    return
                if nxt is None:  # none to start before: ask again
                    nxt = next(waiting, _END)
                active = list(self._in_flight())
                switch = bool(active) and self.weights.newer() and not self.keep_version
                if switch:
                    self._switch(active)
                self._continue(active, switch)
        finally:
            self._close()

    def _switch(self, held: list[Trajectory]) -> None:
        """Load the newest weights; ``held``: the trajectories in flight that continue under them,
        each prefilled again (counted)."""
        self._load_newest()
        self.stats.switches += 1
        self.stats.switch_prefill_tokens += sum(len(t.prompt_ids) + len(t.response_ids) for t in held)

    def _in_flight(self) -> Collection[Trajectory]:
        """The trajectories in flight (a view: read before a switch changes it)."""
        raise NotImplementedError

    def _admit(self, t: Trajectory) -> None:
        raise NotImplementedError

    def _advance(self, more_waiting: bool, enough) -> tuple[list[Trajectory], bool]:
        """One unit of decoding: the trajectories it finished (no longer in flight), and whether
        ``enough`` ended it."""
        raise NotImplementedError

    def _load_newest(self) -> None:
        raise NotImplementedError

    def _continue(self, active: list[Trajectory], switched: bool) -> None:
        """After a unit: ``active`` are still in flight (under the newest weights if ``switched``)."""
        raise NotImplementedError

    def _close(self) -> None:
        pass


class StreamDecoder(StreamLoop):
    """Decode trajectories with ``model`` (and its tokenizer ``tok``), taking newer weights from
    ``weights`` between decode steps (module docstring). ``sampling``: temperature, top_p and
    min_p as ``hf_generate`` takes them (``greedy``: the argmax instead); ``stops``: the stop token ids."""

    def __init__(
        self,
        model,
        tok,
        weights: Weights,
        stops: list[int],
        temperature: float = 1.0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        batch_size: int = 64,
        refill_below: int = 0,
        keep_version: bool = False,
        decode: str = "eager",
        greedy: bool = False,
    ):
        self.model, self.tok, self.weights, self.stops = model, tok, weights, list(stops)
        self.temperature, self.top_p, self.min_p = temperature, top_p, min_p
        if not 0 <= refill_below < batch_size:
            raise ValueError(f"refill_below {refill_below}: must be in [0, batch_size {batch_size})")
        self.batch_size, self.refill_below, self.keep_version = batch_size, refill_below, keep_version
        self.greedy = greedy
        self.mode = decode_mode(decode, model.device)
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else self.stops[0]
        self.stats = StreamStats()
        self.active: list[Trajectory] = []

    def _in_flight(self) -> list[Trajectory]:
        return self.active

    def _admit(self, t: Trajectory) -> None:
        self.active.append(t)

    def _advance(self, more_waiting: bool, enough) -> tuple[list[Trajectory], bool]:
        stopped = self._segment(self.active, more_waiting=more_waiting, enough=enough)
        finished = [t for t in self.active if t.finish_reason]
        self.active = [t for t in self.active if not t.finish_reason]
        return finished, stopped

    def _load_newest(self) -> None:
        self.weights.take(self.model)

    def _continue(self, active: list[Trajectory], switched: bool) -> None:
        for t in active:  # prefilled again at the next segment: under the newer weights after a switch
            t.prefills += 1
            if not switched:
                self.stats.refill_prefill_tokens += len(t.prompt_ids) + len(t.response_ids)

    def _close(self) -> None:
        self.active = []

    @torch.no_grad()
    def _segment(self, rows: list[Trajectory], more_waiting: bool, enough=None) -> bool:
        """Decode one segment of ``rows``; True where ``enough`` ended it."""
        from transformers import LogitsProcessorList, StoppingCriteriaList

        model, device = self.model, self.model.device
        version = self.weights.version
        seqs = [t.prompt_ids + t.response_ids for t in rows]
        width = max(len(s) for s in seqs)
        if self.mode == "compiled":  # the static cache grows, and recompiles, in steps (hf.WIDTH_BUCKET)
            width = -(-width // WIDTH_BUCKET) * WIDTH_BUCKET
        remaining = torch.tensor([t.budget - len(t.response_ids) for t in rows], device=device)
        end = _SegmentEnd(
            width,
            remaining,
            self.stops,
            interrupt=(lambda: False) if self.keep_version else self.weights.newer,
            refill_below=self.refill_below if more_waiting else 0,
            enough=None if enough is None else lambda done: enough([t for t, d in zip(rows, done) if d]),
        )
        sampler = RowSampler(
            torch.tensor([t.key for t in rows], dtype=torch.int64, device=device),
            self.temperature,
            self.top_p,
            greedy=self.greedy,
            min_p=self.min_p,
            fused=fused_sampler(self.mode, model),
            positions=torch.tensor([len(t.response_ids) for t in rows], dtype=torch.int64, device=device),
        )
        saved, model.generation_config = model.generation_config, generation_config(self.mode, self.stops, self.pad)
        try:
            res = model.generate(
                input_ids=padded(seqs, self.pad, width, left=True, device=device),
                attention_mask=padded([[1] * len(s) for s in seqs], 0, width, left=True, device=device),
                max_new_tokens=int(remaining.min()),  # no row past its budget's positions (module docstring)
                do_sample=False,
                logits_processor=LogitsProcessorList([sampler]),
                stopping_criteria=StoppingCriteriaList([end]),
                return_dict_in_generate=True,
            )
        finally:
            model.generation_config = saved
        new = res.sequences[:, width:].tolist()
        lp = torch.stack(sampler.logprobs, dim=1).tolist()
        steps = len(new[0]) if new else 0
        self.stats.segments += 1
        self.stats.decode_steps += steps
        self.stats.row_steps += steps * len(rows)
        self.stats.busy_row_steps += end.busy
        for t, toks, lps in zip(rows, new, lp):
            toks = toks[: t.budget - len(t.response_ids)]
            length, reason = truncate_at_stop(toks, self.stops)
            t.response_ids += toks[:length]
            t.logprobs += lps[:length]
            t.versions += [version] * length
            if reason == "stop" or len(t.response_ids) >= t.budget:
                t.finish_reason = reason if reason == "stop" else "length"
        return end.stopped
