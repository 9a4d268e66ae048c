"""What a train job keeps on disk besides the next policy (``otbflow.training.publish``): the AdamW state across
iterations (``check_optimizer_state`` refuses another layout or policy) and the resumable
checkpoints within one job (``Checkpoints``). DeepSpeed's files of both are read as data only
(``load_checkpoint_file``: a pickle that names anything but tensors, plain containers and
DeepSpeed's few checkpoint types is refused, never run). The stage is ``otbflow.stages.train``;
layouts and rules: docs/training.md, "The optimizer across iterations", "Robustness" and "The next
policy"."""

from __future__ import annotations

import contextlib
import enum
import hashlib
import json
import logging
import os
import pickle
import re
import shutil
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from otbflow.io import check_job, read_json, write_errors_named, write_json, write_text
from otbflow.runtime import manifest, resident
from otbflow.runtime.policy_folder import check_not_pruned
from otbflow.runtime.retention import (
    OPTIMIZER_FAILED,
    OPTIMIZER_META,
    OPTIMIZER_WRITER,
    optimizer_partial,
)

log = logging.getLogger("otbflow.train")

# ------------------------------------------------------------------------------------------
# DeepSpeed's checkpoint files: read as data, never as code
# ------------------------------------------------------------------------------------------


class CheckpointFileError(ValueError):
    """A DeepSpeed checkpoint file that is not loaded: its pickle names a type that a checkpoint
    does not hold (loading it could run code), or it is no torch file."""


def checkpoint_types() -> list[type]:
    """The non-tensor types DeepSpeed 0.19 pickles into the checkpoints of every layout the
    project configures (ZeRO 0-3, fp32 and bf16; found by saving each): the ZeRO stage (an int
    enum), the static loss scaler and, at ZeRO-1/2, the addresses of the fp32 partitions (a
    dataclass of two ints). The unpickler may call their constructors, which only store values."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, fragment_address]


NOT_A_MEMBER = "is no member of an enum that a checkpoint holds"


def enum_member(cls, name: str):
    """``builtins.getattr`` in a checkpoint's pickle, as Python 3.11.0-3.11.4 pickle an enum member
    (``getattr(ZeroStageEnum, "optimizer_states")``; other versions pickle its value): the member
    of a ``checkpoint_types`` enum, and nothing else that getattr could reach (an attribute is a way
    to any function, and so to running code)."""
    if isinstance(cls, enum.EnumMeta) and cls in checkpoint_types() and name in cls.__members__:
        return cls[name]
    raise pickle.UnpicklingError(f"getattr({cls!r}, {name!r}) {NOT_A_MEMBER}")


def load_checkpoint_file(path: str, map_location=None):
    """``torch.load(weights_only=True)`` of one DeepSpeed file: tensors, plain containers,
    ``checkpoint_types`` and their enum members by name (``enum_member``) only. Anything else is
    refused before it is built: a CheckpointFileError that names the file and what its pickle asks for."""
    allowed = checkpoint_types()
    try:
        with torch.serialization.safe_globals([*allowed, (enum_member, "builtins.getattr")]):
            return torch.load(path, map_location=map_location, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:
        try:  # read, not run: the globals its pickle names (zip files, which DeepSpeed writes)
            names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        except Exception:
            names = re.findall(r"GLOBAL ([\w.]+)", str(e))  # what torch's unpickler stopped at
        names = [n for n in names if n not in {f"{t.__module__}.{t.__qualname__}" for t in allowed}]
        if "builtins.getattr" in names and NOT_A_MEMBER not in str(e):
            names.remove("builtins.getattr")  # an enum member by name, loaded; the file failed otherwise
        if names:
            raise CheckpointFileError(
                f"{path}: not loaded: its pickle names {', '.join(names)}, which no DeepSpeed checkpoint "
                f"holds; loading it could run code. The file was replaced or damaged after the train job wrote it"
            ) from None
        detail = "" if isinstance(e, pickle.UnpicklingError) else f" ({str(e).splitlines()[0]})"
        raise CheckpointFileError(
            f"{path}: not loaded: not a torch checkpoint of tensors, plain containers and DeepSpeed's "
            f"checkpoint types{detail}; it is damaged, or was replaced after the train job wrote it"
        ) from None


def save_checkpoint_file(state, path: str, zipfile_serialization: bool) -> None:
    """``torch.save`` of one DeepSpeed file through a Python file object, of the ``canonical``
    state (equal states write equal bytes): a failed write (a full disk) raises its OSError naming
    ``path``, where torch's own file writer says "unexpected pos"."""
    with write_errors_named(path), open(path, "wb") as f:
        torch.save(canonical(state), f, _use_new_zipfile_serialization=zipfile_serialization)


def canonical(obj: Any, memo: dict[int, Any] | None = None, copies: dict | None = None) -> Any:
    """``obj`` with every string interned and its dicts, OrderedDicts, lists and tuples rebuilt
    around the same tensors and other objects (a container met twice is rebuilt once). Pickle
    writes a string object once and refers back to it after, so a state's bytes depended on which
    of its equal strings were one object: an AdamW state of equal tensors written by a warm
    engine (its param groups' keys, such as 'lr', the code's own strings) and after a load (new
    strings from the file) differed in bytes, and a byte digest of the two found a difference.
    ``copies`` (a dict): every tensor copied to host memory too (``snapshot``)."""
    memo = {} if memo is None else memo
    if type(obj) is str:
        return sys.intern(obj)
    if copies is not None and isinstance(obj, torch.Tensor):
        return _host_copy(obj, copies)
    if type(obj) not in (dict, OrderedDict, list, tuple):
        return obj
    if id(obj) not in memo:
        if type(obj) in (dict, OrderedDict):
            memo[id(obj)] = type(obj)((canonical(k, memo), canonical(v, memo, copies)) for k, v in obj.items())
        else:
            memo[id(obj)] = type(obj)(canonical(v, memo, copies) for v in obj)
    return memo[id(obj)]


SNAPSHOT_ON_CPU = os.environ.get("OTBFLOW_SNAPSHOT_ON_CPU") == "1"
"""Whether an engine on the CPU snapshots its AdamW state before writing it in the background
(``save_optimizer_state``'s ``snapshot_done``): an engine on a GPU always does (the copy to host
memory is what lets the next update start); on the CPU the state is in host memory already, and
a copy would double it while it is written. The tests set it (``OTBFLOW_SNAPSHOT_ON_CPU=1``) to
check the snapshot on CPU."""


def snapshots(engine, world_size: int) -> bool:
    """Whether a background write of ``engine``'s state first copies it to host memory, so that
    the next update need not wait for the disk: one rank (several: the writer's collectives must
    not meet the next job's), on a GPU, or on the CPU where ``SNAPSHOT_ON_CPU``."""
    return world_size == 1 and (engine.device.type == "cuda" or SNAPSHOT_ON_CPU)


def snapshot(obj: Any) -> Any:
    """``obj`` (a DeepSpeed file's state, ``canonical``) with every tensor's storage copied to host
    memory once, each tensor a view of its copy with its own offset, shape and stride: what
    ``torch.save`` writes of it is what it writes of ``obj`` as it is now, whatever happens to
    ``obj`` after."""
    return canonical(obj, copies={})


def _host_copy(t: torch.Tensor, copies: dict) -> torch.Tensor:
    storage = t.untyped_storage()
    key = (storage.data_ptr(), str(storage.device), storage.nbytes())
    if key not in copies:
        raw = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
        copies[key] = raw.to("cpu", copy=True).untyped_storage()
    return torch.empty(0, dtype=t.dtype).set_(copies[key], t.storage_offset(), t.size(), t.stride())


def guard_checkpoint_io(engine) -> None:
    """Route the DeepSpeed engine's checkpoint file reads and writes through
    ``load_checkpoint_file`` and ``save_checkpoint_file``. DeepSpeed's ``load_checkpoint`` reads
    every file through its checkpoint engine (``mp_rank_*_model_states.pt``, the ZeRO shards
    ``*_optim_states.pt``), which calls ``torch.load(weights_only=False)``; its other loaders
    (universal checkpoints, NVMe offload, ZeRO-3 weights without optimizer states) are on paths
    the project never takes. Idempotent."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    io = engine.checkpoint_engine
    if getattr(io, "_otbflow_guarded", False):
        return
    if type(io) is not TorchCheckpointEngine:
        raise RuntimeError(f"DeepSpeed's checkpoint engine is {type(io).__name__}, not TorchCheckpointEngine")

    def save(state_dict, path: str) -> None:  # DeepSpeed passes both by name
        if getattr(io, "_otbflow_without_module", False) and state_dict.get("module") is not None:
            state_dict = dict(state_dict, module=None)  # an AdamW state: the weights are its policy's
        captured = getattr(io, "_otbflow_capture", None)
        if captured is not None:  # a snapshot, written later (save_optimizer_state)
            captured.append((snapshot(state_dict), path))
            return
        save_checkpoint_file(state_dict, path, io.zipfile_serialization)

    io.load, io.save = load_checkpoint_file, save
    io._otbflow_guarded = True


# ------------------------------------------------------------------------------------------
# Resumable checkpoints
# ------------------------------------------------------------------------------------------


def fingerprint(cfg: DictConfig, args, world_size: int) -> str:
    """What a checkpoint belongs to (``args``: the train stage's Args): the inputs (advantages
    bytes, policy, previous schedule state, previous optimizer state), the config, the code and
    the number of ranks."""
    from otbflow.pipeline import trigger
    from otbflow.runtime.codeversion import code_version

    h = hashlib.sha256()
    with open(args.advantages, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    prev = Path(args.prev_state).read_text() if args.prev_state else ""
    # the optimizer state's meta.json names the job that wrote it (its fingerprint) and its policy
    prev_opt = (Path(args.prev_optimizer) / OPTIMIZER_META).read_text() if args.prev_optimizer else ""
    config = trigger(cfg, "train")  # what changes the outputs; not resources: a retry with more memory resumes
    h.update(
        json.dumps(
            [
                config,
                str(Path(args.policy).resolve()),
                prev,
                prev_opt,
                args.reference,
                args.iteration,
                world_size,
                # a job that replays from an earlier AdamW state: which one, and the updates after it
                getattr(args, "replay_start", ""),
                getattr(args, "replay_advantages", []),
                code_version("train"),
            ]
        ).encode()
    )
    return h.hexdigest()[:16]


# ------------------------------------------------------------------------------------------
# Optimizer state across iterations
# ------------------------------------------------------------------------------------------


OPTIMIZER_TAG = "state"


class OptimizerStateError(ValueError):
    """A stored optimizer state that this job cannot load."""


def optimizer_layout(tc: DictConfig, world_size: int) -> dict:
    """What DeepSpeed needs to be equal to load a (ZeRO-partitioned) optimizer state."""
    return {"world_size": world_size, "zero_stage": int(tc.zero_stage), "bf16": bool(tc.bf16)}


def check_optimizer_state(
    folder: str, tc: DictConfig, world_size: int, policy_dir: str, identity: str | None = None
) -> dict:
    """The meta of the optimizer state in ``folder`` if this job can resume it; otherwise an
    OptimizerStateError that says what differs and what to do. ``identity``: the policy's weights
    as its manifest lists them, where the caller checks the weights themselves after loading."""
    path = Path(folder)
    check_not_pruned(path)
    meta_path = path / OPTIMIZER_META
    if not meta_path.is_file():
        raise OptimizerStateError(
            f"{path}: not a finished optimizer state (no {OPTIMIZER_META}); it is written "
            f"by the previous iteration's train job (--optimizer)"
        )
    meta = json.loads(meta_path.read_text())
    want = optimizer_layout(tc, world_size)
    have = {k: meta.get(k) for k in want}
    if have != want:

        def fmt(d):
            return f"{d['world_size']} rank(s), ZeRO stage {d['zero_stage']}, bf16 {'on' if d['bf16'] else 'off'}"

        raise OptimizerStateError(
            f"{path}: the optimizer state was saved by {fmt(have)}; this job runs {fmt(want)}. DeepSpeed "
            f"loads an optimizer state only into the layout that saved it (ZeRO shards it per rank). Keep "
            f"train.zero_stage, train.bf16 and resources.train.tasks as they were, or set "
            f"train.reset_optimizer=true to start this iteration with a fresh AdamW."
        )
    digest = identity or manifest.weights_digest(policy_dir, resident.KEY)
    if meta.get("policy_weights") != digest:
        raise OptimizerStateError(
            f"{path}: the optimizer state belongs to another policy than --policy {policy_dir} (weights digest "
            f"{str(meta.get('policy_weights'))[:12]}... vs {digest[:12]}...); pass the policy written by the same "
            f"train job, or set train.reset_optimizer=true"
        )
    return meta


def load_optimizer_state(engine, folder: str) -> None:
    """Load the DeepSpeed checkpoint in ``folder`` into ``engine``: AdamW moments and step counts
    (and with bf16 ZeRO's fp32 master weights); the module weights it holds are those of --policy.
    Its files are read as data (``guard_checkpoint_io``)."""
    guard_checkpoint_io(engine)
    try:
        path, _ = engine.load_checkpoint(
            folder,
            tag=OPTIMIZER_TAG,
            load_module_strict=True,
            load_optimizer_states=True,
            load_lr_scheduler_states=False,
            custom_load_fn=_policy_weights_stay,
        )
    except CheckpointFileError as e:
        raise CheckpointFileError(
            f"{e}. Rerun the previous iteration's train job to write it again, or set "
            f"train.reset_optimizer=true to start this iteration with a fresh AdamW"
        ) from None
    if path is None:
        raise OptimizerStateError(f"{folder}: DeepSpeed could not load the optimizer state")


def _policy_weights_stay(src, dst) -> None:
    """DeepSpeed's module loader for an AdamW state: a state that holds none (a train job's
    output, ``save_optimizer_state``) leaves the module the weights of the policy it was built
    from, which ``check_optimizer_state`` has matched to the state's digest; a state that holds
    them (written outside the outputs, or before) sets them, as DeepSpeed's own loader does."""
    if src is not None:
        dst.load_state_dict(src, strict=True)


def _barrier(world_size: int) -> None:
    """Wait for every rank (a no-op for one process)."""
    if world_size > 1:
        torch.distributed.barrier()


def save_optimizer_state(
    engine,
    out: str,
    meta: dict,
    rank: int,
    world_size: int,
    writer: dict | None = None,
    snapshot_done=None,
    module: bool = True,
) -> None:
    """Write the engine's state as a DeepSpeed checkpoint (every rank its ZeRO shard) to a
    temporary sibling folder, then rank 0 adds ``meta.json`` and renames it to ``out``: a killed
    job never leaves a folder that looks finished. Collective: every rank must call it.
    ``writer``: a record of the writing process, kept in the temporary folder while it writes
    (``retention.OPTIMIZER_WRITER``: a publisher elsewhere waits while it lives); given (a write
    after the job returned), a failure leaves its error there instead (``record_failed_write``).
    ``snapshot_done`` (a ``threading.Event``): the state is first copied to host memory
    (``snapshot``), the event set, and only then written: the engine may change meanwhile.
    ``module`` false (a train job's ``--optimizer`` output): the module's weights are left out of
    the model-states file. They are the policy's that ``meta`` binds by its digest, the job's own
    output, from which a job that loads the state builds its engine (at the 0.5B shape in bf16,
    1 GB of the 7 GB). A state written outside the outputs keeps them: a job replaying from it
    builds its engine from its own --policy, and the state's policy may be pruned by then."""
    out_path = Path(out)
    tmp = optimizer_partial(out_path)  # the same name on every rank

    guard_checkpoint_io(engine)
    if rank == 0 and not (writer is not None and read_json(tmp / OPTIMIZER_WRITER) == writer):
        claim_optimizer_write(out_path, writer)
    _barrier(world_size)
    io = engine.checkpoint_engine
    io._otbflow_without_module = not module
    try:
        with write_errors_named(tmp):
            if snapshot_done is None:
                engine.save_checkpoint(str(tmp), tag=OPTIMIZER_TAG, client_state={}, save_latest=False)
            else:
                captured = []
                io._otbflow_capture = captured
                try:
                    engine.save_checkpoint(str(tmp), tag=OPTIMIZER_TAG, client_state={}, save_latest=False)
                finally:
                    io._otbflow_capture = None
                    snapshot_done.set()
                for state, path in captured:
                    save_checkpoint_file(state, path, io.zipfile_serialization)
                del captured
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed write (a full disk) leaves no partial state
        if writer is not None and rank == 0:
            record_failed_write(out_path, e)
        raise
    finally:
        io._otbflow_without_module = False
    _barrier(world_size)
    if rank == 0:
        try:
            (tmp / OPTIMIZER_WRITER).unlink(missing_ok=True)
            write_json(meta, tmp / OPTIMIZER_META)
            check_job(out_path)  # not published once the job that started this process has ended
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if writer is not None:
                record_failed_write(out_path, e)
            raise
        if out_path.exists():
            shutil.rmtree(out_path)
        os.replace(tmp, out_path)
    _barrier(world_size)


def record_failed_write(out: str | Path, error: BaseException) -> None:
    """The error of a write of the optimizer state ``out`` after its job returned, in its emptied
    temporary folder (``retention.OPTIMIZER_FAILED``): the publish job names it (a full disk: the
    errno and the file), where the worker's own log would otherwise be the only one to. Best effort
    (the disk may still be full: the publish job then says that the writer died)."""
    with contextlib.suppress(Exception):
        tmp = optimizer_partial(out)
        tmp.mkdir(parents=True, exist_ok=True)
        write_json({"error": f"{type(error).__name__}: {error}"}, tmp / OPTIMIZER_FAILED)


def claim_optimizer_write(out: str | Path, writer: dict | None = None) -> None:
    """Rank 0: an empty temporary folder for the optimizer state ``out``, holding the record of
    its ``writer``. A warm train worker makes it before its job returns, so that a publisher that
    starts before the background write does waits for it (it finds neither ``meta.json`` nor a
    live writer otherwise, and counts the state lost)."""
    tmp = optimizer_partial(out)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if writer is not None:
        write_json(writer, tmp / OPTIMIZER_WRITER)


class Checkpoints:
    """DeepSpeed checkpoints of one train job in ``folder``, which is not a declared output
    (Snakemake deletes the outputs of a failed job; this survives it). The folder holds one
    fingerprint: a checkpoint of other inputs or config is wiped, never resumed. Only the latest
    complete checkpoint is kept; ``latest`` names it only once it is written, and is replaced in one rename."""

    def __init__(self, folder: str, fp: str, every: int, rank: int, world_size: int):
        self.folder, self.fp, self.every, self.rank, self.world_size = Path(folder), fp, every, rank, world_size

    def load(self, engine) -> dict | None:
        """The client state of the latest checkpoint after loading it into ``engine``, or None.
        Its files are read as data (``guard_checkpoint_io``)."""
        guard_checkpoint_io(engine)
        stamp = self.folder / "fingerprint"
        resumable = stamp.is_file() and stamp.read_text() == self.fp and self._latest() is not None
        _barrier(self.world_size)
        if not resumable:
            if self.rank == 0 and self.every:
                shutil.rmtree(self.folder, ignore_errors=True)
                self.folder.mkdir(parents=True)
                write_text(self.fp, stamp)
            _barrier(self.world_size)
            return None
        try:
            path, client = engine.load_checkpoint(str(self.folder), load_module_strict=True)
        except CheckpointFileError as e:
            raise CheckpointFileError(f"{e}. Delete {self.folder}: the job then trains from its first step") from None
        if path is None:
            raise RuntimeError(f"{self.folder}: could not load the checkpoint that 'latest' names")
        return client

    def due(self, steps_done: int, total: int) -> bool:
        return bool(self.every) and steps_done % self.every == 0 and steps_done < total

    def _latest(self) -> str | None:
        """The tag that ``latest`` names, where that checkpoint's folder exists."""
        latest = self.folder / "latest"
        tag = latest.read_text().strip() if latest.is_file() else ""
        return tag if tag and (self.folder / tag).is_dir() else None

    def save(self, engine, steps_done: int, client: dict) -> None:
        """Write the checkpoint of ``steps_done`` steps; ``latest`` names it once it is whole. A
        failed write (a full disk: its OSError names the file) removes what it began."""
        guard_checkpoint_io(engine)
        tag = f"step_{steps_done:06d}"
        try:
            with write_errors_named(self.folder):
                engine.save_checkpoint(str(self.folder), tag=tag, client_state=client, save_latest=False)
        except BaseException:
            shutil.rmtree(self.folder / tag, ignore_errors=True)
            raise
        _barrier(self.world_size)
        if self.rank == 0:
            # DeepSpeed's own ``latest`` is opened for writing in place: a job killed between the
            # truncation and the write left it empty, and the previous checkpoint unreachable
            write_text(tag, self.folder / "latest")
        _barrier(self.world_size)
        if self.rank == 0:
            for old in self.folder.glob("step_*"):
                if old.name != tag:
                    shutil.rmtree(old, ignore_errors=True)

    def finish(self) -> None:
        """The stage's outputs are written: the checkpoints are no longer needed. The workflow's
        checkpoint tree (results/checkpoints/train/) goes too once it is empty."""
        _barrier(self.world_size)
        if self.rank == 0:
            shutil.rmtree(self.folder, ignore_errors=True)
            parents = list(self.folder.parents)[:2]
            if parents and parents[-1].name == "checkpoints":
                for parent in parents:
                    with contextlib.suppress(OSError):
                        parent.rmdir()  # only if empty: another iteration's job may be running
