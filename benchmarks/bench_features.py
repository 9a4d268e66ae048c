"""Cost of the full features pass against a log-prob-only forward, in time and peak memory.

Both passes run the transformer body once and the output head over chunks of
``--chunk-size`` response positions (the features stage's layout). The log-prob-only pass takes
log_softmax(z)[y] per chunk; the features pass computes log-probs, entropy, sum pi^2 and the
proxy (otbflow.models.logits.token_stats). Each (model, pass) runs in a fresh process:

- time: best of --repeats whole passes (body + head + statistics);
- memory: peak RSS (VmHWM, reset through /proc/self/clear_refs) of the head + statistics part
  above the RSS before it ("over logits"), and of the whole pass above the loaded model.

Models: the tiny default policy shape (char vocabulary) and a random GPT-2-shaped model with a
50,257-token vocabulary, at 64 sequences x 256 tokens. Prints JSON.

    python benchmarks/bench_features.py [--repeats 3] [--chunk-size 1024] [--models tiny,gpt2_50k]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch
from memory import reset_peak, rss_kib  # benchmarks/memory.py (this folder is on sys.path)

MODELS = {
    "tiny": {"vocab_size": 78, "n_layer": 4, "n_embd": 128, "n_head": 4},
    "gpt2_50k": {"vocab_size": 50257, "n_layer": 2, "n_embd": 256, "n_head": 4},
}


def worker(model_name: str, mode: str, n_seq: int, seq_len: int, prompt_len: int, chunk: int, repeats: int) -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel

    from otbflow.models.logits import ResponseLogits, chunked_token_stats, pack

    torch.manual_seed(0)
    spec = MODELS[model_name]
    model = GPT2LMHeadModel(GPT2Config(n_positions=seq_len, **spec)).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, spec["vocab_size"], (n_seq, seq_len), generator=g).tolist()
    batch = pack([x[:prompt_len] for x in ids], [x[prompt_len:] for x in ids], pad_id=0)
    targets = batch["targets"]

    def head_part(project):
        if mode == "features":  # the features stage's own loop
            return chunked_token_stats(project, targets, 1.0, chunk)
        out = []
        for start in range(0, len(targets), chunk):
            sl = slice(start, start + chunk)
            logits = project(sl)
            out.append(torch.log_softmax(logits.float(), -1).gather(-1, targets[sl, None]).squeeze(-1))
            del logits
        return out

    with torch.no_grad():
        project = ResponseLogits(model, batch)  # warm-up and page-in
        head_part(project)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            head_part(ResponseLogits(model, batch))
            best = min(best, time.perf_counter() - t0)
        del project
        base_model = rss_kib("VmRSS")
        ok = reset_peak()
        project = ResponseLogits(model, batch)
        before_head = rss_kib("VmRSS")
        peak_body = rss_kib("VmHWM")
        reset_peak()
        head_part(project)
        peak_head = rss_kib("VmHWM")
    return {
        "model": model_name,
        "mode": mode,
        "seconds": best,
        "peak_rss_reset_ok": ok,
        "head_peak_mib": (peak_head - before_head) / 1024,
        "pass_peak_mib": (max(peak_head, peak_body) - base_model) / 1024,
        "tokens": int(len(targets)),
        "vocab": spec["vocab_size"],
        "chunk_size": chunk,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chunk-size", type=int, default=1024)
    ap.add_argument("--sequences", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--worker", nargs=2, metavar=("MODEL", "MODE"))
    a = ap.parse_args()
    models = [m for m in a.models.split(",") if m]
    if unknown := set(models) - set(MODELS):
        ap.error(f"unknown models {sorted(unknown)}; known: {', '.join(MODELS)}")
    if a.worker:
        print(json.dumps(worker(*a.worker, a.sequences, a.seq_len, a.prompt_len, a.chunk_size, a.repeats)))
        return
    runs = {}
    for model in models:
        for mode in ("logprob_only", "features"):
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--worker",
                    model,
                    mode,
                    "--repeats",
                    str(a.repeats),
                    "--chunk-size",
                    str(a.chunk_size),
                    "--sequences",
                    str(a.sequences),
                    "--seq-len",
                    str(a.seq_len),
                    "--prompt-len",
                    str(a.prompt_len),
                ],
                capture_output=True,
                text=True,
                check=True,
            )
            runs[(model, mode)] = json.loads(out.stdout.strip().splitlines()[-1])
    result = {
        "benchmark": "features",
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "sequences": a.sequences,
        "seq_len": a.seq_len,
        "chunk_size": a.chunk_size,
        "models": {},
    }
    for model in models:
        lp, ft = runs[(model, "logprob_only")], runs[(model, "features")]
        result["models"][model] = {
            "vocab": lp["vocab"],
            "response_tokens": lp["tokens"],
            "seconds": {"logprob_only": round(lp["seconds"], 4), "features": round(ft["seconds"], 4)},
            "time_ratio": round(ft["seconds"] / lp["seconds"], 3),
            "head_peak_mib": {"logprob_only": round(lp["head_peak_mib"], 1), "features": round(ft["head_peak_mib"], 1)},
            # below 1 MiB the logits are lost in RSS page granularity: no ratio
            "memory_ratio_over_logits": (
                round(ft["head_peak_mib"] / lp["head_peak_mib"], 3) if lp["head_peak_mib"] >= 1 else None
            ),
            "pass_peak_mib": {"logprob_only": round(lp["pass_peak_mib"], 1), "features": round(ft["pass_peak_mib"], 1)},
            "memory_ratio_whole_pass": round(ft["pass_peak_mib"] / max(lp["pass_peak_mib"], 1e-9), 3),
            "peak_rss_reset_ok": lp["peak_rss_reset_ok"] and ft["peak_rss_reset_ok"],
        }
    result["targets"] = {"time_ratio": 1.15, "memory_ratio": 1.25}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
