"""Train: one policy update with DeepSpeed, from an iteration's advantages.

``train.ppo_epochs`` seeded passes over the advantages table's rows, one optimizer step per
mini-batch (``otbflow.training.trainer.Trainer``; losses and their aggregation in ``otbflow.algorithms.losses``), an LR
schedule and an AdamW state carried from iteration to iteration, resumable checkpoints within the
job (``otbflow.training.state``); writes the next policy (an HF folder) and one metrics row per step,
each step also a point of the live curves (``otbflow.runtime.tracking``).
Formulas, options, metrics, checkpoints and launchers: docs/training.md.
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl
import torch
from omegaconf import DictConfig

from otbflow import schemas
from otbflow.algorithms.lr_schedule import LRSchedule
from otbflow.io import SchemaError, check_safetensors, fault_point, write_json, write_parquet
from otbflow.models.policy import load_tokenizer, set_threads
from otbflow.progress import Clock
from otbflow.runtime import adamw, manifest, policy_folder, resident
from otbflow.runtime.process import me
from otbflow.runtime.retention import OPTIMIZER_META
from otbflow.runtime.tracking import Curves, open_curves
from otbflow.seeds import derive_seed
from otbflow.training.distributed import (
    _destroy_process_group,
    broadcast_text,
    build_engine,
    deepspeed_config,
    init_distributed_env,
    load_reference,
    resident_engine,
)
from otbflow.training.hardware import device_peak, matmul_parameters, mfu, step_flops
from otbflow.training.publish import LAST_PUBLISH, published_dtype, published_state, save_policy
from otbflow.training.replay import ReplayMismatch, Update, check_replayed, replay, updates_from_args
from otbflow.training.state import (
    Checkpoints,
    OptimizerStateError,
    check_optimizer_state,
    claim_optimizer_write,
    fingerprint,
    load_optimizer_state,
    optimizer_layout,
    save_optimizer_state,
    snapshots,
)
from otbflow.training.trainer import Trainer, load_rows, mini_batches

log = logging.getLogger("otbflow.train")


@dataclass
class Args:
    advantages: str
    """Advantages Parquet (table 'advantages') of one iteration."""
    policy: str
    """HF folder of the policy that sampled the rollouts (pi_old); training starts from it."""
    out: str
    """Output HF folder of the next policy (model and tokenizer)."""
    metrics: str
    """Output Parquet with one row per optimizer step (table 'train metrics')."""
    iteration: int = 0
    """RL iteration k (seeds the data order, labels the metrics)."""
    state: str = ""
    """Output JSON of the LR schedule's state after this iteration (for the next one's --prev-state)."""
    prev_state: str = ""
    """The previous iteration's --state JSON: the LR schedule resumes from it. Empty: a fresh schedule."""
    reference: str = ""
    """HF folder of the reference policy of the KL term (train.kl_coef > 0), e.g. the initial policy."""
    checkpoint_dir: str = ""
    """Folder of the resumable checkpoints (not an output). Empty: a 'checkpoint' folder beside --out."""
    optimizer: str = ""
    """Output folder of the optimizer state after this iteration (a DeepSpeed checkpoint, for the next
    one's --prev-optimizer). Empty: not written."""
    optimizer_async: bool = False
    """With --optimizer, in a warm worker (docs/workers.md): write the state in the background once
    the policy is published, after the job returns; the publish-optimizer job waits for it."""
    prev_optimizer: str = ""
    """The previous iteration's --optimizer folder: AdamW resumes from it (same world size, ZeRO stage
    and bf16). Empty: a fresh optimizer."""
    tracking_name: str = ""
    """This job's name in the live curves (tracking.*), e.g. train/iter_3: its TensorBoard folder
    results_dir/tensorboard/<name>/ (made anew) and its W&B run. Empty: no live curves."""
    adamw_dir: str = ""
    """Folder of the AdamW states a warm train worker writes outside the outputs (iter_<k>/, the
    newest only): when it retires or is stopped (SIGTERM), and every train.optimizer_every_min. A
    job without the resident engine starts from the newest one that belongs to one of its
    --replay-policies and replays only the updates after it. Empty: none."""
    replay_start: str = ""
    """With --replay-advantages: the policy of the iteration c whose AdamW state --prev-optimizer is;
    a job without a resident engine builds its engine from these two and replays the updates after c
    (``otbflow.training.replay``)."""
    replay_state: str = ""
    """With --replay-advantages: iteration c's --state JSON, the schedule the replay starts from."""
    replay_advantages: list[str] = field(default_factory=list)
    """The advantages tables of iterations c+1 .. k-1, in order: the updates a job without a resident
    engine redoes to reach --policy (no rollout or features job runs again)."""
    replay_policies: list[str] = field(default_factory=list)
    """The policies those updates published, in order (the last is --policy): each replayed one is
    checked against its manifest, and a mismatch fails the job naming the tensors."""


def run(cfg: DictConfig, args: Args) -> None:
    set_threads()
    phase = Clock({})  # where the job's seconds went (its metrics' phases_s)
    tc = cfg.train
    data = load_rows(args.advantages, cfg)
    n = len(data["response_ids"])
    if n == 0:
        raise SchemaError(f"{args.advantages}: no rows to train on")
    if tc.kl_coef > 0 and not args.reference:
        raise SchemaError("train.kl_coef > 0 needs --reference, the reference policy (e.g. the initial one)")
    for folder in (args.policy, *([args.reference] if tc.kl_coef > 0 else [])):
        check_safetensors(folder)  # a malformed header is named by its file, before any work
    if tc.reset_optimizer and args.prev_optimizer:
        raise OptimizerStateError(
            f"train.reset_optimizer is true but --prev-optimizer {args.prev_optimizer} was given: drop one of them"
        )
    fresh = not args.prev_optimizer  # a replay from the initial policy: a fresh AdamW and schedule
    updates = updates_from_args(args.iteration, args.replay_advantages, args.replay_policies, fresh)
    if updates and (not args.replay_start or bool(args.prev_optimizer) != bool(args.replay_state)):
        raise ValueError(
            "--replay-advantages needs --replay-start, and iteration c's --prev-optimizer and --replay-state "
            "together (neither: the replay starts from --replay-start with a fresh AdamW and schedule)"
        )
    if updates and tc.reset_optimizer:
        raise ValueError(
            "train.reset_optimizer is true: every iteration starts a fresh AdamW, there is nothing to replay"
        )
    if updates and Path(updates[-1].policy).resolve() != Path(args.policy).resolve():
        raise ValueError(f"the last of --replay-policies must be --policy {args.policy}, not {updates[-1].policy}")
    rank, world_size = init_distributed_env()
    # a warm worker's engine is not changed while its last state is being written (or copied, before
    # it is written: save_optimizer_state's snapshot): one rank waits only before its first update
    # (forward and backward change nothing the write reads), several ranks now (the writer's
    # collectives must not meet this job's)
    if world_size > 1:
        resident.join_snapshots()
    start_policy = args.replay_start if updates else args.policy  # what --prev-optimizer belongs to
    prev_meta: dict = {}
    if args.prev_optimizer:
        prev_meta = check_optimizer_state(args.prev_optimizer, tc, world_size, start_policy)  # before any work
    seed = derive_seed(cfg.seed, "train", args.iteration)
    torch.manual_seed(seed)
    # the policy's architecture, not its config.json's text: a folder saved in bf16 or by another
    # transformers version (the initial policy, often) holds weights for the same module
    layout = {"deepspeed": deepspeed_config(tc, world_size), "policy": policy_folder.architecture(Path(args.policy))}
    engine = resident_engine(layout, prev_meta, args.policy) if args.prev_optimizer or updates else None
    warm = engine is not None
    # held again once this job's outputs are written: a worker stopped meanwhile writes no state half-updated
    resident.drop("train")
    later = newest_written(args.adamw_dir, updates, tc, world_size) if updates and not warm else None
    if later is not None:  # a state a warm worker wrote after c: only the updates after it are replayed
        at, folder, start_meta = later
        engine = build_engine(args.policy, tc, world_size)
        load_optimizer_state(engine, folder)  # the module's weights too: those of the state's policy
        check_replayed(engine, cfg, updates[at], rank)  # the weights of the policy it belongs to
        updates, start_schedule = updates[at + 1 :], start_meta["schedule"]
        if rank == 0:
            log.info("AdamW resumes from %s, written by a warm worker: %d update(s) to replay", folder, len(updates))
    elif not warm:
        engine = build_engine(start_policy, tc, world_size)
        if args.prev_optimizer:
            load_optimizer_state(engine, args.prev_optimizer)
    if warm and rank == 0:
        log.info("AdamW goes on in the resident engine, which published --policy %s", args.policy)
    elif args.prev_optimizer and rank == 0 and later is None:
        log.info(
            "AdamW resumes from %s (%s optimizer steps before this iteration)",
            args.prev_optimizer,
            prev_meta.get("optimizer_steps"),
        )
    atexit.register(_destroy_process_group)
    fault_point("policy:loaded")  # the policy and AdamW state loaded and checked; no step timed yet
    phase("load")
    ref_model = reference(args.reference, engine.device, tc, world_size) if tc.kl_coef > 0 else None
    pad_id = load_tokenizer(args.policy).pad_token_id  # the eos token's where the policy has no pad token
    prev_schedule = json.loads(Path(args.prev_state).read_text()) if args.prev_state else None
    if updates and not warm:  # from iteration c's AdamW state to --policy, each update checked
        if later is None:
            start_schedule = json.loads(Path(args.replay_state).read_text()) if args.replay_state else None
        replayed = replay(engine, cfg, updates, start_schedule, pad_id, rank, world_size, ref_model)
        if prev_schedule is not None and replayed != prev_schedule:
            raise ReplayMismatch(f"the replayed schedule {replayed} is not --prev-state {args.prev_state}'s")
    trainer = Trainer(engine, data, cfg, pad_id, rank, world_size, ref_model, resident.join_snapshots)
    peak = device_peak(engine.device)
    counts = matmul_parameters(engine.module.policy), None if ref_model is None else matmul_parameters(ref_model)

    plan = mini_batches(n, tc, seed)
    schedule = LRSchedule.from_dict(tc, prev_schedule)
    schedule.set_horizon(len(plan), lambda: cfg.iterations)
    # the live curves' step and tokens before this iteration (a checkpoint's state is further on)
    step0, tokens0 = schedule.state.step, schedule.state.tokens
    curves = open_curves(cfg, args.tracking_name) if rank == 0 else Curves()
    fp = fingerprint(cfg, args, world_size)
    # a warm worker that writes the AdamW state every N >= 2 iterations writes no resumable checkpoint
    # within a job either: a lost job is replayed from the newest state (otbflow.runtime.adamw)
    every = 0 if resident.ENABLED and adamw.every(cfg) > 1 else tc.checkpoint_every
    ckpt = Checkpoints(args.checkpoint_dir or str(Path(args.out).with_name("checkpoint")), fp, every, rank, world_size)
    metrics: list[dict] = []
    start, skips = 0, 0
    if every:  # a checkpoint loads into the engine: not while its last state is being written
        resident.join_snapshots()
    client = ckpt.load(engine)
    if client is not None:
        metrics, start, skips = client["metrics"], client["next_step"], client["consecutive_skips"]
        schedule = LRSchedule.from_dict(tc, client["schedule"])
        torch.set_rng_state(client["torch_rng"])
        if rank == 0:
            log.warning("resuming from the checkpoint in %s after step %d of %d", ckpt.folder, start, len(plan))
    for row in metrics:  # the steps before the checkpoint, into the job's new curves
        tokens0 += row["tokens"]
        curves.log("train", _curve_values(row), step0 + row["step"], args.iteration, tokens0)
    phase("setup")

    for i in range(start, len(plan)):
        t0, waited = time.perf_counter(), trainer.waited_s
        m = trainer.step(plan[i], schedule.lr())
        events = ["skipped: non-finite loss or gradient"] if m["skipped"] else []
        events += [e for e in [schedule.observe(m["mean_response_length"], m["tokens"])] if e]
        skips = skips + 1 if m["skipped"] else 0
        seconds = time.perf_counter() - t0 - (trainer.waited_s - waited)  # not the wait for the AdamW write
        nonpad, response = m.pop("nonpad_tokens"), m.pop("response_tokens")
        metrics.append(
            {
                "iteration": args.iteration,
                "step": i,
                **m,
                "event": "; ".join(events),
                "step_time_s": seconds,
                "nonpad_tokens": nonpad,
                "tokens_per_s": nonpad / seconds,
                "mfu": mfu(step_flops(counts[0], nonpad, response, counts[1]), seconds, peak, world_size),
            }
        )
        curves.log("train", _curve_values(metrics[-1]), step0 + i, args.iteration, schedule.state.tokens)
        if rank == 0:
            for e in events:
                log.warning("step %d: %s", i, e)
            log.info(
                "step %d/%d: loss %.5f grad_norm %.4f lr %.2e clip %.3f kl %.2e entropy %.3f trm %.2f",
                i + 1,
                len(plan),
                m["loss"],
                m["grad_norm"],
                m["lr"],
                m["clip_fraction"],
                m["approx_kl"],
                m["entropy"],
                m["trm_acceptance"],
            )
        if skips >= tc.max_consecutive_skips:
            raise RuntimeError(
                f"{skips} consecutive optimizer steps had a non-finite loss or gradient (last: step "
                f"{i}); stopping (train.max_consecutive_skips={tc.max_consecutive_skips}). The "
                f"checkpoint in {ckpt.folder} holds the last good state."
            )
        if ckpt.due(i + 1, len(plan)):
            ckpt.save(
                engine,
                i + 1,
                {
                    "next_step": i + 1,
                    "metrics": metrics,
                    "consecutive_skips": skips,
                    "schedule": schedule.to_dict(),
                    "torch_rng": torch.get_rng_state(),
                },
            )

    resident.join_snapshots()  # no step ran (a job resumed after its last): its outputs read the engine
    phase("steps")
    phase.seconds["steps"] -= trainer.waited_s
    phase.seconds["adamw_wait"] = trainer.waited_s
    fault_point("train:before-outputs")
    dtype = published_dtype(cfg, args.optimizer)
    state = published_state(engine, rank == 0, dtype)  # collective: all ranks
    published = ""  # the identity of the weights written (rank 0's; the manifest's)
    if rank == 0:
        binding = {"iteration": args.iteration, "job_fingerprint": fp}
        published = save_policy(engine, state, args.policy, args.out, binding, dtype)
    del state
    phase("publish")
    fault_point("train:after-policy")  # the policy published, the optimizer state not yet
    background = None
    if args.optimizer or (resident.ENABLED and not tc.reset_optimizer):
        import deepspeed

        # every rank holds the digest: a warm worker's ranks decide alike whether their engine goes on
        digest = broadcast_text(published, engine.device)
        meta = {
            **optimizer_layout(tc, world_size),
            "deepspeed": deepspeed.__version__,
            "iteration": args.iteration,
            "optimizer_steps": schedule.to_dict().get("step"),
            "policy_weights": digest,
            "job_fingerprint": fp,
            "schedule": schedule.to_dict(),  # where the schedule goes on after this state
        }
        # the next job may start once the state is in host memory, where it is copied there first
        snap = threading.Event() if snapshots(engine, world_size) else None
        if args.optimizer and args.optimizer_async and resident.ENABLED:
            # off the critical path: the next iteration's rollouts and features need only the policy;
            # a worker of several ranks writes it from a thread of each (collective)
            writer = {**me(), "heartbeat": resident.HEARTBEAT}
            # an absolute path: the worker is back in its own folder when the thread writes
            out = os.path.abspath(args.optimizer)
            background = functools.partial(_write_optimizer_state, engine, out, meta, writer, rank, world_size, snap)
        elif args.optimizer:
            save_optimizer_state(engine, args.optimizer, meta, rank, world_size, module=False)  # collective
        # a warm worker keeps the engine (written or not: train.optimizer_every): the next job, whose
        # inputs are these outputs, goes on with it
        adamw_dir = os.path.abspath(args.adamw_dir) if args.adamw_dir else ""  # the worker leaves the job's folder
        held = Resident(engine, layout, meta, adamw_dir, rank, world_size, bool(args.optimizer))
        # rank 0's clock decides for every rank (the write is collective)
        due = tc.optimizer_every_min > 0 and resident.ENABLED and args.adamw_dir and not held.written
        if due and broadcast_text("1" if resident.due(tc.optimizer_every_min * 60) else "", engine.device):
            held.written = True  # train.optimizer_every_min: in the background, as a checkpoint's
            out = os.path.abspath(written_state(args.adamw_dir, args.iteration))
            background = functools.partial(_write_optimizer_state, engine, out, meta, None, rank, world_size, snap)
            writer = None
        resident.hold("train", held)
    phase("state")
    if rank == 0:
        df = pl.DataFrame(metrics, schema=schemas.TRAIN_METRICS.columns)
        import deepspeed

        write_parquet(
            df,
            args.metrics,
            metadata={
                "policy": args.policy,
                "iteration": args.iteration,
                "world_size": world_size,
                "seed": seed,
                "deepspeed": dict(deepspeed_config(tc, world_size), version=deepspeed.__version__),
                "loss_agg_mode": tc.loss_agg_mode,
                "temperature": cfg.rollout.temperature,
                "resumed_at_step": start,
                "schedule": schedule.to_dict(),
                # where the job's seconds went, steps apart: what its timers leave out (docs/workers.md)
                "phases_s": {k: round(v, 4) for k, v in phase.seconds.items()},
                # the policy written: its bytes and, in a warm worker, its delta's (docs/workers.md)
                "publish": dict(LAST_PUBLISH) if published else None,
            },
        )
        if args.state:
            write_json(schedule.to_dict(), args.state)
        log.info(
            "%d steps on %d sequences; next policy in %s (%s)",
            len(plan),
            n,
            args.out,
            ", ".join(f"{k} {v:.2f} s" for k, v in phase.seconds.items()),
        )
    ckpt.finish()
    curves.close()
    if background is not None:  # last: the job's own collectives (ckpt.finish's barrier) are over
        if rank == 0 and writer is not None:  # the writer's record before the job returns: a publisher waits
            claim_optimizer_write(os.path.abspath(args.optimizer), writer)
        resident.save_in_background(background, fatal=world_size > 1, snapshot=snap)


def _write_optimizer_state(
    engine, out: str, meta: dict, writer: dict | None, rank: int, world_size: int, snapshot=None
) -> None:
    if engine.device.type == "cuda":
        torch.cuda.set_device(engine.device)  # a thread starts on device 0: this rank's device
    fault_point("train:writing-optimizer")  # the job returned, the state not yet written
    resident.wrote()
    # the job's --optimizer output holds no module weights: they are its policy's (save_optimizer_state)
    save_optimizer_state(engine, out, meta, rank, world_size, writer, snapshot, module=writer is None)
    if writer is None and rank == 0:  # a state outside the outputs: only the newest is kept
        for older in Path(out).parent.glob("iter_*"):
            if older.name != Path(out).name:
                shutil.rmtree(older, ignore_errors=True)


@dataclass
class Resident:
    """A warm worker's DeepSpeed engine after a job (``otbflow.runtime.resident``): its layout and
    what a write of its AdamW state records (``meta``: the fingerprint of the job that left it, the
    digest of the policy that job wrote, the schedule), where that write goes (``adamw_dir``) and
    whether it was written."""

    engine: object
    layout: dict
    meta: dict
    adamw_dir: str = ""
    rank: int = 0
    world_size: int = 1
    written: bool = False

    @property
    def job_fingerprint(self) -> str:
        return self.meta["job_fingerprint"]

    @property
    def policy_weights(self) -> str:
        return self.meta["policy_weights"]

    def retire(self) -> None:
        """The worker retires or is stopped: its state, unless written, goes to ``adamw_dir``, so
        that the job after replays only what came after it. A worker of several ranks writes none
        (its other ranks have ended): the job after replays from the last checkpoint."""
        if self.written or not self.adamw_dir or self.world_size > 1:
            return
        out = written_state(self.adamw_dir, self.meta["iteration"])
        log.info("the worker ends: its AdamW state after iteration %d goes to %s", self.meta["iteration"], out)
        _write_optimizer_state(self.engine, out, self.meta, None, self.rank, self.world_size)
        self.written = True


def written_state(adamw_dir: str, iteration: int) -> str:
    """Where a warm worker writes the AdamW state after ``iteration`` outside the outputs."""
    return str(Path(adamw_dir, f"iter_{iteration}"))


def newest_written(adamw_dir: str, updates: list[Update], tc: DictConfig, world_size: int):
    """(index in ``updates``, folder, meta) of the newest AdamW state a warm worker wrote in
    ``adamw_dir`` after one of ``updates`` (its policy's weights, this job's layout); None where
    there is none (the writer keeps the newest only)."""
    for i in reversed(range(len(updates))):
        folder = written_state(adamw_dir, updates[i].iteration) if adamw_dir else ""
        if not folder or not Path(folder, OPTIMIZER_META).is_file():
            continue
        try:
            identity = manifest.read(updates[i].policy)
            meta = check_optimizer_state(folder, tc, world_size, updates[i].policy, identity and identity["weights"])
        except (OptimizerStateError, OSError, ValueError) as e:
            log.warning("%s: not used: %s", folder, e)
            continue
        return i, folder, meta
    return None


def reference(path: str, device, tc: DictConfig, world_size: int):
    """The KL term's reference policy (``load_reference``), kept by a warm worker for the jobs
    after, as long as its folder holds the same files (and the same checks apply: packing)."""
    digest = manifest.model_digest(path, resident.KEY)
    key = (digest, str(device), tc.zero_stage, tc.bf16, bool(tc.packing))
    held = resident.take("reference")
    if held is not None and held[0] == key:
        return held[1]
    model = load_reference(path, device, tc, world_size)
    resident.hold("reference", (key, model))
    return model


def _curve_values(row: dict) -> dict:
    """A metrics row as a point of the live curves: its numbers, less the iteration and the step
    (the point's own axes)."""
    return {k: v for k, v in row.items() if k not in ("iteration", "step")}
