"""Every model's own logits: the features and train stages compute log pi from the final hidden
states through the output head, chunk by chunk; families whose forward post-processes the head's
output (Granite's logits_scaling, Gemma2's soft-capping, Cohere's logit_scale, Falcon-H1's
lm_head_multiplier) get the same transform per chunk, and a model whose forward does something
otbflow does not know is refused at load (``otbflow.models.logits.check_head_logits``)."""

from __future__ import annotations

import pytest
import torch

from otbflow import schemas
from otbflow.io import read_table
from otbflow.models import logits
from otbflow.models.logits import check_head_logits, logit_transform, pack, sequence_token_stats
from otbflow.models.policy import build_char_tokenizer, cast_parameters, load_policy
from otbflow.training.logprobs import ResponseLogprobs

TEMPERATURE = 0.7

# (model type, transform as check_head_logits names it). Gemma2's cap is small so that it matters
# for the logits of a random model (|z| < 0.4); real ones cap at 30 logits of 20 and more.
FAMILIES = [
    ("granite", "lm_head(hidden) / 8"),
    ("gemma2", "tanh(lm_head(hidden) / 0.3) * 0.3"),
    ("cohere", "lm_head(hidden) * 0.25"),
    ("falcon_h1", "lm_head(hidden) * 0.3"),
]


def tiny_model(model_type: str, tok, **extra):
    """A randomly initialised 2-layer ``model_type`` for ``tok``'s vocabulary."""
    import transformers

    config = transformers.AutoConfig.for_model(
        model_type,
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.pad_token_id,
        **extra,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


EXTRA = {
    "granite": {"logits_scaling": 8.0, "tie_word_embeddings": False},
    "gemma2": {"final_logit_softcapping": 0.3},
    "cohere": {"logit_scale": 0.25},
    # the Mamba mixers at the attention's size (the reference PyTorch kernels)
    "falcon_h1": {
        "lm_head_multiplier": 0.3,
        **dict(mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=8),
    },
    "llama": {"tie_word_embeddings": False},
}


@pytest.fixture(scope="module")
def policies(tmp_path_factory):
    """HF folders of tiny Granite, Gemma2, Cohere, Falcon-H1 and Llama with the char tokenizer
    (the tiny policy's, so that its rollouts are valid token ids for them)."""
    tok = build_char_tokenizer()
    out = {}
    for model_type in EXTRA:
        path = tmp_path_factory.mktemp("policies") / model_type
        tiny_model(model_type, tok, **EXTRA[model_type]).save_pretrained(path)
        tok.save_pretrained(path)
        out[model_type] = path
    return out


def batch_of(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 70, (n,), generator=g).tolist() for n in (5, 9, 3)]
    responses = [torch.randint(3, 70, (n,), generator=g).tolist() for n in (12, 7, 20)]
    return prompts, responses


def forward_token_stats(model, prompts, responses, temperature=TEMPERATURE) -> tuple[torch.Tensor, torch.Tensor]:
    """(log pi(y_t), entropy) of every response token, flattened, from the model's own forward:
    log_softmax(model(...).logits / T), one unpadded sequence at a time."""
    logp, ent = [], []
    for p, r in zip(prompts, responses):
        z = model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1 : -1].float() / temperature
        all_logp = torch.log_softmax(z, -1)
        logp.append(all_logp.gather(-1, torch.tensor(r)[:, None]).squeeze(-1))
        ent.append(-(all_logp.exp() * all_logp).sum(-1))
    return torch.cat(logp), torch.cat(ent)


def count_forward_calls(model):
    """Counts calls of the model's full forward (the one that returns [tokens x V] logits)."""
    calls = []
    forward = model.forward

    def counted(*args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)

    model.forward = counted
    return calls


@pytest.mark.parametrize("model_type, transform", FAMILIES)
def test_features_and_train_logprobs_are_the_forwards(policies, model_type, transform):
    """Features log pi, entropy (positions in chunks of 5, with and without vocabulary slices of
    7) and the train stage's log pi and gradients (chunks of 5 under activation checkpointing)
    equal those of log_softmax(the model's own forward logits / T) to 1e-5; the head's output
    without the transform is off by more than 0.02. Neither path runs the full forward."""
    model, tok = load_policy(policies[model_type])
    assert model.config.model_type == model_type
    assert repr(check_head_logits(model)) == transform
    prompts, responses = batch_of()
    with torch.no_grad():
        ref_logp, ref_ent = forward_token_stats(model, prompts, responses)
        bare = logits.pack(prompts, responses, tok.pad_token_id)
        head = model.get_output_embeddings()
        hidden = model.base_model(input_ids=bare["input_ids"], attention_mask=bare["attention_mask"])
        z = head(hidden.last_hidden_state[bare["rows"], bare["pos"]]) / TEMPERATURE
        untransformed = torch.log_softmax(z, -1).gather(-1, bare["targets"][:, None]).squeeze(-1)
    assert float((untransformed - ref_logp).abs().max()) > 0.02

    calls = count_forward_calls(model)
    for vocab_chunk in (0, 7):
        stats = sequence_token_stats(model, prompts, responses, TEMPERATURE, 5, tok.pad_token_id, vocab_chunk)
        for key, ref in (("logprobs", ref_logp), ("entropy", ref_ent)):
            got = torch.tensor([x for s in stats for x in s[key]])
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)

    batch = pack(prompts, responses, tok.pad_token_id)
    module = ResponseLogprobs(model, chunk_size=5)
    args = [batch[k] for k in ("input_ids", "attention_mask", "rows", "pos", "targets")]
    logp, ent, _ = module(*args, TEMPERATURE, entropy_grad=True)
    assert not calls  # the body and the head only: no [tokens x V] logits
    torch.testing.assert_close(logp.detach(), ref_logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.detach(), ref_ent, atol=1e-5, rtol=0)
    params = [p for p in model.parameters() if p.requires_grad]
    a = torch.linspace(-1.0, 1.0, len(logp))
    grads = torch.autograd.grad((a * logp).sum() + (a * ent).sum(), params, allow_unused=True)
    model.forward = model.__class__.forward.__get__(model)
    ref_logp, ref_ent = forward_token_stats(model, prompts, responses)
    ref_grads = torch.autograd.grad((a * ref_logp).sum() + (a * ref_ent).sum(), params, allow_unused=True)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("model_type, transform", FAMILIES)
def test_the_check_passes_at_bf16(policies, model_type, transform):
    """The train stage with train.bf16 computes at bf16, where the model's forward computes its
    transform at bf16 and the head-only path at fp32: no false refusal."""
    model, _ = load_policy(policies[model_type])
    assert repr(check_head_logits(cast_parameters(model, torch.bfloat16))) == transform


def test_models_without_a_transform_keep_the_bare_head(policies, tiny_policy):
    """Llama, GPT-2, and MPT (whose config has a logit_scale that its forward ignores)."""
    for path in (policies["llama"], tiny_policy):
        model, _ = load_policy(path)
        assert logit_transform(model) is None and check_head_logits(model) is None
    from transformers import MptConfig, MptForCausalLM

    mpt = MptForCausalLM(MptConfig(vocab_size=80, d_model=32, n_heads=4, n_layers=2, logit_scale=0.5)).eval()
    assert logit_transform(mpt) is None and check_head_logits(mpt) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_transform_otbflow_does_not_know_is_refused(policies, dtype):
    """A Llama whose forward multiplies its logits by 1.5 is refused with its model type named, at
    fp32 and at bf16."""
    model, _ = load_policy(policies["llama"])
    cast_parameters(model, dtype)
    forward = model.forward

    def scaled(*args, **kwargs):
        out = forward(*args, **kwargs)
        out.logits = out.logits * 1.5
        return out

    model.forward = scaled
    with pytest.raises(ValueError, match="^llama: the model post-processes its logits in a way otbflow does not know"):
        check_head_logits(model)


def test_the_features_and_train_stages_refuse_an_unknown_transform(policies, rollouts_path, tmp_path, cfg, monkeypatch):
    """Granite with its entry removed from the registry: the features stage and the train
    stage's engine refuse it at load, naming the model type; with it, the features stage's
    stored log pi are the forward's."""
    from otbflow.stages import features
    from otbflow.training.distributed import build_engine

    args = features.Args(rollouts=str(rollouts_path), policy=str(policies["granite"]), out=str(tmp_path / "f.parquet"))
    features.run(cfg, args)
    df = read_table(args.out, schemas.FEATURES)
    model, _ = load_policy(policies["granite"])
    prompts, responses = df["prompt_ids"].to_list(), df["response_ids"].to_list()
    with torch.no_grad():
        ref, _ = forward_token_stats(model, prompts, responses, cfg.rollout.temperature)
    got = torch.tensor([x for r in df["logprobs"].to_list() for x in r])
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)

    monkeypatch.delitem(logits.LOGIT_TRANSFORMS, "granite")
    with pytest.raises(ValueError, match="^granite: the model post-processes its logits"):
        features.run(cfg, args)
    with pytest.raises(ValueError, match="^granite: the model post-processes its logits"):
        build_engine(str(policies["granite"]), cfg.train, 1)
