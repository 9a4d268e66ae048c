"""A random policy of a named shape, saved as an HF folder whose every token id decodes (for the GPU
benchmarks: benchmarks/gpu/check.sh).

The shape is ``benchmarks/shapes/NAME.json`` (an HF config.json: architecture, widths, vocabulary;
qwen2.5-0.5b: 494 M parameters, vocabulary 151,936, tied embeddings). The weights are the
architecture's random initialisation (seed ``--seed``, on the CPU, so the same on every machine),
saved in ``--dtype`` (the shape's own, bf16 for Qwen2.5). The tokenizer is word-level and covers
the whole vocabulary: otbflow's special tokens (``<pad>`` 0, ``<eos>`` 1, ``<unk>`` 2) and
characters (those of the arithmetic task's prompts, ``otbflow.models.policy.CHARS``), then ``<w{i}>``
tokens up to the vocabulary's size, so any sampled id decodes.

Smaller variants for a CPU check: ``--layers``, ``--vocab`` and ``--hidden`` (the width; heads
keep the shape's head size, the MLP the shape's ratio). Prints JSON: the folder, parameters
(counted once where tied), vocabulary, layers, width, dtype and seconds::

    python benchmarks/make_policy.py --shape qwen2.5-0.5b --out DIR
    python benchmarks/make_policy.py --shape qwen2.5-0.5b --layers 2 --vocab 4096 --hidden 64 --out DIR
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHAPES = REPO / "benchmarks" / "shapes"


def word_tokenizer(vocab_size: int):
    """The character tokenizer of otbflow.models.policy padded with word tokens '<w{i}>' to vocab_size."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from otbflow.models.policy import CHARS, SPECIAL

    tokens = SPECIAL + list(dict.fromkeys(CHARS))
    if vocab_size < len(tokens):
        raise ValueError(f"a vocabulary of {vocab_size} cannot hold the {len(tokens)} special and character tokens")
    tokens += [f"<w{i}>" for i in range(vocab_size - len(tokens))]
    tok = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(""), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", padding_side="left"
    )


def shape_config(shape: dict, layers: int = 0, vocab: int = 0, hidden: int = 0) -> dict:
    """The shape's config fields, with the smaller variant's overrides (0: the shape's own)."""
    cfg = {k: v for k, v in shape.items() if k not in ("architectures", "torch_dtype")}
    if layers:
        cfg["num_hidden_layers"] = layers
    if vocab:
        cfg["vocab_size"] = vocab
    if hidden:
        head_dim = shape["hidden_size"] // shape["num_attention_heads"]
        heads = max(1, hidden // head_dim)
        if hidden % heads:
            raise ValueError(f"--hidden {hidden} is not a multiple of {heads} heads")
        cfg["hidden_size"] = hidden
        cfg["intermediate_size"] = round(hidden * shape["intermediate_size"] / shape["hidden_size"])
        cfg["num_attention_heads"] = heads
        cfg["num_key_value_heads"] = math.gcd(shape.get("num_key_value_heads", heads), heads)
    return cfg


def build(shape_name: str, out: Path, layers: int = 0, vocab: int = 0, hidden: int = 0, dtype: str = "", seed: int = 0):
    """Save the policy to ``out``; returns what ``main`` prints."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = json.loads((SHAPES / f"{shape_name}.json").read_text())
    fields = shape_config(shape, layers, vocab, hidden)
    tok = word_tokenizer(fields["vocab_size"])
    ids = {"bos_token_id": tok.eos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    config = AutoConfig.for_model(**{**fields, **ids})
    dtype = dtype or shape.get("torch_dtype", "float32")
    torch.manual_seed(seed)
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to(getattr(torch, dtype)).save_pretrained(out)
    tok.save_pretrained(out)
    return {
        "shape": shape_name,
        "out": str(out),
        "parameters": sum(p.numel() for p in model.parameters()),  # a tied head counts once
        "vocab": config.vocab_size,
        "layers": config.num_hidden_layers,
        "hidden": config.hidden_size,
        "heads": config.num_attention_heads,
        "kv_heads": config.num_key_value_heads,
        "dtype": dtype,
        "seed": seed,
        "seconds": round(time.perf_counter() - start, 2),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = sorted(f.stem for f in SHAPES.glob("*.json"))
    p.add_argument("--shape", required=True, choices=names, help="benchmarks/shapes/NAME.json")
    p.add_argument("--out", type=Path, required=True, help="the HF folder to write")
    p.add_argument("--layers", type=int, default=0, help="layers (0: the shape's)")
    p.add_argument("--vocab", type=int, default=0, help="vocabulary size (0: the shape's)")
    p.add_argument("--hidden", type=int, default=0, help="width (0: the shape's)")
    p.add_argument("--dtype", default="", choices=("", "float32", "bfloat16", "float16"), help="'': the shape's")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    sys.path.insert(0, str(REPO / "src"))  # otbflow.models.policy's characters, without an install
    res = build(a.shape, a.out, a.layers, a.vocab, a.hidden, a.dtype, a.seed)
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
