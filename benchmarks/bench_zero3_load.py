"""Host memory of the train job's model load under ZeRO-3: partitioned while it loads against whole.

A random Qwen2-shaped policy (``--hidden``, ``--layers``, ``--vocab``; tied embeddings) is saved in
fp32 as the train stage reads it. Then, for each mode, ``--ranks`` ranks on this machine
(torchrun, CPU, gloo) build the train stage's DeepSpeed engine with ``train.zero_stage=3``
(``otbflow.training.distributed.build_engine``) and report their memory:

- ``partitioned``: the train stage as it is (``load_partitioned``: transformers' DeepSpeed
  integration builds the model inside ``deepspeed.zero.Init``; rank 0 alone reads the values).
- ``whole``: the train stage before the change (main at b389a5f): every rank loads the whole fp32
  policy (``load_fp32``), then ``deepspeed.initialize`` partitions it.

Per rank: ``load_peak_rss_mib``, the process's peak resident memory (VmHWM; file-backed pages of
the memory-mapped checkpoint included) from the start of the load until the model is loaded;
``param_elements``, the parameter elements the rank holds then (its ZeRO-3 share where the
parameters are partitioned); ``load_s``; then ``initialize_peak_rss_mib``, the peak during
``deepspeed.initialize`` (the peak reset after the load), and ``build_s``, the whole engine build.
``baseline_rss_mib`` is a rank's VmRSS right before the load (interpreter, torch, transformers,
DeepSpeed, the process group). The checkpoint's bytes are ``checkpoint_mib``. Prints JSON.

    python benchmarks/bench_zero3_load.py [--hidden 1024] [--layers 8] [--vocab 32000] [--ranks 2]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from memory import reset_peak, rss_kib  # benchmarks/memory.py (this folder is on sys.path)

MODES = ("partitioned", "whole")


def save_policy_folder(path: Path, hidden: int, layers: int, vocab: int) -> int:
    """A random fp32 Qwen2-shaped policy with a byte-level tokenizer, saved; returns its parameters."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from otbflow.config import DEFAULT_CONFIG, load_config
    from otbflow.models.policy import build_char_tokenizer

    tok = build_char_tokenizer()
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(hidden * 8 / 3) // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 128),
        num_key_value_heads=max(1, hidden // 512),
        tie_word_embeddings=True,
        max_position_embeddings=load_config(DEFAULT_CONFIG, []).model.n_positions,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def worker(mode: str, policy: str, out: str) -> None:
    """One rank: the train stage's engine at ZeRO-3, its memory written to ``out``.<rank>.json."""
    from otbflow.config import DEFAULT_CONFIG, load_config
    from otbflow.training import distributed as D

    rank, world_size = D.init_distributed_env()
    tc = load_config(DEFAULT_CONFIG, ["train.zero_stage=3"]).train
    import deepspeed
    import transformers  # noqa: F401
    from transformers import AutoModelForCausalLM  # noqa: F401  (imports before the baseline)

    D.skip_cpu_shm_op()
    deepspeed.init_distributed()  # the process group before the baseline, in both modes
    load = D.load_fp32 if mode == "whole" else D.load_partitioned  # whole: main before the change
    marks = {}

    def measured_load(policy_dir: str, config: dict):
        t = time.perf_counter()
        model = load(policy_dir) if mode == "whole" else load(policy_dir, config)
        marks["load_s"] = round(time.perf_counter() - t, 2)
        marks["load_peak_rss_mib"] = rss_kib("VmHWM") / 1024
        # this rank's elements: its ZeRO-3 share (ds_tensor) where the parameter is partitioned
        marks["param_elements"] = sum(getattr(p, "ds_tensor", p).numel() for p in model.parameters())
        reset_peak()
        return model

    D.load_partitioned = measured_load
    baseline = rss_kib("VmRSS")
    reset_peak()
    t = time.perf_counter()
    D.build_engine(policy, tc, world_size)
    result = {
        "rank": rank,
        "baseline_rss_mib": round(baseline / 1024, 1),
        **marks,
        "initialize_peak_rss_mib": rss_kib("VmHWM") / 1024,
        "build_s": round(time.perf_counter() - t, 2),
    }
    Path(f"{out}.{rank}.json").write_text(json.dumps(result))
    # both ranks done before the group goes: a rank that exits with gloo's threads still running can
    # abort ("terminate called without an active exception"), as one did on a loaded 2-core machine
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--policy", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a.worker, a.policy, a.out)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        policy = Path(tmp) / "policy"
        with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's loggers write to stdout: the JSON's
            n_params = save_policy_folder(policy, a.hidden, a.layers, a.vocab)
        modes = {}
        for mode in MODES:
            out = Path(tmp) / mode
            env = dict(os.environ, OTBFLOW_THREADS=os.environ.get("OTBFLOW_THREADS", "1"))
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={a.ranks}"]
            cmd += [__file__, "--worker", mode, "--policy", str(policy), "--out", str(out)]
            res = subprocess.run(cmd, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
            if res.returncode != 0:
                sys.stderr.write(res.stdout[-3000:] + res.stderr[-6000:])
                return res.returncode
            modes[mode] = [json.loads(Path(f"{out}.{r}.json").read_text()) for r in range(a.ranks)]
        checkpoint = sum(f.stat().st_size for f in policy.glob("*.safetensors"))
    print(
        json.dumps(
            {
                "parameters": n_params,
                "checkpoint_mib": round(checkpoint / 2**20, 1),
                "ranks": a.ranks,
                "shape": {"hidden": a.hidden, "layers": a.layers, "vocab": a.vocab},
                "modes": modes,
                "load_peak_above_baseline_mib": {
                    m: [round(r["load_peak_rss_mib"] - r["baseline_rss_mib"], 1) for r in rs] for m, rs in modes.items()
                },
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
