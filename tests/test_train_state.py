"""What the train stage carries from one iteration to the next (otbflow.training.state): the LR
schedule's state, the optimizer state that chains jobs into one AdamW and is refused where it
does not fit, the checkpoint fingerprint, a results folder's DeepSpeed files read as data (a
planted pickle is refused, not run), and checkpoint files whose bytes follow their content."""

from __future__ import annotations

import os
from pathlib import Path

import polars as pl
import pytest
import torch
import train_helpers
from safetensors.torch import load_file
from train_helpers import load_model, make_cfg, random_advantages, run_stage, write_advantages

from otbflow.models.policy import build_char_tokenizer
from otbflow.stages.train import Args, run
from otbflow.training import state as train_state
from otbflow.training.distributed import init_distributed_env
from otbflow.training.publish import published_dtype
from otbflow.training.state import OptimizerStateError

# the module-scoped fixtures of train_helpers: this file's own policy and features
policy_dir = train_helpers.policy_dir
features_path = train_helpers.features_path


# ------------------------------------------------------------------------------------------
# LR schedule across iterations
# ------------------------------------------------------------------------------------------


def test_schedule_state_survives_iterations(policy_dir, features_path, tmp_path):
    """Warm-up over 6 steps spans two iterations of 2 steps: the second resumes at step 2."""
    overrides = ("train.mini_batch_size=4", "train.micro_batch_size=2", "train.lr_warmup_steps=6")
    m0, a0 = run_stage(policy_dir, features_path, tmp_path, *overrides, name="it0", state=str(tmp_path / "s0.json"))
    m1, _ = run_stage(
        policy_dir,
        features_path,
        tmp_path,
        *overrides,
        name="it1",
        prev_state=str(tmp_path / "s0.json"),
        state=str(tmp_path / "s1.json"),
        iteration=1,
    )
    lrs = m0["lr"].to_list() + m1["lr"].to_list()
    assert lrs == pytest.approx([1e-2 * k / 6 for k in (1, 2, 3, 4)])
    import json

    state = json.loads((tmp_path / "s1.json").read_text())
    assert state["step"] == 4 and len(state["lengths"]) == 4


# ------------------------------------------------------------------------------------------
# The optimizer across iterations
# ------------------------------------------------------------------------------------------


def one_engine_reference(cfg, policy_dir, tables: list[Path]) -> dict[str, torch.Tensor]:
    """One DeepSpeed engine (one AdamW) stepping over the mini-batches of every table in turn,
    iteration k's in the train stage's seeded order: the weights one uninterrupted run ends with."""
    from otbflow.seeds import derive_seed
    from otbflow.training.distributed import build_engine
    from otbflow.training.publish import full_fp32_state_dict
    from otbflow.training.trainer import Trainer, load_rows, mini_batches

    init_distributed_env()
    engine = build_engine(str(policy_dir), cfg.train, 1)
    pad_id = build_char_tokenizer().pad_token_id
    for k, table in enumerate(tables):
        data = load_rows(str(table), cfg)
        trainer = Trainer(engine, data, cfg, pad_id)
        for mini in mini_batches(len(data["response_ids"]), cfg.train, derive_seed(cfg.seed, "train", k)):
            trainer.step(mini, cfg.train.lr)
    return full_fp32_state_dict(engine, keep=True)


@pytest.mark.parametrize(
    "layout", ["zero0_fp32", "zero1_bf16", "zero3_bf16", "zero1_bf16_published", "zero3_bf16_published"]
)
def test_chained_jobs_continue_one_optimizer(policy_dir, features_path, tmp_path, layout):
    """Two train jobs chained through the stored optimizer state end with the weights of one
    engine that steps over both tables: bitwise (fp32, and bf16 with ZeRO-1 and ZeRO-3 on CPU; ZeRO-3
    also runs the chunked head under its parameter gathering). With train.reset_optimizer the
    second job starts a fresh AdamW and ends elsewhere.

    ``_published``: model.dtype bfloat16 too, so the policy between the jobs is published in bf16
    (``published_dtype``); the second job's fp32 master weights come from the optimizer state alone,
    and it ends with the one engine's weights cast to bf16, bitwise."""
    overrides = ["train.mini_batch_size=4", "train.micro_batch_size=2", "train.lr=1e-3"]
    if layout != "zero0_fp32":
        overrides += [f"train.zero_stage={layout[4]}", "train.bf16=true", "train.logprob_chunk_size=7"]
    if layout.endswith("_published"):
        overrides += ["model.dtype=bfloat16"]
    cfg = make_cfg(*overrides)
    tables = [tmp_path / "adv0.parquet", tmp_path / "adv1.parquet"]
    for seed, table in enumerate(tables, start=1):
        write_advantages(features_path, table, random_advantages(features_path, seed=seed))

    def job(k, policy, **kwargs):
        args = Args(
            advantages=str(tables[k]),
            policy=str(policy),
            out=str(tmp_path / f"p{k}"),
            metrics=str(tmp_path / f"m{k}.parquet"),
            checkpoint_dir=str(tmp_path / f"ck{k}"),
            iteration=k,
            state=str(tmp_path / f"s{k}.json"),
            **kwargs,
        )
        run(cfg if "prev_optimizer" in kwargs or k == 0 else make_cfg(*overrides, "train.reset_optimizer=true"), args)
        return load_model(args.out).state_dict()

    job(0, policy_dir, optimizer=str(tmp_path / "opt0"))
    meta = __import__("json").loads((tmp_path / "opt0" / "meta.json").read_text())
    assert meta["optimizer_steps"] == 2 and meta["zero_stage"] == cfg.train.zero_stage
    if layout.endswith("_published"):  # the fp32 master weights after the first table, cast to bf16
        p0, master = load_model(tmp_path / "p0").state_dict(), one_engine_reference(cfg, policy_dir, tables[:1])
        for name, value in master.items():
            assert p0[name].dtype == torch.bfloat16 and torch.equal(p0[name], value.to(torch.bfloat16)), name
        # the tensors of the input policy, no more (a tied output head stays tied), 2 bytes a parameter
        # on disk, as `otbflow disk` counts a run that publishes bf16
        assert set(p0) == set(load_model(policy_dir).state_dict())
        assert {t.dtype for t in load_file(tmp_path / "p0" / "model.safetensors").values()} == {torch.bfloat16}
        assert set(load_file(tmp_path / "p0" / "model.safetensors")) == set(load_file(policy_dir / "model.safetensors"))
        n = sum(p.numel() for p in load_model(policy_dir).parameters())
        assert 2 * n < (tmp_path / "p0" / "model.safetensors").stat().st_size < 2 * n + 2**16
    # the second job writes no optimizer state: it publishes its fp32 master weights
    chained = job(1, tmp_path / "p0", prev_optimizer=str(tmp_path / "opt0"), prev_state=str(tmp_path / "s0.json"))
    reference = one_engine_reference(cfg, policy_dir, tables)
    for name, value in reference.items():
        assert torch.equal(chained[name], value), name
    fresh = job(1, tmp_path / "p0", prev_state=str(tmp_path / "s0.json"))  # train.reset_optimizer=true
    assert max(float((fresh[n] - reference[n]).abs().max()) for n in reference) > 1e-4


def test_which_policies_are_published_in_bf16():
    """bf16 only where the policy computes and trains in bf16 and the job writes the AdamW state
    that holds its fp32 master."""
    bf16 = ("model.dtype=bfloat16", "train.bf16=true", "train.zero_stage=1")
    cases = [
        ((), "opt", torch.bfloat16),
        ((), "", torch.float32),  # no AdamW state written: the master goes nowhere else
        # ... unless the run writes it every N >= 2 iterations: a warm worker's engine carries it, or its replay
        (("train.optimizer_every=2",), "", torch.bfloat16),
        (("train.reset_optimizer=true",), "opt", torch.float32),
        (("model.dtype=float32",), "opt", torch.float32),
        (("train.bf16=false",), "opt", torch.float32),
    ]
    for extra, optimizer, want in cases:
        assert published_dtype(make_cfg(*bf16, *extra), optimizer) == want, (extra, optimizer)


def test_the_export_writes_the_fp32_master_weights_of_a_bf16_run(policy_dir, features_path, tmp_path):
    """A bf16 ZeRO-1 job that writes its AdamW state publishes bf16; the export of that policy and
    state (otbflow.stages.export) holds the fp32 weights the same job publishes where it writes no
    state (its fp32 master: the reference, read without the AdamW state), bitwise; cast to bf16,
    the published policy's."""
    from otbflow.stages import export

    bf16 = ("model.dtype=bfloat16", "train.bf16=true", "train.zero_stage=1", "train.mini_batch_size=8")
    _, written = run_stage(policy_dir, features_path, tmp_path, *bf16, name="bf16", optimizer=str(tmp_path / "opt"))
    _, master = run_stage(policy_dir, features_path, tmp_path, *bf16, name="fp32")
    out = tmp_path / "export"
    export.run(make_cfg(*bf16), export.Args(policy=written.out, optimizer=str(tmp_path / "opt"), out=str(out)))
    got, want, published = (load_file(Path(p) / "model.safetensors") for p in (out, master.out, written.out))
    assert got.keys() == want.keys() == published.keys()
    assert all(got[k].dtype == torch.float32 and torch.equal(got[k], want[k]) for k in got)
    assert all(published[k].dtype == torch.bfloat16 and torch.equal(got[k].bfloat16(), published[k]) for k in got)
    assert any(not torch.equal(got[k], published[k].float()) for k in got)  # more than the bf16 policy holds


def test_a_snapshot_writes_the_state_it_copied_whatever_the_engine_does_after(policy_dir, tmp_path, monkeypatch):
    """A background write that snapshots (a GPU engine's; here on the CPU with SNAPSHOT_ON_CPU):
    the state is copied to host memory, the event set, then written. The engine's weights and
    AdamW moments changed between the copy and the write leave the files byte for byte as a
    direct write before that change (a direct write after it differs): the next update may start
    once the event is set."""
    import threading

    from otbflow.training.distributed import build_engine

    cfg = make_cfg()
    init_distributed_env()
    engine = build_engine(str(policy_dir), cfg.train, 1)
    loss = sum((p.float() ** 2).sum() for p in engine.module.parameters()) * 1e-3
    engine.backward(loss)
    engine.step()  # the AdamW moments exist
    monkeypatch.setattr(train_state, "SNAPSHOT_ON_CPU", True)
    assert train_state.snapshots(engine, 1) and not train_state.snapshots(engine, 2)
    meta = {"iteration": 0}
    train_state.save_optimizer_state(engine, str(tmp_path / "before"), meta, 0, 1)
    write = train_state.save_checkpoint_file

    def change_then_write(state, path, zipfile_serialization):
        with torch.no_grad():
            for p in engine.module.parameters():
                p.add_(1.0)
                for moment in engine.optimizer.state[p].values():
                    moment.add_(1.0)
        write(state, path, zipfile_serialization)

    monkeypatch.setattr(train_state, "save_checkpoint_file", change_then_write)
    copied = threading.Event()
    train_state.save_optimizer_state(engine, str(tmp_path / "snapshot"), meta, 0, 1, snapshot_done=copied)
    monkeypatch.setattr(train_state, "save_checkpoint_file", write)
    train_state.save_optimizer_state(engine, str(tmp_path / "after"), meta, 0, 1)

    def files(folder):
        return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*.pt"))}

    assert copied.is_set() and files(tmp_path / "before")
    assert files(tmp_path / "snapshot") == files(tmp_path / "before") != files(tmp_path / "after")


def test_a_stored_optimizer_state_that_does_not_fit_is_refused(policy_dir, features_path, tmp_path):
    """Another ZeRO stage or bf16 setting, another policy, a folder without meta.json (an unfinished
    write), or reset_optimizer with a state: a clear error before any training, no outputs."""
    import shutil

    m, first = run_stage(
        policy_dir, features_path, tmp_path, "train.mini_batch_size=8", name="first", optimizer=str(tmp_path / "opt")
    )
    opt = str(tmp_path / "opt")
    cases = [
        (
            ("train.zero_stage=1",),
            first.out,
            opt,
            r"saved by 1 rank\(s\), ZeRO stage 0, bf16 off; this job runs 1 "
            r"rank\(s\), ZeRO stage 1, bf16 off.*train.reset_optimizer=true",
        ),
        (("train.zero_stage=1", "train.bf16=true"), first.out, opt, "ZeRO stage 1, bf16 on"),
        ((), policy_dir, opt, "belongs to another policy than --policy"),
        (("train.reset_optimizer=true",), first.out, opt, "drop one of them"),
    ]
    shutil.copytree(opt, tmp_path / "half")
    (tmp_path / "half" / "meta.json").unlink()
    cases.append(((), first.out, str(tmp_path / "half"), "not a finished optimizer state"))
    for overrides, policy, prev, message in cases:
        with pytest.raises(OptimizerStateError, match=message):
            run_stage(
                policy,
                features_path,
                tmp_path,
                "train.mini_batch_size=8",
                *overrides,
                name="second",
                prev_optimizer=prev,
                optimizer=str(tmp_path / "opt2"),
            )
        assert not (tmp_path / "second").exists() and not (tmp_path / "opt2").exists()
        assert not (tmp_path / "second.ckpt").exists()  # refused before any work


def test_the_checkpoint_fingerprint_covers_the_optimizer_input(policy_dir, features_path, tmp_path):
    from otbflow.training.state import fingerprint

    write_advantages(features_path, tmp_path / "adv.parquet", random_advantages(features_path))
    cfg = make_cfg()
    prints = []
    for name, content in (("a", '{"job_fingerprint": "1"}'), ("b", '{"job_fingerprint": "2"}')):
        (tmp_path / name).mkdir()
        (tmp_path / name / "meta.json").write_text(content)
        prints.append(
            fingerprint(
                cfg,
                Args(
                    advantages=str(tmp_path / "adv.parquet"),
                    policy=str(policy_dir),
                    out="o",
                    metrics="m",
                    prev_optimizer=str(tmp_path / name),
                ),
                1,
            )
        )
    prints.append(
        fingerprint(
            cfg, Args(advantages=str(tmp_path / "adv.parquet"), policy=str(policy_dir), out="o", metrics="m"), 1
        )
    )
    assert len(set(prints)) == 3


# ------------------------------------------------------------------------------------------
# A results folder holds data, never code: a planted pickle is refused, not run
# ------------------------------------------------------------------------------------------


class Planted:
    """What someone who can write a shared results folder could put in a DeepSpeed file: a pickle
    that runs a shell command when it is loaded (here, one that creates ``marker``)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch '{self.marker}'",))


def plant(path: Path, marker: Path) -> None:
    """Replace a file that DeepSpeed wrote with a torch.save'd checkpoint that holds a Planted."""
    assert path.is_file(), sorted(p.name for p in path.parent.iterdir())
    torch.save({"module": Planted(marker), "optimizer_state_dict": {}}, path)


SHARDS = ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"]


@pytest.mark.parametrize("name", SHARDS)
def test_a_planted_pickle_in_an_optimizer_state_is_refused(policy_dir, features_path, tmp_path, name):
    """A file of the stored optimizer state replaced (meta.json untouched: the layout and the
    policy digest still match): the next job refuses it, naming the file, and the pickle never
    runs; no output appears."""
    overrides = ("train.mini_batch_size=8", "train.zero_stage=1")
    _, first = run_stage(policy_dir, features_path, tmp_path, *overrides, name="first", optimizer=str(tmp_path / "opt"))
    target, marker = tmp_path / "opt" / "state" / name, tmp_path / "marker"
    plant(target, marker)
    with pytest.raises(Exception) as refused:
        run_stage(
            first.out,
            features_path,
            tmp_path,
            *overrides,
            name="second",
            prev_optimizer=str(tmp_path / "opt"),
            optimizer=str(tmp_path / "opt2"),
        )
    assert not marker.exists(), "the planted pickle ran"
    assert isinstance(refused.value, train_state.CheckpointFileError), refused.value
    assert str(target) in str(refused.value) and "posix.system" in str(refused.value)
    assert not any((tmp_path / n).exists() for n in ("second", "second.parquet", "opt2", ".opt2.partial"))


@pytest.mark.parametrize("name", SHARDS)
def test_a_planted_pickle_in_a_resumable_checkpoint_is_refused(policy_dir, features_path, tmp_path, monkeypatch, name):
    """A file of the resumable checkpoint that a failed job left (its fingerprint matches the
    rerun's) replaced: the rerun refuses it, naming the file, the pickle never runs and no
    output appears."""
    overrides = ("train.mini_batch_size=4", "train.micro_batch_size=2", "train.zero_stage=1")
    overrides += ("train.checkpoint_every=1",)
    with monkeypatch.context() as m:
        m.setattr(train_state.Checkpoints, "finish", lambda self: None)  # kept, as a failed job keeps them
        _, args = run_stage(policy_dir, features_path, tmp_path, *overrides, name="job")
    for out in (args.out, args.metrics):  # Snakemake deletes a failed job's outputs
        __import__("shutil").rmtree(out) if Path(out).is_dir() else Path(out).unlink()
    ckpt = Path(args.checkpoint_dir)
    target, marker = ckpt / (ckpt / "latest").read_text().strip() / name, tmp_path / "marker"
    plant(target, marker)
    with pytest.raises(Exception) as refused:
        run_stage(policy_dir, features_path, tmp_path, *overrides, name="job")
    assert not marker.exists(), "the planted pickle ran"
    assert isinstance(refused.value, train_state.CheckpointFileError), refused.value
    assert str(target) in str(refused.value) and "posix.system" in str(refused.value)
    assert not Path(args.out).exists() and not Path(args.metrics).exists()


class ByName:
    """What Python 3.11.0-3.11.4 write for an enum member (``getattr(cls, name)``; other versions
    write its value), with any class and name: a checkpoint written on such a Python holds
    ``ByName(ZeroStageEnum, "optimizer_states")``."""

    def __init__(self, cls, name: str):
        self.cls, self.name = cls, name

    def __reduce__(self):
        return (getattr, (self.cls, self.name))


def test_an_enum_member_pickled_by_name_loads_and_nothing_else_getattr_reaches(tmp_path):
    """A DeepSpeed file written on Python 3.11.0-3.11.4 (Debian 12's python3 is 3.11.2) names
    builtins.getattr for its ZeRO stage: it loads, as the member; a getattr of anything else (an
    attribute of an allowed class is a way to its module's globals, and so to running code) is
    refused as any other planted global is, naming the file."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    good = tmp_path / "optim_states.pt"
    torch.save({"zero_stage": ByName(ZeroStageEnum, "optimizer_states"), "step": torch.ones(2)}, good)
    assert b"getattr" in good.read_bytes()
    loaded = train_state.load_checkpoint_file(str(good))
    assert loaded["zero_stage"] is ZeroStageEnum.optimizer_states and loaded["zero_stage"] == 1
    for cls, name in ((LossScaler, "__init__"), (ZeroStageEnum, "__class__"), (ZeroStageEnum, "nothing")):
        bad = tmp_path / f"{name}.pt"
        torch.save({"zero_stage": ByName(cls, name)}, bad)
        with pytest.raises(train_state.CheckpointFileError) as refused:
            train_state.load_checkpoint_file(str(bad))
        assert str(bad) in str(refused.value) and "builtins.getattr" in str(refused.value), refused.value


def test_equal_checkpoint_states_write_equal_bytes(tmp_path):
    """Issue 53: pickle writes a string object once and refers back to it, so two equal states
    whose equal strings were one object in one and two in the other (a warm engine's AdamW param
    groups against a loaded state's) wrote different bytes. Through save_checkpoint_file (training.
    state.canonical) they write the same bytes, and load back equal; torch.save alone does not."""
    from collections import OrderedDict

    from otbflow.training.state import load_checkpoint_file, save_checkpoint_file

    exp_avg = torch.arange(6, dtype=torch.float32)

    def state(shared: bool):
        lr = "lr" if shared else "".join(["l", "r"])  # an equal string, another object
        group = {lr: 1e-3, "weight_decay": 0.0, "params": [0]}
        return {
            "optimizer": {"state": {0: {"step": torch.tensor(2.0), "exp_avg": exp_avg}}, "param_groups": [group]},
            "lr_key": "lr",
            "shapes": [OrderedDict([("w", torch.Size([6]))])],
            "pair": ("a", 1),
        }

    raw = []
    for k, shared in enumerate((True, False)):
        torch.save(state(shared), tmp_path / f"raw{k}.pt")
        raw.append((tmp_path / f"raw{k}.pt").read_bytes())
        save_checkpoint_file(state(shared), str(tmp_path / f"{k}.pt"), True)
    assert raw[0] != raw[1]  # the difference this fixes
    assert (tmp_path / "0.pt").read_bytes() == (tmp_path / "1.pt").read_bytes()
    back = load_checkpoint_file(str(tmp_path / "1.pt"))
    assert torch.equal(back["optimizer"]["state"][0]["exp_avg"], exp_avg) and back["pair"] == ("a", 1)
    assert back["optimizer"]["param_groups"] == [{"lr": 1e-3, "weight_decay": 0.0, "params": [0]}]
    assert type(back["shapes"][0]) is OrderedDict and back["shapes"][0]["w"] == torch.Size([6])


@pytest.mark.parametrize("layout", ["zero0_fp32", "zero1_bf16_published"])
def test_a_job_without_the_resident_engine_replays_the_updates_after_the_last_adamw_state(
    policy_dir, features_path, tmp_path, layout
):
    """Three chained iterations (0, 1, 2); iteration 2 run again from iteration 0's AdamW state, its
    policy and schedule, replaying iteration 1's update from its advantages: the same policy, metrics
    and AdamW state, bitwise; and from the initial policy, replaying iterations 0 and 1 with a fresh
    AdamW: the same policy. A replayed update that does not give the published policy (here one
    trained at another learning rate) fails the job, naming the tensors (otbflow.training.replay)."""
    import json

    from otbflow.training.replay import ReplayMismatch

    overrides = ["train.mini_batch_size=4", "train.micro_batch_size=2", "train.lr=1e-3", "iterations=4"]
    if layout != "zero0_fp32":
        overrides += ["train.zero_stage=1", "train.bf16=true", "model.dtype=bfloat16"]
    cfg = make_cfg(*overrides)
    tables = [tmp_path / f"adv{k}.parquet" for k in range(3)]
    for seed, table in enumerate(tables, start=1):
        write_advantages(features_path, table, random_advantages(features_path, seed=seed))

    def job(k, name, cfg=cfg, **kwargs):
        args = Args(
            advantages=str(tables[k]),
            out=str(tmp_path / f"p{name}"),
            metrics=str(tmp_path / f"m{name}.parquet"),
            checkpoint_dir=str(tmp_path / f"ck{name}"),
            iteration=k,
            state=str(tmp_path / f"s{name}.json"),
            optimizer=str(tmp_path / f"opt{name}"),
            **kwargs,
        )
        run(cfg, args)
        return args

    job(0, "0", policy=str(policy_dir))
    job(
        1, "1", policy=str(tmp_path / "p0"), prev_optimizer=str(tmp_path / "opt0"), prev_state=str(tmp_path / "s0.json")
    )
    chained = dict(policy=str(tmp_path / "p1"), prev_state=str(tmp_path / "s1.json"))
    job(2, "2", prev_optimizer=str(tmp_path / "opt1"), **chained)
    replay = dict(
        prev_optimizer=str(tmp_path / "opt0"),
        replay_start=str(tmp_path / "p0"),
        replay_state=str(tmp_path / "s0.json"),
        replay_advantages=[str(tables[1])],
    )
    job(2, "2r", replay_policies=[str(tmp_path / "p1")], **replay, **chained)
    whole, replayed = (load_file(tmp_path / f"p{n}" / "model.safetensors") for n in ("2", "2r"))
    assert whole.keys() == replayed.keys() and all(torch.equal(whole[n], replayed[n]) for n in whole)
    a, b = (pl.read_parquet(tmp_path / f"m{n}.parquet").drop("step_time_s", "tokens_per_s", "mfu") for n in ("2", "2r"))
    assert a.equals(b)
    assert json.loads((tmp_path / "s2.json").read_text()) == json.loads((tmp_path / "s2r.json").read_text())
    for f in sorted((tmp_path / "opt2" / "state").rglob("*.pt")):
        want = torch.load(f, weights_only=False)
        got = torch.load(tmp_path / "opt2r" / f.relative_to(tmp_path / "opt2"), weights_only=False)
        assert repr(flat(want)) == repr(flat(got)), f

    # from the initial policy with a fresh AdamW and schedule (no state written yet): iterations 0 and 1
    fresh = dict(replay_start=str(policy_dir), replay_advantages=[str(t) for t in tables[:2]])
    job(2, "2f", replay_policies=[str(tmp_path / "p0"), str(tmp_path / "p1")], **fresh, **chained)
    replayed = load_file(tmp_path / "p2f" / "model.safetensors")
    assert all(torch.equal(whole[n], replayed[n]) for n in whole)

    # iteration 1 trained at another learning rate: its published policy is not what the replay gives
    other = make_cfg(*[o for o in overrides if not o.startswith("train.lr")], "train.lr=3e-3")
    job(
        1,
        "1x",
        cfg=other,
        policy=str(tmp_path / "p0"),
        prev_optimizer=str(tmp_path / "opt0"),
        prev_state=str(tmp_path / "s0.json"),
    )
    with pytest.raises(ReplayMismatch, match=r"replaying iteration 1 gave other weights than .*p1x"):
        job(
            2,
            "2x",
            policy=str(tmp_path / "p1x"),
            prev_state=str(tmp_path / "s1x.json"),
            replay_policies=[str(tmp_path / "p1x")],
            **replay,
        )
    assert not (tmp_path / "p2x").exists()


def flat(obj):
    """Tensors and scalars of a nested checkpoint, as plain lists (every value, exactly)."""
    if isinstance(obj, torch.Tensor):
        return obj.float().tolist() if obj.is_floating_point() else obj.tolist()
    if isinstance(obj, dict):
        return {str(k): flat(v) for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))}
    if isinstance(obj, (list, tuple)):
        return [flat(v) for v in obj]
    return obj if isinstance(obj, (int, float, str, bool, type(None))) else type(obj).__name__
