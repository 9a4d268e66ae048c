"""Real HF architectures (gpt2, llama, qwen2) with char or byte-level BPE + ChatML tokenizers:
saved and reloaded offline, chat rendering, stop tokens, left-padded generation against
right-padded teacher forcing, and the bootstrap's supervised format."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_config

from otbflow.engines import stop_token_ids, truncate_at_stop
from otbflow.engines.hf import hf_generate
from otbflow.engines.prompts import render_prompts, use_chat
from otbflow.io import read_metadata
from otbflow.models.logits import sequence_token_stats
from otbflow.models.policy import build_char_tokenizer, build_tiny_model, build_tokenizer, load_policy
from otbflow.stages import bootstrap

ARCHS = [("gpt2", "char"), ("llama", "char"), ("llama", "bpe"), ("qwen2", "bpe")]
CORPUS = ["7+3=10;10-5=5;#5", "12+4=16;#16", "user\n", "assistant\n", "system\n"] * 4


def build(tmp_path, arch, tokenizer, **model):
    cfg = tiny_config(
        f"model.arch={arch}",
        f"model.tokenizer={tokenizer}",
        "model.n_kv_head=1" if arch != "gpt2" else "model.n_kv_head=0",
        *(f"model.{k}={v}" for k, v in model.items()),
    )
    tok = build_tokenizer(cfg.model, CORPUS)
    m = build_tiny_model(cfg.model, tok, seed=0)
    path = tmp_path / f"{arch}_{tokenizer}"
    m.save_pretrained(path)
    tok.save_pretrained(path)
    return cfg, path


@pytest.fixture(scope="module")
def qwen2_bpe(tmp_path_factory):
    return build(tmp_path_factory.mktemp("models"), "qwen2", "bpe")


def test_bpe_tokenizer_and_chat_template_reload_offline(qwen2_bpe):
    cfg, path = qwen2_bpe
    model, tok = load_policy(path)
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.config.tie_word_embeddings
    assert model.config.num_key_value_heads == 1 and model.model.layers[0].self_attn.q_proj.bias is not None
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>" and tok.padding_side == "left"
    # byte-level: any text round-trips, special tokens are single ids
    text = "7+3=10; é 中文 \\boxed{\\frac{1}{2}}\n"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    assert len(tok("<|im_start|>", add_special_tokens=False)["input_ids"]) == 1
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "7+3="}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n7+3=<|im_end|>\n<|im_start|>assistant\n"
    )
    # the generation config stops on both end tokens, as Qwen2.5-Instruct's does
    gen = json.loads((path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert stop_token_ids(tok, path) == gen["eos_token_id"]


def test_a_policy_cast_on_the_host_equals_the_one_cast_after_loading(qwen2_bpe, monkeypatch):
    """load_policy(cast_to=bf16) (the features stage at train.bf16) casts before the move to the
    device: when the model is moved its parameters are already bf16, every one equal to the fp32
    checkpoint's value rounded to bf16, as DeepSpeed's bf16 engine casts it, and the buffers
    (Qwen2's rotary inv_freq) stay fp32 as in that engine."""
    _, path = qwen2_bpe
    fp32, _ = load_policy(path, "float32")
    moved: list[set] = []  # the parameters' dtypes whenever a model is moved
    to = torch.nn.Module.to

    def recording_to(self, *args, **kwargs):
        moved.append({p.dtype for p in self.parameters()})
        return to(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "to", recording_to)
    cast, _ = load_policy(path, "float32", cast_to=torch.bfloat16)
    monkeypatch.undo()
    assert moved and all(dtypes == {torch.bfloat16} for dtypes in moved)
    params = dict(fp32.named_parameters())
    for name, p in cast.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p, params[name].to(torch.bfloat16)), name
    buffers = dict(fp32.named_buffers())
    inv_freq = [name for name, _ in cast.named_buffers() if name.endswith("inv_freq")]
    assert inv_freq and all(cast.get_buffer(n).dtype == torch.float32 for n in inv_freq)
    assert all(torch.equal(b, buffers[n]) for n, b in cast.named_buffers())


def test_chat_rendering_and_its_errors(qwen2_bpe, tiny_policy):
    cfg, path = qwen2_bpe
    _, tok = load_policy(path)
    decode = lambda ids: tok.decode(ids)  # noqa: E731
    (plain,) = render_prompts(tok, ["1+2="], None, chat=True, system_prompt="S.")
    assert (
        decode(plain) == "<|im_start|>system\nS.<|im_end|>\n<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n"
    )
    verl = json.dumps([{"role": "system", "content": "Own."}, {"role": "user", "content": "1+2="}])
    (own,) = render_prompts(tok, ["1+2="], [verl], chat=True, system_prompt="S.")
    assert decode(own).startswith("<|im_start|>system\nOwn.<|im_end|>") and "S." not in decode(own)
    (raw,) = render_prompts(tok, ["1+2="], None, chat=False)
    assert decode(raw) == "1+2="
    with pytest.raises(ValueError, match="chat messages \\(system, user\\)"):
        render_prompts(tok, ["1+2="], [verl], chat=False)
    assert use_chat(tiny_config(), tok) and not use_chat(tiny_config("task.chat=false"), tok)
    _, char_tok = load_policy(tiny_policy)
    assert not use_chat(tiny_config(), char_tok)
    with pytest.raises(ValueError, match="task.chat is true but the policy's tokenizer has no chat template"):
        use_chat(tiny_config("task.chat=true", "model.tokenizer=bpe"), char_tok)


@pytest.mark.parametrize("arch, tokenizer", ARCHS)
def test_left_padded_generation_matches_unpadded_and_teacher_forcing(tmp_path, arch, tokenizer):
    """Batched generation left-pads prompts of unequal length; each response's rollout log-probs
    must equal (a) the features stage's right-padded pass and (b) one unpadded forward pass of
    that sequence alone, and greedy decoding must give the same tokens as each prompt alone."""
    cfg, path = build(tmp_path, arch, tokenizer)
    model, tok = load_policy(path)
    chat = tokenizer == "bpe"
    prompts = ["1+2=", "9-8+7+6-5+4-3+2=", "55+4="]
    ids = render_prompts(tok, prompts, None, chat, "You add." if chat else None)
    assert len({len(x) for x in ids}) == 3  # unequal lengths: real left padding
    stops = stop_token_ids(tok, path)
    samples = hf_generate(model, tok, ids, n=2, max_new_tokens=12, seed=3, stop_ids=stops)
    stats = sequence_token_stats(
        model,
        [s.prompt_ids for s in samples],
        [s.response_ids for s in samples],
        1.0,
        chunk_size=64,
        pad_id=tok.pad_token_id,
    )
    for s, st in zip(samples, stats):
        full = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            logits = model(input_ids=full).logits[0, len(s.prompt_ids) - 1 : -1]
        alone = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(s.response_ids)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(s.logprobs), alone, atol=2e-5, rtol=0)
        torch.testing.assert_close(torch.tensor(st["logprobs"]), alone, atol=2e-5, rtol=0)
    batched = hf_generate(model, tok, ids, greedy=True, max_new_tokens=12, stop_ids=stops)
    for i in range(len(ids)):
        (single,) = hf_generate(model, tok, [ids[i]], greedy=True, max_new_tokens=12, stop_ids=stops)
        assert batched[i].response_ids == single.response_ids


def test_a_response_ends_at_the_first_of_any_stop_token(qwen2_bpe):
    cfg, path = qwen2_bpe
    model, tok = load_policy(path)
    ids = render_prompts(tok, ["3+4="], None, chat=True)
    (free,) = hf_generate(model, tok, ids, max_new_tokens=16, seed=1, stop_ids=[10**6])  # never stops
    assert free.finish_reason == "length" and len(free.response_ids) == 16
    k = next(i for i in range(2, 16) if free.response_ids[i] not in free.response_ids[:i])
    extra = free.response_ids[k]  # a token first sampled at position k (same seed: same draws up to there)
    (cut,) = hf_generate(model, tok, ids, max_new_tokens=16, seed=1, stop_ids=[10**6, extra])
    assert cut.response_ids == free.response_ids[: k + 1] and cut.finish_reason == "stop"
    assert len(cut.logprobs) == k + 1 and cut.logprobs == pytest.approx(free.logprobs[: k + 1], abs=1e-6)
    assert truncate_at_stop([5, 7, 2, 7, 0], {0, 2}) == (3, "stop") and truncate_at_stop([5], {0}) == (1, "length")


def test_bootstrap_builds_a_qwen2_bpe_chat_policy(tmp_path):
    cfg = tiny_config(
        "model.arch=qwen2",
        "model.tokenizer=bpe",
        "model.n_kv_head=2",
        "bootstrap.sft_max_steps=2",
        "bootstrap.eval_every=2",
        "bootstrap.n_eval_prompts=4",
        "bootstrap.sft_batch_size=8",
        "task.system_prompt='Add.'",
    )
    out = tmp_path / "policy"
    bootstrap.run(cfg, bootstrap.Args(out=str(out), metrics=str(tmp_path / "curve.parquet")))
    model, tok = load_policy(out)
    assert type(model).__name__ == "Qwen2ForCausalLM" and tok.chat_template
    meta = read_metadata(tmp_path / "curve.parquet")
    assert meta["arch"] == "qwen2" and meta["tokenizer"] == "bpe" and meta["chat"] is True
    assert meta["vocab_size"] == len(tok) == model.config.vocab_size
    # the supervised sequences are the chat template's own rendering of the whole conversation
    import random

    ids, mask, labels = bootstrap.sft_batch(tok, random.Random(0), cfg, set(), chat=True)
    row = ids[0][mask[0].bool()].tolist()
    response = [t for t, lab in zip(row, labels[0].tolist()) if lab != -100]
    prompt = row[: len(row) - len(response)]
    user = tok.decode(prompt).split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
    conversation = [
        {"role": "system", "content": "Add."},
        {"role": "user", "content": user},
        {"role": "assistant", "content": tok.decode(response[:-1])},
    ]
    assert tok.decode(row) + "\n" == tok.apply_chat_template(conversation, tokenize=False)
    assert response[-1] == tok.eos_token_id and user.endswith("=")


# ------------------------------------------------------------------------------------------
# A policy folder checked against what it must hold (issue 35, item 6)
# ------------------------------------------------------------------------------------------


def without(folder, tmp_path, name, keep=()):
    """A copy of ``folder`` without its tokenizer files (those named in ``keep`` kept)."""
    import shutil

    out = tmp_path / name
    shutil.copytree(folder, out)
    for f in out.iterdir():
        if "token" in f.name and f.name not in keep:
            f.unlink()
    return out


def test_model_path_without_its_tokenizer_is_refused_before_any_job(tiny_policy, tmp_path):
    """Was: accepted by the dry run; AutoTokenizer then built an empty tokenizer of length 1 and the
    rollout died with an IndexError. The workflow's check (validate_workflow, which the Snakefile
    runs before planning: a dry run too) reads the folder's file names, no torch."""
    from otbflow.config import ConfigError, validate_workflow

    def check(path):
        validate_workflow(tiny_config(f"model.path={path}"))

    check(tiny_policy)
    for bare in (
        without(tiny_policy, tmp_path, "bare"),
        without(tiny_policy, tmp_path, "cfg", ("tokenizer_config.json",)),
    ):
        with pytest.raises(
            ConfigError, match=r"config key 'model.path': .*: no tokenizer files \(one of tokenizer.json"
        ):
            check(bare)
    with pytest.raises(ConfigError, match="config key 'model.path': .*nowhere: no such folder"):
        check(tmp_path / "nowhere")
    (tmp_path / "weights").mkdir()
    with pytest.raises(ConfigError, match="config key 'model.path': .*weights: no config.json"):
        check(tmp_path / "weights")


def test_a_tokenizer_far_smaller_than_the_embedding_is_refused(tiny_policy, tmp_path):
    from otbflow.models.policy import load_tokenizer

    with pytest.raises(ValueError, match="bare: no tokenizer files"):
        load_tokenizer(without(tiny_policy, tmp_path, "bare"))
    assert len(load_tokenizer(tiny_policy)) == json.loads((tiny_policy / "config.json").read_text())["vocab_size"]
    # another model's embedding (config.json) beside this tokenizer: 76 tokens for 50,257 rows
    wrong = without(tiny_policy, tmp_path, "wrong", ("tokenizer.json", "tokenizer_config.json"))
    config = json.loads((wrong / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps(config | {"vocab_size": 50257}))
    n = len(build_char_tokenizer())
    with pytest.raises(ValueError, match=rf"its tokenizer has {n} tokens for an embedding of 50257"):
        load_tokenizer(wrong)
    # a padded embedding (Qwen2.5 pads 151,665 tokens to 151,936 rows) is no mistake
    (wrong / "config.json").write_text(json.dumps(config | {"vocab_size": 2 * n}))
    assert len(load_tokenizer(wrong)) == n
