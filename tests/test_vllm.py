"""The vLLM backend: config-to-engine arguments and output conversion on CPU; the engine itself
where CUDA and vLLM are present (skipped elsewhere, with the reason)."""

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import polars as pl
import pytest
import torch

from otbflow import schemas, vllm_engine
from otbflow.io import check_schema
from otbflow.rewards import arithmetic_reward
from otbflow.rollout import rollout_table

DATA = Path(__file__).parent / "data" / "vllm_request_outputs.json"


def recorded_outputs():
    """The recorded structure as objects with vLLM's attribute names (Logprob has .logprob)."""
    raw = json.loads(DATA.read_text())["requests"]

    def completion(c):
        logprobs = [{int(k): SimpleNamespace(**v) for k, v in entry.items()} for entry in c["logprobs"]]
        return SimpleNamespace(**{**c, "logprobs": logprobs})

    return [SimpleNamespace(**{**r, "outputs": [completion(c) for c in r["outputs"]]}) for r in raw], raw


def test_engine_and_sampling_arguments_from_config():
    from conftest import tiny_config

    cfg = tiny_config("rollout.backend=vllm", "rollout.tensor_parallel_size=2", "rollout.temperature=0.7",
                      "model.dtype=bfloat16")
    r = cfg.rollout
    e = vllm_engine.engine_kwargs("/models/p", cfg.model.dtype, 5, r.tensor_parallel_size, r.temperature,
                                  r.gpu_memory_utilization)
    assert e["model"] == e["tokenizer"] == "/models/p"
    assert e["tensor_parallel_size"] == 2 and e["dtype"] == "bfloat16" and e["seed"] == 5
    assert e["logprobs_mode"] == "processed_logprobs"  # temperature-scaled, like the trainer's
    assert vllm_engine.engine_kwargs("/p", "float32", 0, 1, 1.0, 0.9)["logprobs_mode"] == "raw_logprobs"
    s = vllm_engine.sampling_kwargs(r.group_size, r.temperature, r.top_p, r.max_new_tokens, greedy=False, seed=5)
    assert s == {"n": 4, "temperature": 0.7, "top_p": 1.0, "top_k": -1, "max_tokens": 24, "logprobs": 0, "seed": 5,
                 "skip_special_tokens": True}
    g = vllm_engine.sampling_kwargs(4, 0.7, 1.0, 24, greedy=True, seed=5)
    assert g["n"] == 1 and g["temperature"] == 0.0


def test_recorded_outputs_convert_to_the_rollout_schema():
    outputs, raw = recorded_outputs()
    prompt_ids = [r["prompt_token_ids"] for r in raw]
    samples = vllm_engine.samples_from_outputs(outputs, prompt_ids, eos_id=1)
    assert [(s.prompt_index, s.sample_idx) for s in samples] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert samples[0].logprobs[4] == pytest.approx(-1.2) and samples[0].finish_reason == "stop"
    assert samples[1].finish_reason == "length" and len(samples[1].logprobs) == len(samples[1].response_ids)
    batch = pl.DataFrame({"prompt_id": [10, 11], "prompt": ["1+2=", "5-3="], "answer": ["3", "2"],
                          "split": ["train"] * 2, "shard": [0, 0]})
    table = rollout_table(samples, batch, iteration=0, shard=0, seed=5, reward_fn=arithmetic_reward)
    check_schema(table, schemas.ROLLOUTS, "vllm rollouts")  # the identical schema as the hf backend
    assert table["reward"].to_list() == [1.0, 0.0, 0.0, 0.0]
    assert table["group_id"].to_list() == [10, 10, 11, 11]


def test_missing_logprobs_is_an_error():
    outputs, raw = recorded_outputs()
    outputs[0].outputs[0].logprobs = None
    with pytest.raises(ValueError, match="SamplingParams.logprobs must be 0"):
        vllm_engine.samples_from_outputs(outputs, [r["prompt_token_ids"] for r in raw], eos_id=1)


def _gpu_reason():
    if not torch.cuda.is_available():
        return "no CUDA device: the vLLM engine runs on GPU nodes only"
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed in this environment (it lives in envs/vllm.yaml)"
    return None


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_reason() is not None, reason=str(_gpu_reason()))
def test_greedy_vllm_matches_transformers(tiny_policy):
    """Temperature 0 on the same prompts: same token ids; log-probs within 1e-3 (fp32)."""
    from otbflow.model import encode, load_policy
    from otbflow.rollout import hf_generate

    prompts = ["1+2=", "3+4-5=", "9-8+7+6="]
    model, tok = load_policy(tiny_policy)
    hf = hf_generate(model, tok, prompts, n=1, greedy=True, max_new_tokens=20)
    vl, _ = vllm_engine.generate(str(tiny_policy), encode(tok, prompts), tok.eos_token_id, 1, 1.0, 1.0, 20,
                                 greedy=True, seed=0, dtype="float32", tensor_parallel_size=1,
                                 gpu_memory_utilization=0.3)
    for a, b in zip(hf, vl):
        assert a.response_ids == b.response_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-3)
