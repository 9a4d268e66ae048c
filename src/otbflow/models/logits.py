"""Per-token statistics of a causal LM's response logits, shared by the stages that read them
(features, train, scaling, variance): the prompt+response batch (``pack``), the response
positions' logits (``ResponseLogits``), and log pi, entropy, sum pi^2 and the Logit-Gradient Proxy
energy over chunks of positions without a vocabulary-sized tensor per token (``token_stats``,
``chunked_token_stats``, ``streamed_token_stats``, ``sequence_token_stats``), plus the exact
sequence gradient norms of the EOB oracle (``exact_grad_sq_norms``). Logits come from the output
head followed by the model's own post-processing (``logit_transform``), which ``check_head_logits``
verifies against the model's forward at load. With ``min_p`` > 0 (``rollout.min_p``) every path
computes the statistics of the pruned policy pi_S (``otbflow.algorithms.vocab_pruning``). The formulas are in
docs/features.md. The train stage's log-probs with autograd, over the same batches, are in
``otbflow.training.logprobs``."""

from __future__ import annotations

import logging
import math

import torch

from otbflow.algorithms.tensors import padded
from otbflow.algorithms.vocab_pruning import MASK_VALUE, PRUNING_STATS, force_include, outside
from otbflow.progress import Progress

STAT_COLUMNS = ("logprobs", "entropy", "sum_pi_sq", "proxy")

log = logging.getLogger("otbflow.models.logits")


def token_stats(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    temperature: float = 1.0,
    *,
    inplace: bool = False,
    buffer: torch.Tensor | None = None,
    min_p: float = 0.0,
) -> dict[str, torch.Tensor]:
    """Per-token statistics of softmax(logits / temperature) at the sampled ``token_ids``.

    ``logits`` [..., V], ``token_ids`` [...]. Returns fp32 tensors of shape [...]: ``logprobs``,
    ``entropy``, ``sum_pi_sq`` and ``proxy`` = max(0, 1 - 2 pi + sum_pi_sq).

    With z = logits / temperature, m = max z, e = exp(z - m) and S = sum e:
    logp = z_y - m - log S, sum_pi_sq = sum e^2 / S^2 (= exp(lse(2z) - 2 lse(z))),
    entropy = m + log S - sum e z / S. The two sums of products are a vector norm and batched dot
    products, which allocate nothing of size V.

    ``min_p`` > 0: the same statistics of the pruned policy pi_S (``otbflow.algorithms.vocab_pruning``: the tokens
    outside the safe set get logit m + MASK_VALUE, the sampled token is force-included), plus
    ``PRUNING_STATS`` per token.

    Memory: only z and e are vocabulary-sized, as in a log-softmax. ``inplace=True`` lets the
    function scale an fp32 ``logits`` in place (the features stage owns each chunk's logits);
    ``buffer`` is a reusable [n, V] fp32 tensor for e (allocation dominates the cost of exp).
    """
    shape = token_ids.shape
    z = logits.reshape(-1, logits.shape[-1])
    if inplace and z.dtype == torch.float32:
        if temperature != 1.0:
            z.div_(temperature)
    else:
        z = z.float() / temperature
    y = token_ids.reshape(-1, 1)
    m = torch.amax(z, dim=-1, keepdim=True)
    e = torch.empty_like(z) if buffer is None else buffer[: z.shape[0]]
    torch.sub(z, m, out=e)
    e.exp_()
    pruning = {}
    if min_p > 0:
        s_all = e.sum(-1)
        z, count, pruned_sum, forced = _prune(z, e, m, min_p, y)
        pruning = dict(zip(PRUNING_STATS, (count / z.shape[-1], pruned_sum / s_all, forced.float())))
    s = e.sum(-1)
    log_s = torch.log(s)
    m = m.squeeze(-1)
    logp = z.gather(-1, y).squeeze(-1) - m - log_s
    ez = torch.bmm(e.unsqueeze(1), z.unsqueeze(2)).reshape(-1)
    sum_pi_sq = torch.linalg.vector_norm(e, dim=-1) ** 2 / (s * s)
    entropy = m + log_s - ez / s
    pi = logp.exp()
    proxy = ((1.0 - pi) ** 2 + (sum_pi_sq - pi**2)).clamp_min(0.0)
    out = {"logprobs": logp, "entropy": entropy, "sum_pi_sq": sum_pi_sq, "proxy": proxy, **pruning}
    return {k: v.reshape(shape) for k, v in out.items()}


def _prune(
    z: torch.Tensor, e: torch.Tensor, m: torch.Tensor, min_p: float, y: torch.Tensor, offset: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Restrict rows of temperature-scaled logits ``z`` [n, V] (a slice of the vocabulary; ``m``
    [n, 1]: the maxima over all of it) and their e = exp(z - m) to the safe set (pruned:
    z = m + MASK_VALUE, e = exp(MASK_VALUE)), force-including the sampled tokens ``y`` [n, 1]
    when in the slice, whose first token id is ``offset``; e in place, z in place unless it
    carries a gradient. Returns (z, the pruned count [n], the sum of e over the pruned tokens
    before the masking [n], whether the sampled token was pruned [n])."""
    cut = outside(z, m, min_p)
    forced = force_include(cut, y, offset)
    pruned_sum = torch.where(cut, e, 0.0).sum(-1)
    e.masked_fill_(cut, math.exp(MASK_VALUE))
    z = torch.where(cut, m + MASK_VALUE, z) if z.requires_grad else torch.where(cut, m + MASK_VALUE, z, out=z)
    return z, cut.sum(-1, dtype=torch.float32), pruned_sum, forced


# The operations a family's forward applies to lm_head(hidden) before returning its logits, in
# order, each with the config attribute holding its constant (read from the text config of a
# composite model, skipped where None). Keyed by model type, not by attribute: Granite divides
# by logits_scaling where HyperCLOVAX multiplies, and MPT's config has a logit_scale that its
# forward ignores. A family missing here is caught by ``check_head_logits``.
_SOFTCAP = (("softcap", "final_logit_softcapping"),)
LOGIT_TRANSFORMS: dict[str, tuple[tuple[str, str], ...]] = {
    **dict.fromkeys(
        (
            "granite",
            "granite_swa",
            "granitemoe",
            "granitemoe_swa",
            "granitemoehybrid",
            "granitemoeshared",
            "minicpm3",  # divides the hidden states: the same through a bias-free head
        ),
        (("div", "logits_scaling"),),
    ),
    "hyperclovax": (("mul", "logits_scaling"),),
    **dict.fromkeys(("cohere", "cohere2", "cohere2_moe", "cohere_compass_text"), (("mul", "logit_scale"),)),
    "falcon_h1": (("mul", "lm_head_multiplier"),),
    **dict.fromkeys(
        (
            "gemma2",
            "gemma3",
            "gemma3_text",
            "gemma3n",
            "gemma3n_text",
            "gemma4",
            "gemma4_text",
            "gemma4_unified_text",
            "vaultgemma",
            "nanochat",
            "beam",
            "inkling2_text",
        ),
        _SOFTCAP,
    ),
    "recurrent_gemma": (("softcap", "logits_soft_cap"),),
    "xlstm": (("softcap", "output_logit_soft_cap"),),
}


class LogitTransform:
    """The model's own post-processing of lm_head(hidden): ``steps`` of (operation, constant),
    operation 'mul' (z * c), 'div' (z / c) or 'softcap' (tanh(z / c) * c), in the forward's order
    and arithmetic. Elementwise, so it applies to any chunk of positions or vocabulary slice;
    in place where the tensor carries no gradient (the caller's fresh logits)."""

    def __init__(self, model_type: str, steps: tuple[tuple[str, float], ...]):
        self.model_type, self.steps = model_type, steps

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        inplace = not z.requires_grad
        for op, c in self.steps:
            if op == "mul":
                z = z.mul_(c) if inplace else z * c
            elif op == "div":
                z = z.div_(c) if inplace else z / c
            else:
                z = z.div_(c).tanh_().mul_(c) if inplace else torch.tanh(z / c) * c
        return z

    def __repr__(self) -> str:
        expr = "lm_head(hidden)"
        for op, c in self.steps:
            expr = {"mul": "{} * {:g}", "div": "{} / {:g}", "softcap": "tanh({} / {:g}) * {:g}"}[op].format(expr, c, c)
        return expr


def logit_transform(model) -> LogitTransform | None:
    """The known post-processing of ``model``'s logits (``LOGIT_TRANSFORMS``), None where its
    logits are lm_head(hidden). Multiplying or dividing by 1 is left out (exact either way)."""
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = getattr(config, "model_type", None)
    rules = LOGIT_TRANSFORMS.get(model_type) or LOGIT_TRANSFORMS.get(getattr(text, "model_type", None), ())
    steps = []
    for op, attr in rules:
        value = getattr(text, attr, None)
        if value is None:
            value = getattr(config, attr, None)
        if value is not None and (op == "softcap" or float(value) != 1.0):
            steps.append((op, float(value)))
    return LogitTransform(model_type, tuple(steps)) if steps else None


def pack(
    prompt_ids: list[list[int]],
    response_ids: list[list[int]],
    pad_id: int,
    device: torch.device | str = "cpu",
    row_tokens: int = 0,
) -> dict[str, torch.Tensor]:
    """The prompt + response sequences as the model's input and, for each response token t of
    sequence i, flattened: ``seqs`` = i, ``cols`` = t, ``targets`` = the token id, and (``rows``,
    ``pos``) = where in the input the position predicting it is. Shared by the features and train
    stages, so both compute the same log-probs.

    Padded (``row_tokens`` 0): ``input_ids`` [sequences, longest] right-padded with its
    ``attention_mask``; ``rows`` = i, ``pos`` = len(prompt_i) - 1 + t.

    Packed (``row_tokens`` > 0): the sequences one after the other, in order, in rows of at most
    ``row_tokens`` tokens (a longer sequence alone in its row), no attention mask; ``position_ids``
    restart at 0 with each sequence, and transformers keeps packed sequences apart from them (a
    block-diagonal causal mask). A row shorter than the longest is filled with pad tokens whose
    positions restart too, every longest-sequence length: segments of their own that no sequence
    attends to. Capping the rows keeps the attention's dense mask at rows x row_tokens^2 instead of
    (all tokens)^2. The two layouts give the same results up to float rounding (``check_packing``).

    A response after an empty prompt is refused (ValueError): a causal LM predicts each token from
    the position before it, and nothing precedes a sequence's first token, so no forward of that
    sequence alone scores it; the position before it would be another sequence's (packed) or the
    row's last (padded: index -1)."""
    empty = [i for i, (p, r) in enumerate(zip(prompt_ids, response_ids)) if r and not p]
    if empty:
        raise ValueError(
            f"sequence {empty[0]} of the batch ({len(empty)} in all) has a response after an empty prompt: "
            "no position of a causal LM predicts a sequence's first token, so its first response token has "
            "no log-prob; every prompt needs at least one token (e.g. the tokenizer's BOS)"
        )
    seqs = [p + r for p, r in zip(prompt_ids, response_ids)]

    def tensor(values):
        return torch.tensor(values, dtype=torch.long, device=device)

    flat = {
        "seqs": tensor([i for i, r in enumerate(response_ids) for _ in r]),
        "cols": tensor([t for r in response_ids for t in range(len(r))]),
        "targets": tensor([t for r in response_ids for t in r]),
    }
    if not row_tokens:
        return {
            "input_ids": padded(seqs, pad_id, device=device),
            "attention_mask": padded([[1] * len(s) for s in seqs], 0, device=device),
            "rows": flat["seqs"],
            "pos": tensor([len(p) - 1 + t for p, r in zip(prompt_ids, response_ids) for t in range(len(r))]),
            **flat,
        }
    rows: list[list[int]] = []  # the sequences of each row
    used: list[int] = []  # the tokens of each row
    where: list[tuple[int, int]] = []  # each sequence's (row, offset)
    for i, seq in enumerate(seqs):
        if not rows or (used[-1] + len(seq) > row_tokens and rows[-1]):
            rows.append([])
            used.append(0)
        where.append((len(rows) - 1, used[-1]))
        rows[-1].append(i)
        used[-1] += len(seq)
    width = max(used)
    period = max(1, max(len(s) for s in seqs))
    ids, positions = [], []
    for row, n in zip(rows, used):
        filler = width - n
        ids.append([x for i in row for x in seqs[i]] + [pad_id] * filler)
        positions.append([t for i in row for t in range(len(seqs[i]))] + [t % period for t in range(filler)])
    return {
        "input_ids": tensor(ids),
        "position_ids": tensor(positions),
        "rows": tensor([where[i][0] for i, r in enumerate(response_ids) for _ in r]),
        "pos": tensor(
            [
                where[i][1] + len(p) - 1 + t
                for i, (p, r) in enumerate(zip(prompt_ids, response_ids))
                for t in range(len(r))
            ]
        ),
        **flat,
    }


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
    """The keyword arguments of the model's forward for a ``pack`` batch, padded or packed."""
    return {k: batch.get(k) for k in ("input_ids", "attention_mask", "position_ids")}


class ResponseLogits:
    """Logits of the response tokens of a packed batch, chunk by chunk: ``self(sl)`` for a slice
    ``sl`` of the flattened tokens. The transformer body runs once, at construction; the output
    head ``head`` and the model's own post-processing of its logits ``transform``
    (``logit_transform``: scaling, soft-capping; None for most models) run per call, the
    transform in fp32."""

    def __init__(self, model, batch: dict[str, torch.Tensor]):
        self.rows, self.pos = batch["rows"], batch["pos"]
        self.head = model.get_output_embeddings()
        self.transform = logit_transform(model)
        self._hidden = model.base_model(**model_inputs(batch), use_cache=False).last_hidden_state

    def hidden(self, sl: slice) -> torch.Tensor:
        return self._hidden[self.rows[sl], self.pos[sl]]

    def __call__(self, sl: slice) -> torch.Tensor:
        logits = self.head(self.hidden(sl))
        return logits if self.transform is None else self.transform(logits.float())


CHECK_TOKENS = 8
HEAD_CHECKED = "_otbflow_head_checked"
"""The attribute a module checked by ``check_head_logits`` holds its transform in."""


def check_head_logits(model) -> LogitTransform | None:
    """Refuse a model whose logits otbflow would get wrong: the model's own forward on
    ``CHECK_TOKENS`` tokens of a fixed sequence against the head-only computation the features,
    train, scaling and variance stages use (``ResponseLogits``: the body, lm_head, then
    ``logit_transform``). A ValueError naming the model type where the two differ by more than a
    tolerance relative to the largest logit (1e-4 at fp32, 2e-2 at bf16 or fp16, where the
    forward computes the transform at the lower precision). Returns the transform applied. Once per
    module: what it checks is the architecture's, which a warm worker's resident module keeps
    while its weights change (``otbflow.runtime.resident``)."""
    if HEAD_CHECKED in vars(model):
        return vars(model)[HEAD_CHECKED]
    transform = logit_transform(model)
    model_type = getattr(model.config, "model_type", type(model).__name__)
    head = model.get_output_embeddings()
    if head is None:
        raise ValueError(f"{model_type}: the model has no output embeddings (lm_head); otbflow needs one")
    n_vocab = getattr(head.weight, "ds_shape", head.weight.shape)[0]  # ZeRO-3: the whole, not this rank's share
    ids = [(7919 * i + 11) % n_vocab for i in range(CHECK_TOKENS)]
    batch = pack([ids[:1]], [ids[1:]], 0, model.device)
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            own = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
            own = own.logits[0, :-1].float()
            mine = ResponseLogits(model, batch)(slice(None)).float()
    finally:
        model.train(training)
    tol = 1e-4 if head.weight.dtype in (torch.float32, torch.float64) else 2e-2
    err = float((own - mine).abs().max()) if own.shape == mine.shape else float("inf")
    bound = tol * float(own.abs().max()) + 1e-6
    if not err <= bound:
        raise ValueError(
            f"{model_type}: the model post-processes its logits in a way otbflow does not know: its own "
            f"forward's logits differ from {transform or 'lm_head(hidden)'} by up to {err:.3g} on "
            f"{CHECK_TOKENS} tokens (tolerance {bound:.3g}), so its log-probs from the output head would be "
            "wrong. Known transforms: otbflow.models.logits.LOGIT_TRANSFORMS."
        )
    if transform is not None:
        log.info("%s: logits = %s, as its forward computes them (max |diff| %.2g)", model_type, transform, err)
    vars(model)[HEAD_CHECKED] = transform
    return transform


def check_packing(model) -> None:
    """Refuse packing (``train.packing``) for a model whose forward lets packed sequences see each
    other: the log-probs of three sequences of unequal lengths, packed (``pack`` with rows of 12
    tokens: two sequences in one, the third with its filler in the other) against padded, on the
    model as the train stage holds it. A ValueError naming the model type
    where they differ by more than 1e-4 (fp32; 2e-2 at bf16 or fp16)."""
    model_type = getattr(model.config, "model_type", type(model).__name__)
    head = model.get_output_embeddings()
    n_vocab = getattr(head.weight, "ds_shape", head.weight.shape)[0]
    ids = [(7919 * i + 11) % n_vocab for i in range(3 * CHECK_TOKENS)]
    prompts, responses = [ids[:2], ids[8:13], ids[16:17]], [ids[2:6], ids[13:14], ids[17:23]]
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            got = []
            for row_tokens in (0, 12):  # packed: two sequences in a row, then one and its filler
                batch = pack(prompts, responses, 0, model.device, row_tokens)
                project = ResponseLogits(model, batch)
                logits = project(slice(None)).float()
                got.append(torch.log_softmax(logits, -1).gather(-1, batch["targets"][:, None]).squeeze(-1))
    finally:
        model.train(training)
    tol = 1e-4 if head.weight.dtype in (torch.float32, torch.float64) else 2e-2
    err = float((got[0] - got[1]).abs().max())
    if not err <= tol:
        raise ValueError(
            f"{model_type}: packed sequences are not kept apart by this model's forward (packed log-probs "
            f"differ from padded ones by up to {err:.3g}, tolerance {tol:g}): set train.packing false"
        )


def streamed_token_stats(
    hidden: torch.Tensor,
    head: torch.nn.Linear,
    token_ids: torch.Tensor,
    temperature: float,
    vocab_chunk: int,
    transform: LogitTransform | None = None,
    min_p: float = 0.0,
) -> dict[str, torch.Tensor]:
    """token_stats with the output head (then ``transform``, elementwise) applied over vocabulary
    slices (an online softmax), so that only n x vocab_chunk logits exist at a time. Same results
    as token_stats(transform(head(hidden)), min_p=min_p). With ``min_p`` > 0 a first pass over
    the slices finds each row's maximum, which the safe set needs before any slice is pruned."""
    n = hidden.shape[0]
    dev = hidden.device
    y = token_ids.reshape(-1)
    weight, bias = head.weight, head.bias

    def logits(v0: int, v1: int) -> torch.Tensor:
        z = torch.nn.functional.linear(hidden, weight[v0:v1], None if bias is None else bias[v0:v1]).float()
        if transform is not None:
            z = transform(z)
        z /= temperature
        return z

    slices = [(v0, min(v0 + vocab_chunk, weight.shape[0])) for v0 in range(0, weight.shape[0], vocab_chunk)]
    m = torch.full((n,), float("-inf"), device=dev)
    if min_p > 0:
        for v0, v1 in slices:
            m = torch.maximum(m, torch.amax(logits(v0, v1), dim=-1))
        pruned_count, pruned_sum, s_all = (torch.zeros(n, device=dev) for _ in range(3))
        forced = torch.zeros(n, dtype=torch.bool, device=dev)
    s, ez, ee, z_y = (torch.zeros(n, device=dev) for _ in range(4))
    for v0, v1 in slices:
        z = logits(v0, v1)
        new_m = torch.maximum(m, torch.amax(z, dim=-1))  # with min_p: m, already the maximum
        scale = torch.exp(m - new_m)
        e = torch.exp(z - new_m[:, None])
        if min_p > 0:
            s_all += e.sum(-1)
            z, count, pruned, slice_forced = _prune(z, e, m[:, None], min_p, y, v0)
            pruned_count, pruned_sum, forced = pruned_count + count, pruned_sum + pruned, forced | slice_forced
        s = s * scale + e.sum(-1)
        ez = ez * scale + torch.bmm(e.unsqueeze(1), z.unsqueeze(2)).reshape(-1)
        ee = ee * scale**2 + torch.linalg.vector_norm(e, dim=-1) ** 2
        inside = (y >= v0) & (y < v1)
        z_y[inside] = z[inside.nonzero().squeeze(-1), y[inside] - v0]
        m = new_m
    log_s = torch.log(s)
    logp = z_y - m - log_s
    sum_pi_sq = ee / (s * s)
    pi = logp.exp()
    out = {
        "logprobs": logp,
        "entropy": m + log_s - ez / s,
        "sum_pi_sq": sum_pi_sq,
        "proxy": ((1.0 - pi) ** 2 + (sum_pi_sq - pi**2)).clamp_min(0.0),
    }
    if min_p > 0:
        stats = (pruned_count / weight.shape[0], pruned_sum / s_all, forced.float())
        out |= dict(zip(PRUNING_STATS, stats))
    return out


@torch.no_grad()
def chunked_token_stats(
    project: ResponseLogits,
    targets: torch.Tensor,
    temperature: float,
    chunk_size: int,
    vocab_chunk: int = 0,
    min_p: float = 0.0,
) -> dict[str, torch.Tensor]:
    """token_stats of the flattened response tokens ``targets`` over chunks of ``chunk_size``
    positions (and, with ``vocab_chunk`` > 0, of the vocabulary); with ``min_p`` > 0 those of the
    pruned policy, and ``PRUNING_STATS``. Flat fp32 CPU tensors."""
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in STAT_COLUMNS + (PRUNING_STATS if min_p > 0 else ())}
    buffer = None
    for start in range(0, len(targets), chunk_size):
        sl = slice(start, start + chunk_size)
        if vocab_chunk > 0:
            stats = streamed_token_stats(
                project.hidden(sl), project.head, targets[sl], temperature, vocab_chunk, project.transform, min_p
            )
        else:
            logits = project(sl)
            if buffer is None and logits.dtype == torch.float32:
                buffer = torch.empty((min(chunk_size, len(targets)), logits.shape[-1]), device=logits.device)
            stats = token_stats(logits, targets[sl], temperature, inplace=True, buffer=buffer, min_p=min_p)
            del logits
        for k, v in stats.items():
            parts[k].append(v.cpu())
    return {k: (torch.cat(v) if v else torch.empty(0)) for k, v in parts.items()}


@torch.no_grad()
def sequence_token_stats(
    model,
    prompt_ids: list[list[int]],
    response_ids: list[list[int]],
    temperature: float,
    chunk_size: int,
    pad_id: int,
    vocab_chunk: int = 0,
    min_p: float = 0.0,
) -> list[dict[str, list[float]]]:
    """token_stats for every response token of a batch of (prompt, response) pairs, computed
    over chunks of ``chunk_size`` response tokens (``min_p`` > 0: of the pruned policy, with
    ``PRUNING_STATS``); one dict of lists per sequence."""
    batch = pack(prompt_ids, response_ids, pad_id, model.device)
    project = ResponseLogits(model, batch)
    flat = chunked_token_stats(project, batch["targets"], temperature, chunk_size, vocab_chunk, min_p)
    out, offset = [], 0
    for r in response_ids:
        out.append({k: v[offset : offset + len(r)].tolist() for k, v in flat.items()})
        offset += len(r)
    return out


def exact_grad_sq_norms(
    model,
    prompt_ids: list[list[int]],
    response_ids: list[list[int]],
    temperature: float,
    pad_id: int,
    progress: Progress | None = None,
    min_p: float = 0.0,
) -> list[float]:
    """||grad_theta sum_t log pi(y_t)||^2 over all parameters, one backward pass per sequence
    (the EOB oracle and the length-scaling fit; meant for small models; ``min_p`` > 0: of the
    pruned policy's log pi_S). ``progress`` counts the sequences done."""
    params = [p for p in model.parameters() if p.requires_grad]
    out = []
    for p_ids, r_ids in zip(prompt_ids, response_ids):
        if not r_ids:
            out.append(0.0)
        else:
            batch = pack([p_ids], [r_ids], pad_id, model.device)
            with torch.enable_grad():
                logits = ResponseLogits(model, batch)(slice(None)).float() / temperature
                if min_p > 0:
                    logits, _ = pruned_logits(logits, batch["targets"], min_p)
                logp = torch.log_softmax(logits, -1).gather(-1, batch["targets"][:, None]).sum()
                grads = torch.autograd.grad(logp, params, allow_unused=True)
            out.append(float(sum((g.double() ** 2).sum() for g in grads if g is not None)))
        if progress is not None:
            progress.update()
    return out


def pruned_logits(z: torch.Tensor, targets: torch.Tensor, min_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature-scaled logits ``z`` [n, V] restricted to the safe set (``otbflow.algorithms.vocab_pruning``):
    the pruned ones replaced by max z + MASK_VALUE, the mask built without gradient and the
    sampled ``targets`` [n] force-included; differentiable through the kept logits only. Returns
    (the logits, ``PRUNING_STATS`` as [n, 3], no gradient)."""
    with torch.no_grad():
        m = torch.amax(z, dim=-1, keepdim=True)
        cut = outside(z, m, min_p)
        forced = force_include(cut, targets)
        e = torch.exp(z - m)
        mass = torch.where(cut, e, 0.0).sum(-1) / e.sum(-1)
        stats = torch.stack([cut.sum(-1, dtype=torch.float32) / z.shape[-1], mass, forced.float()], -1)
    return torch.where(cut, m + MASK_VALUE, z), stats
