"""The train stage end to end with DeepSpeed on CPU on a tiny policy: an update raises a rewarded
sequence's log-prob, micro-batches and 2 ranks give the full-batch loss and gradient, rollout
correction (IS, TRM), the registered losses, the KL and entropy terms, the variance proxies, the
MFU and the first ratio of an iteration. By subject elsewhere: the losses (test_losses.py), the
log-probs and packing (test_train_logprobs.py), the state across iterations
(test_train_state.py), failures (test_train_robustness.py)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import train_helpers
from train_helpers import (
    MODES,
    TEMPERATURE,
    WALL,
    load_model,
    make_cfg,
    plain_token_stats,
    random_advantages,
    run_stage,
    write_advantages,
    write_rollouts,
)

from otbflow import schemas
from otbflow.algorithms.losses import (
    POLICY_LOSSES,
    aggregate_loss,
    ppo_clip_loss,
    register_policy_loss,
    reinforce_loss,
    trm_keep,
)
from otbflow.config import ConfigError
from otbflow.io import SchemaError, read_table, write_parquet
from otbflow.models.policy import build_char_tokenizer, build_tiny_model
from otbflow.stages import features
from otbflow.stages.train import Args, run
from otbflow.training.distributed import init_distributed_env
from otbflow.training.logprobs import policy_logprobs
from otbflow.training.state import OptimizerStateError

# the module-scoped fixtures of train_helpers: this file's own policy and features
policy_dir = train_helpers.policy_dir
features_path = train_helpers.features_path


@pytest.fixture(scope="module")
def dropout_policy_dir(tmp_path_factory):
    """A GPT-2 with every dropout of a released GPT-2 checkpoint at 0.1."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = build_char_tokenizer()
    torch.manual_seed(1)
    config = GPT2Config(
        vocab_size=len(tok),
        n_positions=64,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_pdrop=0.1,
        summary_first_dropout=0.1,
        bos_token_id=tok.eos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    path = tmp_path_factory.mktemp("dropout_policy") / "policy"
    GPT2LMHeadModel(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def sequence_logprobs(model, df) -> torch.Tensor:
    """Sum of log pi over each response (temperature-scaled)."""
    with torch.no_grad():
        logp, mask = policy_logprobs(
            model,
            df["prompt_ids"].to_list(),
            df["response_ids"].to_list(),
            TEMPERATURE,
            build_char_tokenizer().pad_token_id,
        )
    return (logp * mask).sum(-1)


def full_batch_grad_norm(model, df, mode: str, cfg) -> tuple[float, float]:
    """(loss, gradient norm) of the whole table as one batch, in plain torch (first step: r = 1)."""
    model.zero_grad()
    logp, mask = policy_logprobs(
        model,
        df["prompt_ids"].to_list(),
        df["response_ids"].to_list(),
        TEMPERATURE,
        build_char_tokenizer().pad_token_id,
    )
    pad = lambda col: torch.tensor([x + [0.0] * (mask.shape[1] - len(x)) for x in df[col].to_list()])  # noqa: E731
    token_loss, _ = ppo_clip_loss(logp, pad("logprobs"), pad("advantages"), torch.ones_like(logp), cfg.train)
    loss = aggregate_loss(
        token_loss,
        mask,
        mode,
        int(mask.sum()),
        int((mask.sum(-1) > 0).sum()),
        cfg.train.loss_scale_factor or cfg.rollout.max_new_tokens,
    )
    loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]))
    return float(loss.detach()), float(norm)


# ------------------------------------------------------------------------------------------
# End to end with DeepSpeed on CPU
# ------------------------------------------------------------------------------------------


def test_run_raises_the_logprob_of_a_rewarded_sequence(policy_dir, features_path, tmp_path):
    adv = [[0.0] * n for n in read_table(features_path, schemas.FEATURES)["response_length"].to_list()]
    adv[0] = [1.0] * len(adv[0])  # only sequence 0 has a (positive) advantage, on every token
    df = write_advantages(features_path, tmp_path / "adv.parquet", adv)
    cfg = make_cfg("train.mini_batch_size=8", "train.micro_batch_size=2")
    args = Args(
        advantages=str(tmp_path / "adv.parquet"),
        policy=str(policy_dir),
        out=str(tmp_path / "next"),
        metrics=str(tmp_path / "metrics.parquet"),
        iteration=3,
    )
    run(cfg, args)

    metrics = read_table(args.metrics, schemas.TRAIN_METRICS)
    assert metrics.columns == list(schemas.TRAIN_METRICS.columns)
    row = metrics.row(0, named=True)
    assert metrics.height == 1 and row["iteration"] == 3 and row["step"] == 0
    assert row["tokens"] == df["response_length"].sum() and row["sequences"] == 8
    assert row["lr"] == pytest.approx(1e-2)
    assert row["clip_fraction"] == 0.0 and abs(row["approx_kl"]) < 1e-10  # first step: ratio 1
    assert row["loss"] == pytest.approx(-len(adv[0]) / row["tokens"], rel=1e-5)  # token-mean of -A r
    assert row["grad_norm"] > 0 and row["entropy"] > 0

    before, after = load_model(policy_dir), load_model(args.out)
    assert after.dtype == torch.float32
    assert any(not torch.equal(p, q) for p, q in zip(before.parameters(), after.parameters()))
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(args.out, local_files_only=True).pad_token == "<pad>"
    assert sequence_logprobs(after, df)[0] > sequence_logprobs(before, df)[0] + 1e-3


@pytest.mark.parametrize("mode", MODES)
def test_run_gradient_equals_full_batch_gradient(policy_dir, features_path, tmp_path, mode):
    """Micro-batches of 3 (uneven: 3+3+2) accumulate to the full-batch loss and gradient norm."""
    df = write_advantages(features_path, tmp_path / "adv.parquet", random_advantages(features_path))
    cfg = make_cfg("train.mini_batch_size=9", "train.micro_batch_size=3", f"train.loss_agg_mode={mode}")
    args = Args(
        advantages=str(tmp_path / "adv.parquet"),
        policy=str(policy_dir),
        out=str(tmp_path / "next"),
        metrics=str(tmp_path / "metrics.parquet"),
    )
    run(cfg, args)
    row = read_table(args.metrics, schemas.TRAIN_METRICS).row(0, named=True)
    loss, norm = full_batch_grad_norm(load_model(policy_dir), df, mode, cfg)
    assert row["loss"] == pytest.approx(loss, rel=1e-5, abs=1e-7)
    assert row["grad_norm"] == pytest.approx(norm, rel=1e-5)


def test_run_is_reproducible_with_partial_mini_batches(policy_dir, features_path, tmp_path):
    write_advantages(features_path, tmp_path / "adv.parquet", random_advantages(features_path))
    cfg = make_cfg("train.mini_batch_size=6", "train.micro_batch_size=2", "train.ppo_epochs=2", "seed=7")
    weights, tables = [], []
    for name in ("a", "b"):
        args = Args(
            advantages=str(tmp_path / "adv.parquet"),
            policy=str(policy_dir),
            out=str(tmp_path / name),
            metrics=str(tmp_path / f"{name}.parquet"),
            iteration=1,
        )
        run(cfg, args)
        weights.append(load_model(args.out).state_dict())
        tables.append(read_table(args.metrics, schemas.TRAIN_METRICS))
    for k in weights[0]:
        assert torch.equal(weights[0][k], weights[1][k]), k
    m = tables[0]
    assert m["step"].to_list() == [0, 1, 2, 3] and m["sequences"].to_list() == [6, 2, 6, 2]
    assert m["approx_kl"][1:].max() > 0  # later steps see a policy that moved
    assert m.drop(WALL).equals(tables[1].drop(WALL))


def test_slurm_variables_map_to_torch_distributed(monkeypatch):
    for k, v in dict(
        SLURM_PROCID="3", SLURM_LOCALID="1", SLURM_NTASKS="4", SLURM_JOB_ID="20042", SLURM_JOB_NODELIST="node[7-8]"
    ).items():
        monkeypatch.setenv(k, v)
    assert init_distributed_env() == (3, 4)
    assert os.environ["LOCAL_RANK"] == "1" and os.environ["WORLD_SIZE"] == "4"
    assert os.environ["MASTER_PORT"] == str(20000 + 20042 % 20000) and os.environ["MASTER_ADDR"]


# ------------------------------------------------------------------------------------------
# The stage with rollout correction, extra terms and schedules
# ------------------------------------------------------------------------------------------


def test_mfu_counts_the_model_flops_by_hand(policy_dir, features_path, tmp_path, monkeypatch):
    """The train metrics' mfu against FLOPs counted by hand for the tiny GPT-2 (one layer, d = 32,
    the char vocabulary V, tied head): body = ln_1 2d + c_attn (d x 3d + 3d) + attn c_proj (d^2 + d)
    + ln_2 2d + c_fc (d x 4d + 4d) + mlp c_proj (4d x d + d) + ln_f 2d = 12 d^2 + 15 d = 12,768;
    head = V x d (the tied wte, once); wpe, a lookup, nothing. One step over all rows with the KL
    term's reference (the same policy): 8 x (body x prompt and response tokens + head x response
    tokens), over step_time_s and a peak of 1 TFLOP/s (patched in: a CPU has none). Llama (untied,
    no biases): body = q, k, v, o 4 d^2 + gate, up, down 3 x d x 4d + 2 norms per layer and a final
    one 3d = 16,480, head V x d; its input embedding, a lookup, nothing."""
    from otbflow.stages import train as train_stage
    from otbflow.training import hardware

    V = len(build_char_tokenizer())
    assert hardware.matmul_parameters(load_model(policy_dir)) == (12_768, 32 * V)
    llama = build_tiny_model(make_cfg("model.arch=llama").model, build_char_tokenizer(), seed=0)
    assert hardware.matmul_parameters(llama) == (16_480, 32 * V)

    df = read_table(features_path, schemas.FEATURES)
    prompt = sum(map(len, df["prompt_ids"].to_list()))
    response = sum(map(len, df["response_ids"].to_list()))
    monkeypatch.setattr(train_stage, "device_peak", lambda device: 1.0)
    rows = {}
    for name, extra in [("plain", []), ("kl", ["train.kl_coef=0.5"])]:
        metrics, _ = run_stage(
            policy_dir,
            features_path,
            tmp_path,
            f"train.mini_batch_size={df.height}",
            *extra,
            name=name,
            **({"reference": str(policy_dir)} if extra else {}),
        )
        rows[name] = metrics.row(0, named=True)
        assert rows[name]["sequences"] == df.height and rows[name]["nonpad_tokens"] == prompt + response
    for name, per in [("plain", 6), ("kl", 8)]:
        flops = per * (12_768 * (prompt + response) + 32 * V * response)
        assert rows[name]["mfu"] == pytest.approx(flops / rows[name]["step_time_s"] / 1e12, rel=1e-12)


def test_trm_masks_sequences_but_keeps_the_pre_mask_normaliser(policy_dir, features_path, tmp_path):
    df = read_table(features_path, schemas.FEATURES)
    k2 = float(df["seq_max_k2"].median())
    accept = trm_keep(df["seq_max_k2"].to_numpy(), df["seq_mean_k3"].to_numpy(), k2, 1e9)
    assert 0 < accept.sum() < len(accept)
    adv = random_advantages(features_path)
    m, _ = run_stage(
        policy_dir,
        features_path,
        tmp_path,
        "train.trm=true",
        f"mismatch.max_k2={k2}",
        "mismatch.mean_k3=1e9",
        "train.mini_batch_size=8",
        adv=adv,
    )
    row = m.row(0, named=True)
    tokens = int(df["response_length"].sum())
    expected = -sum(a * sum(x) for a, x in zip(accept, adv)) / tokens  # first step: r = 1, L = -A
    assert row["trm_acceptance"] == pytest.approx(accept.mean())
    assert row["tokens"] == tokens and row["loss"] == pytest.approx(expected, rel=1e-5)
    assert row["log_ppl_abs_diff"] == pytest.approx(df["log_ppl_abs_diff"].mean(), rel=1e-6)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_truncated_is_weights_scale_the_ppo_loss(policy_dir, features_path, tmp_path, level):
    df = read_table(features_path, schemas.FEATURES)
    adv = random_advantages(features_path)
    log_rho = [
        np.asarray(a) - np.asarray(b) for a, b in zip(df["logprobs"].to_list(), df["rollout_logprobs"].to_list())
    ]
    if level == "token":
        w = [np.minimum(np.exp(x), 1.5) for x in log_rho]
    else:
        w = [np.full(len(x), min(np.exp(x.sum()), 1.5)) for x in log_rho]
    m, _ = run_stage(
        policy_dir,
        features_path,
        tmp_path,
        f"train.rollout_is={level}",
        "train.rollout_is_threshold=1.5",
        "train.mini_batch_size=8",
        adv=adv,
    )
    row = m.row(0, named=True)
    tokens = int(df["response_length"].sum())
    assert row["loss"] == pytest.approx(-sum(np.dot(a, x) for a, x in zip(adv, w)) / tokens, rel=1e-5)
    assert row["is_weight_mean"] == pytest.approx(sum(x.sum() for x in w) / tokens, rel=1e-5)
    assert row["is_weight_max"] == pytest.approx(max(x.max() for x in w), rel=1e-6)


def test_reinforce_loss_on_policy_has_the_ppo_gradient(policy_dir, features_path, tmp_path):
    df = read_table(features_path, schemas.FEATURES)
    adv = random_advantages(features_path)
    ppo, _ = run_stage(policy_dir, features_path, tmp_path, "train.mini_batch_size=8", adv=adv, name="ppo")
    rf, _ = run_stage(
        policy_dir, features_path, tmp_path, "train.mini_batch_size=8", "train.loss_type=reinforce", adv=adv, name="rf"
    )
    tokens = int(df["response_length"].sum())
    lp = df["logprobs"].to_list()
    assert rf["loss"][0] == pytest.approx(-sum(np.dot(a, x) for a, x in zip(adv, lp)) / tokens, rel=1e-5)
    # at r = 1 both gradients are -sum A grad log pi / tokens
    assert rf["grad_norm"][0] == pytest.approx(ppo["grad_norm"][0], rel=1e-5)


def test_loss_type_takes_the_registered_losses(policy_dir, features_path, tmp_path):
    """train.loss_type's values are the registry's names: the config refuses a name nobody
    registered, accepts it once a function is registered under it, and the train stage then trains
    with that function; unregistered, the name is refused again."""
    df = read_table(features_path, schemas.FEATURES)
    adv = random_advantages(features_path)
    assert {n: POLICY_LOSSES[n].is_mode for n in ("ppo_clip", "reinforce")} == {
        "ppo_clip": "decoupled",  # rho = pi_old / pi_rollout (algorithms.md §6.5)
        "reinforce": "bypass",  # rho = pi_theta / pi_rollout (algorithms.md §6.4)
    }
    with pytest.raises(ConfigError, match="train.loss_type"):
        make_cfg("train.loss_type=half_reinforce")
    with pytest.raises(ValueError, match="registered twice"):
        register_policy_loss("reinforce", is_mode="bypass")(reinforce_loss)
    with pytest.raises(ValueError, match="is_mode"):
        register_policy_loss("half_reinforce", is_mode="coupled")

    @register_policy_loss("half_reinforce", is_mode="bypass")
    def half_reinforce(logp, old_logp, adv, is_w, tc):
        return -0.5 * adv * logp * is_w.detach(), logp.new_zeros(logp.shape).bool()

    try:
        m, _ = run_stage(
            policy_dir, features_path, tmp_path, "train.mini_batch_size=8", "train.loss_type=half_reinforce", adv=adv
        )
    finally:
        del POLICY_LOSSES["half_reinforce"]
    tokens = int(df["response_length"].sum())
    lp = df["logprobs"].to_list()
    assert m["loss"][0] == pytest.approx(-0.5 * sum(np.dot(a, x) for a, x in zip(adv, lp)) / tokens, rel=1e-5)
    with pytest.raises(ConfigError, match="train.loss_type"):
        make_cfg("train.loss_type=half_reinforce")


def test_kl_and_entropy_terms(policy_dir, features_path, tmp_path):
    adv = random_advantages(features_path)
    base, _ = run_stage(policy_dir, features_path, tmp_path, "train.mini_batch_size=8", adv=adv, name="base")
    ent, _ = run_stage(
        policy_dir, features_path, tmp_path, "train.mini_batch_size=8", "train.entropy_coef=1.0", adv=adv, name="ent"
    )
    assert ent["loss"][0] == pytest.approx(base["loss"][0] - base["entropy"][0], rel=1e-5)
    assert abs(ent["grad_norm"][0] - base["grad_norm"][0]) > 1e-4  # the bonus has a gradient
    with pytest.raises(SchemaError, match="--reference"):
        run_stage(policy_dir, features_path, tmp_path, "train.kl_coef=0.5", adv=adv, name="noref")
    kl, _ = run_stage(
        policy_dir,
        features_path,
        tmp_path,
        "train.mini_batch_size=8",
        "train.ppo_epochs=3",
        "train.kl_coef=0.5",
        adv=adv,
        name="kl",
        reference=str(policy_dir),
    )
    assert kl["kl_ref"][0] == pytest.approx(0.0, abs=1e-9)  # pi_theta = pi_ref before the first update
    assert kl["kl_ref"][1] > 0 and kl["kl_ref"][2] > 0


@pytest.mark.parametrize("rollout_is,mode", [("none", "seq-mean-token-sum-norm"), ("token", "token-mean")])
def test_variance_proxies_against_the_spec(policy_dir, features_path, tmp_path, rollout_is, mode):
    """algorithms.md §1.8, from independent computations: S is the squared norm of the step's
    gradient taken with plain torch autograd, sequence by sequence; P a loop over sequences of
    max(W_i, 0) Abar_i^2 (x (mean_t rho_i,t)^2 with rollout IS), W_i = sum_t 1 - 2 pi + sum_v p_v^2
    from a plain softmax; V = max(0, (P - S) / (N - 1)). Dr.GRPO's constant C = 100 makes S < P,
    so that V is not 0 in the first case."""
    df = read_table(features_path, schemas.FEATURES)
    rng = np.random.default_rng(5)
    adv = [rng.normal(size=n).tolist() for n in df["response_length"].to_list()]  # varies within a sequence
    m, _ = run_stage(
        policy_dir,
        features_path,
        tmp_path,
        "train.mini_batch_size=8",
        f"train.rollout_is={rollout_is}",
        "train.rollout_is_threshold=1.5",
        f"train.loss_agg_mode={mode}",
        "train.loss_scale_factor=100",
        adv=adv,
    )
    row = m.row(0, named=True)

    model = load_model(policy_dir)
    norm = int(df["response_length"].sum()) if mode == "token-mean" else len(adv) * 100.0
    loss, power = torch.zeros(()), []
    for prompt, response, a, old, rollout in zip(
        df["prompt_ids"].to_list(),
        df["response_ids"].to_list(),
        adv,
        df["logprobs"].to_list(),
        df["rollout_logprobs"].to_list(),
    ):
        logp, logp_all = plain_token_stats(model, prompt, response)
        p = logp_all.exp()
        rho = [min(np.exp(o - r), 1.5) if rollout_is == "token" else 1.0 for o, r in zip(old, rollout)]
        loss = loss - sum(float(w) * float(x) * lp for w, x, lp in zip(rho, a, logp)) / norm  # r = 1: L = -w A r
        with torch.no_grad():
            pi = logp.exp()
            w_i = float(sum(1 - 2 * pi[t] + (p[t] ** 2).sum() for t in range(len(response))))
        abar = sum(a) / len(a)
        power.append(max(w_i, 0.0) * abar**2 * (np.mean(rho) ** 2 if rollout_is == "token" else 1.0))
    grads = torch.autograd.grad(loss, [q for q in model.parameters()])
    s = float(sum((g.double() ** 2).sum() for g in grads))
    p_ref = float(np.mean(power))
    assert row["proxy1_signal_strength"] == pytest.approx(s, rel=1e-5)
    assert row["proxy2_total_power"] == pytest.approx(p_ref, rel=1e-4)
    assert row["proxy3_pure_noise"] == pytest.approx(max(0.0, (p_ref - s) / (len(adv) - 1)), rel=1e-4, abs=1e-12)
    assert (row["proxy3_pure_noise"] > 0) == (mode == "seq-mean-token-sum-norm")
    assert row["mean_response_length"] == pytest.approx(df["response_length"].mean())


# ------------------------------------------------------------------------------------------
# The first ratio of an iteration
# ------------------------------------------------------------------------------------------


def features_then_train(cfg, policy_dir, tmp_path):
    """The random rollouts through the real features stage, random advantages, then the real train
    stage: (its metrics table, the features table's path)."""
    write_rollouts(tmp_path / "rollouts.parquet")
    feats = tmp_path / "features.parquet"
    features.run(
        cfg, features.Args(rollouts=str(tmp_path / "rollouts.parquet"), policy=str(policy_dir), out=str(feats))
    )
    write_advantages(feats, tmp_path / "adv.parquet", random_advantages(feats))
    args = Args(
        advantages=str(tmp_path / "adv.parquet"),
        policy=str(policy_dir),
        out=str(tmp_path / "next"),
        metrics=str(tmp_path / "metrics.parquet"),
        checkpoint_dir=str(tmp_path / "ckpt"),
    )
    run(cfg, args)
    return read_table(args.metrics, schemas.TRAIN_METRICS), feats


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_first_ratio_is_one(dropout_policy_dir, tmp_path, precision):
    """A GPT-2 with dropout 0.1 everywhere, through the real features and train stages, with other
    batch shapes in each (features: 5 sequences per pass, chunks of 1024 positions; train: 3
    sequences per micro-batch, chunks of 7): at the first optimizer step log pi_theta - log pi_old
    is 0 to 1e-6 on every token. fp32: a few ulp (4.8e-7 measured; the matmuls round differently
    for other batch shapes); bf16 (ZeRO-1, DeepSpeed's cast; the features stage casts alike): 0,
    bitwise, on the 2-core CPU VM. Before (train mode, features at model.dtype) this model gave
    0.10 (dropout) and 1.5e-3 (bf16 training, fp32 features)."""
    overrides = [
        "train.mini_batch_size=6",
        "train.micro_batch_size=3",
        "features.batch_size=5",
        "train.logprob_chunk_size=7",
    ]
    if precision == "bf16":
        overrides += ["train.bf16=true", "train.zero_stage=1"]
    cfg = make_cfg(*overrides)
    m, feats = features_then_train(cfg, dropout_policy_dir, tmp_path)
    # a bf16 discrepancy would be orders of magnitude above 1e-6 (0 measured: bitwise)
    assert m["max_abs_log_ratio"][0] <= 1e-6 and m["clip_fraction"][0] == 0.0
    assert m["max_abs_log_ratio"][1] > 1e-3  # the metric is live: the second step sees the updated policy


def test_the_first_ratio_is_one_with_pruning(dropout_policy_dir, tmp_path):
    """rollout.min_p on (rho = 0.55: the untrained policy is nearly flat), through the real features
    and train stages with other batch shapes in each: the first step's log pi_theta equals pi_old
    to 1e-6 on every token, the random responses' tokens outside the safe set force-included by
    both stages alike; the step's pruning metrics are live (0 < pruned share < 1, mass > 0,
    force-included tokens counted), and the features stage counted the same force-included tokens."""
    cfg = make_cfg(
        "rollout.min_p=0.55",
        "train.mini_batch_size=8",
        "train.micro_batch_size=4",
        "features.batch_size=5",
        "train.logprob_chunk_size=7",
    )
    m, feats = features_then_train(cfg, dropout_policy_dir, tmp_path)
    assert m["max_abs_log_ratio"][0] <= 1e-6 and m["clip_fraction"][0] == 0.0
    assert 0.0 < m["pruned_vocab_fraction"][0] < 1.0 and m["pruned_mass"][0] > 0.0
    f = read_table(feats, schemas.FEATURES)
    # every row is in the first step (mini_batch_size = N_SEQ): the same tokens force-included
    assert m["forced_tokens"][0] == f["forced_tokens"].sum() > 0


# ------------------------------------------------------------------------------------------
# Two ranks (a subprocess: torchrun)
# ------------------------------------------------------------------------------------------


def test_two_ranks_give_the_full_batch_gradient(policy_dir, features_path, tmp_path):
    """torchrun --nproc_per_node 2 on CPU (gloo), one run per aggregation mode: uneven rank slices
    (4 + 4 rows of a 9-row mini-batch) and micro-batches (3 + 1)."""
    import json
    import subprocess
    import sys

    from omegaconf import OmegaConf

    from otbflow.io import read_metadata

    df = write_advantages(features_path, tmp_path / "adv.parquet", random_advantages(features_path))
    jobs, cfgs = [], {}
    for mode in MODES:
        cfgs[mode] = make_cfg("train.mini_batch_size=9", "train.micro_batch_size=3", f"train.loss_agg_mode={mode}")
        (tmp_path / f"{mode}.yaml").write_text(OmegaConf.to_yaml(cfgs[mode]))
        jobs.append(
            {
                "config": str(tmp_path / f"{mode}.yaml"),
                "advantages": str(tmp_path / "adv.parquet"),
                "policy": str(policy_dir),
                "out": str(tmp_path / mode),
                "metrics": str(tmp_path / f"{mode}.parquet"),
            }
        )
    jobs[0]["optimizer"] = str(tmp_path / "opt")  # ZeRO-0 state of 2 ranks
    # with a KL term: the policy and the reference whole on every rank (ZeRO-0), then partitioned
    # while they load (ZeRO-3)
    for zero in (0, 3):
        kl = make_cfg("train.kl_coef=0.5", f"train.zero_stage={zero}", "train.mini_batch_size=8", "train.ppo_epochs=2")
        (tmp_path / f"kl_zero{zero}.yaml").write_text(OmegaConf.to_yaml(kl))
        jobs.append(
            {
                "config": str(tmp_path / f"kl_zero{zero}.yaml"),
                "advantages": str(tmp_path / "adv.parquet"),
                "policy": str(policy_dir),
                "reference": str(policy_dir),
                "out": str(tmp_path / f"kl_zero{zero}"),
                "metrics": str(tmp_path / f"kl_zero{zero}.parquet"),
            }
        )
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["OTBFLOW_THREADS"] = "1"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(Path(__file__).with_name("two_rank_worker.py")),
            str(tmp_path / "jobs.json"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    for mode in MODES:
        assert read_metadata(tmp_path / f"{mode}.parquet")["world_size"] == 2
        row = read_table(tmp_path / f"{mode}.parquet", schemas.TRAIN_METRICS).row(0, named=True)
        loss, norm = full_batch_grad_norm(load_model(policy_dir), df, mode, cfgs[mode])
        assert row["loss"] == pytest.approx(loss, rel=1e-5, abs=1e-7), mode
        assert row["grad_norm"] == pytest.approx(norm, rel=1e-5), mode
    # ZeRO-3: each rank held its half of the policy's and of the reference's elements once loaded
    # (the halves padded to the ranks), and the update is the one of the whole models
    loads = re.findall(r"loaded partitioned \(ZeRO-3\): rank (\d) holds (\d+) of its (\d+) parameter", res.stderr)
    assert sorted(rank for rank, _, _ in loads) == ["0", "0", "1", "1"], res.stderr[-3000:]
    params = list(load_model(policy_dir).parameters())
    total = sum(p.numel() for p in params)
    for _, held, of in loads:  # each parameter's half padded by at most one element
        assert int(of) == total and total / 2 <= int(held) <= total / 2 + len(params)
    whole, partitioned = load_model(tmp_path / "kl_zero0").state_dict(), load_model(tmp_path / "kl_zero3").state_dict()
    assert whole.keys() == partitioned.keys()
    # to within 0.1% of how far the weights moved: ZeRO-3 reduces the gradients in another order
    # (measured: 3.3e-6 at most, on a zero-initialised bias, against moves of 0.02); a rank that
    # trained from anything but the checkpoint's values would be off by the weights themselves
    initial = load_model(policy_dir).state_dict()
    moved = max(float((whole[k] - initial[k]).abs().max()) for k in whole)
    assert moved > 1e-3
    for k in whole:
        assert float((whole[k] - partitioned[k]).abs().max()) <= 1e-3 * moved, k
    kl = [read_table(tmp_path / f"kl_zero{z}.parquet", schemas.TRAIN_METRICS)["kl_ref"] for z in (0, 3)]
    assert kl[0].to_list() == pytest.approx(kl[1].to_list(), rel=1e-6, abs=1e-12) and kl[0].max() > 0
    # a world size that changes between iterations is refused, before any work
    with pytest.raises(OptimizerStateError, match=r"saved by 2 rank\(s\).*this job runs 1 rank\(s\)"):
        run(
            cfgs[MODES[0]],
            Args(
                advantages=str(tmp_path / "adv.parquet"),
                policy=str(tmp_path / MODES[0]),
                out=str(tmp_path / "next"),
                metrics=str(tmp_path / "next.parquet"),
                prev_optimizer=str(tmp_path / "opt"),
            ),
        )


def test_a_streamed_table_one_version_behind_trains_what_s1_trains(policy_dir, tmp_path):
    """rollout.stream with every token exactly one version behind: the table of iteration 1 records
    token_versions [0, 0, ...] beside behaviour_iteration 0. Through the features stage (the
    current policy as pi_prox) and the train stage with the same advantages, it trains what the
    s = 1 table without them trains: the same metrics, the same policy, bit for bit."""
    import polars as pl

    from otbflow.stages import features

    cfg = make_cfg("rollout.staleness=1", "train.rollout_is=token")
    write_rollouts(tmp_path / "base.parquet")
    s1 = read_table(tmp_path / "base.parquet", schemas.ROLLOUTS).with_columns(pl.lit(1).alias("iteration"))
    streamed = s1.with_columns(token_versions=pl.Series([[0] * n for n in s1["response_length"]], dtype=schemas.I64L))
    out = {}
    for name, table in (("s1", s1), ("stream", streamed)):
        work = tmp_path / name
        work.mkdir()
        write_parquet(table, work / "rollouts.parquet")
        feats = work / "features.parquet"
        rollouts = str(work / "rollouts.parquet")
        features.run(cfg, features.Args(rollouts=rollouts, policy=str(policy_dir), out=str(feats)))
        metrics, args = run_stage(
            policy_dir, feats, work, "rollout.staleness=1", "train.rollout_is=token", adv=random_advantages(feats)
        )
        out[name] = (metrics.drop(WALL), load_model(args.out).state_dict())
    assert out["s1"][0].equals(out["stream"][0])
    assert all(torch.equal(v, out["stream"][1][k]) for k, v in out["s1"][1].items())
