"""What a stage job pays before (and after) its work, per model size: the start-up that
docs/scale.md extrapolates to Qwen2.5-7B and -32B shapes.

Every measurement runs in a fresh interpreter (a job's start is a fresh process), for two
shapes: the default config's built model (``default``, 0.8 M parameters: the fixed costs) and
a random Qwen2.5-0.5B-shaped model (``qwen2.5-0.5b``, benchmarks/shapes/: the per-parameter
costs), saved once in fp32 as the train stage saves a policy. Files are read once before the
timed part (the page cache is hot: a cold read from a shared filesystem adds bytes / bandwidth,
which docs/scale.md adds separately). Per shape:

- ``features``: the imports of the features stage (torch, transformers), then ``load_policy``
  (fp32 weights to the model);
- ``train``: the imports of the train stage (deepspeed too); ``build_engine`` split into the
  model load and ``deepspeed.initialize`` (AdamW, ``train.zero_stage`` 0, fp32, one rank);
  writing the optimizer state as the job does (``save_optimizer_state``) and loading it back as
  the next iteration's job does (``load_optimizer_state``); writing the next policy
  (``save_policy``);
- ``advantages``: the imports of the advantages stage (no model);
- ``vllm`` (only with .venv-vllm, ``make vllm-env``): ``import vllm`` and building the engine
  (``vllm.LLM`` with the rollout stage's arguments, ``rollout.enforce_eager: false``, a 1 GiB KV
  cache): model load, profiling and the CPU build's compilation.

Prints JSON (and writes it to ``--out``); the machine and torch version are in it. About 6
minutes on a 2-core CPU, with nothing else running::

    python benchmarks/bench_startup.py --out benchmarks/measured/startup.json
    python benchmarks/bench_startup.py --shapes default --no-vllm     # a quick check of the script
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

T_START = time.perf_counter()  # before any heavy import: the worker's imports are timed from here

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
SHAPES = ("default", "qwen2.5-0.5b")


# ------------------------------------------------------------------------------------------
# Workers: one fresh interpreter each, printing one JSON line
# ------------------------------------------------------------------------------------------


def _since(t: float) -> float:
    return round(time.perf_counter() - t, 3)


def worker_features(model: str) -> dict:
    import otbflow.stages.features  # noqa: F401
    from otbflow.models.policy import load_policy

    out = {"import_s": _since(T_START)}
    t = time.perf_counter()
    load_policy(model)
    out["model_load_s"] = _since(t)
    return out


def worker_advantages(model: str) -> dict:
    import otbflow.stages.advantages  # noqa: F401

    return {"import_s": _since(T_START)}


def worker_train(model: str) -> dict:
    import deepspeed
    import transformers  # noqa: F401
    from transformers import AutoModelForCausalLM  # noqa: F401  (the lazy module's real import)

    import otbflow.stages.train  # noqa: F401
    from otbflow.config import DEFAULT_CONFIG, load_config
    from otbflow.training.distributed import build_engine, init_distributed_env
    from otbflow.training.publish import full_fp32_state_dict, save_policy
    from otbflow.training.state import load_optimizer_state, save_optimizer_state

    out = {"import_s": _since(T_START)}
    tc = load_config(DEFAULT_CONFIG, []).train
    init_distributed_env()
    timed = {}
    real_initialize = deepspeed.initialize

    def initialize(*a, **kw):  # build_engine's DeepSpeed part, timed apart from its model load
        t = time.perf_counter()
        result = real_initialize(*a, **kw)
        timed["deepspeed_init_s"] = _since(t)
        return result

    deepspeed.initialize = initialize
    t = time.perf_counter()
    engine = build_engine(model, tc, 1)
    out["deepspeed_init_s"] = timed["deepspeed_init_s"]
    out["model_load_s"] = round(_since(t) - timed["deepspeed_init_s"], 3)
    # one optimizer step (zero gradients), so that AdamW's moments exist as in a trained job's state
    engine.set_gradient_accumulation_boundary(True)
    engine.backward(sum((p * 0).sum() for p in engine.module.parameters()), scale_wrt_gas=False)
    engine.step()
    with tempfile.TemporaryDirectory(dir=Path(model).parent) as tmp:
        t = time.perf_counter()
        save_optimizer_state(engine, f"{tmp}/optimizer", {}, 0, 1)
        out["optimizer_save_s"] = _since(t)
        out["optimizer_bytes"] = sum(f.stat().st_size for f in Path(f"{tmp}/optimizer").rglob("*") if f.is_file())
        subprocess.run(["cat", *map(str, Path(f"{tmp}/optimizer").rglob("*.pt"))], stdout=subprocess.DEVNULL)
        t = time.perf_counter()
        load_optimizer_state(engine, f"{tmp}/optimizer")
        out["optimizer_load_s"] = _since(t)
        t = time.perf_counter()
        save_policy(engine, full_fp32_state_dict(engine, True), model, f"{tmp}/policy")
        out["policy_save_s"] = _since(t)
    return out


def worker_vllm(model: str) -> dict:
    import vllm

    from otbflow.config import DEFAULT_CONFIG, load_config
    from otbflow.engines.vllm import engine_kwargs

    out = {"import_s": _since(T_START)}
    r = load_config(DEFAULT_CONFIG, []).rollout
    kwargs = engine_kwargs(
        model, "float32", 0, 1, r.gpu_memory_utilization, enforce_eager=r.enforce_eager, kv_cache_gib=1
    )
    t = time.perf_counter()
    vllm.LLM(**kwargs)
    out["engine_build_s"] = _since(t)
    return out


WORKERS = {"features": worker_features, "advantages": worker_advantages, "train": worker_train, "vllm": worker_vllm}


# ------------------------------------------------------------------------------------------
# The parent: build the models, run the workers
# ------------------------------------------------------------------------------------------


def build_model(shape: str, folder: Path) -> dict:
    """Save the shape's random model (fp32) with a tokenizer; returns its parameter count and bytes."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from otbflow.config import DEFAULT_CONFIG, load_config
    from otbflow.models.policy import build_bpe_tokenizer, build_tiny_model, build_tokenizer

    cfg = load_config(DEFAULT_CONFIG, [])
    if shape == "default":
        tok = build_tokenizer(cfg.model, [])  # model.tokenizer: char
        model = build_tiny_model(cfg.model, tok, cfg.seed)
    else:
        hf = json.loads((REPO / "benchmarks" / "shapes" / f"{shape}.json").read_text())
        tok = build_bpe_tokenizer([f"{a} + {b} = {a + b}" for a in range(100) for b in range(100)], 512)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf), dtype=torch.float32)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    n = sum(p.numel() for p in model.parameters())
    return {"parameters": n, "bytes": sum(f.stat().st_size for f in folder.glob("*.safetensors"))}


def run_worker(python: str, name: str, model: Path, threads: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OTBFLOW_THREADS=str(threads))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")])
    subprocess.run(["cat", *map(str, model.glob("*"))], stdout=subprocess.DEVNULL)  # the page cache hot
    t = time.perf_counter()
    res = subprocess.run(
        [python, __file__, "--worker", name, "--model", str(model)],
        capture_output=True,
        text=True,
        env=env,
        stdin=subprocess.DEVNULL,
        cwd=model.parent,
    )
    wall = time.perf_counter() - t
    if res.returncode != 0:
        raise SystemExit(f"{name} on {model} failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    out = json.loads(res.stdout.strip().splitlines()[-1])
    out["process_s"] = round(wall, 3)  # the whole process: interpreter start and exit too
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated: default, qwen2.5-0.5b")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-vllm", action="store_true", help="skip the vLLM engine build")
    p.add_argument("--out", help="also write the JSON here")
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    ns = p.parse_args()
    if ns.worker:
        print(json.dumps(WORKERS[ns.worker](ns.model)))
        return

    import torch
    from machine import cpu_model  # benchmarks/ is on sys.path (a script); not in the timed workers

    vllm = VLLM_PYTHON.is_file() and not ns.no_vllm
    result = {
        "command": " ".join(["python", "benchmarks/bench_startup.py", *sys.argv[1:]]),
        "date": datetime.now().isoformat(timespec="seconds"),
        "machine": {
            "cpu": cpu_model(),
            "cores": os.cpu_count(),
            "torch": torch.__version__,
            "threads": ns.threads,
        },
        "page_cache": "hot (files read before each timed step)",
        "load_average_before": os.getloadavg(),
        "shapes": {},
    }
    with tempfile.TemporaryDirectory(dir=REPO) as tmp:  # on the repository's disk, not a tmpfs
        for shape in ns.shapes.split(","):
            folder = Path(tmp) / shape
            entry = build_model(shape, folder)
            for name in ("advantages", "features", "train"):
                entry[name] = run_worker(sys.executable, name, folder, ns.threads)
                print(f"{shape} {name}: {entry[name]}", file=sys.stderr, flush=True)
            if vllm:
                entry["vllm"] = run_worker(str(VLLM_PYTHON), "vllm", folder, ns.threads)
                print(f"{shape} vllm: {entry['vllm']}", file=sys.stderr, flush=True)
            result["shapes"][shape] = entry
    result["load_average_after"] = os.getloadavg()
    text = json.dumps(result, indent=2)
    print(text)
    if ns.out:
        Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
