"""What only a GPU can check (the ``gpu`` marker: skipped, with the reason, where torch sees no CUDA;
benchmarks/gpu/check.sh runs these on the GPU it measures): otbflow's sampling gives on CUDA what it
gives on the CPU, the decode profile of benchmarks/bench_decode.py attributes CUDA kernels, and the
GPU is in the MFU script's table of peaks."""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import REPO

from otbflow.engines import hf
from otbflow.engines.hf import RowSampler, gumbel_noise, hf_generate, row_keys

pytestmark = pytest.mark.gpu
sys.path.insert(0, str(REPO / "benchmarks"))


def test_philox_is_bitwise_the_same_on_cpu_and_cuda():
    """Random123's known answers for Philox4x32-10 on CUDA, and
    the noise words of the same rows bitwise those of the CPU, eagerly and compiled (the int64 arithmetic of 16-bit
    halves never overflows, on either device)."""
    from test_rollout_features import PHILOX_KAT

    for counter, key, expected in PHILOX_KAT:
        words = [torch.tensor([w], device="cuda") for w in counter]
        assert [int(w) for w in hf.philox4x32(*words, key=key)] == list(expected)
    keys = row_keys(7, range(64), 8, "cpu")
    positions = torch.arange(len(keys)) * 7
    cpu = hf.noise_words(keys, positions, hf.token_ids(151_936, "cpu"))
    args = (keys.cuda(), positions.cuda(), hf.token_ids(151_936, "cuda"))
    assert torch.equal(hf.noise_words(*args).cpu(), cpu)
    assert torch.equal(torch.compile(hf.noise_words, dynamic=True)(*args).cpu(), cpu)


def test_row_noise_and_tokens_the_same_on_cpu_and_cuda():
    """The Gumbel noise of the same row keys (their words bitwise equal) agrees to a few ulp of 1
    in fp64 (log on CUDA and on the CPU need not round alike; measured on an H100 with the murmur
    hash before Philox: 2.2e-16 at most, relatively 3.5e-12 where the noise is near 0) and
    RowSampler picks the same tokens from the same fp32 logits, with the same log-probs."""
    vocab = 151_936
    keys = row_keys(7, range(8), 4, "cpu")
    for step in (0, 1, 191):
        at = torch.full_like(keys, step)
        cpu, cuda = gumbel_noise(keys, at, vocab), gumbel_noise(keys.cuda(), at.cuda(), vocab).cpu()
        torch.testing.assert_close(cuda, cpu, rtol=1e-14, atol=1e-15)
    logits = torch.randn(len(keys), vocab, generator=torch.Generator().manual_seed(1))
    on_cpu, on_cuda = RowSampler(keys, 1.0, 1.0, False), RowSampler(keys.cuda(), 1.0, 1.0, False)
    for _ in range(3):
        assert torch.equal(on_cpu(None, logits).argmax(-1), on_cuda(None, logits.cuda()).argmax(-1).cpu())
    torch.testing.assert_close(torch.stack(on_cuda.logprobs).cpu(), torch.stack(on_cpu.logprobs), rtol=0, atol=1e-5)


def test_hf_generate_samples_the_same_on_cpu_and_cuda(tiny_policy):
    """The tiny fp32 policy's samples for the same seed and prompts: the same tokens on both
    devices, log-probs within 1e-4 (the matrix products round differently)."""
    from otbflow.models.policy import load_policy

    model, tok = load_policy(tiny_policy, "float32")
    prompts = [
        tok("3+4-1=", add_special_tokens=False)["input_ids"],
        tok("12+5=", add_special_tokens=False)["input_ids"],
    ]
    runs = {}
    for dev in ("cpu", "cuda"):
        runs[dev] = hf_generate(model.to(dev), tok, prompts, n=4, max_new_tokens=16, seed=3)
    for a, b in zip(runs["cpu"], runs["cuda"]):
        assert a.response_ids == b.response_ids
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), rtol=0, atol=1e-4)


def test_the_fused_sampler_on_cuda_picks_the_cpu_tokens():
    """rollout.hf_decode 'compiled': the Triton kernels of the fused sampler pick the tokens the
    eager CPU path picks from the same fp32 logits, at the Qwen2.5 vocabulary, with the same
    log-probs to 1e-5."""
    vocab = 151_936
    keys = row_keys(11, range(64), 8, "cpu")
    for step in (0, 1, 191):
        z = torch.randn(len(keys), vocab, generator=torch.Generator().manual_seed(step))
        at, tokens = torch.full_like(keys, step), hf.token_ids(vocab, "cpu")
        token, logprob = hf.fused_step()(z.cuda(), keys.cuda(), at.cuda(), tokens.cuda())
        assert torch.equal(token.cpu(), hf.gumbel_argmax(z, keys, at, tokens))
        reference = torch.log_softmax(z, -1).gather(-1, token.cpu()[:, None])[:, 0]
        torch.testing.assert_close(logprob.cpu(), reference, rtol=0, atol=1e-5)


@pytest.mark.parametrize("mode", ["static", "compiled"])
def test_the_gpu_decode_loops_sample_the_eager_tokens(tiny_policy, mode):
    """The tiny fp32 policy on CUDA: 'static' and 'compiled' sample the eager path's tokens, with
    log-probs within 1e-4."""
    from otbflow.models.policy import load_policy

    model, tok = load_policy(tiny_policy, "float32")
    model = model.to("cuda")
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in ("3+4-1=", "12+5=", "7*8=")]
    eager = hf_generate(model, tok, prompts, n=4, max_new_tokens=16, seed=3, decode="eager")
    other = hf_generate(model, tok, prompts, n=4, max_new_tokens=16, seed=3, decode=mode)
    for a, b in zip(eager, other):
        assert a.response_ids == b.response_ids
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), rtol=0, atol=1e-4)


def test_decode_profile_attributes_cuda_kernels(tmp_path):
    """benchmarks/bench_decode.py's profile on CUDA: kernel time inside the sampler and in the
    model's matrix products, one sampler call per decode step plus the first."""
    import bench_decode
    import make_policy

    make_policy.build("qwen2.5-0.5b", tmp_path / "p", layers=2, vocab=4096, hidden=64, dtype="float32")
    args = ["--policy", str(tmp_path / "p"), "--device", "cuda", "--dtype", "float32", "--prompts", "4"]
    args += ["--group-size", "2", "--max-new-tokens", "6", "--repeats", "1", "--profile-steps", "3"]
    res = bench_decode.main(args)
    prof = res["profile"]
    assert prof["time"] == "CUDA kernels" and prof["sampler_calls"] == 4
    assert prof["us_per_step"]["sampler"] > 0 and prof["us_per_step"]["matmul"] > 0
    assert abs(sum(prof["share"].values()) - 1) < 1e-3
    assert all(p["steps"] == 6 for p in res["paths"].values())


def test_this_gpu_has_a_known_peak():
    """The MFU needs the card's dense bf16 peak: the name torch gives this GPU is in the table."""
    from otbflow.training.hardware import peak_for

    name = torch.cuda.get_device_name(0)
    assert peak_for(name)[0] is not None, f"add {name!r} to PEAKS in src/otbflow/training/hardware.py"
