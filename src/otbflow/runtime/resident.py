"""What a warm worker (``otbflow.ops.worker``) keeps between the jobs it runs: off in every other process.

- ``policy``: the policies loaded by ``otbflow.models.policy.load_policy`` (generation and the features
  pass), one per (dtype, precision). A job whose policy folder holds the same weights (by their
  digests, never by its path: ``otbflow.runtime.manifest``) gets the resident module as it is; one
  with other weights of the same architecture has the tensors that differ copied into the resident
  module in place, from the job's own input folder, or only the elements that changed where the
  folder's delta starts from the weights it holds (``otbflow.runtime.delta``); another architecture
  or tokenizer is loaded anew. ``KEY`` (the run's secret) decides which manifests are trusted without reading the files.
- ``hold`` / ``take`` / ``drop``: named objects a stage keeps for the next job (the train stage's
  DeepSpeed engine with its AdamW state, the KL reference), each with the facts the next job must
  match to use it; ``drop`` forgets them (a failed or abandoned job: its state is not trusted).
- ``save_in_background`` / ``join_writes`` / ``join_snapshots``: the AdamW state a train job
  writes after it returned (the next job waits for its copy to host memory where it takes one);
  ``due`` / ``wrote``: the time since the last one (``train.optimizer_every_min``); ``retire``: what
  the held objects write before the worker ends.

Nothing here changes what a job computes: a resident module holds exactly the weights a fresh load
of the job's input folder would (tests/test_worker.py compares the outputs bitwise).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from otbflow.runtime import delta, manifest, tensorfile
from otbflow.runtime.policy_folder import architecture, tokenizer_digest

log = logging.getLogger("otbflow.runtime.resident")

ENABLED = False
"""True in a worker (``enable``): the stages keep what the next job needs."""
KEY: bytes | None = None
"""The run's secret in a worker (``enable``): a policy manifest whose MAC verifies with it is
trusted without a pass over the folder's files (``otbflow.runtime.manifest``)."""
HEARTBEAT = ""
"""The worker's heartbeat file (``otbflow.ops.worker``): a record of what it writes names it."""

_held: dict[str, Any] = {}


def enable(key: bytes | None = None) -> None:
    global ENABLED, KEY
    ENABLED, KEY = True, key


def hold(name: str, value: Any) -> None:
    if ENABLED:
        _held[name] = value


def take(name: str) -> Any:
    """The object held under ``name`` (None: none), left held."""
    return _held.get(name) if ENABLED else None


def drop(name: str | None = None) -> None:
    """Forget ``name`` (None: everything), e.g. after a job failed half-way."""
    if name is None:
        _held.clear()
    else:
        _held.pop(name, None)


def retire() -> None:
    """The worker ends (retired, idle, stopped): each held object with a ``retire`` method writes
    what it must keep (the train engine's AdamW state, unless written)."""
    for value in list(_held.values()):
        if hasattr(value, "retire"):
            try:
                value.retire()
            except Exception:
                log.exception("writing what the worker held before it ends failed")


_LAST_WRITE = [time.time()]


def wrote() -> None:
    """An AdamW state write starts now (``due``)."""
    _LAST_WRITE[0] = time.time()


def due(seconds: float) -> bool:
    """Whether ``seconds`` (> 0) have passed since this worker's last AdamW write, or its start."""
    return ENABLED and seconds > 0 and time.time() - _LAST_WRITE[0] >= seconds


WRITER_THREAD = "optimizer-writer"
"""The name of a warm train worker's thread that writes an optimizer state after its job returned."""


_SNAPSHOTS: dict[threading.Thread, threading.Event] = {}


def save_in_background(write: Callable[[], None], fatal: bool = False, snapshot: threading.Event | None = None) -> None:
    """Run ``write`` (``otbflow.training.state.save_optimizer_state``) in a thread of this process
    (a warm train worker's, after its job returned); ``join_writes`` waits for it. Not a daemon:
    the process finishes the write before it exits (SIGTERM included; the worker stays registered
    until then). A failed write leaves no folder: the publish job then finds the state lost.
    ``fatal``: a failure ends the process (a rank of a worker of several, whose collectives are
    then out of step with the other ranks'; the launcher ends them). ``snapshot``: set by ``write``
    once the state is copied to host memory (``join_snapshots`` waits only for that)."""

    def run():
        try:
            write()
        except BaseException:
            log.exception("writing the optimizer state failed")
            if fatal:
                log.error("this rank's collectives are out of step with the others': the worker ends")
                os._exit(1)

    thread = threading.Thread(target=run, name=WRITER_THREAD)
    if snapshot is not None:
        _SNAPSHOTS[thread] = snapshot
    thread.start()


def join_writes() -> None:
    """Wait for this process's optimizer states being written in the background."""
    for thread in threading.enumerate():
        if thread.name == WRITER_THREAD:
            thread.join()
    _SNAPSHOTS.clear()


def join_snapshots() -> None:
    """Wait until the engine may change: the states being written in the background are copied to
    host memory (a writer with a snapshot: its disk write goes on), or written (one without)."""
    for thread in threading.enumerate():
        if thread.name == WRITER_THREAD:
            event = _SNAPSHOTS.get(thread)
            if event is None:
                thread.join()
            else:
                while not event.wait(0.1) and thread.is_alive():
                    pass
    for thread in [t for t in _SNAPSHOTS if not t.is_alive()]:
        _SNAPSHOTS.pop(thread, None)


def tokenizer(path: str | Path, load: Callable) -> Any:
    """The tokenizer of the folder ``path`` as ``load(path)`` gives it, kept for the jobs after by
    the digest of its files and the folder's architecture (the load checks the tokenizer against
    the model's config): a run's policies share their tokenizer files byte for byte."""
    key = f"tokenizer:{tokenizer_digest(path)}:{architecture(path)}"
    if key not in _held:
        _held[key] = load(path)
    return _held[key]


@dataclass
class Policy:
    model: Any
    tok: Any
    architecture: str
    """``policy_folder.architecture`` of the folder it was loaded from."""
    tokenizer: str
    weights: str
    """``manifest.identity`` of the weights it holds."""
    tensors: dict[str, dict]
    """The manifest entries of the weights it holds, by tensor name (``manifest.entries``)."""


LAST_LOAD: dict[str, Any] = {}
"""What the last policy load of this process read (``policy``, ``otbflow.models.policy.load_policy``):
{tensors read, bytes read, whether the manifest was trusted, seconds}; the rollout and features
jobs record it in their table's metadata (``policy_load``): the bytes a handover moved."""


def loaded(tensors: int | None, nbytes: int, trusted: bool, seconds: float, delta_elements: int | None = None) -> None:
    LAST_LOAD.clear()
    LAST_LOAD.update(tensors=tensors, bytes=nbytes, trusted=trusted, seconds=round(seconds, 3))
    if delta_elements is not None:  # read from the folder's delta (otbflow.runtime.delta)
        LAST_LOAD.update(delta_elements=delta_elements)


def policy(path: str | Path, dtype: str, cast_to, load: Callable) -> tuple[Any, Any]:
    """(model, tokenizer) of the policy folder ``path`` as ``load(path, dtype, cast_to)`` gives it,
    from the resident module where one of the same architecture and tokenizer is held: only the
    tensors whose digests differ from the resident ones are read, where the folder's manifest is
    trusted (``manifest.trusted``, the worker's key), and every tensor read is checked against it;
    a folder without a trusted manifest is read whole, in one pass that hashes as it copies.
    ``load`` may return the folder's manifest entries third (computed as it read the files,
    checked against the folder's manifest: ``load_weights_in_place``), which spares a pass."""
    path, t0 = Path(path), time.perf_counter()
    key = f"policy:{dtype}:{cast_to}"
    held: Policy | None = _held.get(key)
    architecture_, tokenizer = architecture(path), tokenizer_digest(path)
    if held is not None and held.architecture == architecture_ and held.tokenizer == tokenizer:
        listed = manifest.read(path)
        trusted = manifest.trusted(path, listed, KEY)
        if trusted and listed["weights"] == held.weights:
            loaded(0, 0, True, time.perf_counter() - t0)
            log.info("resident policy: %s holds the weights already resident", path)
        elif trusted and delta.applies(listed.get("delta"), held.weights):
            _held.pop(key)  # until the delta is set whole
            changed, nbytes = delta.apply(held.model, path, listed["delta"])
            held.tensors, held.weights = listed["tensors"], listed["weights"]
            _held[key] = held
            loaded(changed, nbytes, True, time.perf_counter() - t0, listed["delta"]["elements"])
            log.info(
                "resident policy: %d elements of %d tensors (%.1f MB) of %s set from its delta (manifest trusted)",
                listed["delta"]["elements"],
                changed,
                nbytes / 1e6,
                path,
            )
        else:
            _held.pop(key)  # until the copy is whole: a failed one leaves a module of two policies
            tensors, moved = load_weights_in_place(
                held.model, path, want=listed["tensors"] if listed else None, have=held.tensors if trusted else None
            )
            held.tensors, held.weights = tensors, manifest.identity(tensors)
            _held[key] = held
            loaded(*moved, trusted, time.perf_counter() - t0)
            log.info(
                "resident policy: %d of %d tensors (%.1f MB) of %s copied into the resident module (manifest %s)",
                *moved[:1],
                len(tensors),
                moved[1] / 1e6,
                path,
                "trusted" if trusted else "checked while reading",
            )
        for p in held.model.parameters():
            p.grad = None
        held.model.eval()
        return held.model, held.tok
    model, tok, *read = load(path, dtype, cast_to)
    if ENABLED:
        if read and read[0] is not None:  # the entries the load computed, checked against the manifest
            tensors, trusted = read[0], manifest.trusted(path, manifest.read(path), KEY)
            weights = manifest.identity(tensors)
        else:
            weights, tensors, trusted = manifest.weights(path, KEY)
        nbytes = sum(p.stat().st_size for p in path.glob("*.safetensors"))
        loaded(len(tensors), nbytes, trusted, time.perf_counter() - t0)
        _held[key] = Policy(model, tok, architecture_, tokenizer, weights, tensors)
    return model, tok


def load_weights_in_place(model, path: Path, want: dict | None = None, have: dict | None = None):
    """Copy the weights of the HF folder ``path`` (safetensors) into ``model``'s own tensors, each
    cast to the tensor's dtype on its device; a name the files lack must be tied to one they hold
    (GPT-2's and Qwen's output head). ValueError where they do not fit.

    ``want``: the folder's manifest entries; every tensor read must match its digest (else
    ``manifest.ManifestMismatch``). ``have``: the entries the module holds already; a tensor whose
    digest is the same in both is not read. Returns (the folder's entries, (tensors copied, bytes
    read))."""
    import torch

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no safetensors weights to load in place")
    blake3 = manifest._blake3()
    params = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    seen, tensors, bad, copied, moved = set(), {}, [], 0, 0
    chunk = torch.empty(0, dtype=torch.uint8)
    for file in files:
        start, header = manifest.safetensors_layout(file)
        with open(file, "rb", buffering=0) as f:
            for name in sorted(header, key=lambda n: header[n]["data_offsets"][0]):  # the file's order
                t = header[name]
                if name not in params:
                    raise ValueError(f"{file}: tensor {name} has no place in the resident {type(model).__name__}")
                target = params[name]
                if tuple(t["shape"]) != tuple(target.shape):
                    raise ValueError(
                        f"{file}: tensor {name} is {tuple(t['shape'])}, the module's {tuple(target.shape)}"
                    )
                seen.add(id(target))
                listed = (want or {}).get(name, {}).get(manifest.HASH)
                if listed is not None and have is not None and have.get(name, {}).get(manifest.HASH) == listed:
                    tensors[name] = want[name]
                    continue
                a, b = t["data_offsets"]
                dtype = getattr(torch, manifest.DTYPES[t["dtype"]])
                # the bytes go straight into the module's tensor where it is a contiguous host tensor of
                # the file's dtype (one copy, from the page cache); otherwise a chunk at a time through a
                # small buffer and a cast (never the whole tensor in the file's dtype beside the module)
                f.seek(start + a)
                h = blake3(max_threads=blake3.AUTO if b - a >= tensorfile.THREADED else 1)
                if target.dtype == dtype and target.device.type == "cpu" and target.is_contiguous():
                    parts = [(target.data.view(-1), None)]
                elif target.is_contiguous():
                    if not chunk.numel():
                        chunk = torch.empty(tensorfile.THREADED, dtype=torch.uint8)
                    step = len(chunk) // dtype.itemsize
                    flat = target.data.view(-1)
                    parts = [
                        (chunk[: len(flat[i : i + step]) * dtype.itemsize].view(dtype), flat[i : i + step])
                        for i in range(0, len(flat), step)
                    ]
                else:
                    parts = [(torch.empty(t["shape"], dtype=dtype).view(-1), target.data)]
                for into, then in parts:
                    raw = memoryview(into.view(torch.uint8).numpy()) if into.numel() else memoryview(b"")
                    if f.readinto(raw) != len(raw):
                        raise ValueError(f"{file}: tensor {name} is cut short (the file ends before its bytes)")
                    h.update(raw)
                    raw.release()
                    if then is not None:
                        then.copy_(into.view(then.shape))
                digest = h.hexdigest()
                tensors[name] = manifest.entry(file.name, t["dtype"], t["shape"], digest)
                if want is not None and listed != digest:
                    bad.append(name)  # the module is dropped (``policy``): what it now holds is not trusted
                    continue
                copied, moved = copied + 1, moved + (b - a)
    if want is not None:
        bad += sorted(set(want) - set(tensors))
    if bad:
        raise manifest.mismatch(path, bad)
    missing = [n for n, p in model.named_parameters(remove_duplicate=False) if id(p) not in seen]
    if missing:
        raise ValueError(f"{path}: no weights for {', '.join(missing[:5])}")
    return tensors, (copied, moved)
