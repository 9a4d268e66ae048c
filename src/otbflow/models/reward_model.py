"""Learned reward models (algorithms.md §9): a local HF ``AutoModelForSequenceClassification`` with
one label scores (prompt, response). ``check_reward_model`` validates a folder from its config.json
and tokenizer files alone (before any generation; no torch, no weights); ``RewardModel`` loads one
and ``score`` returns one float64 per pair. The scoring contract (rendering, truncation, padding,
the last-token score): docs/rewards.md.

This module imports no otbflow module and no torch at its top level: the config module may import
``check_reward_model``; the caller passes the device (``otbflow.models.policy.device()``)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from otbflow.runtime.policy_folder import VOCABULARY_FILES

log = logging.getLogger("otbflow.models.reward_model")

# A tokenizer's model_max_length above this is HF's "unknown" (VERY_LARGE_INTEGER), not a limit.
UNSET_MAX_LENGTH = 10**9


def config_num_labels(config: dict[str, Any]) -> int:
    """The number of labels HF reads from a config.json: ``num_labels``, else the length of
    ``id2label``, else HF's default of 2."""
    if "num_labels" in config:
        return int(config["num_labels"])
    if config.get("id2label") is not None:
        return len(config["id2label"])
    return 2


def check_reward_model(path: str | Path) -> None:
    """Raise ValueError, naming ``path`` and what is needed, unless it is a folder with a
    config.json of a sequence-classification architecture (``architectures`` names a
    ``*ForSequenceClassification``) with one label, and tokenizer files. Reads config.json and
    the folder's file names only: cheap enough to run before any generation."""
    path = Path(path)
    need = "a local HF AutoModelForSequenceClassification folder with num_labels = 1"
    if not path.is_dir():
        raise ValueError(f"reward model {path}: no such folder ({need} is needed)")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"reward model {path}: no config.json, not an HF model folder ({need} is needed)")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"reward model {path}: config.json is not valid JSON ({e})") from e
    architectures = config.get("architectures") or []
    if not any(str(a).endswith("ForSequenceClassification") for a in architectures):
        found = ", ".join(architectures) if architectures else "none"
        raise ValueError(
            f"reward model {path}: config.json's architectures ({found}) name no *ForSequenceClassification "
            f"model; a causal LM or base model has no trained score head ({need} is needed)"
        )
    n = config_num_labels(config)
    if n != 1:
        raise ValueError(
            f"reward model {path}: config.json has {n} labels; a reward model gives one scalar score "
            f"(num_labels = 1, one entry in id2label)"
        )
    if not any((path / f).is_file() for f in VOCABULARY_FILES):
        raise ValueError(
            f"reward model {path}: no tokenizer files (one of {', '.join(VOCABULARY_FILES)}); the reward "
            "model's own tokenizer renders and encodes what it scores"
        )


def max_length_of(tok, config) -> int:
    """The longest input the reward model reads: the smaller of the tokenizer's ``model_max_length``
    (where set) and the config's ``max_position_embeddings`` or ``n_positions``."""
    limits = [int(tok.model_max_length)] if 0 < tok.model_max_length < UNSET_MAX_LENGTH else []
    for key in ("max_position_embeddings", "n_positions"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            limits.append(value)
            break
    if not limits:
        raise ValueError(
            "the reward model's maximum length is unknown: its tokenizer has no model_max_length and its "
            "config no max_position_embeddings or n_positions; pass max_length"
        )
    return min(limits)


class RewardModel:
    """A loaded reward model: ``score(prompts, responses)`` gives one float64 per pair.

    - Rendering (``render``): the reward model's own chat template over a user message (the prompt)
      and an assistant message (the response) where its tokenizer has one, else the prompt text
      followed by the response text. Chat-rendered text is encoded without the tokenizer's special
      tokens (the template writes them), plain text with them (a BOS where the tokenizer adds one).
    - Truncation: to ``max_length`` tokens (``max_length_of``), keeping the end (left truncation;
      the tokenizer keeps the special tokens it adds). The score is read at the last token, so the
      end, where the response is, must be kept; the start of the prompt is what goes. How many
      inputs were cut is logged.
    - Padding: to the right, with the tokenizer's pad token; a tokenizer without one pads with its
      eos token (logged, and set as the model config's pad_token_id); one with neither is refused.
    - The score: the score head (``score``) over the final hidden state at the last real token,
      found from the attention mask, never from pad_token_id (HF's own pooling takes the last token
      that is not the pad id, which is wrong where pad = eos and the text ends with eos). Position
      ids come from the attention mask, so a batch equals its inputs scored one by one whatever the
      padding side. Computed in ``dtype``, returned as Python floats (float64).
    """

    def __init__(self, path: str | Path, device: Any = "cpu", dtype: str = "float32", max_length: int | None = None):
        """Load the folder ``path`` (checked by ``check_reward_model`` first) onto ``device`` (the
        stage passes ``otbflow.models.policy.device()``), in eval mode, its parameters in ``dtype``."""
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from otbflow.io import check_safetensors  # not at the top: the config check imports this module

        check_reward_model(path)
        check_safetensors(path)
        self.path = Path(path)
        tok = AutoTokenizer.from_pretrained(self.path, local_files_only=True)
        if tok.pad_token_id is None:
            if tok.eos_token_id is None:
                raise ValueError(
                    f"reward model {self.path}: its tokenizer has neither a pad token nor an eos token to pad "
                    "batches with; give it a pad_token (tokenizer_config.json)"
                )
            tok.pad_token = tok.eos_token
            log.warning(
                "reward model %s: the tokenizer has no pad token; padding with its eos token %r (id %d)",
                self.path,
                tok.eos_token,
                tok.eos_token_id,
            )
        tok.padding_side = "right"
        tok.truncation_side = "left"
        model, info = AutoModelForSequenceClassification.from_pretrained(
            self.path, local_files_only=True, dtype=getattr(torch, dtype), output_loading_info=True
        )
        if info.get("missing_keys"):
            missing = ", ".join(sorted(info["missing_keys"])[:5])
            raise ValueError(
                f"reward model {self.path}: weights missing from the checkpoint ({missing}); they would be "
                "random, so the scores would mean nothing"
            )
        head = getattr(model, "score", None)
        if not isinstance(head, torch.nn.Linear) or head.out_features != 1:
            raise ValueError(
                f"reward model {self.path}: {type(model).__name__} has no last-token score head (a Linear "
                "`score` with one output, as the decoder models GPT-2, Llama, Qwen2, Mistral have)"
            )
        model.config.pad_token_id = tok.pad_token_id
        self.model = model.to(device).eval()
        self.tokenizer = tok
        self.device = torch.device(device)
        self.max_length = max_length if max_length is not None else max_length_of(tok, model.config)
        self.chat = bool(getattr(tok, "chat_template", None))

    def render(self, prompt: str, response: str) -> str:
        """The text the reward model reads for (prompt, response)."""
        if not self.chat:
            return prompt + response
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
        return self.tokenizer.apply_chat_template(messages, tokenize=False)

    def encode(self, texts: list[str]) -> dict:
        """Right-padded, left-truncated token ids and attention mask of ``texts`` (torch tensors)."""
        return self.tokenizer(
            texts,
            add_special_tokens=not self.chat,
            truncation=True,
            max_length=self.max_length,
            padding=True,
            return_tensors="pt",
        )

    def score_ids(self, input_ids, attention_mask):
        """The score of each row of a padded batch, at its last real token: a float tensor [B]."""
        import torch

        mask = attention_mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        hidden = self.model.base_model(
            input_ids=input_ids.to(self.device), attention_mask=mask, position_ids=positions, use_cache=False
        ).last_hidden_state
        last = (torch.arange(mask.shape[1], device=self.device) * mask).argmax(-1)
        rows = torch.arange(mask.shape[0], device=self.device)
        return self.model.score(hidden[rows, last])[:, 0]

    def score(self, prompts: list[str], responses: list[str], batch_size: int = 8) -> list[float]:
        """One score per (prompt, response), in order; batches of ``batch_size`` texts of similar
        lengths (sorted by length, which changes no score)."""
        import torch

        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, not {batch_size}")
        if not prompts:  # a shard that dynamic sampling left empty: nothing to score
            return []
        texts = [self.render(p, r) for p, r in zip(prompts, responses)]
        lengths = [len(ids) for ids in self.tokenizer(texts, add_special_tokens=not self.chat)["input_ids"]]
        empty = [i for i, n in enumerate(lengths) if n == 0]
        if empty:
            raise ValueError(
                f"reward model {self.path}: pairs {empty[:5]} render to no tokens (empty prompt and response "
                "without a chat template): there is no last token to score"
            )
        cut = sum(n > self.max_length for n in lengths)
        if cut:
            log.warning(
                "reward model %s: %d of %d inputs are longer than its %d tokens; their starts were dropped",
                self.path,
                cut,
                len(texts),
                self.max_length,
            )
        order = sorted(range(len(texts)), key=lambda i: lengths[i])
        scores = [0.0] * len(texts)
        with torch.inference_mode():
            for start in range(0, len(order), batch_size):
                chunk = order[start : start + batch_size]
                enc = self.encode([texts[i] for i in chunk])
                values = self.score_ids(enc["input_ids"], enc["attention_mask"]).double().cpu().tolist()
                for i, v in zip(chunk, values):
                    scores[i] = float(v)
        return scores
