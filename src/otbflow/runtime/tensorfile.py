"""A safetensors file written tensor by tensor, each tensor's BLAKE3 digest taken from the bytes
as they go out: one pass over the weights, none read back.

safetensors' own ``save_file`` builds the whole file in memory before it writes it (a second copy
of the weights) and offers no digest; the format is its documented one (an 8-byte little-endian
header length, the JSON header padded with spaces to 8 bytes, the tensors' bytes in the header's
``data_offsets``), so that transformers, vLLM and safetensors read the file as their own, and
``otbflow.runtime.manifest.entries`` finds the same digests in it. A tensor in another dtype than
the file's is cast into one of two scratch buffers, reused (no second copy of the model)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from otbflow.progress import Clock
from otbflow.runtime.manifest import DTYPES, _blake3, entry

SAFETENSORS_DTYPES = {torch_name: name for name, torch_name in DTYPES.items()}
"""torch's dtype names -> safetensors' (a header's ``dtype``)."""
THREADED = 1 << 24
"""From this many bytes a tensor is hashed on every core (BLAKE3's tree)."""


def header(items: list[tuple[str, tuple]], metadata: dict[str, str] | None = None) -> bytes:
    """The header of a file holding ``items`` ((name, (torch tensor giving its shape, the dtype
    written)) pairs) in that order: its length, then the JSON padded with spaces to 8 bytes."""
    out: dict[str, dict] = {"__metadata__": metadata} if metadata else {}
    at = 0
    for name, (t, dtype) in items:
        n = t.numel() * dtype.itemsize
        out[name] = {"dtype": SAFETENSORS_DTYPES[str(dtype).removeprefix("torch.")], "shape": list(t.shape)}
        out[name]["data_offsets"] = [at, at + n]
        at += n
    text = json.dumps(out, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def write(
    path: str | Path,
    tensors: Iterable[tuple[str, object]],
    dtype=None,
    metadata: dict[str, str] | None = None,
    each: Callable[[str, object], None] | None = None,
    seconds: dict[str, float] | None = None,
) -> dict[str, dict]:
    """Write ``tensors`` ((name, torch tensor) pairs, in the file's order) to the safetensors file
    ``path``, floating-point ones as ``dtype`` where given (the others as they are), and return
    their manifest entries ({file, dtype, shape, blake3}: ``otbflow.runtime.manifest.entries``'s,
    computed from the bytes written). ``each(name, tensor)`` sees every tensor as written (in the
    file's dtype, on the CPU). A tensor's bytes go to the file, and to ``each``, each in a thread of
    its own while the next tensor is cast and hashed (the disk's time and the comparison beside the
    digest); a tensor that must be cast or copied first goes through one of two scratch buffers,
    taken in turn. ``seconds``: where the time went (cast, hash, and wait: for the write and
    ``each`` of the tensor before), added to its keys."""
    import torch

    items = [(n, (t, dtype if dtype is not None and t.is_floating_point() else t.dtype)) for n, t in tensors]
    head = header(items, metadata)
    biggest = max((t.numel() * d.itemsize for _, (t, d) in items if _needs_copy(t, d)), default=0)
    scratch = [torch.empty(biggest, dtype=torch.uint8) for _ in range(2 if biggest else 0)]
    blake3, entries = _blake3(), {}
    clock = Clock(seconds)
    with (
        open(path, "wb") as f,
        ThreadPoolExecutor(1, thread_name_prefix="tensorfile") as writer,
        ThreadPoolExecutor(1, thread_name_prefix="tensorfile-each") as seer,
    ):
        pending, seen = writer.submit(f.write, head), None
        for i, (name, (t, d)) in enumerate(items):
            if _needs_copy(t, d):
                data = scratch[i % 2][: t.numel() * d.itemsize].view(d).view(t.shape)
                data.copy_(t)  # the buffer of the tensor before the last: its write and ``each`` are done
            else:
                data = t
            clock("cast")
            raw = memoryview(data.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")
            threads = blake3.AUTO if len(raw) >= THREADED else 1
            digest = blake3(raw, max_threads=threads).hexdigest()
            clock("hash")
            pending.result()  # the file's bytes in order: the tensor before is written
            if seen is not None:
                seen.result()  # and seen (its errors raised here)
            clock("wait")
            pending = writer.submit(f.write, raw)
            seen = seer.submit(each, name, data) if each is not None else None
            entries[name] = entry(Path(path).name, SAFETENSORS_DTYPES[str(d).removeprefix("torch.")], t.shape, digest)
        pending.result()
        if seen is not None:
            seen.result()
        clock("wait")
    return entries


def _needs_copy(t, dtype) -> bool:
    """Whether a tensor's bytes must be copied before they are written: another dtype, another
    device, or not one contiguous block."""
    return t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous()
