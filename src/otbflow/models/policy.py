"""Policies: the small models the bootstrap builds (``model.arch`` gpt2, llama or qwen2;
``model.tokenizer`` char or a byte-level BPE with a ChatML chat template), saved as HF folders
that reload offline, and loading any local HF causal LM. The architectures and tokenizers:
docs/data.md, "A real model and dataset" (built policies)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from omegaconf import DictConfig

from otbflow.io import check_safetensors, fault_point
from otbflow.models.architectures import ARCHITECTURES
from otbflow.runtime import resident
from otbflow.runtime.policy_folder import VOCABULARY_FILES, check_not_pruned, check_tokenizer, policy_weights

CHARS = "0123456789+-*/=;#:. abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ\n"
SPECIAL = ["<pad>", "<eos>", "<unk>"]
# ChatML, as Qwen2.5's template without its default system message and tool calls.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
BPE_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_char_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL + list(dict.fromkeys(CHARS)))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(""), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", padding_side="left"
    )


def build_bpe_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE (GPT-2 pre-tokenisation, any byte string encodes) trained on ``texts``,
    with the ChatML special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=BPE_SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        padding_side="left",
        chat_template=CHATML_TEMPLATE,
    )


def build_tokenizer(mcfg: DictConfig, texts: list[str]):
    """``model.tokenizer``: 'char', or 'bpe' trained on ``texts`` (the task's prompts and responses)."""
    if mcfg.tokenizer == "char":
        return build_char_tokenizer()
    return build_bpe_tokenizer(texts, mcfg.vocab_size)


def tiny_model_config(mcfg: DictConfig, vocab_size: int, eos: int | None = None, pad: int | None = None):
    """The HF config of the ``model.arch`` model of the configured size (``build_tiny_model``)."""
    from transformers import GPT2Config, LlamaConfig, Qwen2Config

    arch = mcfg.arch
    if arch == "gpt2":
        return GPT2Config(
            vocab_size=vocab_size,
            n_positions=mcfg.n_positions,
            n_embd=mcfg.n_embd,
            n_layer=mcfg.n_layer,
            n_head=mcfg.n_head,
            bos_token_id=eos,
            eos_token_id=eos,
            pad_token_id=pad,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    common = dict(
        vocab_size=vocab_size,
        hidden_size=mcfg.n_embd,
        intermediate_size=4 * mcfg.n_embd,
        num_hidden_layers=mcfg.n_layer,
        num_attention_heads=mcfg.n_head,
        num_key_value_heads=mcfg.n_kv_head or mcfg.n_head,
        max_position_embeddings=mcfg.n_positions,
        bos_token_id=pad,
        eos_token_id=eos,
        pad_token_id=pad,
        attention_dropout=0.0,
    )
    if arch == "llama":
        return LlamaConfig(**common, tie_word_embeddings=False)
    if arch == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=True)
    raise ValueError(f"model.arch: unknown architecture {arch!r}; one of {', '.join(ARCHITECTURES)}")


def tiny_vocab_size(mcfg: DictConfig) -> int:
    """The built tokenizer's vocabulary: the char tokenizer's, or model.vocab_size for BPE (at most:
    the trainer stops early when the texts have fewer merges)."""
    return len(SPECIAL) + len(dict.fromkeys(CHARS)) if mcfg.tokenizer == "char" else mcfg.vocab_size


def build_tiny_model(mcfg: DictConfig, tokenizer, seed: int):
    """A randomly initialised ``model.arch`` model of the configured size for ``tokenizer``."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.manual_seed(seed)
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id
    model = AutoModelForCausalLM.from_config(tiny_model_config(mcfg, len(tokenizer), eos, pad))
    # Stop on every end token the tokenizer has (ChatML: <|im_end|> and <|endoftext|>), as Qwen2.5 does.
    stops = list(dict.fromkeys(i for i in (eos, pad if tokenizer.chat_template else None) if i is not None))
    model.generation_config = GenerationConfig(
        eos_token_id=stops if len(stops) > 1 else stops[0], pad_token_id=pad, bos_token_id=model.config.bos_token_id
    )
    return model


def set_threads() -> None:
    """Use the CPUs Slurm gave us (jobs are not CPU-pinned), else the torch default."""
    n = os.environ.get("SLURM_CPUS_PER_TASK") or os.environ.get("OTBFLOW_THREADS")
    if n:
        torch.set_num_threads(int(n))


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_tokenizer(path: str | Path):
    """The tokenizer of a local HF folder, left-padding (batched generation), with a pad token
    (the eos token where the checkpoint has none). A folder without a tokenizer's vocabulary, or
    whose tokenizer is far smaller than the model's embedding, is refused (``check_tokenizer``).
    A warm worker keeps it for the jobs after (``otbflow.runtime.resident.tokenizer``)."""
    if resident.ENABLED:
        return resident.tokenizer(path, _load_tokenizer)
    return _load_tokenizer(path)


def _load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    if not any((Path(path) / f).is_file() for f in VOCABULARY_FILES):
        raise ValueError(f"{path}: no tokenizer files (one of {', '.join(VOCABULARY_FILES)})")
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    check_tokenizer(tok, path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def load_policy(path: str | Path, dtype: str = "float32", cast_to: torch.dtype | None = None):
    """(model in eval mode on the default device, tokenizer) from a local HF folder, loaded at
    ``dtype``. ``cast_to``: its floating-point parameters then cast to that precision
    (``cast_parameters``) on the host, before the move, so that the device holds only the cast copy
    (a 32B policy: 66 GB in bf16 instead of 131 GB in fp32)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: not an HF model folder (no config.json)")
    check_not_pruned(path)
    check_safetensors(path)
    if resident.ENABLED:  # a warm worker: the resident module where it fits (otbflow.runtime.resident)
        model, tok = resident.policy(path, dtype, cast_to, _load_resident)
    else:
        t0 = time.perf_counter()
        model, tok = _load_policy(path, dtype, cast_to)
        resident.loaded(None, sum(f.stat().st_size for f in policy_weights(path)), False, time.perf_counter() - t0)
    fault_point("policy:loaded")  # the load, its digests and copies done; no stage's timer has begun
    return model, tok


def _load_policy(path: Path, dtype: str, cast_to: torch.dtype | None):
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=getattr(torch, dtype))
    if cast_to is not None:
        cast_parameters(model, cast_to)
    model = model.to(device())
    model.eval()
    return model, tok


def _load_resident(path: Path, dtype: str, cast_to: torch.dtype | None):
    """(model, tokenizer, the folder's manifest entries) as ``_load_policy`` gives the first two,
    for a warm worker's first load of a policy: the module built without its weights (transformers'
    ``no_init_weights``: its parameters allocated, its buffers computed, the folder's config and
    generation config), then every tensor read into it in place and hashed as it is read
    (``resident.load_weights_in_place``, each checked against the folder's manifest where it has
    one). No file is mapped: the process never holds the file's pages beside the module (a 0.5B
    policy's fp32 file is 2 GB beside its 1 GB bf16 module), and the digests need no second pass.
    A load at fp32 cast to ``cast_to`` builds the module at ``cast_to`` at once (fp32 holds every
    file's values exactly, so the values are the same) and never holds the fp32 model.
    A folder without safetensors weights is loaded by ``_load_policy``, its entries None."""
    if not list(path.glob("*.safetensors")):
        return (*_load_policy(path, dtype, cast_to), None)
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    from transformers.initialization import no_init_weights

    from otbflow.runtime import manifest

    tok = load_tokenizer(path)
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    # fp32 holds every file's values exactly: loaded at fp32 and cast after is cast once, so the
    # module is built at ``cast_to`` (never an fp32 copy of the model beside it)
    build = cast_to if cast_to is not None and dtype == "float32" else getattr(torch, dtype)
    with no_init_weights():  # which also leaves out the tying of the output head: done here
        model = AutoModelForCausalLM.from_config(config, dtype=build)
    model.tie_weights()
    model.config.dtype = getattr(torch, dtype)  # as from_pretrained at ``dtype`` leaves it
    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path, local_files_only=True)
    listed = manifest.read(path)
    tensors, _ = resident.load_weights_in_place(model, path, want=listed["tensors"] if listed else None)
    if cast_to is not None:
        cast_parameters(model, cast_to)
    model = model.to(device())
    model.eval()
    return model, tok, tensors


def trainer_dtype(train_cfg: DictConfig) -> torch.dtype:
    """The precision the train stage computes log pi at: DeepSpeed's bf16 with train.bf16, else
    fp32. The features stage computes pi_old at it too (model.dtype is for generation)."""
    return torch.bfloat16 if train_cfg.bf16 else torch.float32


def cast_parameters(model, dtype: torch.dtype):
    """Cast the floating-point parameters, not the buffers (rotary inv_freq stays fp32), as
    DeepSpeed's bf16 engine casts the module it trains (engine._cast_module_mixed_precision)."""
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
    return model


def encode(tok, texts: list[str]) -> list[list[int]]:
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
