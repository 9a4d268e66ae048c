"""The architectures and tokenizers of the policies otbflow builds (``model.arch``,
``model.tokenizer``): their registries, from which the config takes its choices and
``otbflow.models.policy`` builds them (docs/data.md, "A real model and dataset"). Importing this
module imports no torch (the config imports it)."""

from __future__ import annotations

from otbflow.models.tasks import chat_setting
from otbflow.registry import Registry, Requirement

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
