"""The generation-backend interface shared by the rollout, evaluate and bootstrap stages: ``Sample``
(one generated response), ``Sampling`` (what to generate), ``Backend`` (implemented by
``otbflow.engines.hf`` and ``otbflow.engines.vllm``, which depend on this module, never the other
way round; ``open_backend`` builds one by name), prompt rendering (``render_prompts``) and stop
tokens (``stop_token_ids``), and the checks of a policy's positions against the prompts'
characters before they render (``check_prompt_chars``, in ``render_table``; the shard stage's
``prompt_char_limit``) and against the rendered prompts (``check_prompt_lengths``). What a policy
folder holds and the checks of it before any job reads it: ``otbflow.runtime.policy_folder``. Chat
rendering and stop tokens: docs/data.md, "A real model and dataset"."""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from omegaconf import DictConfig

from otbflow.registry import Entry, Registry, Requirement
from otbflow.runtime.policy_folder import model_config, model_positions


@dataclass(frozen=True)
class BackendEntry(Entry):
    """A generation backend: ``obj`` is where its class lives, "module:Class" (loaded by name: vLLM
    is not importable in every environment); its options are the rollout.* keys it reads, and
    ``samples`` those of them that change its samples (the others change only how it runs).
    otbflow.pipeline's rollout, evaluate and variance_pool stages read ``sample_keys`` and
    ``run_keys``."""

    samples: tuple[str, ...] = ()

    @property
    def target(self) -> str:
        return self.obj

    @property
    def sample_keys(self) -> tuple[str, ...]:
        return tuple(f"rollout.{k}" for k in self.samples)

    @property
    def run_keys(self) -> tuple[str, ...]:
        return tuple(f"rollout.{k}" for k in self.options if k not in self.samples)


BACKENDS = Registry("backend", "rollout", entry=BackendEntry)
"""The generation engines by ``rollout.backend`` name (the config takes its choices from here, so
this module imports neither the config nor the engines). Add one with
``BACKENDS.register("name", options=..., samples=..., doc=...)("module:Class")``."""
# every row draws its own noise: the batch size changes memory and speed (samples only by rounding)
# and so does the decode loop (rollout.hf_decode)
BACKENDS.register("hf", options=("batch_size", "hf_decode"), doc="transformers' generate, CPU or GPU")(
    "otbflow.engines.hf:HFBackend"
)
# tensor parallelism changes the reductions' order
BACKENDS.register(
    "vllm",
    options=("tensor_parallel_size", "gpu_memory_utilization", "kv_cache_gib", "enforce_eager"),
    samples=("tensor_parallel_size",),
    doc="vLLM, GPU only, own environment",
)("otbflow.engines.vllm:VLLMBackend")

ARCHITECTURES = Registry("architecture", "model")
"""The architectures of the models otbflow builds (``model.arch``), each the name of its
transformers model class (``otbflow.models.policy.tiny_model_config`` builds its config)."""
ARCHITECTURES.register(
    "gpt2",
    requires=(
        Requirement(
            "model.n_kv_head",
            "0 (no grouped-query attention)",
            lambda n_kv_head, cfg: n_kv_head in (0, cfg.model.n_head),
        ),
    ),
    doc="GPT-2",
)("GPT2LMHeadModel")
ARCHITECTURES.register("llama", options=("n_kv_head",), doc="Llama, untied embeddings")("LlamaForCausalLM")
ARCHITECTURES.register("qwen2", options=("n_kv_head",), doc="Qwen2: q/k/v biases, tied embeddings")("Qwen2ForCausalLM")

TOKENIZERS = Registry("tokenizer", "model")
"""The tokenizers of the models otbflow builds (``model.tokenizer``), each the name of its
builder in ``otbflow.models.policy`` (``build_tokenizer``)."""
TOKENIZERS.register(
    "char",
    requires=(
        Requirement(
            "task.chat",
            "'auto' or 'false' when the bootstrap builds the policy (it has no chat template)",
            # a model.path policy brings its own tokenizer; the bootstrap builds for the built-in task only
            lambda chat, cfg: (
                cfg.model.path is not None or cfg.task.name != "arithmetic" or chat_setting(cfg) != "true"
            ),
        ),
    ),
    doc="one token per character, no chat template",
)("build_char_tokenizer")
TOKENIZERS.register(
    "bpe", options=("vocab_size",), doc="a byte-level BPE trained on the task's text, with a ChatML chat template"
)("build_bpe_tokenizer")

HF_DECODE_MODES = ("auto", "eager", "static", "compiled")
"""The hf backend's decode loops (``rollout.hf_decode``; ``otbflow.engines.hf.generation_config``)."""


@dataclass
class Sample:
    prompt_index: int
    sample_idx: int
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str


@dataclass(frozen=True)
class Sampling:
    n: int = 1
    """Samples per prompt (1 when greedy)."""
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 48
    greedy: bool = False
    seed: int = 0
    min_p: float = 0.0
    """rho of min-p sampling after the temperature (rollout.min_p; otbflow.algorithms.vocab_pruning). 0: none."""


class Backend(Protocol):
    name: str
    stops: list[int]
    """Token ids that end a response (``stop_token_ids`` of the policy)."""

    def generate(self, prompt_ids: list[list[int]], sampling: Sampling) -> list[Sample]:
        """Responses to each prompt, ordered by (prompt_index, sample_idx)."""

    def metadata(self, sampling: Sampling) -> dict[str, Any]:
        """Versions and engine/sampling arguments, for the output's Parquet metadata."""


def open_backend(cfg: DictConfig, policy: str) -> Backend:
    """The ``rollout.backend`` engine over the HF folder ``policy`` (model loaded once)."""
    module, cls = BACKENDS[cfg.rollout.backend].target.split(":")
    return getattr(importlib.import_module(module), cls)(cfg, policy)


def stop_token_ids(tok, policy: str | Path | None = None) -> list[int]:
    """The tokenizer's eos id, then the eos ids of ``policy``'s generation_config.json."""
    gen = Path(policy) / "generation_config.json" if policy is not None else None
    eos = json.loads(gen.read_text()).get("eos_token_id") if gen is not None and gen.is_file() else None
    return stops_of(tok, eos, policy)


def stops_of(tok, generation_eos: int | list[int] | None, where: Any = "the policy") -> list[int]:
    """The tokenizer's eos id, then ``generation_eos`` (a generation config's eos_token_id: an id,
    a list of them or None), without repeats."""
    ids = [tok.eos_token_id] if tok.eos_token_id is not None else []
    ids += (
        generation_eos if isinstance(generation_eos, list) else [generation_eos] if generation_eos is not None else []
    )
    if not ids:
        raise ValueError(f"{where}: the tokenizer has no eos token and generation_config.json no eos_token_id")
    return list(dict.fromkeys(int(i) for i in ids))


def truncate_at_stop(tokens: list[int], stops: set[int] | list[int]) -> tuple[int, str]:
    """(length, finish reason): up to and including the first stop token ('stop'), else all ('length')."""
    for i, t in enumerate(tokens):
        if t in stops:
            return i + 1, "stop"
    return len(tokens), "length"


PROMPT_CHARS_PER_POSITION = 64
"""The shard stage, and the rollout and evaluate jobs before they render, refuse a prompt of more
characters than this many per position of the model (``prompt_char_limit``): a prompt that fits
the positions averages a few characters a token, and one past this bound could never fit; it is
stopped before any tokenizer or GPU sees it."""


def prompt_char_limit(positions: int) -> int:
    """The most characters a prompt may have for a model of ``positions`` (the shard stage's bound
    and ``check_prompt_chars``')."""
    return PROMPT_CHARS_PER_POSITION * positions


def prompt_chars(messages: str) -> int:
    """A prompt's characters: those of its messages' contents (``messages``: the prompts table's
    JSON list of {role, content}), what the chat template renders."""
    return sum(len(m["content"]) for m in json.loads(messages))


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


def chat_setting(cfg: DictConfig) -> str:
    """task.chat as 'auto' | 'true' | 'false' (YAML's true/false arrive as 'True'/'False')."""
    return str(cfg.task.chat).lower()


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
