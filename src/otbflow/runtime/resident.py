"""What a warm worker (``otbflow.ops.worker``) keeps between the jobs it runs: off in every other process.

- ``policy``: the policies loaded by ``otbflow.models.policy.load_policy`` (generation and the features
  pass), one per (dtype, precision). A job whose policy folder holds the same weights (by the
  digest of its weight files, never by its path: ``otbflow.runtime.policy_folder``) gets the
  resident module as it is; one with other weights of the same architecture has them copied into
  the resident module in place, from the job's own input folder; another architecture or
  tokenizer is loaded anew.
- ``hold`` / ``take`` / ``drop``: named objects a stage keeps for the next job (the train stage's
  DeepSpeed engine with its AdamW state, the KL reference), each with the facts the next job must
  match to use it; ``drop`` forgets them (a failed or abandoned job: its state is not trusted).
- ``save_in_background`` / ``join_writes``: the AdamW state a train job writes after it returned.

Nothing here changes what a job computes: a resident module holds exactly the weights a fresh load
of the job's input folder would (tests/test_worker.py compares the outputs bitwise).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from otbflow.runtime.policy_folder import architecture, tokenizer_digest, weights_digest

log = logging.getLogger("otbflow.runtime.resident")

ENABLED = False
"""True in a worker (``enable``): the stages keep what the next job needs."""
HEARTBEAT = ""
"""The worker's heartbeat file (``otbflow.ops.worker``): a record of what it writes names it."""

_held: dict[str, Any] = {}


def enable() -> None:
    global ENABLED
    ENABLED = True


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


WRITER_THREAD = "optimizer-writer"
"""The name of a warm train worker's thread that writes an optimizer state after its job returned."""


def save_in_background(write: Callable[[], None], fatal: bool = False) -> None:
    """Run ``write`` (``otbflow.training.state.save_optimizer_state``) in a thread of this process
    (a warm train worker's, after its job returned); ``join_writes`` waits for it. Not a daemon:
    the process finishes the write before it exits (SIGTERM included; the worker stays registered
    until then). A failed write leaves no folder: the publish job then finds the state lost.
    ``fatal``: a failure ends the process (a rank of a worker of several, whose collectives are
    then out of step with the other ranks'; the launcher ends them)."""

    def run():
        try:
            write()
        except BaseException:
            log.exception("writing the optimizer state failed")
            if fatal:
                log.error("this rank's collectives are out of step with the others': the worker ends")
                os._exit(1)

    threading.Thread(target=run, name=WRITER_THREAD).start()


def join_writes() -> None:
    """Wait for this process's optimizer states being written in the background."""
    for thread in threading.enumerate():
        if thread.name == WRITER_THREAD:
            thread.join()


@dataclass
class Policy:
    model: Any
    tok: Any
    architecture: str
    """``policy_folder.architecture`` of the folder it was loaded from."""
    tokenizer: str
    weights: str


def policy(path: str | Path, dtype: str, cast_to, load: Callable) -> tuple[Any, Any]:
    """(model, tokenizer) of the policy folder ``path`` as ``load(path, dtype, cast_to)`` gives it,
    from the resident module where one of the same architecture and tokenizer is held."""
    path = Path(path)
    key = f"policy:{dtype}:{cast_to}"
    held: Policy | None = _held.get(key)
    architecture_, tokenizer = architecture(path), tokenizer_digest(path)
    if held is not None and held.architecture == architecture_ and held.tokenizer == tokenizer:
        weights = weights_digest(path)
        if weights != held.weights:
            load_weights_in_place(held.model, path)
            held.weights = weights
            log.info("resident policy: the weights of %s copied into the resident module", path)
        else:
            log.info("resident policy: %s holds the weights already resident", path)
        for p in held.model.parameters():
            p.grad = None
        held.model.eval()
        return held.model, held.tok
    model, tok = load(path, dtype, cast_to)
    if ENABLED:
        _held[key] = Policy(model, tok, architecture_, tokenizer, weights_digest(path))
    return model, tok


def load_weights_in_place(model, path: Path) -> None:
    """Copy the weights of the HF folder ``path`` (safetensors) into ``model``'s own tensors, each
    cast to the tensor's dtype on its device; a name the files lack must be tied to one they hold
    (GPT-2's and Qwen's output head). ValueError where they do not fit."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no safetensors weights to load in place")
    params = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    seen = set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name not in params:
                    raise ValueError(f"{file}: tensor {name} has no place in the resident {type(model).__name__}")
                target = params[name]
                tensor = f.get_tensor(name)
                if tuple(tensor.shape) != tuple(target.shape):
                    raise ValueError(
                        f"{file}: tensor {name} is {tuple(tensor.shape)}, the module's {tuple(target.shape)}"
                    )
                target.data.copy_(tensor)
                seen.add(id(target))
    missing = [n for n, p in model.named_parameters(remove_duplicate=False) if id(p) not in seen]
    if missing:
        raise ValueError(f"{path}: no weights for {', '.join(missing[:5])}")
