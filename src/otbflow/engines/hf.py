"""The transformers generation backend ('hf'; CPU or GPU): batches of prompts left-padded with an
attention mask (transformers derives the position ids of llama/qwen2/gpt2 from it), ``n`` sampled
responses per prompt, each ending at its first stop token. Log-probs and sampling defaults:
README.md, "Environments and the vLLM backend" and "A real model and dataset"."""

from __future__ import annotations

import logging
from typing import Any

import torch
from omegaconf import DictConfig

from otbflow.engines import Sample, Sampling, stop_token_ids, truncate_at_stop
from otbflow.logits import padded
from otbflow.model import load_policy
from otbflow.progress import Progress

log = logging.getLogger("otbflow.generate")


@torch.no_grad()
def hf_generate(
    model,
    tok,
    prompt_ids: list[list[int]],
    n: int = 1,
    temperature: float = 1.0,
    top_p: float = 1.0,
    max_new_tokens: int = 48,
    greedy: bool = False,
    batch_size: int = 64,
    seed: int = 0,
    stop_ids: list[int] | None = None,
    progress: Progress | None = None,
) -> list[Sample]:
    """Sample ``n`` responses for each prompt (greedy: one). Deterministic on CPU for a seed.
    ``stop_ids``: tokens that end a response (default: the tokenizer's eos token); ``progress``
    counts the prompts done (otbflow.progress)."""
    from transformers import GenerationConfig

    torch.manual_seed(seed)
    stops = stop_ids or [tok.eos_token_id]
    pad = tok.pad_token_id if tok.pad_token_id is not None else stops[0]
    out: list[Sample] = []
    n = 1 if greedy else n
    sampling = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
    saved, model.generation_config = model.generation_config, GenerationConfig(eos_token_id=stops, pad_token_id=pad)
    try:
        for start in range(0, len(prompt_ids), batch_size):
            batch = prompt_ids[start : start + batch_size]
            input_ids = padded(batch, pad, left=True, device=model.device)
            width = input_ids.shape[1]
            attention = padded([[1] * len(x) for x in batch], 0, left=True, device=model.device)
            res = model.generate(
                input_ids=input_ids,
                attention_mask=attention,
                max_new_tokens=max_new_tokens,
                num_return_sequences=n,
                output_logits=True,
                return_dict_in_generate=True,
                **sampling,
            )
            new = res.sequences[:, width:]
            # log-prob of each sampled token under the raw, temperature-scaled distribution
            t = 1.0 if greedy else temperature
            lp = torch.stack(
                [
                    torch.log_softmax(step.float() / t, dim=-1).gather(-1, new[:, i : i + 1]).squeeze(-1)
                    for i, step in enumerate(res.logits)
                ],
                dim=1,
            )
            for row in range(new.shape[0]):
                toks = new[row].tolist()
                length, reason = truncate_at_stop(toks, set(stops))
                pi = start + row // n
                out.append(
                    Sample(
                        pi,
                        row % n,
                        prompt_ids[pi],
                        toks[:length],
                        lp[row, :length].tolist(),
                        reason,
                        tok.decode(toks[:length], skip_special_tokens=True),
                    )
                )
            if progress is not None:
                progress.update(len(batch))
    finally:
        model.generation_config = saved
    return out


class HFBackend:
    """transformers ``generate`` on the policy loaded once (``model.dtype``, default device)."""

    name = "hf"

    def __init__(self, cfg: DictConfig, policy: str):
        self.model, self.tok = load_policy(policy, cfg.model.dtype)
        self.stops = stop_token_ids(self.tok, policy)
        self.batch_size = cfg.rollout.batch_size

    def generate(self, prompt_ids: list[list[int]], sampling: Sampling) -> list[Sample]:
        s = sampling
        label = "greedy generation" if s.greedy else f"generation ({s.n} per prompt)"
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
                "max_new_tokens": s.max_new_tokens,
                "greedy": s.greedy,
            },
        }
