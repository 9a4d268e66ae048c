"""The vLLM rollout backend (GPU nodes; its own environment, envs/vllm.yaml).

Official vLLM pins its own torch and transformers, so it is never imported by the CPU
environment: ``import vllm`` happens inside ``generate`` only. Everything else here is plain
Python and unit-tested on CPU: the engine and sampling arguments built from the config, and the
conversion of vLLM's ``RequestOutput`` objects to the rollout schema.

Log-probs: the trainer's log-probs (features stage) are log_softmax(z / T) of the raw logits z.
vLLM returns per sampled token either ``raw_logprobs`` (log_softmax(z), before temperature and
any processing) or ``processed_logprobs`` (after temperature, penalties and top-k/top-p). So we
ask for ``raw_logprobs`` at temperature 1 and ``processed_logprobs`` otherwise; the two engines'
log-probs are then the same quantity as long as top_p = 1 and no penalty is set (with top_p < 1
vLLM renormalises over the nucleus, which the mismatch columns will show). The mode is recorded
in the rollout Parquet metadata.
"""

from __future__ import annotations

from typing import Any, Iterable

from otbflow.rollout import Sample


def logprobs_mode(temperature: float) -> str:
    return "raw_logprobs" if temperature == 1.0 else "processed_logprobs"


def engine_kwargs(policy: str, dtype: str, seed: int, tensor_parallel_size: int, temperature: float,
                  gpu_memory_utilization: float, max_model_len: int | None = None) -> dict[str, Any]:
    """Arguments of ``vllm.LLM`` for a local HF folder (no download)."""
    kwargs = {
        "model": policy,
        "tokenizer": policy,
        "dtype": dtype,
        "seed": seed,
        "tensor_parallel_size": tensor_parallel_size,
        "gpu_memory_utilization": gpu_memory_utilization,
        "logprobs_mode": logprobs_mode(temperature),
        "enable_prefix_caching": True,  # G samples share their prompt
    }
    if max_model_len:
        kwargs["max_model_len"] = max_model_len
    return kwargs


def sampling_kwargs(n: int, temperature: float, top_p: float, max_new_tokens: int, greedy: bool,
                    seed: int) -> dict[str, Any]:
    """Arguments of ``vllm.SamplingParams``: n samples, the sampled token's log-prob only."""
    if greedy:
        return {"n": 1, "temperature": 0.0, "max_tokens": max_new_tokens, "logprobs": 0, "seed": seed}
    return {"n": n, "temperature": temperature, "top_p": top_p, "top_k": -1, "max_tokens": max_new_tokens,
            "logprobs": 0, "seed": seed, "skip_special_tokens": True}


def _token_logprob(entry: Any, token: int) -> float:
    """The sampled token's log-prob from one position of ``CompletionOutput.logprobs``: a dict
    {token_id: Logprob(logprob=...)} (or a plain float)."""
    value = entry[token] if isinstance(entry, dict) else entry
    return float(getattr(value, "logprob", value))


def samples_from_outputs(outputs: Iterable[Any], prompt_ids: list[list[int]], eos_id: int) -> list[Sample]:
    """Convert ``LLM.generate`` results (one RequestOutput per prompt, in order, each with n
    CompletionOutputs) to the backend-independent ``Sample`` records."""
    samples = []
    for pi, request in enumerate(outputs):
        for completion in sorted(request.outputs, key=lambda c: c.index):
            tokens = list(completion.token_ids)
            if completion.logprobs is None or len(completion.logprobs) != len(tokens):
                raise ValueError(f"prompt {pi} sample {completion.index}: vLLM returned no per-token log-probs "
                                 f"(SamplingParams.logprobs must be 0)")
            reason = "stop" if completion.finish_reason == "stop" else "length"
            logprobs = [_token_logprob(entry, tok) for entry, tok in zip(completion.logprobs, tokens)]
            samples.append(Sample(pi, completion.index, prompt_ids[pi], tokens, logprobs, reason, completion.text))
    return samples


def generate(policy: str, prompt_ids: list[list[int]], eos_id: int, n: int, temperature: float, top_p: float,
             max_new_tokens: int, greedy: bool, seed: int, dtype: str, tensor_parallel_size: int,
             gpu_memory_utilization: float) -> tuple[list[Sample], dict[str, Any]]:
    """Sample with vLLM; returns the samples and metadata (version, engine and sampling args)."""
    import vllm

    e_kwargs = engine_kwargs(policy, dtype, seed, tensor_parallel_size, temperature, gpu_memory_utilization)
    s_kwargs = sampling_kwargs(n, temperature, top_p, max_new_tokens, greedy, seed)
    llm = vllm.LLM(**e_kwargs)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], vllm.SamplingParams(**s_kwargs),
                           use_tqdm=False)
    meta = {"vllm_version": vllm.__version__, "engine": e_kwargs, "sampling": s_kwargs}
    return samples_from_outputs(outputs, prompt_ids, eos_id), meta
