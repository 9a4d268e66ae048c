"""Policies: the built-in tiny character-level GPT-2, and loading any local HF causal LM.

The tiny tokenizer is a ``tokenizers`` WordLevel model over single characters, wrapped in
``PreTrainedTokenizerFast`` and saved next to the model, so that ``AutoTokenizer`` and
``AutoModelForCausalLM`` reload the folder offline like any HF checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from omegaconf import DictConfig

CHARS = "0123456789+-*/=;#:. abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ\n"
SPECIAL = ["<pad>", "<eos>", "<unk>"]


def build_char_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL + list(dict.fromkeys(CHARS)))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(""), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>", padding_side="left")


def build_tiny_model(mcfg: DictConfig, tokenizer, seed: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=mcfg.n_positions, n_embd=mcfg.n_embd,
                        n_layer=mcfg.n_layer, n_head=mcfg.n_head, bos_token_id=tokenizer.eos_token_id,
                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def set_threads() -> None:
    """Use the CPUs Slurm gave us (jobs are not CPU-pinned), else the torch default."""
    n = os.environ.get("SLURM_CPUS_PER_TASK") or os.environ.get("OTBFLOW_THREADS")
    if n:
        torch.set_num_threads(int(n))


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_policy(path: str | Path, dtype: str = "float32"):
    """(model in eval mode on the default device, tokenizer) from a local HF folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: not an HF model folder (no config.json)")
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True,
                                                 dtype=getattr(torch, dtype)).to(device())
    model.eval()
    return model, tok


def encode(tok, texts: list[str]) -> list[list[int]]:
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
