"""A policy's element-level delta: the elements that changed since the policy its train job
started from, so that a warm worker holding that policy reads megabytes instead of the model.

Between two RL steps ~99% of a bf16 policy's elements are bit-identical (the learning rate moves
few of them past bf16's last digit; benchmarks/bench_iteration.py records the share). A warm train
worker publishing bf16 compares each tensor as it writes it with the same tensor of the policy the
job started from, read back from that folder's file and checked against its manifest (``Base``;
no copy of the model is kept in memory): the changed elements' flat positions and new values go
to ``FILE`` in the new folder (``Base.write``), a safetensors file of its own name
(``<tensor>@index``, int32 or int64, and ``<tensor>@value``; a tensor that changed in more than a
third of its elements as ``<tensor>@value`` whole), which no model loader takes for weights. The
folder's manifest lists it (``delta``: the identity of the weights it applies to, and a digest per
entry), under the manifest's MAC in a worker.

A reader whose resident module holds exactly those base weights (``otbflow.runtime.resident``)
reads only ``FILE``, checks every entry against its digest and sets the elements (``apply``); any
other reader loads the weights as before. The full files are always written: the record, and the
readers that hold something else."""

from __future__ import annotations

import mmap
from pathlib import Path

from otbflow.runtime import manifest, tensorfile
from otbflow.runtime.policy_folder import DELTA as FILE

WHOLE = 1 / 3
"""A tensor whose changed share is above this goes whole (its positions would cost more)."""
CHUNK = 1 << 22
"""Bytes compared at a time (a chunk's masks stay in the cache)."""


def changed(new, old, itemsize: int):
    """The flat positions of the elements of ``itemsize`` bytes whose bits differ between the
    byte arrays ``new`` and ``old`` (numpy uint8, equal lengths), ascending (int64), compared a
    chunk at a time."""
    import numpy as np

    bits = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[itemsize]
    a, b, step = new.view(bits), old.view(bits), CHUNK // itemsize
    found = [i + np.flatnonzero(a[i : i + step] != b[i : i + step]) for i in range(0, len(a), step)]
    return np.concatenate(found) if found else np.empty(0, dtype=np.int64)


class Base:
    """The policy a train job started from, as its folder's files hold it: what ``observe``
    compares each tensor being written with. Each tensor of the base is read from its file where it
    lies (mapped, not copied; its pages let go once compared, so no copy of the model stays in
    memory) and checked against the digest its manifest lists; a base that does not match (its
    files changed after publication) gives no delta. A base without a manifest, or not in
    safetensors, gives none either (``usable``)."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        listed = manifest.read(folder)
        self.weights = listed and listed.get("weights")
        self.listed: dict = (listed or {}).get("tensors", {})
        self.usable = bool(self.weights) and all(
            e.get("dtype") in manifest.DTYPES and str(e.get("file", "")).endswith(".safetensors")
            for e in self.listed.values()
        )
        self.layouts: dict[str, tuple[int, dict]] = {}
        self.changes: dict = {}
        self.elements = 0
        self.broken = ""
        self.release = None

    def _read(self, name: str, nbytes: int):
        """The base's bytes of ``name`` (a read-only uint8 array over the mapped file, unmapped with
        its last view; ``release`` lets go of its pages), checked against its digest; None where the
        base has no such tensor of that size or its bytes do not match."""
        import numpy as np

        entry = self.listed.get(name)
        if entry is None:
            return None
        file = self.folder / entry["file"]
        if entry["file"] not in self.layouts:
            self.layouts[entry["file"]] = manifest.safetensors_layout(file)
        start, header = self.layouts[entry["file"]]
        a, b = header.get(name, {}).get("data_offsets", (0, -1))
        if b - a != nbytes or not nbytes:
            return None if b - a != nbytes else np.empty(0, dtype=np.uint8)
        with open(file, "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if mapped.size() < start + b:
            self.broken = self.broken or name
            return None
        view = np.frombuffer(mapped, dtype=np.uint8, count=nbytes, offset=start + a)
        first = (start + a) // mmap.PAGESIZE * mmap.PAGESIZE
        self.release = lambda: mapped.madvise(mmap.MADV_DONTNEED, first, start + b - first)
        blake3 = manifest._blake3()
        threads = blake3.AUTO if nbytes >= tensorfile.THREADED else 1
        if blake3(view, max_threads=threads).hexdigest() != entry[manifest.HASH]:
            self.broken = self.broken or name
            return None
        return view

    def observe(self, name: str, new) -> None:
        """Compare ``new`` (a tensor as written: CPU, contiguous, the file's dtype) with the base's
        tensor of that name and keep what changed."""
        import torch

        if not self.usable or self.broken:
            return
        entry = self.listed.get(name, {})
        old = self._read(name, new.numel() * new.element_size())
        if self.broken:
            return
        same = old is not None and entry.get("shape") == list(new.shape)
        same = same and manifest.DTYPES.get(entry.get("dtype")) == str(new.dtype).removeprefix("torch.")
        if not same:  # a tensor the base lacks, or of another shape or dtype: whole
            self.changes[f"{name}@value"] = new.clone()
            self.elements += new.numel()
            return
        if not new.numel():
            return
        where = changed(new.reshape(-1).view(torch.uint8).numpy(), old, new.element_size())
        self.release()  # its pages: the page cache keeps them, this process's resident set does not
        self.release = None
        if len(where) > WHOLE * new.numel():
            self.changes[f"{name}@value"] = new.clone()
        elif len(where):
            index = torch.from_numpy(where)
            self.changes[f"{name}@index"] = index.to(torch.int32) if new.numel() < 2**31 else index
            self.changes[f"{name}@value"] = new.reshape(-1)[index]
        self.elements += len(where)

    def write(self, folder: str | Path) -> dict | None:
        """Write the changes found into ``folder``'s ``FILE`` and return the manifest's ``delta``
        section ({base, file, elements, bytes, tensors: digests}); None where the base gave none."""
        if not self.usable or self.broken:
            return None
        path = Path(folder) / FILE
        tensors = tensorfile.write(path, sorted(self.changes.items()))
        self.changes = {}
        return {
            "base": self.weights,
            "file": FILE,
            "elements": self.elements,
            "bytes": path.stat().st_size,
            "tensors": tensors,
        }


def applies(section: dict | None, held_weights: str | None) -> bool:
    """Whether a manifest's ``delta`` section takes a module holding ``held_weights`` to the
    folder's weights."""
    return bool(section) and section.get("base") == held_weights and isinstance(section.get("tensors"), dict)


def apply(model, folder: str | Path, section: dict) -> tuple[int, int]:
    """Set the changed elements the manifest's ``delta`` ``section`` lists into ``model``'s own
    tensors (each cast to the tensor's dtype, on its device), every entry checked against its
    digest first (``manifest.ManifestMismatch`` naming them; the module is then untouched).
    ValueError where an entry has no place in the module. Returns (tensors changed, bytes read)."""
    import torch

    path = Path(folder) / section["file"]
    data = bytearray(path.stat().st_size)  # read once; every entry a view of it, none copied
    with open(path, "rb", buffering=0) as f:
        got = f.readinto(data)
    start, header = manifest.safetensors_layout(path)
    listed = section["tensors"]
    blake3, read, bad = manifest._blake3(), {}, sorted(set(listed) ^ set(header))
    for name in sorted(set(listed) & set(header)):
        t = header[name]
        a, b = t["data_offsets"]
        raw = memoryview(data)[start + a : start + b]
        if start + b > got or blake3(raw).hexdigest() != listed[name][manifest.HASH]:
            bad.append(name)
            continue
        dtype = getattr(torch, manifest.DTYPES[t["dtype"]])
        if (start + a) % dtype.itemsize:  # not aligned to its elements in the file: a copy that is
            raw = bytearray(raw)
        read[name] = torch.frombuffer(raw, dtype=dtype) if b > a else torch.empty(0, dtype=dtype)
    if bad:
        raise manifest.mismatch(path, bad)
    params = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    names = sorted({n.rsplit("@", 1)[0] for n in read})
    for name in names:
        target = params.get(name)
        if target is None or not target.is_contiguous():
            raise ValueError(f"{path}: {name} has no contiguous place in the resident {type(model).__name__}")
    for name in names:
        target, value = params[name].data, read[f"{name}@value"]
        if f"{name}@index" in read:
            index = read[f"{name}@index"].to(target.device)  # int32 or int64, as written
            target.view(-1)[index] = value.to(device=target.device, dtype=target.dtype)
        else:
            target.copy_(value.view(target.shape))
    return len(names), len(data)
