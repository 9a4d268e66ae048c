"""The current policy's log-probs in the train stage, with autograd: the same fp32 arithmetic as
the features stage's statistics (``otbflow.models.logits``), in chunks of response tokens under
activation checkpointing (``response_token_stats``), the module DeepSpeed wraps
(``ResponseLogprobs``), flat per-token values scattered back to [rows, longest response]
(``to_padded``) and the padded log-probs of a batch (``policy_logprobs``). With ``min_p`` > 0
(``rollout.min_p``) those of the pruned policy pi_S (``otbflow.algorithms.vocab_pruning``)."""

from __future__ import annotations

import torch

from otbflow.algorithms.vocab_pruning import PRUNING_STATS
from otbflow.models.logits import ResponseLogits, pack, pruned_logits


def logit_stats(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, entropy_grad: bool = False, min_p: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log pi(y_t), entropy, pruning) of rows of logits [n, V] at ``targets`` [n], with the
    features stage's fp32 arithmetic (``logits.token_stats``): z = logits / temperature, m = max z,
    e = exp(z - m), s = sum e; log pi = z_y - m - log s and entropy = m + log s - sum e z / s.
    m is a constant for autograd (it cancels). The entropy carries a gradient only with
    ``entropy_grad`` (an entropy bonus). ``min_p`` > 0: those of the pruned policy pi_S
    (``pruned_logits``); pruning is ``PRUNING_STATS`` per row [n, 3] (zeros when off)."""
    z = logits.float() / temperature
    m = torch.amax(z, dim=-1, keepdim=True).detach()
    if min_p > 0:
        z, pruning = pruned_logits(z, targets, min_p)
    else:
        pruning = z.new_zeros(z.shape[0], len(PRUNING_STATS))
    e = torch.exp(z - m)
    s = e.sum(-1)
    log_s = torch.log(s)
    m = m.squeeze(-1)
    logp = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - m - log_s
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        ez = torch.bmm(e.unsqueeze(1), z.unsqueeze(2)).reshape(-1)
        entropy = m + log_s - ez / s
    return logp, entropy, pruning


def _head_stats(head, transform, hidden, targets, temperature: float, entropy_grad: bool, min_p: float):
    logits = head(hidden)
    if transform is not None:
        logits = transform(logits.float())
    return logit_stats(logits, targets, temperature, entropy_grad, min_p)


def response_token_stats(
    model,
    input_ids,
    attention_mask,
    rows,
    pos,
    targets,
    temperature: float,
    chunk_size: int = 256,
    entropy_grad: bool = False,
    min_p: float = 0.0,
    position_ids=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log pi(y_t), entropy, pruning) of every response token, flattened, computed over chunks
    of ``chunk_size`` tokens (``logit_stats``; pruning: [tokens, 3], ``PRUNING_STATS``). The
    transformer body runs once; the output head and ``logit_stats`` run per chunk, under
    activation checkpointing when gradients are on: the graph keeps each chunk's hidden states
    [chunk, H] and its per-token results, never its logits, and the backward recomputes one
    chunk's logits at a time. Peak: a few chunk x V fp32 tensors instead of several [tokens x V]
    ones. The head is called as a module inside the caller's forward, so ZeRO-3 gathers its
    weight for every chunk (and again for the recomputation). The model's own post-processing of
    its logits (``logit_transform``) runs per chunk after the head, before the temperature."""
    from torch.utils.checkpoint import checkpoint

    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
    project = ResponseLogits(model, {**batch, "rows": rows, "pos": pos})
    outs: list[tuple[torch.Tensor, ...]] = []
    for start in range(0, len(targets), chunk_size):
        sl = slice(start, start + chunk_size)
        args = (project.head, project.transform, project.hidden(sl), targets[sl], temperature, entropy_grad, min_p)
        if torch.is_grad_enabled():
            outs.append(checkpoint(_head_stats, *args, use_reentrant=False, preserve_rng_state=False))
        else:
            outs.append(_head_stats(*args))
    if not outs:
        empty = torch.zeros(0, device=input_ids.device)
        return empty, empty, torch.zeros(0, len(PRUNING_STATS), device=input_ids.device)
    logp, entropy, pruning = (torch.cat(parts) for parts in zip(*outs))
    return logp, entropy, pruning


class ResponseLogprobs(torch.nn.Module):
    """The policy with a forward that returns ``response_token_stats``. DeepSpeed wraps this
    module, so that the whole computation runs inside ``engine(...)`` (ZeRO's hooks)."""

    def __init__(self, policy, chunk_size: int):
        super().__init__()
        self.policy = policy
        self.chunk_size = chunk_size

    def forward(
        self,
        input_ids,
        attention_mask,
        rows,
        pos,
        targets,
        temperature: float,
        entropy_grad: bool = False,
        min_p: float = 0.0,
        position_ids=None,
    ):
        return response_token_stats(
            self.policy,
            input_ids,
            attention_mask,
            rows,
            pos,
            targets,
            temperature,
            self.chunk_size,
            entropy_grad,
            min_p,
            position_ids,
        )


def to_padded(flat: torch.Tensor, batch: dict[str, torch.Tensor], n_rows: int) -> torch.Tensor:
    """Scatter flat per-token values into [n_rows, longest response], zeros elsewhere
    (differentiable)."""
    width = int(batch["cols"].max()) + 1 if len(batch["cols"]) else 0
    return flat.new_zeros(n_rows, width).index_put((batch["seqs"], batch["cols"]), flat)


def policy_logprobs(
    model,
    prompt_ids: list[list[int]],
    response_ids: list[list[int]],
    temperature: float,
    pad_id: int,
    chunk_size: int = 256,
    min_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log pi(y_t) [B, T] zero-padded, mask [B, T]) of an HF causal LM, differentiable
    (``min_p`` > 0: log pi_S of the pruned policy)."""
    batch = pack(prompt_ids, response_ids, pad_id, model.device)
    logp, _, _ = response_token_stats(
        model,
        batch["input_ids"],
        batch["attention_mask"],
        batch["rows"],
        batch["pos"],
        batch["targets"],
        temperature,
        chunk_size,
        min_p=min_p,
    )
    mask = to_padded(torch.ones_like(logp), batch, len(response_ids)).bool()
    return to_padded(logp, batch, len(response_ids)), mask
