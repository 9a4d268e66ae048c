"""The transformers generation backend ('hf'; CPU or GPU): batches of prompts left-padded with an
attention mask (transformers derives the position ids of llama/qwen2/gpt2 from it), ``n`` sampled
responses per prompt, each ending at its first stop token.

Each row (prompt i, sample j) draws its own noise: ``RowSampler`` picks the next token by
Gumbel-max with counter-based noise, Philox4x32-10 of (the row's 63-bit key hashed from the call's
seed, i and j; its response position; the token id), so a row's sample depends
on neither its batch nor the other rows (duplicated prompts get different samples; another
``rollout.batch_size`` the same ones, up to the logits' rounding), and records the log-prob of
the sampled token under the distribution it was sampled from (the log-prob contract:
docs/training.md, "Log-probs").

The decode loop (``rollout.hf_decode``, ``HF_DECODE_MODES``): transformers' ``generate`` with its
dynamic KV cache ('eager': the bitwise-reproducible CPU path), a static KV cache ('static'), or
the static cache with the model's forward compiled by torch.compile, which generate runs through
CUDA graphs ('compiled'); 'auto' picks one by device and process (``decode_mode``). The sampler is
compiled into fused kernels in 'compiled', in every mode on a GPU and for large vocabularies
(``RowSampler``, ``FUSED_VOCAB``). A row's
sample is the same function of its key in every mode; the modes differ only in the logits'
rounding."""

from __future__ import annotations

import logging
from typing import Any

import torch

from otbflow.algorithms.tensors import padded
from otbflow.algorithms.vocab_pruning import outside
from otbflow.engines import Sample, truncate_at_stop
from otbflow.progress import Progress
from otbflow.runtime import resident
from otbflow.seeds import derive_seed

log = logging.getLogger("otbflow.generate")

_M32 = 0xFFFFFFFF
_NOISE_ELEMENTS = {"cpu": 1 << 18, "cuda": 1 << 25}
"""Rows x vocabulary entries whose noise is drawn at once on the eager path, by device type: on a
CPU its int64 temporaries (about ten live in a Philox round) stay at 2 MiB each, inside the CPU's
caches; on a GPU (only where the fused sampler failed to compile) near 256 MiB each."""
FUSED_VOCAB = 16_384
"""From this vocabulary size on, the sampler is fused (compiled) on a CPU too, in every decode mode:
eagerly, a Philox round is some twenty passes over [rows, vocabulary] int64 tensors, and with a
GPT-2-sized vocabulary (50,257) they outlast the forward pass (benchmarks/bench_rollout.py,
docs/measurements.md#hf_philox_sampling_cost). Below it (the built-in policy's 76 tokens, the
tests' tokenizers) the eager sampler costs less than a compilation."""
WIDTH_BUCKET = 32
"""'compiled': prompt batches are left-padded to a multiple of this width. generate keeps its static
cache at the longest length it has met and recompiles the decode step when it grows: in steps of
this many tokens, not one per new prompt length."""


def processed_logits(logits: torch.Tensor, temperature: float, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """The logits sampling draws from, in fp32: ``logits / temperature``, then with ``min_p`` > 0
    the safe set (``otbflow.algorithms.vocab_pruning``: tokens below max + log min_p set to -inf, vLLM's order),
    then the top-p nucleus (tokens sorted by probability; those whose cumulative probability from
    the least likely one is at most 1 - top_p are set to -inf, the most likely always kept: vLLM's
    and transformers' rule). log_softmax of the result is the log-prob contract's distribution."""
    z = logits.float() / temperature
    if min_p > 0:
        z = z.masked_fill(outside(z, torch.amax(z, dim=-1, keepdim=True), min_p), float("-inf"))
    if top_p < 1.0:
        ordered, index = z.sort(dim=-1, stable=True)  # ties: the higher index kept, as vLLM's torch path
        drop = ordered.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
        drop[..., -1] = False
        z = z.masked_fill(torch.zeros_like(drop).scatter_(-1, index, drop), float("-inf"))
    return z


PHILOX_M = (0xD2511F53, 0xCD9E8D57)
"""Philox4x32's two round multipliers (Salmon et al. 2011, "Parallel random numbers: as easy as 1, 2, 3")."""
PHILOX_W = (0x9E3779B9, 0xBB67AE85)
"""Philox4x32's key schedule: the Weyl increments added to the two key words after each round."""
NOISE_KEY = (0, 0)
"""The Philox key of the sampler's noise; each row's own key is in the counter (``noise_words``)."""


def _mulhilo(x: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The high and low 32-bit words of ``x * m`` for int64 ``x`` in [0, 2^32) and a 32-bit
    constant ``m``, from 16-bit halves so that no intermediate passes 2^50: a wrapped 64-bit
    product is exact in eager torch, but Inductor's C++ kernels miscompute it (signed overflow is
    undefined there; on torch 2.13 Philox of the wrapped products gave other words than eager
    torch from its third round on)."""
    mh, ml = m >> 16, m & 0xFFFF
    xh, xl = x >> 16, x & 0xFFFF
    low = xl * ml + ((xh * ml + xl * mh) << 16)  # the product's low 50 bits, less xh * mh * 2^32
    return (xh * mh + (low >> 32)) & _M32, low & _M32


def philox4x32(c0, c1, c2, c3, key: tuple[int, int] = NOISE_KEY, rounds: int = 10):
    """Philox4x32-``rounds`` of the counter (c0, c1, c2, c3), each an int64 tensor (or an int) of
    32-bit words that broadcast together, under a 2-word ``key``: four int64 tensors of words in
    [0, 2^32), Random123's ``philox4x32_R``. A bijection of the 128-bit counter for one key, so
    distinct counters never share an output, in plain int64 arithmetic with masks (no uint32 ops,
    which CUDA and Inductor lack for some kernels). The key's words are Python ints of the
    schedule, never tensors."""
    k0, k1 = key
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + PHILOX_W[0]) & _M32, (k1 + PHILOX_W[1]) & _M32
        hi0, lo0 = _mulhilo(c0, PHILOX_M[0])
        hi1, lo1 = _mulhilo(c2, PHILOX_M[1])
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def token_ids(vocab: int, device) -> torch.Tensor:
    """[vocab] int64 token ids, the last word of the noise's counter. The compiled sampler reads
    them from memory: an ``arange`` inside the compiled function lets Inductor fold arithmetic on
    it into an int32 index expression, which Triton refuses for constants past 2^31 (the hash before
    Philox met "Scalar 2654435761 is out of range for type int32" on an H100 with torch 2.11)."""
    return torch.arange(vocab, device=device, dtype=torch.int64)


def noise_words(row_keys: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] int64 in [0, 2^52): Philox4x32-10 of the counter (the row key's low and high
    words, the row's response position, the token id), its first two output words as 52 bits.
    ``row_keys``: int64 [rows] in [0, 2^63) (``row_keys``); ``positions``: int64 [rows], each row's
    own position in its response (rows that started at other decode steps keep their own
    streams); ``tokens``: ``token_ids`` of the vocabulary. Nothing else is mixed in: every
    (row key, position, token) has its own counter, so two rows share no noise unless their
    63-bit keys are equal."""
    w0, w1, _, _ = philox4x32(
        (row_keys & _M32)[:, None], (row_keys >> 32)[:, None], positions[:, None], tokens[None, :]
    )
    return (w0 << 20) | (w1 >> 12)


def gumbel_of_words(n: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise -log(-log u) of 52-bit integers, u = (n + 0.5) / 2^52 in fp64: exact
    (n + 0.5 needs 53 bits, fp64's precision) and strictly inside (0, 1) at both ends of the
    range, so every token's noise is finite (in fp32 u would round to 1.0 near the top: an
    infinite noise)."""
    return -torch.log(-torch.log((n.double() + 0.5) / 2.0**52))


def gumbel_noise(row_keys: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] standard Gumbel noise, a pure function of (row key, position, token id): the
    same on any device, in any batch (``noise_words``)."""
    return gumbel_of_words(noise_words(row_keys, positions, token_ids(vocab, row_keys.device)))


def gumbel_argmax(
    z: torch.Tensor, row_keys: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor
) -> torch.Tensor:
    """The Gumbel-max token of each row of fp32 logits ``z`` [rows, vocab] with its own noise:
    argmax(z + noise) in fp64. Written as one expression so that torch.compile fuses the counter's
    rounds, the noise and the argmax into one pass over the logits (``fused_step``); eagerly it
    holds [rows, vocab] int64 temporaries, hence ``RowSampler``'s chunks."""
    return (z.double() + gumbel_of_words(noise_words(row_keys, positions, tokens))).argmax(dim=-1)


def _fused_step(
    z: torch.Tensor, row_keys: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    token = gumbel_argmax(z, row_keys, positions, tokens)
    logprob = z.gather(-1, token[:, None]).squeeze(-1) - torch.logsumexp(z, dim=-1)
    return token, logprob


_COMPILED: dict[str, Any] = {}


def fused_step():
    """``_fused_step`` compiled by torch.compile (once per process; rows dynamic): the token and
    its log-prob, log_softmax's value z_y - logsumexp(z), from fused kernels over the logits;
    called as ``fused_step()(z, row_keys, positions, token_ids(vocab, device))``."""
    if "step" not in _COMPILED:
        _COMPILED["step"] = torch.compile(_fused_step, dynamic=True, fullgraph=True)
    if _COMPILED["step"] is None:
        raise RuntimeError("it failed to compile earlier in this process")
    return _COMPILED["step"]


def one_hot_choice(token: torch.Tensor, vocab: int) -> torch.Tensor:
    """What a logits processor returns so that generate's argmax takes ``token``: one byte per
    vocabulary entry, 1 at the token (generate's token selection is an argmax over what the
    processors return; bytes, a quarter of the fp32 scores' traffic)."""
    return (torch.arange(vocab, device=token.device) == token[:, None]).to(torch.uint8)


class RowSampler:
    """A transformers logits processor that samples every row itself (generate runs with
    ``do_sample=False``, so its argmax takes the one token this marks, ``one_hot_choice``):
    Gumbel-max over ``processed_logits`` with each row's own noise (greedy: the argmax of the
    logits, at temperature 1). ``positions``: int64 [rows], each row's response position at the
    first call (default 0: every row starts its response there); it advances by one a call.
    ``logprobs`` collects, per step, the sampled tokens' log-probs under
    log_softmax(processed logits). ``fused`` ('compiled', every decode mode on a GPU, and a
    vocabulary of ``FUSED_VOCAB`` or more on a CPU): the noise, argmax and log-prob in the compiled
    kernels of ``fused_step``, every row at once (eagerly a Philox round is some twenty passes over
    [rows, vocab] int64 tensors: on a GPU, kernel launches and memory traffic that would outlast the
    decode step); otherwise eagerly, ``_NOISE_ELEMENTS`` at a time (the tiny policies' path: their
    log-probs are those the fixtures pin). Both paths draw the same tokens."""

    def __init__(
        self,
        row_keys: torch.Tensor,
        temperature: float,
        top_p: float,
        greedy: bool,
        min_p: float = 0.0,
        fused: bool = False,
        positions: torch.Tensor | None = None,
    ):
        self.row_keys, self.temperature, self.top_p, self.greedy = row_keys, temperature, top_p, greedy
        self.min_p = min_p
        self.positions = torch.zeros_like(row_keys) if positions is None else positions
        self.fused = fused and _COMPILED.get("step", True) is not None  # not after a failed compilation
        self.logprobs: list[torch.Tensor] = []
        self.tokens: torch.Tensor | None = None  # token_ids of the vocabulary, made at the first step

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        positions = self.positions + len(self.logprobs)
        if self.greedy:
            z = scores.float()
            token = z.argmax(dim=-1)
            logprob = torch.log_softmax(z, dim=-1).gather(-1, token[:, None]).squeeze(-1)
        else:
            z = processed_logits(scores, self.temperature, self.top_p, self.min_p)
            if self.tokens is None:
                self.tokens = token_ids(z.shape[-1], z.device)
            if self.fused:
                token, logprob = self._fused(z, positions)
            if not self.fused:
                token = torch.empty(z.shape[0], dtype=torch.long, device=z.device)
                rows = max(1, _NOISE_ELEMENTS.get(z.device.type, _NOISE_ELEMENTS["cpu"]) // z.shape[-1])
                for s in range(0, z.shape[0], rows):
                    token[s : s + rows] = gumbel_argmax(
                        z[s : s + rows], self.row_keys[s : s + rows], positions[s : s + rows], self.tokens
                    )
                logprob = torch.log_softmax(z, dim=-1).gather(-1, token[:, None]).squeeze(-1)
        self.logprobs.append(logprob)
        return one_hot_choice(token, scores.shape[-1])

    def _fused(self, z: torch.Tensor, positions: torch.Tensor):
        """``fused_step`` at these positions; where torch.compile fails (no C compiler, no Triton),
        a warning and the eager path for the rest of the process (the same tokens)."""
        try:
            return fused_step()(z, self.row_keys, positions, self.tokens)
        except Exception as e:  # torch.compile's errors have no common base class
            log.warning("the fused sampler did not compile (%s: %s); sampling eagerly", type(e).__name__, e)
            _COMPILED["step"] = None
            self.fused = False
            return None, None


def decode_mode(mode: str, device) -> str:
    """``rollout.hf_decode`` on ``device``. 'auto': 'eager' on a CPU (the bitwise fingerprints);
    on a GPU 'compiled' in a warm worker (``otbflow.runtime.resident``: its compilation is paid once, the
    compiled code serves every later job) and 'static' in a process that runs one job (which would
    pay the compilation every time)."""
    if mode != "auto":
        return mode
    if torch.device(device).type != "cuda":
        return "eager"
    return "compiled" if resident.ENABLED else "static"


def fused_sampler(mode: str, model) -> bool:
    """Whether ``RowSampler`` samples through the compiled kernels in decode ``mode`` on ``model``:
    in 'compiled', on a GPU, and from a vocabulary of ``FUSED_VOCAB`` on."""
    return mode == "compiled" or model.device.type == "cuda" or getattr(model.config, "vocab_size", 0) >= FUSED_VOCAB


def generation_config(mode: str, stops: list[int], pad: int):
    """generate's settings for a decode mode (``decode_mode``'s result): the stop and pad tokens,
    the KV cache ('static' and 'compiled': allocated once per call at the batch's full length)
    and whether generate compiles the forward (on every device where asked: its own default is
    CUDA only)."""
    from transformers import CompileConfig, GenerationConfig

    if mode == "eager":
        return GenerationConfig(eos_token_id=stops, pad_token_id=pad)
    compiled = mode == "compiled"
    compile_config = CompileConfig()
    compile_config._compile_all_devices = compiled  # generate compiles on CUDA alone unless told
    return GenerationConfig(
        eos_token_id=stops,
        pad_token_id=pad,
        cache_implementation="static",
        compile_config=compile_config if compiled else None,
        disable_compile=not compiled,
    )


def row_keys(seed: int, prompt_indices: range, n: int, device) -> torch.Tensor:
    """The 63-bit noise key of each row (prompt i, sample j) of a batch, prompt-major as generate
    expands them: hashed from the call's seed, i and j (never seed + index, whose neighbours
    collide); two of a million rows share a key with odds of 1 in 10^7 (``derive_seed``)."""
    keys = [derive_seed(seed, "row", i, j, bits=63) for i in prompt_indices for j in range(n)]
    return torch.tensor(keys, dtype=torch.int64, device=device)


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
    min_p: float = 0.0,
    decode: str = "eager",
) -> list[Sample]:
    """Sample ``n`` responses for each prompt (greedy: one), a function of the seed and the
    prompts: ``batch_size`` changes the memory and the speed, and the samples only through the
    logits' rounding (other padding; identical in the tests' fp32 on CPU, a near-tie in bf16 on a
    GPU can flip a token).
    ``stop_ids``: tokens that end a response (default: the tokenizer's eos token); ``progress``
    counts the prompts done (otbflow.progress); ``min_p``: min-p sampling (``processed_logits``);
    ``decode``: the decode loop, a ``rollout.hf_decode`` mode ('auto' resolved on the model's device)."""
    from transformers import LogitsProcessorList

    stops = stop_ids or [tok.eos_token_id]
    pad = tok.pad_token_id if tok.pad_token_id is not None else stops[0]
    out: list[Sample] = []
    n = 1 if greedy else n
    mode = decode_mode(decode, model.device)
    saved, model.generation_config = model.generation_config, generation_config(mode, stops, pad)
    try:
        for start in range(0, len(prompt_ids), batch_size):
            batch = prompt_ids[start : start + batch_size]
            longest = max(len(x) for x in batch)
            # 'compiled': widths in steps of WIDTH_BUCKET, so that the cache grows, and recompiles, in steps
            width = -(-longest // WIDTH_BUCKET) * WIDTH_BUCKET if mode == "compiled" else longest
            # n rows per prompt, prompt-major (generate's own expansion needs do_sample)
            input_ids = padded(batch, pad, width, left=True, device=model.device).repeat_interleave(n, dim=0)
            attention = padded([[1] * len(x) for x in batch], 0, width, left=True, device=model.device)
            keys = row_keys(seed, range(start, start + len(batch)), n, model.device)
            sampler = RowSampler(keys, temperature, top_p, greedy, min_p, fused=fused_sampler(mode, model))
            res = model.generate(
                input_ids=input_ids,
                attention_mask=attention.repeat_interleave(n, dim=0),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                logits_processor=LogitsProcessorList([sampler]),
                return_dict_in_generate=True,
            )
            new = res.sequences[:, width:]
            lp = torch.stack(sampler.logprobs, dim=1)
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
