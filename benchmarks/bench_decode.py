"""Milliseconds per decode step of otbflow's sampler against transformers' sampling, on the same
model and rows, and where a decode step's device time goes.

The rows: ``--prompts`` prompts of the arithmetic task (rendered as the rollout renders them),
each repeated ``--group-size`` times, left-padded, in one batch; ``--max-new-tokens`` steps at
temperature 1, top-p 1, the policy's stop tokens. A random policy's rows rarely sample a stop
token, so every row runs every step (``steps`` says how many ran). Paths, each one warm-up call
and then the best of ``--repeats``, CUDA synchronised:

- ``otbflow``: ``otbflow.engines.hf.hf_generate``, the rollout's transformers backend (its
  ``RowSampler``: Gumbel-max with Philox noise per row, position and token; the log-probs recorded),
  with ``rollout.hf_decode: eager`` (a dynamic KV cache);
- ``otbflow_static``, ``otbflow_compiled``: the same with ``hf_decode`` 'static' (a static KV
  cache) and 'compiled' (the static cache, the forward compiled, CUDA graphs on a GPU, the sampler
  fused; the warm-up call's ``warmup_s`` holds the compilation);
- ``sample``: transformers' multinomial sampling, ``generate(do_sample=True, top_k=0)``;
- ``static``: the same with ``cache_implementation="static"``, not compiled (``disable_compile``:
  the baseline the fast-decoding work is measured against);
- ``static_compile`` (not run unless named in ``--paths``): the same as transformers runs it by
  default on CUDA, the decode step compiled (the warm-up call's ``warmup_s`` holds the
  compilation, a minute or more).

Per path: ``seconds``, ``ms_per_step`` (seconds / steps, the prefill spread over the steps),
``decode_ms_per_step`` ((seconds - prefill_s) / (steps - 1), where ``prefill_s`` is one forward
of the model over the rows' prompts, timed alone), ``tokens_per_s`` (rows x steps / seconds) and
``decode_tokens_per_s`` (rows / decode step).

``profile``: ``torch.profiler`` over one ``hf_generate`` call of ``--profile-steps`` + 1 new
tokens, on ``otbflow_compiled`` where it runs (else ``otbflow``). Its decode steps (after the
first sampler call, which follows the prefill) are split by the op that launched each kernel:
``sampler`` (inside ``RowSampler.__call__``, marked with a ``record_function`` for this run),
``matmul`` (aten::mm, addmm, bmm, ...; in a compiled forward, cuBLAS's and CUTLASS's kernels by
name), ``attention`` (scaled-dot-product attention ops; compiled: the fused attention kernels by
name), ``other``; the
share of each in the kernels' time (on CPU: in the ops' own CPU time), with the host's wall time
and the kernels launched per step. The goal of the fast-decoding work: the sampler at most 10% of
a decode step's CUDA time.
``sampler_alone``: ``RowSampler`` on [rows, vocabulary] fp32 logits (fused on a GPU, eager on a CPU,
as ``hf_generate`` runs it there), and transformers' softmax + multinomial on the same, ms per call.

Prints JSON (and writes it to ``--out``) naming the command, the date, the GPU and the versions::

    python benchmarks/bench_decode.py --policy DIR                      # CUDA, bf16, 64 x 8 rows, 64 steps
    python benchmarks/bench_decode.py --policy DIR --device cpu --dtype float32 --prompts 4 \\
        --group-size 2 --max-new-tokens 8 --repeats 1                  # a tiny policy on CPU
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import time
from collections import Counter
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
PATHS = ("otbflow", "otbflow_static", "otbflow_compiled", "sample", "static", "static_compile")
DEFAULT_PATHS = ("otbflow", "otbflow_static", "otbflow_compiled", "sample", "static")  # on CPU less the compiled
SAMPLER = "otbflow.RowSampler"
MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear"}
MATMUL_OPS |= {"aten::_scaled_mm"}
# Kernels launched by a compiled forward (no aten op around them), told by their own names: cuBLAS's
# GEMMs (nvjet_sm90_* on an H100 with CUDA 13, *gemm* elsewhere, CUTLASS's) and the fused attention
# kernels (cuDNN's sdpa, flash, fmha); Inductor's Triton kernels are named after every op they fuse
# ("triton_poi_fused__scaled_dot_product_..._cat_cos": rotary and copies), so they stay "other".
MATMUL_KERNEL = re.compile(r"gemm|nvjet|cutlass|xmma", re.I)
ATTENTION_KERNEL = re.compile(r"sdpa|flash|fmha", re.I)
CATEGORIES = ("sampler", "matmul", "attention", "other")


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(device: str, fn):
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


@contextlib.contextmanager
def marked_sampler():
    """``hf_generate``'s RowSampler with each call inside a profiler range named SAMPLER (what it
    samples is unchanged); the original class is put back on exit."""
    from otbflow.engines import hf

    original = hf.RowSampler

    class Marked(original):
        def __call__(self, input_ids, scores):
            with torch.profiler.record_function(SAMPLER):
                return super().__call__(input_ids, scores)

    hf.RowSampler = Marked
    try:
        yield
    finally:
        hf.RowSampler = original


def category(event) -> str:
    """The part of a decode step a profiled op belongs to: inside the sampler, else by its name."""
    e = event
    while e is not None:
        if e.name == SAMPLER:
            return "sampler"
        e = e.cpu_parent
    if event.name in MATMUL_OPS:
        return "matmul"
    if "attention" in event.name or "scaled_dot_product" in event.name:
        return "attention"
    return "other"


def kernel_category(op: str, kernel: str) -> str:
    """A CUDA kernel's part: its launching op's (``category``), or where that says "other", the
    kernel's own name's (``MATMUL_KERNEL``, ``ATTENTION_KERNEL``)."""
    if op != "other" or kernel.startswith("triton_"):
        return op
    if MATMUL_KERNEL.search(kernel):
        return "matmul"
    return "attention" if ATTENTION_KERNEL.search(kernel) else "other"


def breakdown(events, cuda: bool, steps: int) -> dict:
    """Microseconds per category over the decode steps between the first and the last sampler
    call: on CUDA each kernel's time, counted for the CPU op that launched it; on CPU each op's
    own (self) time."""
    from torch.autograd import DeviceType

    cpu = [e for e in events if e.device_type == DeviceType.CPU and not e.is_async]  # not the GPU's copy of a range
    marks = sorted((e for e in cpu if e.name == SAMPLER), key=lambda e: e.time_range.start)
    lo, hi = marks[0].time_range.end, marks[-1].time_range.end
    us = dict.fromkeys(CATEGORIES, 0.0)
    top: Counter = Counter()
    kernels = 0
    for e in cpu:
        if not lo <= e.time_range.start < hi:
            continue
        kernels += len(e.kernels)
        op = category(e)
        parts = [(kernel_category(op, k.name), k.name, k.duration) for k in e.kernels]
        for part, name, d in parts if cuda else [(op, e.name, e.self_cpu_time_total)]:
            if d > 0:
                us[part] += d
                top[f"{part}: {name[:100]}"] += d
    total = sum(us.values())
    return {
        "time": "CUDA kernels" if cuda else "CPU (ops' self time)",
        "decode_steps": steps,
        "sampler_calls": len(marks),
        "host_us_per_step": round((hi - lo) / steps, 1),  # the CPU's wall time: launching, and waiting where it syncs
        "kernels_per_step": round(kernels / steps, 1) if cuda else None,
        "us_per_step": {k: round(v / steps, 1) for k, v in us.items()},
        "share": {k: round(v / total, 4) if total else None for k, v in us.items()},
        "top": [{"name": n, "us_per_step": round(d / steps, 1)} for n, d in top.most_common(12)],
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", required=True, help="an HF folder (benchmarks/make_policy.py makes one)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--paths",
        help="comma-separated, of "
        + ", ".join(PATHS)
        + "; default: all but static_compile (on CPU: and otbflow_compiled)",
    )
    ap.add_argument("--profile-steps", type=int, default=4, help="decode steps profiled (0: no profile)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    a = ap.parse_args(argv)
    default = [p for p in DEFAULT_PATHS if a.device.startswith("cuda") or p != "otbflow_compiled"]
    paths = [p for p in a.paths.split(",") if p] if a.paths else default
    if any(p not in PATHS for p in paths):
        ap.error(f"--paths: of {', '.join(PATHS)}")
    sys.path.insert(0, str(REPO / "src"))
    from bench_rollout import prompt_ids_for  # benchmarks/ is on sys.path (a script)
    from machine import run_record
    from transformers import GenerationConfig

    from otbflow.algorithms.tensors import padded
    from otbflow.engines import stop_token_ids
    from otbflow.engines.hf import RowSampler, hf_generate, row_keys
    from otbflow.models.policy import load_policy, set_threads

    set_threads()  # OTBFLOW_THREADS, as the stages: on a shared CPU more threads than free cores spin
    dev = a.device
    load_s, (model, tok) = timed(dev, lambda: load_policy(a.policy, a.dtype))
    model.to(dev)
    stops = stop_token_ids(tok, a.policy)
    prompts = prompt_ids_for(a.policy, a.prompts)
    n, rows = a.group_size, a.prompts * a.group_size
    ids = padded(prompts, tok.pad_token_id, left=True, device=dev).repeat_interleave(n, dim=0)
    mask = padded([[1] * len(p) for p in prompts], 0, left=True, device=dev).repeat_interleave(n, dim=0)
    width = ids.shape[1]

    def otbflow(steps: int, seed: int, decode: str = "eager"):
        out = hf_generate(
            model, tok, prompts, n, 1.0, 1.0, steps, batch_size=a.prompts, seed=seed, stop_ids=stops, decode=decode
        )
        return max(len(s.response_ids) for s in out)  # the longest row: the steps generate ran

    def transformers_sampling(static: bool, compiled: bool = False):
        def run(steps: int, seed: int):
            gen = GenerationConfig(
                do_sample=True,
                temperature=1.0,
                top_k=0,  # off (transformers' default is 50)
                top_p=1.0,
                max_new_tokens=steps,
                eos_token_id=stops,
                pad_token_id=tok.pad_token_id,
                cache_implementation="static" if static else None,
                disable_compile=not compiled,
            )
            torch.manual_seed(seed)
            with torch.no_grad():
                return model.generate(input_ids=ids, attention_mask=mask, generation_config=gen).shape[1] - width

        return run

    runs = {
        "otbflow": otbflow,
        "otbflow_static": lambda steps, seed: otbflow(steps, seed, "static"),
        "otbflow_compiled": lambda steps, seed: otbflow(steps, seed, "compiled"),
        "sample": transformers_sampling(False),
        "static": transformers_sampling(True),
        "static_compile": transformers_sampling(True, compiled=True),
    }

    def measure(run) -> dict:
        graphs0 = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        warmup_s, _ = timed(dev, lambda: run(a.max_new_tokens, a.seed))
        tries = [timed(dev, lambda r=r: run(a.max_new_tokens, a.seed + 1 + r)) for r in range(a.repeats)]
        seconds, steps = min(tries)
        decode_s = (seconds - prefill_s) / max(steps - 1, 1)
        decode_s = decode_s if decode_s > 0 else None  # a noisy machine: the prefill outlasted the call
        return {
            "warmup_s": round(warmup_s, 4),
            "seconds": round(seconds, 4),
            "all_seconds": [round(t, 4) for t, _ in tries],
            "steps": steps,
            "ms_per_step": round(1000 * seconds / steps, 3),
            "decode_ms_per_step": round(1000 * decode_s, 3) if decode_s else None,
            "tokens_per_s": round(rows * steps / seconds, 1),
            "decode_tokens_per_s": round(rows / decode_s, 1) if decode_s else None,
            "compiled_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs0,
        }

    with torch.no_grad():
        prefill = [
            timed(dev, lambda: model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1))[0]
            for _ in range(max(2, a.repeats))
        ]
    prefill_s = min(prefill[1:])  # the first is a warm-up
    result = {
        **run_record(),
        "benchmark": "decode",
        "policy": {
            "path": a.policy,
            "arch": model.config.model_type,
            "parameters": sum(p.numel() for p in model.parameters()),
            "vocab": model.config.vocab_size,
            "layers": model.config.num_hidden_layers,
            "hidden": model.config.hidden_size,
            "load_s": round(load_s, 3),
        },
        "device": dev,
        "threads": torch.get_num_threads(),
        "dtype": a.dtype,
        "prompts": a.prompts,
        "group_size": n,
        "rows": rows,
        "prompt_width": width,
        "max_new_tokens": a.max_new_tokens,
        "sampling": "temperature 1, top_p 1, top_k off, the policy's stop tokens",
        "prefill_s": round(prefill_s, 5),
        "paths": {},
    }
    for name in paths:
        result["paths"][name] = measure(runs[name])
        print(json.dumps({name: result["paths"][name]["ms_per_step"]}), file=sys.stderr, flush=True)
    p = result["paths"]
    if "otbflow" in p:  # otbflow's ms per step over each other path's
        result["otbflow_over"] = {k: round(p["otbflow"]["ms_per_step"] / v["ms_per_step"], 3) for k, v in p.items()}
        del result["otbflow_over"]["otbflow"]

    if a.profile_steps > 0:
        from torch.profiler import ProfilerActivity, profile

        cuda = dev.startswith("cuda")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        profiled = "otbflow_compiled" if "otbflow_compiled" in paths else "otbflow"  # the fastest otbflow path
        runs[profiled](a.profile_steps + 1, a.seed)  # warm
        with marked_sampler(), profile(activities=activities) as prof:
            runs[profiled](a.profile_steps + 1, a.seed)
            sync(dev)
        result["profile"] = {"path": profiled, **breakdown(prof.events(), cuda, a.profile_steps)}

    vocab = model.config.vocab_size
    scores = torch.randn(rows, vocab, device=dev, dtype=torch.float32)
    keys = row_keys(a.seed, range(a.prompts), n, dev)

    def per_call(fn, calls: int = 8) -> float:
        fn()
        return min(timed(dev, lambda: [fn() for _ in range(calls)])[0] for _ in range(max(1, a.repeats))) / calls

    sampler = RowSampler(keys, 1.0, 1.0, False, fused=dev.startswith("cuda"))  # as hf_generate samples there
    result["sampler_alone"] = {
        "rows": rows,
        "vocab": vocab,
        "row_sampler_ms": round(1000 * per_call(lambda: sampler(ids, scores)), 3),
        "softmax_multinomial_ms": round(1000 * per_call(lambda: torch.multinomial(scores.softmax(-1), 1)), 3),
    }
    text = json.dumps(result, indent=1)
    print(text)
    if a.out:
        a.out.write_text(text)
    return result


if __name__ == "__main__":
    main()
