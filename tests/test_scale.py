"""benchmarks/scale.py, the cost model behind docs/scale.md: its FLOP count against torch's own
FLOP counter on real architectures (the doc itself is checked against the script by
tests/test_docs_commands.py, `python benchmarks/scale.py --check`)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from conftest import REPO
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoConfig, AutoModelForCausalLM

spec = importlib.util.spec_from_file_location("scale", REPO / "benchmarks" / "scale.py")
scale = importlib.util.module_from_spec(spec)
spec.loader.exec_module(scale)

SHAPES = {
    # untied head and embedding, grouped-query attention, as Qwen2.5-7B/32B
    "qwen2": {
        "model_type": "qwen2",
        "hidden_size": 128,
        "intermediate_size": 352,
        "num_hidden_layers": 3,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "vocab_size": 1000,
        "tie_word_embeddings": False,
    },
    # tied, as Qwen2.5-0.5B
    "llama_tied": {
        "model_type": "llama",
        "hidden_size": 96,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "vocab_size": 700,
        "tie_word_embeddings": True,
    },
}


@pytest.mark.parametrize("name", SHAPES)
def test_forward_flops_match_torch_flop_counter(name):
    """A forward over T tokens in eager attention multiplies the full T x T logits (the causal
    mask is added after), so its count is T forward_flops at context T; torch's counter counts
    matrix products only (no norms or activations), as the model does. (CPU SDPA is not counted
    by torch's counter: eager attention here.)"""
    hf = SHAPES[name]
    config = AutoConfig.for_model(**hf, attn_implementation="eager")
    model = AutoModelForCausalLM.from_config(config).eval()
    n = sum(p.numel() for p in model.parameters())
    T = 64
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(torch.randint(0, hf["vocab_size"], (1, T)))
    expected = T * scale.forward_flops(n, hf, T)
    # the model counts biases as weights (0.2% here)
    assert counter.get_total_flops() == pytest.approx(expected, rel=0.005)


def test_train_mfu_is_the_measured_range():
    """The train MFU of docs/scale.md is the measured one (docs/measurements.md: 6.5–8.7% in
    iteration_h100, 5.6–8.0% and a warm step's 11.6% in iteration_workers_h100), not an assumption."""
    lo, hi = scale.measured_train_mfu()
    assert (round(lo, 3), round(hi, 3)) == (0.056, 0.116)
    assert scale.mfu_ranges()["train"] == (lo, hi)
