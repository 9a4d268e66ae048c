"""The train stage when things go wrong: a step whose loss overflows is skipped and consecutive ones
fail the job, non-finite inputs are refused before any work, a job killed with kill -9 resumes
to the weights of an uninterrupted one, and a full disk fails the job with ENOSPC and leaves
nothing."""

from __future__ import annotations

import os
import re
from pathlib import Path

import polars as pl
import pytest
import torch
import train_helpers
from train_helpers import WALL, load_model, make_cfg, random_advantages, run_stage, write_advantages

from otbflow import schemas
from otbflow.io import SchemaError, read_table, write_parquet
from otbflow.stages.train import Args, run

# the module-scoped fixtures of train_helpers: this file's own policy and features
policy_dir = train_helpers.policy_dir
features_path = train_helpers.features_path


# ------------------------------------------------------------------------------------------
# Non-finite steps
# ------------------------------------------------------------------------------------------


def overflowing_advantages(features_path):
    """Row 0's advantages are finite but 3e38 (float32's largest is 3.4e38): the loss of the step
    holding it overflows to infinity. (NaN or infinite advantages are refused when the table is
    read: test_non_finite_inputs_are_refused_before_any_work.)"""
    adv = random_advantages(features_path)
    adv[0] = [3e38] * len(adv[0])
    return adv


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_a_non_finite_step_is_skipped(policy_dir, features_path, tmp_path, zero_stage):
    """Row 0's advantages overflow the loss: the step holding it makes no update, the other one does."""
    m, args = run_stage(
        policy_dir,
        features_path,
        tmp_path,
        "train.mini_batch_size=4",
        "train.micro_batch_size=2",
        f"train.zero_stage={zero_stage}",
        adv=overflowing_advantages(features_path),
    )
    assert m["skipped"].sum() == 1 and m.filter(pl.col("skipped"))["event"][0].startswith("skipped")
    assert m.filter(~pl.col("skipped"))["grad_norm"].is_finite().all()
    after = load_model(args.out)
    assert all(torch.isfinite(p).all() for p in after.parameters())
    assert any(not torch.equal(p, q) for p, q in zip(load_model(policy_dir).parameters(), after.parameters()))


def test_consecutive_non_finite_steps_fail_the_job(policy_dir, features_path, tmp_path):
    overrides = ("train.mini_batch_size=8", "train.ppo_epochs=2")
    m, args = run_stage(
        policy_dir,
        features_path,
        tmp_path,
        *overrides,
        "train.max_consecutive_skips=3",
        adv=overflowing_advantages(features_path),
    )
    assert m["skipped"].to_list() == [True, True]
    for p, q in zip(load_model(policy_dir).parameters(), load_model(args.out).parameters()):
        assert torch.equal(p, q)  # nothing was applied
    with pytest.raises(RuntimeError, match="2 consecutive optimizer steps"):
        run_stage(policy_dir, features_path, tmp_path, *overrides, "train.max_consecutive_skips=2", name="fail")
    assert not (tmp_path / "fail").exists() and not (tmp_path / "fail.parquet").exists()


@pytest.mark.parametrize("column, token", [("rollout_logprobs", 1), ("advantages", 0), ("seq_mean_k3", None)])
def test_non_finite_inputs_are_refused_before_any_work(policy_dir, features_path, tmp_path, column, token):
    """Issue 35: a NaN in the train stage's input stops it before the engine starts, naming the
    file, the column, the row, its group and the token; nothing is written."""
    table = write_advantages(features_path, tmp_path / "adv.parquet", random_advantages(features_path))
    row = [i for i, n in enumerate(table["response_length"]) if n > (token or 0)][2]
    values = table[column].to_list()
    if token is None:
        values[row] = float("nan")
    else:
        values[row][token] = float("nan")
    write_parquet(table.with_columns(pl.Series(column, values, dtype=table.schema[column])), tmp_path / "adv.parquet")
    where = rf"row {row} \(group_id {table['group_id'][row]}\)" + (f" token {token}" if token is not None else "")
    with pytest.raises(SchemaError, match=rf"adv.parquet: column '{column}' {where}: nan is not a finite number"):
        run_stage(policy_dir, features_path, tmp_path)
    assert not (tmp_path / "run").exists() and not (tmp_path / "run.parquet").exists()
    assert not (tmp_path / "run.ckpt").exists()


# ------------------------------------------------------------------------------------------
# kill -9 then resume (a subprocess: the real CLI)
# ------------------------------------------------------------------------------------------


def cli_run(cfg, policy_dir, tmp_path, name, wait=True, extra=()):
    """``otbflow train`` as a subprocess with ``cfg`` as its YAML (and ``extra`` arguments)."""
    import subprocess
    import sys

    from omegaconf import OmegaConf

    (tmp_path / "cfg.yaml").write_text(OmegaConf.to_yaml(cfg))
    cmd = [
        sys.executable,
        "-m",
        "otbflow",
        "train",
        "--config",
        str(tmp_path / "cfg.yaml"),
        "--advantages",
        str(tmp_path / "adv.parquet"),
        "--policy",
        str(policy_dir),
        "--out",
        str(tmp_path / name),
        "--metrics",
        str(tmp_path / f"{name}.parquet"),
        "--checkpoint-dir",
        str(tmp_path / f"{name}.ckpt"),
        *extra,
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    log = open(tmp_path / f"{name}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    if wait:
        assert proc.wait(timeout=300) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
    return proc


def test_kill_9_then_rerun_resumes_to_the_same_weights(policy_dir, features_path, tmp_path, monkeypatch):
    """With an optimizer state carried in from a previous job and one written out: the resumed
    job ends with the weights and metrics of an uninterrupted one. No job compiles or loads a
    torch extension (DeepSpeed's CPU shared-memory op): nothing a killed job could leave locked."""
    import signal
    import time

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "torch_extensions"))

    write_advantages(features_path, tmp_path / "adv.parquet", random_advantages(features_path))
    cfg = make_cfg(
        "train.mini_batch_size=1",
        "train.micro_batch_size=1",
        "train.ppo_epochs=2",
        "train.checkpoint_every=1",
        "train.lr=1e-3",
        "seed=3",
    )
    run(
        make_cfg("train.mini_batch_size=8", "train.lr=1e-3"),
        Args(
            advantages=str(tmp_path / "adv.parquet"),
            policy=str(policy_dir),
            out=str(tmp_path / "prev"),
            metrics=str(tmp_path / "prev.parquet"),
            optimizer=str(tmp_path / "prev.opt"),
        ),
    )
    policy_dir = tmp_path / "prev"

    def io(name):
        return ("--prev-optimizer", str(tmp_path / "prev.opt"), "--optimizer", str(tmp_path / f"{name}.opt"))

    cli_run(cfg, policy_dir, tmp_path, "whole", extra=io("whole"))  # 16 steps, uninterrupted

    proc = cli_run(cfg, policy_dir, tmp_path, "killed", wait=False, extra=io("killed"))
    latest = tmp_path / "killed.ckpt" / "latest"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if latest.is_file() and latest.read_text().strip() >= "step_000004":
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.005)
    assert proc.wait(timeout=60) == -signal.SIGKILL, "the run ended before it could be killed"
    assert not (tmp_path / "killed").exists() and not (tmp_path / "killed.parquet").exists()
    assert not (tmp_path / "killed.opt").exists()

    cli_run(cfg, policy_dir, tmp_path, "killed", extra=io("killed"))  # the rerun: same command
    log = (tmp_path / "killed.log").read_text()
    step = int(__import__("re").search(r"resuming from the checkpoint in .* after step (\d+) of 16", log).group(1))
    assert 4 <= step < 16
    whole, resumed = load_model(tmp_path / "whole").state_dict(), load_model(tmp_path / "killed").state_dict()
    for k in whole:
        assert torch.equal(whole[k], resumed[k]), k
    a = read_table(tmp_path / "whole.parquet", schemas.TRAIN_METRICS).drop(WALL)
    b = read_table(tmp_path / "killed.parquet", schemas.TRAIN_METRICS).drop(WALL)
    assert a.equals(b)
    assert not (tmp_path / "killed.ckpt").exists()  # removed once the outputs are written
    assert (tmp_path / "killed.opt" / "meta.json").is_file() and not list(tmp_path.glob(".*.partial"))
    assert not (tmp_path / "torch_extensions").exists()
    # issue 53: the AdamW state the resumed job wrote (its param groups loaded from the checkpoint)
    # is the uninterrupted one's, byte for byte (training.state.canonical)
    files = sorted(p.relative_to(tmp_path / "whole.opt") for p in (tmp_path / "whole.opt" / "state").rglob("*.pt"))
    assert files and files == sorted(
        p.relative_to(tmp_path / "killed.opt") for p in (tmp_path / "killed.opt" / "state").rglob("*.pt")
    )
    for f in files:
        assert (tmp_path / "whole.opt" / f).read_bytes() == (tmp_path / "killed.opt" / f).read_bytes(), f


def test_latest_is_never_rewritten_in_place(policy_dir, features_path, tmp_path, monkeypatch):
    """The file ``latest`` that names the checkpoint to resume from is only ever replaced by a
    rename: DeepSpeed's own writer truncates it in place, and a job killed between its truncation
    and its write left it empty and the previous checkpoint unreachable (the kill -9 test above
    then trained from step 0: CI, 2026-11-28). Every open of a file named ``latest`` is recorded."""
    import builtins

    opened, real_open = [], builtins.open

    def recording_open(file, mode="r", *a, **k):
        if Path(str(file)).name == "latest":
            opened.append(mode)
        return real_open(file, mode, *a, **k)

    renamed, real_replace = [], os.replace

    def recording_replace(src, dst, *a, **k):
        if Path(str(dst)).name == "latest":
            renamed.append(Path(str(dst)).read_text() if Path(str(dst)).exists() else "")
        return real_replace(src, dst, *a, **k)

    monkeypatch.setattr(builtins, "open", recording_open)
    monkeypatch.setattr(os, "replace", recording_replace)
    run_stage(
        policy_dir,
        features_path,
        tmp_path,
        "train.mini_batch_size=2",
        "train.micro_batch_size=1",
        "train.checkpoint_every=1",
    )
    assert not [m for m in opened if set(m) & set("wax+")], opened
    # 8 rows in mini-batches of 2: 4 steps, a checkpoint after each but the last
    assert renamed == ["", "step_000001", "step_000002"]


# ------------------------------------------------------------------------------------------
# A full disk (a small tmpfs in a user and mount namespace: the real ENOSPC)
# ------------------------------------------------------------------------------------------


def small_tmpfs_works() -> bool:
    import shutil
    import subprocess

    if shutil.which("unshare") is None:
        return False
    probe = "mkdir -p /tmp && mount -t tmpfs -o size=4k tmpfs /mnt"
    return subprocess.run(["unshare", "-rm", "sh", "-c", probe], capture_output=True).returncode == 0


@pytest.mark.skipif(not small_tmpfs_works(), reason="needs unshare -rm to mount a small tmpfs (user namespaces)")
@pytest.mark.parametrize("target", ["checkpoint", "policy", "optimizer"])
def test_a_full_disk_fails_the_train_job_with_enospc_and_leaves_nothing(policy_dir, features_path, tmp_path, target):
    """One of the train job's writes on a 32 KiB tmpfs (the resumable checkpoint, the next policy,
    the optimizer state; everything else on the ordinary disk): the job fails naming errno 28 and
    a path on the full filesystem, not torch's "unexpected pos", and the tmpfs holds no temporary
    file and nothing that looks finished afterwards."""
    import subprocess
    import sys

    from omegaconf import OmegaConf

    write_advantages(features_path, tmp_path / "adv.parquet", random_advantages(features_path))
    cfg = make_cfg("train.mini_batch_size=4", "train.micro_batch_size=2", "train.checkpoint_every=1")
    (tmp_path / "cfg.yaml").write_text(OmegaConf.to_yaml(cfg))
    full = tmp_path / "full"
    full.mkdir()
    paths = {
        "checkpoint": tmp_path / "ckpt",
        "policy": tmp_path / "next",
        "optimizer": tmp_path / "opt",
    }
    paths[target] = full / target
    cmd = [
        sys.executable,
        "-m",
        "otbflow",
        "train",
        "--config",
        str(tmp_path / "cfg.yaml"),
        "--advantages",
        str(tmp_path / "adv.parquet"),
        "--policy",
        str(policy_dir),
        "--out",
        str(paths["policy"]),
        "--metrics",
        str(tmp_path / "metrics.parquet"),
        "--checkpoint-dir",
        str(paths["checkpoint"]),
        "--optimizer",
        str(paths["optimizer"]),
    ]
    # mount, run the job, then list what the tmpfs holds (it is gone with the namespace)
    script = 'mount -t tmpfs -o size=32k tmpfs "$0" && { "$@"; rc=$?; find "$0" -mindepth 1 > "$0.left"; exit $rc; }'
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    res = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script, str(full), *cmd], capture_output=True, text=True, env=env, timeout=300
    )
    log = res.stdout + res.stderr
    assert res.returncode != 0, log[-3000:]
    error = re.search(r"OSError: \[Errno 28\] No space left on device: '([^']+)'", log)
    assert error, log[-3000:]
    assert Path(error.group(1)).is_relative_to(full) and "unexpected pos" not in log
    left = [Path(p).relative_to(full) for p in (tmp_path / "full.left").read_text().split()]
    # the checkpoint folder keeps its fingerprint stamp (written before the first step), nothing else
    assert [str(p) for p in left] == (["checkpoint", "checkpoint/fingerprint"] if target == "checkpoint" else []), left
    assert not (tmp_path / "metrics.parquet").exists()
