"""One rollout engine's costs against its batch, and the lengths of stored rollouts: what
``benchmarks/laminar_sim.py`` is calibrated with on this machine.

- ``decode``: seconds per decode step of the policy's forward with a dynamic KV cache (the
  transformers backend's eager decode), for each batch of ``--rows`` rows, every row at the same
  context (``--context`` tokens prefilled, then ``--steps`` steps timed; the step's sampling is an
  argmax, a small share at these widths). Best of ``--repeats``.
- ``prefill``: seconds for one forward over ``--prefill-rows`` rows of ``--context`` tokens each
  (``tokens`` = rows x context), best of ``--repeats``.
- ``affine``: least-squares fits ``decode_s = fixed + per_row x rows`` and
  ``prefill_s = fixed + per_token x tokens`` over the points.
- ``lengths`` (``--rollouts GLOB``): the histogram of ``response_length`` and of the prompts'
  lengths (``prompt_ids``) over the matching ``rollouts.parquet`` files, with the responses that
  hit ``max_new_tokens`` (``finish_reason`` 'length') counted apart.

The policy is the config's built-in one (``--configfile`` layered over config/config.yaml: its
architecture, widths and positions), random weights, fp32, ``--threads`` torch threads (one: an
engine per core). Prints JSON (and writes it to ``--out``)::

    python benchmarks/bench_engine_costs.py --configfile config/examples/long_tail.yaml \\
        --rollouts 'benchmarks/out/iteration/grpo_s0/results/iter_*/rollout/rollouts_*.parquet'
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from machine import run_record  # benchmarks/machine.py (this folder is on sys.path)

REPO = Path(__file__).resolve().parents[1]


def tiny_policy(configfile: str | None):
    from otbflow.config import DEFAULT_CONFIG, load_config
    from otbflow.models.policy import build_tiny_model, build_tokenizer
    from otbflow.stages.bootstrap import tokenizer_corpus

    cfg = load_config(DEFAULT_CONFIG, [], extra=load_config(configfile) if configfile else None)
    tok = build_tokenizer(cfg.model, tokenizer_corpus(cfg))
    return cfg, build_tiny_model(cfg.model, tok, seed=0).eval()


def best_of(repeats: int, fn) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


@torch.no_grad()
def decode_step_s(model, rows: int, context: int, steps: int, repeats: int) -> float:
    """Seconds per decode step of ``rows`` rows at ``context`` tokens of context."""
    from transformers import DynamicCache

    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (rows, context), generator=torch.Generator().manual_seed(0))

    best = float("inf")
    for _ in range(repeats):
        cache = DynamicCache()
        nxt = model(input_ids=ids, cache=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        t = time.perf_counter()
        for _ in range(steps):
            nxt = model(input_ids=nxt, cache=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        best = min(best, (time.perf_counter() - t) / steps)
    return best


@torch.no_grad()
def prefill_s(model, rows: int, context: int, repeats: int) -> float:
    from transformers import DynamicCache

    ids = torch.randint(0, model.config.vocab_size, (rows, context), generator=torch.Generator().manual_seed(1))
    return best_of(repeats, lambda: model(input_ids=ids, cache=DynamicCache(), use_cache=True))


def affine(xs: list[float], ys: list[float]) -> dict:
    """Least squares y = fixed + slope x."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return {"fixed_s": my - slope * mx, "slope_s": slope}


def lengths(pattern: str) -> dict:
    import polars as pl

    files = sorted(glob.glob(pattern))
    if not files:
        raise SystemExit(f"--rollouts {pattern!r} matches no file")
    df = pl.concat(
        [
            pl.read_parquet(f, columns=["prompt_ids", "response_length", "finish_reason"]).with_columns(
                pl.col("prompt_ids").list.len().alias("prompt_length")
            )
            for f in files
        ]
    )
    hist = lambda col: {str(k): v for k, v in sorted(Counter(df[col].to_list()).items())}  # noqa: E731
    return {
        "files": len(files),
        "responses": df.height,
        "truncated": int((df["finish_reason"] == "length").sum()),
        "response_length": hist("response_length"),
        "prompt_length": hist("prompt_length"),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configfile", help="layered over config/config.yaml (the policy's shape)")
    ap.add_argument("--rows", default="1,8,32,128,512", help="decode batches, comma-separated")
    ap.add_argument("--context", type=int, default=96, help="tokens of context of every row")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--prefill-rows", default="8,32,128")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rollouts", help="a glob of rollouts.parquet files: their lengths' histograms")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg, model = tiny_policy(args.configfile)
    rows = [int(r) for r in args.rows.split(",")]
    decode = {str(r): round(decode_step_s(model, r, args.context, args.steps, args.repeats), 6) for r in rows}
    prefill_rows = [int(r) for r in args.prefill_rows.split(",")]
    prefill = {str(r * args.context): round(prefill_s(model, r, args.context, args.repeats), 6) for r in prefill_rows}
    out = {
        **run_record(),
        "benchmark": "engine_costs",
        "policy": {
            "arch": model.config.model_type,
            "parameters": sum(p.numel() for p in model.parameters()),
            "bytes_fp32": sum(p.numel() * 4 for p in model.parameters()),
        },
        "threads": args.threads,
        "context": args.context,
        "steps": args.steps,
        "decode_s": decode,
        "prefill_s": prefill,
        "affine": {
            "decode": affine([float(r) for r in decode], list(decode.values())),
            "prefill": affine([float(t) for t in prefill], list(prefill.values())),
        },
    }
    if args.rollouts:
        out["lengths"] = lengths(args.rollouts)
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
