"""The GPU check (benchmarks/gpu/check.sh) on the CPU: its tiny form as the docs show it, every step
(the policy builder, the decode benchmark, the `gpu` tests, the workflow chain, the MFU), with the
facts of its policy and its decode benchmark; then the MFU arithmetic and the bench_iteration
settings that check.sh asks for. No timings are asserted."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import REPO, make_sandbox, sandbox_env

sys.path.insert(0, str(REPO / "benchmarks"))
# docs/environments.md, "The GPU check": the check's tiny form, run as shown (test_docs_commands.HOW
# points here for it, for the check's other forms and for the scripts its steps run)
SHOWN = "bash benchmarks/gpu/check.sh --device cpu --tiny --out results/gpu_check"
COVERED = {
    SHOWN,
    "benchmarks/gpu/check.sh",
    "bash benchmarks/gpu/check.sh --bundle .gpu-bundle --out results/gpu_check",
    "benchmarks/make_policy.py",
    "benchmarks/bench_decode.py",
    "benchmarks/bench_iteration.py",
    "python benchmarks/bench_iteration.py",
}
STEPS = ["policy", "decode", "gpu_tests", "chain", "mfu"]
# docs/environments.md's tiny shape (the --tiny policy step's own arguments)
TINY = ["--shape", "qwen2.5-0.5b", "--layers", "2", "--vocab", "4096", "--hidden", "64"]
pytestmark = pytest.mark.xdist_group("gpu_check")  # one worker runs the check, once


def run(*args: str) -> subprocess.CompletedProcess:
    res = subprocess.run(
        [sys.executable, *args], cwd=REPO, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return res


@pytest.fixture(scope="module")
def gpu_check(tmp_path_factory):
    """SHOWN in a sandbox checkout, its work folder (the policy, the runs) under the sandbox's own
    TMPDIR; returns (sandbox, work folder, the completed process)."""
    work = make_sandbox(tmp_path_factory.mktemp("gpu_check"))
    tmp = work / "tmp"
    tmp.mkdir()
    res = subprocess.run(
        SHOWN,
        shell=True,
        cwd=work,
        env={**sandbox_env(work), "TMPDIR": str(tmp)},
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=900,
    )
    (folder,) = tmp.glob("otbflow-gpu-check.*")
    return work, folder, res


def test_every_shown_form_of_the_check_runs_here():
    from test_docs_commands import GPU_CHECK, HOW

    assert {c for c, how in HOW.items() if how == GPU_CHECK} == COVERED


def test_the_tiny_check_runs_every_step(gpu_check):
    work, _, res = gpu_check
    assert res.returncode == 0, f"{SHOWN!r} failed:\n{res.stdout[-3000:]}\n{res.stderr[-5000:]}"
    out = work / "results/gpu_check"
    record = json.loads((out / "check.json").read_text())
    assert [(s["step"], s["exit"]) for s in record["steps"]] == [(step, 0) for step in STEPS]
    assert record["command"] == SHOWN
    for name in ("decode", "iteration", "mfu"):
        assert json.loads((out / f"{name}.json").read_text())


@pytest.fixture(scope="module")
def policy(gpu_check):
    """The check's policy (benchmarks/make_policy.py at the tiny shape), and the JSON it printed."""
    work, folder, _ = gpu_check
    log = (work / "results/gpu_check/check.log").read_text()
    step = re.search(r"^== policy \(.*?\n(.*?)^== policy: exit 0", log, re.S | re.M)
    assert step and f"--out {folder / 'policy'} {' '.join(TINY[2:])}" in log, log[:3000]
    printed = json.loads(step.group(1).strip().splitlines()[-1])  # the last line: DeepSpeed may log before it
    assert (printed["vocab"], printed["layers"], printed["hidden"], printed["dtype"]) == (4096, 2, 64, "bfloat16")
    return folder / "policy", printed


def test_made_policy_loads_and_every_id_decodes(policy):
    from otbflow.models.policy import load_policy

    path, printed = policy
    model, tok = load_policy(path, "float32")
    vocab = model.config.vocab_size
    assert model.config.model_type == "qwen2" and model.config.tie_word_embeddings
    assert len(tok) == vocab == 4096 and model.dtype == torch.float32
    assert sum(p.numel() for p in model.parameters()) == printed["parameters"]
    texts = tok.batch_decode([[i] for i in range(vocab)])
    assert all(texts) and len(set(texts)) == vocab
    assert tok.decode(tok("12+3=", add_special_tokens=False)["input_ids"]) == "12+3="  # the task's characters
    assert (tok.pad_token_id, tok.eos_token_id) == (model.config.pad_token_id, model.config.eos_token_id) == (0, 1)


def test_full_shape_has_qwen_sizes_and_a_decodable_tokenizer():
    """At the shape's own size (counted on the meta device): 494 M parameters, vocabulary 151,936,
    every id of the word-level tokenizer decoding to its own text."""
    from make_policy import SHAPES, shape_config, word_tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**shape_config(json.loads((SHAPES / "qwen2.5-0.5b.json").read_text())))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == 494_032_768 and config.vocab_size == 151_936
    tok = word_tokenizer(config.vocab_size)
    texts = tok.batch_decode([[i] for i in range(config.vocab_size)])
    assert len(tok) == 151_936 and all(texts) and len(set(texts)) == 151_936


def test_bench_decode_on_cpu(gpu_check):
    """The check's decode step (--dtype float32, 4 prompts x 2, 8 new tokens, 1 repeat, a profile of
    2 steps): every path decoded every step, and the profile split the compiled loop's steps."""
    work, folder, _ = gpu_check
    res = json.loads((work / "results/gpu_check/decode.json").read_text())
    assert res["machine"]["gpu"] is None
    assert res["command"].startswith(f"python benchmarks/bench_decode.py --policy {folder / 'policy'} --device cpu")
    assert res["rows"] == 8 and set(res["paths"]) == {"otbflow", "otbflow_static", "sample", "static"}
    for path in res["paths"].values():
        assert path["steps"] == 8 and path["ms_per_step"] > 0 and path["tokens_per_s"] > 0
    prof = res["profile"]
    assert prof["sampler_calls"] == 3 and prof["decode_steps"] == 2 and prof["us_per_step"]["sampler"] > 0
    assert prof["path"] == "otbflow" and abs(sum(prof["share"].values()) - 1) < 1e-3
    assert res["sampler_alone"]["row_sampler_ms"] > 0


def test_list_settings_names_what_check_sh_runs():
    from bench_iteration import SETTINGS

    listed = run("benchmarks/bench_iteration.py", "--list-settings").stdout.split()
    assert listed == list(SETTINGS) and {"grpo_s0", "grpo_s1"} <= set(listed)


def test_each_engines_idle_share_is_the_window_its_rollouts_leave():
    """bench_iteration's ``rollout_engines_idle_share``: per engine, the share of the window that the
    union of its rollout jobs leaves uncovered, each job clipped to the window (an engine whose
    rollouts all fall outside it: idle throughout); other stages do not count."""
    from bench_iteration import engines_idle

    def job(engine, start, end, stage="rollout"):
        return {"stage": stage, "engine": engine, "start": start, "end": end}

    js = [
        job("w1", 10, 30),
        job("w1", 20, 40),  # overlaps the one before: 10..40 busy
        job("w1", 90, 120),  # 90..100 inside the window
        job("shard_1", -20, 5),  # 0..5
        job("w2", 100, 110),  # after the window
        job("w1", 40, 90, stage="train"),
    ]
    assert engines_idle(js, (0.0, 100.0)) == {"shard_1": 0.95, "w1": 0.6, "w2": 1.0}


def test_peaks_by_device_name():
    from otbflow.training.hardware import peak_for

    assert peak_for("NVIDIA H100 80GB HBM3")[0] == 989.0 and peak_for("NVIDIA H200")[0] == 989.0
    assert peak_for("NVIDIA H100 PCIe")[0] == 756.0 and peak_for("NVIDIA H200 NVL")[0] == 835.0
    assert peak_for(None)[0] is None and peak_for("NVIDIA GeForce RTX 4090")[0] is None


def test_mfu_of_a_step(tmp_path):
    """6 x parameters x (response + prompt tokens) / step time / peak, on a metrics row with the
    columns the train stage writes."""
    from bench_train_mfu import steps_of

    metrics = tmp_path / "metrics.parquet"
    row = {"step": [0], "step_time_s": [2.0], "tokens": [100], "nonpad_tokens": [108], "sequences": [2]}
    pq.write_table(pa.table(row), metrics)
    (step,) = steps_of(metrics, params=10**9, peak=1000.0, run="r", iteration=0)
    assert step["nonpad_tokens"] == 108 and step["tokens_per_s"] == 54.0
    assert step["tflops"] == pytest.approx(6 * 10**9 * 108 / 2 / 1e12, abs=0.01)
    assert step["mfu"] == pytest.approx(6 * 10**9 * 108 / 2 / 1e12 / 1000, abs=1e-4)
    assert step["mfu_response_tokens"] == pytest.approx(6 * 10**9 * 100 / 2 / 1e12 / 1000, abs=1e-4)


@pytest.mark.parametrize(
    "op, kernel, part",
    [
        # kernels of the compiled decode step profiled on an H100 (torch 2.11, CUDA 13), 2026-11-27
        ("other", "nvjet_sm90_tst_168x128_64x5_2x4_h_bz_TNN", "matmul"),
        ("other", "cudnn_generated_fort_native_sdpa_sm80_flash_fprop_wmma_f16_knob_3_64x64x64_4x1x1", "attention"),
        ("other", "triton_poi_fused__scaled_dot_product_cudnn_attention__to_copy__unsafe_view_add_cat_cos", "other"),
        ("other", "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda", "other"),
        ("sampler", "void at::native::vectorized_elementwise_kernel<4, at::native::BUnaryFunctor", "sampler"),
        ("matmul", "ampere_sgemm_128x64_tn", "matmul"),
    ],
)
def test_decode_profile_names_the_kernels_of_a_compiled_forward(op, kernel, part):
    """A compiled forward launches cuBLAS's and cuDNN's kernels with no aten op around them: the
    profile tells them by name; Inductor's Triton kernels, named after every op they fuse, stay
    "other"; a kernel launched inside the sampler is the sampler's."""
    from bench_decode import kernel_category

    assert kernel_category(op, kernel) == part
