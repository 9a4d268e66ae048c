"""Prompts as the engines read them: the prompts table's rows rendered to token ids with the
policy's tokenizer (``render_prompts``, ``render_table``; the chat template with ``task.chat``,
``use_chat``), checked against the policy's positions before they render (``check_prompt_chars``:
their characters, the bound of ``otbflow.models.tasks.prompt_char_limit``) and after
(``check_prompt_lengths``), and how they were rendered, for the outputs' metadata
(``prompt_metadata``). Chat rendering and stop tokens: docs/data.md, "A real model and dataset"."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from otbflow.models.tasks import PROMPT_CHARS_PER_POSITION, chat_setting, prompt_char_limit, prompt_chars
from otbflow.runtime.policy_folder import model_config, model_positions


def check_prompt_chars(prompts, policy: str | Path) -> None:
    """Raise ValueError, before any tokenizer sees them, where a prompt of the table ``prompts``
    (schemas.PROMPTS: its text or its messages' contents) has more characters than
    ``prompt_char_limit`` of the positions of ``policy``'s config.json, naming the first such
    prompt, the policy and how many there are: a 10 MB prompt otherwise takes the tokenizer tens
    of seconds and GBs before ``check_prompt_lengths`` refuses it. Nothing is checked where the
    config names no positions."""
    found = model_positions(model_config(policy))
    if found is None:
        return
    positions, name = found
    limit = prompt_char_limit(positions)
    texts, messages = prompts["prompt"].to_list(), prompts["messages"].to_list()
    # messages' contents are never longer than their JSON: parsed only where that is past the bound
    sizes = [max(len(t), prompt_chars(m) if len(m) > limit else 0) for t, m in zip(texts, messages)]
    long = [i for i, n in enumerate(sizes) if n > limit]
    if long:
        i = long[0]
        raise ValueError(
            f"prompt {prompts['prompt_id'][i]}: {sizes[i]:,} characters, more than {limit:,} "
            f"({PROMPT_CHARS_PER_POSITION} per position of the policy's {positions}, {Path(policy) / 'config.json'}: "
            f"{name}): no such prompt fits its positions; {len(long)} of {len(sizes)} prompts are too long. "
            "Drop or shorten those prompts in the dataset"
        )


def check_prompt_lengths(
    prompt_ids: list[list[int]], ids: list, max_new_tokens: int, key: str, policy: str | Path
) -> None:
    """Raise ValueError, before any generation, where a rendered prompt (``prompt_ids``, with the
    prompt ids ``ids``) and ``max_new_tokens`` (the config key ``key``) need more positions than
    the policy's config.json gives, naming the first such prompt, its length and how many there
    are. Nothing is checked where the config names no positions."""
    found = model_positions(model_config(policy))
    if found is None:
        return
    positions, name = found
    room = positions - max_new_tokens
    long = [i for i, p in enumerate(prompt_ids) if len(p) > room]
    if long:
        i = long[0]
        raise ValueError(
            f"prompt {ids[i]}: {len(prompt_ids[i])} tokens rendered + {key} {max_new_tokens} = "
            f"{len(prompt_ids[i]) + max_new_tokens} positions, more than the policy's {positions} "
            f"({Path(policy) / 'config.json'}: {name}); {len(long)} of {len(prompt_ids)} prompts are too long "
            f"(the longest: {max(len(prompt_ids[j]) for j in long)} tokens). Lower {key}, or drop or shorten "
            "those prompts in the dataset"
        )


def use_chat(cfg: DictConfig, tok) -> bool:
    """task.chat resolved for this tokenizer ('auto': when it has a chat template)."""
    mode = chat_setting(cfg)
    has_template = bool(getattr(tok, "chat_template", None))
    if mode == "true" and not has_template:
        raise ValueError(
            "task.chat is true but the policy's tokenizer has no chat template "
            "(set task.chat to auto or false, or use a tokenizer with one)"
        )
    return has_template if mode == "auto" else mode == "true"


def render_prompts(
    tok, prompts: list[str], messages: list[str] | None, chat: bool, system_prompt: str | None = None
) -> list[list[int]]:
    """Token ids of each prompt. ``chat``: its messages (a JSON list of {role, content}; None: one
    user message with the prompt text), after a ``system_prompt`` message unless they have a
    system message, through ``apply_chat_template(add_generation_prompt=True)``; else the text."""
    out = []
    for i, text in enumerate(prompts):
        msgs = json.loads(messages[i]) if messages is not None else [{"role": "user", "content": text}]
        if not chat:
            if len(msgs) != 1 or msgs[0]["role"] != "user":
                raise ValueError(
                    f"prompt {i} has chat messages ({', '.join(m['role'] for m in msgs)}), which need "
                    "the chat template: set task.chat to auto or true with a tokenizer that has one"
                )
            out.append(tok(text, add_special_tokens=False)["input_ids"])
            continue
        if system_prompt is not None and not any(m["role"] == "system" for m in msgs):
            msgs = [{"role": "system", "content": system_prompt}, *msgs]
        rendered = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        out.append(tok(rendered, add_special_tokens=False)["input_ids"])
    return out


def render_table(cfg: DictConfig, tok, prompts, policy: str | Path) -> tuple[list[list[int]], bool]:
    """Token ids of a prompts table's rows (schemas.PROMPTS: prompt, messages), and whether the
    chat template rendered them (task.chat resolved for ``tok``, the tokenizer of ``policy``),
    after ``check_prompt_chars`` against ``policy``."""
    check_prompt_chars(prompts, policy)
    chat = use_chat(cfg, tok)
    return render_prompts(
        tok, prompts["prompt"].to_list(), prompts["messages"].to_list(), chat, cfg.task.system_prompt
    ), chat


def prompt_metadata(cfg: DictConfig, tok, chat: bool, stops: list[int]) -> dict[str, Any]:
    """How the prompts were rendered and when responses stop, for the Parquet metadata."""
    return {
        "chat": chat,
        "system_prompt": cfg.task.system_prompt if chat else None,
        "stop_token_ids": stops,
        "stop_tokens": tok.convert_ids_to_tokens(stops),
    }
