"""Peak memory of one training micro-step (forward + backward), chunked against unchunked log-probs.

The model is Qwen2-0.5B-shaped where the memory goes: vocabulary 151,936, hidden 896, tied
embeddings, GQA 14/2 heads, MLP 4864, on a 2-layer body (random weights). The micro-batch is 4
sequences of a 16-token prompt and a 512-token response (2,048 response tokens). One micro-step
is the train stage's forward (``otbflow.training.logprobs.ResponseLogprobs``: the body once, then log pi and
the entropy per response token), the PPO-clip token-mean loss at ratio 1 with random advantages
and entropy_coef = 0, and the backward into the parameters' gradients.

- ``chunked``: the train stage as it is: the head and log-softmax over chunks of ``--chunk-size``
  positions under activation checkpointing.
- ``unchunked``: the train stage before the change (main at a51600c): the full [tokens x V] fp32
  logits in the graph, a logsumexp, and a softmax for the logged entropy.

Each variant runs in a fresh process. Memory is RSS: VmHWM, reset through /proc/self/clear_refs
right before the micro-step, so ``step_peak_mib`` is the micro-step's own peak above the RSS it
starts from (model weights, inputs, allocator state) and ``process_peak_mib`` the whole process's
peak during it. Each process writes its loss and the flat gradient of every parameter to a
temporary file; the parent compares them. Prints JSON.

    python benchmarks/bench_train_memory.py [--chunk-size 256] [--layers 2] [--vocab 151936]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

import torch
from memory import reset_peak, rss_kib  # benchmarks/memory.py (this folder is on sys.path)

VOCAB, HIDDEN = 151_936, 896


def unchunked_stats(model, batch, temperature: float):
    """main's train.response_token_stats (a51600c): full logits, logsumexp, softmax entropy."""
    from otbflow.models.logits import ResponseLogits

    z = ResponseLogits(model, batch)(slice(None)).float() / temperature
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, batch["targets"].unsqueeze(-1)).squeeze(-1) - lse
    with torch.no_grad():
        entropy = lse - (torch.softmax(z, dim=-1) * z).sum(-1)
    return logp, entropy


def worker(
    mode: str, layers: int, n_seq: int, prompt_len: int, response_len: int, chunk: int, out: str, vocab: int = VOCAB
) -> dict:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from otbflow.algorithms.losses import ppo_clip_loss
    from otbflow.models.logits import pack
    from otbflow.training.logprobs import ResponseLogprobs

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=4864,
        num_hidden_layers=layers,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        max_position_embeddings=prompt_len + response_len,
    )
    model = Qwen2ForCausalLM(config).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (n_seq, prompt_len + response_len), generator=g).tolist()
    batch = pack([x[:prompt_len] for x in ids], [x[prompt_len:] for x in ids], pad_id=0)
    adv = torch.randn(len(batch["targets"]), generator=g)
    module = ResponseLogprobs(model, chunk).eval()

    before = rss_kib("VmRSS")
    ok = reset_peak()
    t0 = time.perf_counter()
    if mode == "chunked":
        logp, entropy, _ = module(
            batch["input_ids"], batch["attention_mask"], batch["rows"], batch["pos"], batch["targets"], 1.0, False
        )
    else:
        logp, entropy = unchunked_stats(model, batch, 1.0)
    tc = SimpleNamespace(clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0)
    token_loss, _ = ppo_clip_loss(logp, logp.detach(), adv, torch.ones_like(adv), tc)
    loss = token_loss.mean()
    loss.backward()
    seconds = time.perf_counter() - t0
    peak = rss_kib("VmHWM")
    grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    torch.save({"loss": loss.detach(), "grad": grad, "entropy_mean": entropy.mean()}, out)
    return {
        "mode": mode,
        "peak_rss_reset_ok": ok,
        "step_peak_mib": (peak - before) / 1024,
        "process_peak_mib": peak / 1024,
        "rss_before_mib": before / 1024,
        "seconds": seconds,
        "tokens": int(len(batch["targets"])),
        "parameters": int(sum(p.numel() for p in model.parameters())),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument(
        "--vocab", type=int, default=VOCAB, help="vocabulary size (Qwen2's by default; smaller: a quick check)"
    )
    ap.add_argument("--sequences", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--response-len", type=int, default=512)
    ap.add_argument("--worker", nargs=2, metavar=("MODE", "OUT"))
    a = ap.parse_args()
    if a.worker:
        print(
            json.dumps(
                worker(
                    a.worker[0], a.layers, a.sequences, a.prompt_len, a.response_len, a.chunk_size, a.worker[1], a.vocab
                )
            )
        )
        return
    runs, saved = {}, {}
    with tempfile.TemporaryDirectory(prefix="bench_train_memory.") as tmp:
        for mode in ("unchunked", "chunked"):
            path = os.path.join(tmp, f"{mode}.pt")
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--worker",
                    mode,
                    path,
                    "--chunk-size",
                    str(a.chunk_size),
                    "--layers",
                    str(a.layers),
                    "--vocab",
                    str(a.vocab),
                    "--sequences",
                    str(a.sequences),
                    "--prompt-len",
                    str(a.prompt_len),
                    "--response-len",
                    str(a.response_len),
                ],
                capture_output=True,
                text=True,
                check=True,
            )
            runs[mode] = json.loads(out.stdout.strip().splitlines()[-1])
            saved[mode] = torch.load(path)
    full, part = saved["unchunked"], saved["chunked"]
    diff = part["grad"].double() - full["grad"].double()
    result = {
        "benchmark": "train_memory",
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "vocab": a.vocab,
        "hidden": HIDDEN,
        "layers": a.layers,
        "parameters": runs["chunked"]["parameters"],
        "response_tokens": runs["chunked"]["tokens"],
        "chunk_size": a.chunk_size,
        "step_peak_mib": {m: round(runs[m]["step_peak_mib"], 1) for m in runs},
        "process_peak_mib": {m: round(runs[m]["process_peak_mib"], 1) for m in runs},
        "rss_before_step_mib": {m: round(runs[m]["rss_before_mib"], 1) for m in runs},
        "step_peak_ratio": round(runs["chunked"]["step_peak_mib"] / runs["unchunked"]["step_peak_mib"], 3),
        "process_peak_ratio": round(runs["chunked"]["process_peak_mib"] / runs["unchunked"]["process_peak_mib"], 3),
        "seconds": {m: round(runs[m]["seconds"], 2) for m in runs},
        "loss": {
            "unchunked": float(full["loss"]),
            "chunked": float(part["loss"]),
            "abs_diff": abs(float(part["loss"]) - float(full["loss"])),
        },
        "grad": {
            "max_abs_diff": float(diff.abs().max()),
            "max_abs": float(full["grad"].abs().max()),
            "rel_l2_diff": float(diff.norm() / full["grad"].double().norm()),
        },
        "entropy_mean_abs_diff": abs(float(part["entropy_mean"]) - float(full["entropy_mean"])),
        "peak_rss_reset_ok": all(r["peak_rss_reset_ok"] for r in runs.values()),
        "targets": {"step_peak_ratio": 0.40, "loss_abs_diff": 1e-5, "grad_max_abs_diff": 1e-5},
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
