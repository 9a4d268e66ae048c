"""Streaming decode on the vllm backend: ``hf_stream.StreamDecoder``'s contract on vLLM's own
scheduler (issue "Laminar"; arXiv 2510.12633, seed 004; algorithms.md §10-11).

A ``VLLMStreamDecoder`` keeps up to ``batch_size`` trajectories in flight as requests of one
``vllm.LLM`` engine and steps the engine itself (``LLMEngine.step``): vLLM batches them
continuously (a finished request's KV blocks go to the next one at once, each request costing its
own length), and a trajectory that finishes is replaced by the next waiting one after that step.
Between two steps it asks ``weights`` whether a newer policy is published. If so, it does what
AReaL does on a weight update:

- every request in flight is aborted, its tokens so far kept (the requests stream their new
  tokens and log-probs step by step, ``RequestOutputKind.DELTA``);
- the newest policy's weights are loaded into the running engine (``vllm.reload_policy``: vLLM's
  ``reload_weights``, and its prefix cache reset, so that no KV block of the old weights is
  reused);
- each aborted trajectory is submitted again as its prompt plus its tokens so far, with the
  budget it has left: vLLM prefills it under the new weights and continues. The tokens prefilled
  again are counted (``StreamStats.switch_prefill_tokens``).

``keep_version`` (rollout.take_newer 'trajectory') instead starts no new trajectory while a newer
policy waits and switches once those in flight have finished.

Each request is seeded from its trajectory's noise key and its position in the response
(``request_seed``): a trajectory submitted at the same position under the same weights samples
the same tokens, whatever else the engine holds (tests/test_vllm.py checks the per-request seeds'
independence). Unlike the hf backend's keyed sampler, vLLM's per-request generator restarts at a
resubmission, so a resumed trajectory does not continue the noise it would have drawn
uninterrupted: it draws a new stream from its new position. Each token records the version that
sampled it, and its log-prob is the engine's processed log-prob under that version.

Its ``StreamStats``: ``segments`` counts its runs (vLLM has no segments), ``decode_steps`` the
engine's steps, ``row_steps`` those steps times the rows it may hold in flight and
``busy_row_steps`` the tokens they produced, so that their ratio is the share of its slots used."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator

from otbflow.engines.hf_stream import StreamLoop, StreamStats, Trajectory, Weights
from otbflow.seeds import derive_seed


def request_seed(key: int, position: int) -> int:
    """The vLLM seed of a trajectory's request that starts at response ``position``."""
    return derive_seed(key, "position", position, bits=63)


class VLLMStreamDecoder(StreamLoop):
    """Decode trajectories on ``engine()`` (a ``vllm.LLM``, built at a run's start), taking newer
    weights from ``weights`` between engine steps (module docstring; its loop is
    ``hf_stream.StreamLoop``'s). ``params(seed, max_tokens)``: the ``vllm.SamplingParams`` of one
    request (n = 1, the sampled token's log-prob); ``reload(llm, path)``: loads a policy folder's
    weights into the running engine. However a run ends, no request of it is left in the engine."""

    def __init__(
        self,
        engine: Callable[[], object],
        weights: Weights,
        params: Callable[[int, int], object],
        reload: Callable[[object, str], None],
        batch_size: int,
        keep_version: bool = False,
    ):
        self.engine, self.weights, self.params, self.reload = engine, weights, params, reload
        self.batch_size, self.keep_version = batch_size, keep_version
        self.stats = StreamStats()
        self.live: dict[str, Trajectory] = {}
        """The requests in flight, by request id."""
        self._ids = 0
        self._llm = None

    def run(self, trajectories: Iterable[Trajectory | None], enough=None) -> Iterator[Trajectory]:
        """``StreamLoop.run`` on the engine, built (or found warm) when the run starts."""
        self._llm = self.engine()
        self.stats.segments += 1
        yield from super().run(trajectories, enough)

    def _in_flight(self) -> Collection[Trajectory]:
        return self.live.values()

    def _admit(self, t: Trajectory) -> None:
        self._ids += 1
        request = f"t{self._ids}"
        prompt = {"prompt_token_ids": t.prompt_ids + t.response_ids}
        seed, left = request_seed(t.key, len(t.response_ids)), t.budget - len(t.response_ids)
        self._llm.llm_engine.add_request(request, prompt, self.params(seed, left))
        self.live[request] = t

    def _advance(self, more_waiting: bool, enough) -> tuple[list[Trajectory], bool]:
        """One engine step: each request's new tokens appended to its trajectory; those finished."""
        version = self.weights.version
        rows = len(self.live)
        finished = []
        for out in self._llm.llm_engine.step():
            t = self.live.get(out.request_id)
            if t is None:
                continue
            (c,) = out.outputs
            tokens = list(c.token_ids)
            if tokens and (c.logprobs is None or len(c.logprobs) != len(tokens)):
                raise ValueError("vLLM returned no per-token log-probs (SamplingParams.logprobs must be 0)")
            t.response_ids += tokens
            t.logprobs += [token_logprob(entry, token) for entry, token in zip(c.logprobs or [], tokens)]
            t.versions += [version] * len(tokens)
            self.stats.busy_row_steps += len(tokens)
            if out.finished:
                t.finish_reason = finish_reason(c.finish_reason)
                finished.append(t)
                del self.live[out.request_id]
        self.stats.decode_steps += 1
        self.stats.row_steps += self.batch_size if rows else 0
        return finished, False

    def _load_newest(self) -> None:
        """Abort the requests in flight (their trajectories keep their tokens so far), then load
        the newest weights into the engine; ``_continue`` submits them again."""
        self._abort_in_flight()
        v, path = self.weights.newest()
        self.reload(self._llm, str(path))
        self.weights.held(v, path)

    def _continue(self, active: list[Trajectory], switched: bool) -> None:
        if switched:  # aborted by the switch: each again as its prompt and tokens so far
            for t in active:
                t.prefills += 1
                self._admit(t)

    def _close(self) -> None:
        self._abort_in_flight()

    def _abort_in_flight(self) -> None:
        if self.live:
            self._llm.llm_engine.abort_request(list(self.live))
            self.live.clear()


def finish_reason(reason: str | None) -> str:
    """A completion's finish reason as a sample's ('stop': a stop token, kept as the last token;
    'length': the budget); any other (an abort, an error) is no finished response."""
    if reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM ended a request with finish reason {reason!r}, not 'stop' or 'length'")
    return reason


def token_logprob(entry, token: int) -> float:
    """The sampled token's log-prob from one position of ``CompletionOutput.logprobs``: a dict
    {token_id: Logprob(logprob=...)} (or a plain float)."""
    value = entry[token] if isinstance(entry, dict) else entry
    return float(getattr(value, "logprob", value))
