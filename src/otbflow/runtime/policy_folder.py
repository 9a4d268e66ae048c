"""A policy folder (an HF causal-LM folder: config.json, weights, tokenizer files) and what every
reader asks of it, in one place: which of its files hold weights (``WEIGHTS``, ``WEIGHT_SUFFIXES``,
``policy_weights``) and which a tokenizer (``VOCABULARY_FILES``, ``TOKENIZER_FILES``), its config
(``model_config``), positions (``model_positions``) and architecture (``architecture``), the digests
that say whether two folders hold the same tokenizer (``tokenizer_digest``; the weights':
``otbflow.runtime.manifest``), the checks before any job reads one
(``check_policy_folder``, ``check_tokenizer``) and the marker of a folder whose heavy files the
retention policy deleted (``PRUNED``, ``pruned_record``, ``check_not_pruned``;
``otbflow.runtime.retention``).

Reads file names, JSON and bytes only: importing it imports no torch and no other otbflow module
(the Snakefile's retention check and the config check import it)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

WEIGHTS = (".safetensors", ".bin")
"""The weight files transformers loads a policy from (safetensors, or PyTorch's .bin): what a
policy's manifest lists (``otbflow.runtime.manifest``)."""
DELTA = "weights.delta"
"""What changed since the policy before, element by element (``otbflow.runtime.delta``): a
safetensors file under a name no model loader takes for weights."""
WEIGHT_SUFFIXES = (*WEIGHTS, ".pt", ".pth", ".gguf", ".delta")
"""Every file of a policy folder that holds weights, those loaded and others a folder may bring;
the rest (config, tokenizer) is small: what the retention policy deletes (``policy_weights``)."""

# A tokenizer's vocabulary is in one of these (a fast tokenizer, a slow BPE's vocab.json with its
# merges, SentencePiece, WordPiece); a folder with none, or with tokenizer_config.json alone, gives
# AutoTokenizer an empty tokenizer of length 1, with which generation fails deep in the model.
VOCABULARY_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model", "vocab.txt", "spiece.model")
TOKENIZER_FILES = (
    *VOCABULARY_FILES,
    "merges.txt",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
"""Every file of a tokenizer that transformers saves or reads: a trained policy gets its input's,
byte for byte (``otbflow.training.publish.save_policy``)."""
# config.json keys that give a causal LM's positions (transformers' names across architectures).
POSITION_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length")


def model_config(path: str | Path) -> dict[str, Any]:
    """The config.json of the HF model folder ``path``; ValueError naming the folder where it is
    no folder, has no config.json or one that is not a JSON object."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{path}: no such folder (a local HF causal-LM folder is needed)")
    file = path / "config.json"
    if not file.is_file():
        raise ValueError(f"{path}: no config.json, not an HF model folder")
    try:
        config = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file}: not a JSON object")
    return config


def model_positions(config: dict[str, Any]) -> tuple[int, str] | None:
    """(the positions a causal LM reads, prompt and response together, the config.json key that
    says so), or None where its config names none (``POSITION_KEYS``)."""
    for key in POSITION_KEYS:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value, key
    return None


VOLATILE = ("dtype", "torch_dtype", "transformers_version", "_name_or_path")
"""config.json keys that say how a folder was saved, not what it holds: another value does not
make another architecture (each load states its own dtype; the stop tokens are read per job)."""


def architecture(path: Path) -> str:
    """The folder's config.json without ``VOLATILE`` keys, canonical: what a resident module or
    engine must match to take the folder's weights."""
    config = json.loads((Path(path) / "config.json").read_text())
    return json.dumps({k: v for k, v in config.items() if k not in VOLATILE}, sort_keys=True)


def publishes_bf16(cfg) -> bool:
    """Whether a run's train jobs publish their policies in bf16 (2 bytes a parameter) rather than
    fp32: where the policy computes in bf16 (``model.dtype``), trains in bf16 (``train.bf16``) and
    its fp32 master weights go on in the AdamW state the train jobs write (not
    ``train.reset_optimizer``). Every reader computes in ``model.dtype``: the bf16 policy is what
    it held after casting the fp32 one (``otbflow.training.publish.published_dtype``)."""
    return bool(cfg.train.bf16) and not cfg.train.reset_optimizer and cfg.model.dtype == "bfloat16"


def check_policy_folder(path: str | Path) -> None:
    """Raise ValueError naming ``path`` unless it is an HF model folder (config.json) with a
    tokenizer's vocabulary beside it (``VOCABULARY_FILES``). Reads config.json and file names
    only (no torch, no weights): the config check runs it on model.path before any job."""
    model_config(path)
    if not any((Path(path) / f).is_file() for f in VOCABULARY_FILES):
        raise ValueError(
            f"{path}: no tokenizer files (one of {', '.join(VOCABULARY_FILES)}): the policy's tokenizer "
            "renders the prompts and decodes the responses (copy it beside the weights)"
        )


def check_tokenizer(tok, path: str | Path) -> None:
    """Raise ValueError unless the tokenizer loaded from ``path`` has at least half as many tokens
    as the model's embedding has rows (config.json's vocab_size; checkpoints pad the embedding by
    a few hundred rows at most): fewer is a wrong or broken tokenizer, e.g. the empty one that
    AutoTokenizer builds from a folder without its vocabulary files."""
    vocab = model_config(path).get("vocab_size") if (Path(path) / "config.json").is_file() else None
    if isinstance(vocab, int) and vocab > 0 and 2 * len(tok) < vocab:
        raise ValueError(
            f"{path}: its tokenizer has {len(tok)} tokens for an embedding of {vocab} (config.json vocab_size): "
            "not this model's tokenizer, or a folder without its vocabulary files "
            f"({', '.join(VOCABULARY_FILES)})"
        )


def files_digest(folder: str | Path, suffixes: tuple[str, ...]) -> str:
    """sha256 over the names and bytes of ``folder``'s files with these suffixes, in name order."""
    h = hashlib.sha256()
    for path in sorted(p for p in Path(folder).iterdir() if p.suffix in suffixes or p.name in suffixes):
        h.update(path.name.encode())
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                h.update(chunk)
    return h.hexdigest()


def tokenizer_digest(folder: str | Path) -> str:
    """sha256 of an HF folder's tokenizer files (``TOKENIZER_FILES``): what a warm worker's
    resident module or engine must match to take the folder's weights. The weights' own digests
    are the manifest's (``otbflow.runtime.manifest``)."""
    return files_digest(folder, TOKENIZER_FILES)


def policy_weights(folder: str | Path) -> list[Path]:
    return sorted(p for p in Path(folder).iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))


PRUNED = "PRUNED.json"
"""In a policy or optimizer folder whose heavy files the retention policy deleted: what was
deleted and why (``otbflow.runtime.retention.prune_folder``)."""


def pruned_record(folder: str | Path) -> dict | None:
    """The PRUNED.json of a pruned folder, None for a complete one."""
    p = Path(folder) / PRUNED
    return json.loads(p.read_text()) if p.is_file() else None


def check_not_pruned(folder: str | Path) -> None:
    """Stop with the reason where a stage would read a folder whose heavy files retention deleted."""
    record = pruned_record(folder)
    if record is not None:
        raise FileNotFoundError(
            f"{folder}: the retention policy deleted its {record['what']} ({record['reason']}; see "
            f"{Path(folder) / PRUNED}). Rerun the train job that made it (snakemake --forcerun), or keep such "
            "outputs with retention.policy_every / retention.optimizer before a change that reads them."
        )
