"""The live curves (otbflow.runtime.tracking): the train and evaluate stages' TensorBoard event files, read
back with TensorBoard's own reader, and their offline W&B runs, read back from the run files."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import tiny_config

from otbflow import schemas
from otbflow.io import read_table, write_json
from otbflow.runtime.tracking import AXES, EventFile, masked_crc32c
from otbflow.stages import advantages, evaluate, train

TRAIN = ["train.mini_batch_size=4", "train.micro_batch_size=4", "train.checkpoint_every=1"]
WANDB = ["tracking.wandb.project=otbflow-tests", "tracking.wandb.mode=offline"]


def scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of a TensorBoard run folder, by tag: (step, value) in the order written."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def wandb_records(run_file: Path) -> list:
    """The records of a W&B run file (run-<id>.wandb): a 7-byte header (':W&B', magic, version),
    then a LevelDB log: 32 KiB blocks of pieces (CRC-32C, length, type, data), a record split
    over blocks in FIRST, MIDDLE and LAST pieces; each record a wandb ``Record`` protobuf."""
    from wandb.proto.wandb_internal_pb2 import Record

    data, block = run_file.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, records, pending = 7, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a piece's header: padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # zeros up to the block's end
            pos += block - pos % block
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST
            records.append(Record.FromString(pending))
            pending = b""
    return records


def finished_records(run_file: Path) -> list:
    """The records of a finished W&B run file (its last one the exit record); [] while W&B is
    still writing it (a record cut short parses as an error)."""
    from google.protobuf.message import DecodeError

    try:
        records = wandb_records(run_file)
    except DecodeError:
        return []
    return records if records and records[-1].WhichOneof("record_type") == "exit" else []


def wandb_run(results: Path, name: str) -> tuple:
    """The one offline W&B run folder of job ``name`` under ``results``: its run record and its
    history rows (key -> value); every chart's x-axis is the step (define_metric)."""
    folders = [p for p in (results / "wandb").glob("offline-run-*") if p.name.endswith(name.replace("/", "-"))]
    assert len(folders) == 1, folders
    # W&B's own process writes the file and finishes it after run.finish() returned (which only
    # informs it): on a loaded machine the file held its header alone at first
    run_file, deadline = next(folders[0].glob("run-*.wandb")), time.monotonic() + 60
    while not (records := finished_records(run_file)):
        assert time.monotonic() < deadline, f"{run_file} holds no exit record after 60 s"
        time.sleep(0.1)
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    axes = {r.metric.glob_name or r.metric.name: r.metric.step_metric for r in records if r.metric.step_metric}
    assert axes == {"train/*": "progress/step", "evaluate/*": "progress/step"} | dict.fromkeys(AXES, "progress/step")
    rows = []
    for r in records:
        if r.WhichOneof("record_type") == "history":
            rows.append({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item})
    return run, rows


@pytest.fixture(scope="module")
def advantages_path(tmp_path_factory, cfg, features_path):
    out = tmp_path_factory.mktemp("advantages")
    advantages.run(
        cfg,
        advantages.Args(
            features=[str(features_path)], out=str(out / "advantages.parquet"), comparison=str(out / "c.parquet")
        ),
    )
    return out / "advantages.parquet"


def run_train(tmp_path, results, policy, adv, *overrides, name="next"):
    """Iteration 1's train job after 10 optimizer steps and 1000 tokens (its --prev-state)."""
    write_json({"step": 10, "tokens": 1000}, tmp_path / "prev.json")
    args = train.Args(
        advantages=str(adv),
        policy=str(policy),
        out=str(tmp_path / name),
        metrics=str(tmp_path / f"{name}.parquet"),
        state=str(tmp_path / f"{name}.json"),
        prev_state=str(tmp_path / "prev.json"),
        checkpoint_dir=str(tmp_path / f"{name}.ckpt"),
        iteration=1,
        tracking_name="train/iter_1",
    )
    train.run(tiny_config(*TRAIN, f"results_dir={results}", *overrides), args)
    return read_table(args.metrics, schemas.TRAIN_METRICS)


def test_train_curves_are_the_metrics_per_step(tmp_path, tiny_policy, advantages_path, monkeypatch):
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    results = tmp_path / "results"
    metrics = run_train(tmp_path, results, tiny_policy, advantages_path, *WANDB)
    assert metrics.height == 4
    steps = [10 + i for i in range(metrics.height)]
    tokens = (1000 + np.cumsum(metrics["tokens"].to_numpy())).tolist()
    folder = results / "tensorboard" / "train" / "iter_1"
    curves = scalars(folder)
    for col in ("loss", "lr", "grad_norm", "clip_fraction", "entropy", "is_weight_mean", "tokens"):
        assert [s for s, _ in curves[f"train/{col}"]] == steps, col
        assert [v for _, v in curves[f"train/{col}"]] == pytest.approx(metrics[col].to_list(), rel=1e-6), col
    assert curves["progress/tokens"] == [(s, t) for s, t in zip(steps, tokens)]
    assert curves["progress/iteration"] == [(s, 1.0) for s in steps]
    assert json.loads((tmp_path / "next.json").read_text())["tokens"] == tokens[-1]  # the next iteration's start

    run, rows = wandb_run(results, "train/iter_1")
    group = json.loads((results / "wandb" / "workflow.json").read_text())["group"]
    assert (run.display_name, run.run_group, run.job_type) == ("train/iter_1", group, "train")
    assert run.project == "otbflow-tests" and group.startswith(f"{tmp_path.name}-")
    assert [r["progress/step"] for r in rows] == steps and [r["progress/tokens"] for r in rows] == tokens
    assert [r["train/loss"] for r in rows] == pytest.approx(metrics["loss"].to_list(), rel=1e-12)

    # the same job again: one set of points, not two (TensorBoard folder and W&B run replaced)
    run_train(tmp_path, results, tiny_policy, advantages_path, *WANDB)
    assert len(list(folder.glob("events.out.tfevents.*"))) == 1
    assert scalars(folder)["train/loss"] == curves["train/loss"]
    assert len(wandb_run(results, "train/iter_1")[1]) == metrics.height


def test_a_resumed_train_job_writes_every_step_once(tmp_path, tiny_policy, advantages_path, monkeypatch):
    """A job that fails after 2 steps leaves its curves up to there; the rerun resumes from the
    checkpoint and writes the steps it holds again, into a new folder: all 4 steps, once each."""
    results = tmp_path / "results"
    whole = run_train(tmp_path, tmp_path / "whole_results", tiny_policy, advantages_path, name="whole")
    step, calls = train.Trainer.step, []

    def failing(self, *a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("node lost")
        return step(self, *a, **k)

    monkeypatch.setattr(train.Trainer, "step", failing)
    with pytest.raises(RuntimeError, match="node lost"):
        run_train(tmp_path, results, tiny_policy, advantages_path)
    folder = results / "tensorboard" / "train" / "iter_1"
    assert [s for s, _ in scalars(folder)["train/loss"]] == [10, 11]  # flushed as it went
    monkeypatch.setattr(train.Trainer, "step", step)
    resumed = run_train(tmp_path, results, tiny_policy, advantages_path)
    assert (tmp_path / "next.parquet").is_file() and resumed.height == 4
    curves = scalars(folder)
    assert curves == scalars(tmp_path / "whole_results" / "tensorboard" / "train" / "iter_1") | {
        "train/step_time_s": curves["train/step_time_s"],
        "train/tokens_per_s": curves["train/tokens_per_s"],
        "train/mfu": curves["train/mfu"],  # NaN on a CPU (NaN != NaN)
    }
    assert [v for _, v in curves["train/loss"]] == pytest.approx(whole["loss"].to_list(), rel=1e-6)


def run_evaluate(tmp_path, results, policy, data_dir, *overrides, train_state=None):
    args = evaluate.Args(
        prompts=str(data_dir / "eval.parquet"),
        policy=str(policy),
        name="iter_0",
        samples=str(tmp_path / "samples.parquet"),
        summary=str(tmp_path / "summary.parquet"),
        iteration=0,
        train_state=str(train_state) if train_state else "",
        tracking_name="evaluate/iter_0",
    )
    cfg = tiny_config("evaluate.n_samples=2", "evaluate.max_new_tokens=8", f"results_dir={results}", *overrides)
    evaluate.run(cfg, args)
    return read_table(args.summary, schemas.EVAL_SUMMARY).row(0, named=True)


def test_evaluate_curves_are_the_summary(tmp_path, tiny_policy, data_dir, monkeypatch):
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    results = tmp_path / "results"
    write_json({"step": 7, "tokens": 123}, tmp_path / "schedule.json")
    summary = run_evaluate(tmp_path, results, tiny_policy, data_dir, *WANDB, train_state=tmp_path / "schedule.json")
    curves = scalars(results / "tensorboard" / "evaluate" / "iter_0")
    for col in ("greedy_accuracy", "sampled_accuracy", "mean_response_length"):
        assert curves[f"evaluate/{col}"] == [(7, pytest.approx(summary[col], rel=1e-6))], col
    assert curves["progress/tokens"] == [(7, 123.0)] and curves["progress/iteration"] == [(7, 0.0)]
    run, rows = wandb_run(results, "evaluate/iter_0")
    assert (run.display_name, run.job_type) == ("evaluate/iter_0", "evaluate")
    assert rows == [
        {
            **{f"evaluate/{k}": pytest.approx(v) for k, v in summary.items() if k not in ("policy", "iteration")},
            "progress/iteration": 0.0,
            "progress/tokens": 123.0,
            "progress/step": 7,
            "_step": 7,
            "_runtime": pytest.approx(rows[0]["_runtime"]),
            "_timestamp": pytest.approx(rows[0]["_timestamp"]),
        }
    ]
    # the initial policy: step 0, no tokens; no W&B: no new run folder
    run_evaluate(tmp_path, results, tiny_policy, data_dir)
    assert scalars(results / "tensorboard" / "evaluate" / "iter_0")["progress/tokens"] == [(0, 0.0)]
    assert len(list((results / "wandb").glob("offline-run-*"))) == 1


def test_no_tracking_name_no_curves(tmp_path, tiny_policy, data_dir):
    """A stage run by hand (no --tracking-name) writes no curves, even with tracking on."""
    evaluate.run(
        tiny_config("evaluate.n_samples=1", "evaluate.max_new_tokens=4", f"results_dir={tmp_path / 'results'}"),
        evaluate.Args(
            prompts=str(data_dir / "eval.parquet"),
            policy=str(tiny_policy),
            name="initial",
            samples=str(tmp_path / "samples.parquet"),
            summary=str(tmp_path / "summary.parquet"),
        ),
    )
    assert not (tmp_path / "results").exists()


def test_tensorboard_off_writes_no_event_file(tmp_path, tiny_policy, data_dir):
    run_evaluate(tmp_path, tmp_path / "results", tiny_policy, data_dir, "tracking.tensorboard=false")
    assert not (tmp_path / "results" / "tensorboard").exists()


def test_event_file_framing_against_tensorboard(tmp_path):
    """The hand-written TFRecord framing and protobuf messages, against TensorBoard's own CRC and
    reader: negative and large values, steps past 2^31, NaN."""
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as reference

    for data in (b"", b"a", bytes(range(256)) * 3):
        assert masked_crc32c(data) == reference(data)
    events = EventFile(tmp_path)
    events.scalars(3, {"a": -2.5, "b": 1e39})
    events.scalars(2**40, {"a": float("nan"), "b": 0.0})
    events.close()
    got = scalars(tmp_path)
    assert got["a"][0] == (3, -2.5) and got["a"][1][0] == 2**40 and np.isnan(got["a"][1][1])
    assert got["b"] == [(3, float("inf")), (2**40, 0.0)]
