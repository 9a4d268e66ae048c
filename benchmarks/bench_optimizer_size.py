"""The AdamW state folder's size against the fp32 weights, per DeepSpeed layout.

A random GPT-2 of about 3.2 M parameters (4 layers, 256 wide, the built-in character tokenizer)
is saved as an fp32 policy; for each layout the train stage's engine is built on it
(``otbflow.training.distributed.build_engine``, one rank on the CPU) and its state written as the
train job writes it (``otbflow.training.state.save_optimizer_state``), after one optimizer step
(AdamW makes its moments at its first step). The size is the folder's bytes over the fp32
weights' (4 bytes a parameter): what ``otbflow.ops.disk`` multiplies by. Prints JSON.

    python benchmarks/bench_optimizer_size.py
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from machine import run_record  # benchmarks/machine.py (this folder is on sys.path)

LAYOUTS = {
    "zero0_fp32": ["train.zero_stage=0", "train.bf16=false"],
    "zero1_fp32": ["train.zero_stage=1", "train.bf16=false"],
    "zero1_bf16": ["train.zero_stage=1", "train.bf16=true"],
    "zero2_bf16": ["train.zero_stage=2", "train.bf16=true"],
    "zero3_fp32": ["train.zero_stage=3", "train.bf16=false"],
    "zero3_bf16": ["train.zero_stage=3", "train.bf16=true"],
}


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def one_step(engine) -> None:
    """One optimizer step on one 8-token sequence: AdamW makes its moments at its first step."""
    import torch

    ids = torch.arange(4, 12).unsqueeze(0)
    logp, _, _ = engine(
        ids, torch.ones_like(ids), torch.zeros(4, dtype=torch.long), torch.arange(3, 7), ids[0, 4:], 1.0
    )
    engine.set_gradient_accumulation_boundary(True)  # as the train stage sets it per mini-batch
    engine.backward(-logp.sum())
    engine.step()


def main() -> None:
    from omegaconf import OmegaConf

    from otbflow.config import DEFAULT_CONFIG, load_config
    from otbflow.models.policy import build_char_tokenizer, build_tiny_model
    from otbflow.training.distributed import build_engine, init_distributed_env
    from otbflow.training.state import save_optimizer_state

    init_distributed_env()
    out: dict = {"benchmark": "optimizer_size", **run_record(), "layouts": {}}
    with tempfile.TemporaryDirectory(prefix="bench_optimizer_size_") as tmp:
        policy = Path(tmp) / "policy"
        cfg = load_config(DEFAULT_CONFIG, ["model.n_layer=4", "model.n_embd=256", "model.n_head=4"])
        tok = build_char_tokenizer()
        model = build_tiny_model(cfg.model, tok, seed=0)
        model.save_pretrained(policy)
        tok.save_pretrained(policy)
        n = sum(p.numel() for p in model.parameters())
        out["parameters"] = n
        for name, overrides in LAYOUTS.items():
            tc = load_config(DEFAULT_CONFIG, overrides).train
            engine = build_engine(str(policy), tc, 1)
            one_step(engine)
            folder = Path(tmp) / name
            save_optimizer_state(engine, str(folder), {"layout": name}, 0, 1, module=False)  # as train's --optimizer
            size = folder_bytes(folder)
            out["layouts"][name] = {"bytes": size, "over_fp32_weights": round(size / (4 * n), 3)}
            del engine
    out["config"] = OmegaConf.to_container(cfg.model)
    json.dump(out, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
