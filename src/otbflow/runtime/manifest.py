"""A policy folder's manifest: a BLAKE3 digest per tensor, written once by the train job that
publishes the folder, last, so that a reader learns which weights a folder holds without another
pass over its files.

- ``entries(folder)``: one pass over the weight files: every tensor of a safetensors file by name
  (dtype, shape, BLAKE3 of its bytes, read from the file's own layout); a ``.bin`` file whole.
- ``identity(entries)``: the folder's weights in one digest, whichever files hold them (shards,
  order): what says whether two folders, or a resident module and a folder, hold the same weights.
- ``publish(tmp, final, binding, key)``: the train job's manifest of the folder it is writing.
  With the run's key (a warm worker's: ``otbflow.ops.dispatch.secret``) the manifest carries a MAC
  that binds it to the run, the folder's path, the iteration and the job's fingerprint.
- ``weights(folder, key)``: (identity, entries, trusted). A manifest whose MAC verifies with
  ``key`` and that names this folder is trusted as it is: nothing is read but the manifest. Any
  other folder (no key, a copied run, ``model.path``, a manifest of another folder) costs one pass
  (``entries``); where it has a manifest, every tensor must match it, or ValueError names them.

What a trusted manifest proves, and to whom: docs/security.md ("Policy manifests"). Reads bytes
and JSON only (no torch): the Snakefile's retention check imports the modules beside it."""

from __future__ import annotations

import json
import mmap
from pathlib import Path

from otbflow.runtime.policy_folder import WEIGHTS

MANIFEST = "manifest.json"
FORMAT = "otbflow-policy-manifest-1"
HASH = "blake3"
KEY_CONTEXT = "otbflow 2026-11-28 policy manifest MAC"
"""BLAKE3's key derivation context: the manifest's MAC key is derived from the run's secret for
this use alone (the dispatch requests' signatures use the secret otherwise)."""


DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "BOOL": "bool", "U8": "uint8"}
DTYPES |= {f"I{b}": f"int{b}" for b in (8, 16, 32, 64)}
"""safetensors' dtype names (a manifest entry's ``dtype``) -> torch's (``getattr(torch, name)``)."""


class ManifestMismatch(ValueError):
    """A folder's weight files do not hold what its manifest lists."""


def _blake3():
    import blake3

    return blake3.blake3


def safetensors_layout(path: Path) -> tuple[int, dict]:
    """(where the data starts, the header by tensor name) of a safetensors file: an 8-byte little
    endian header length, the JSON header, then the data (each tensor's ``data_offsets`` from the
    data's start)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return 8 + n, header


def entry(file: str, dtype: str, shape, digest: str) -> dict:
    """A tensor's manifest entry: the file that holds it, its safetensors dtype, shape and BLAKE3."""
    return {"file": file, "dtype": dtype, "shape": list(shape), HASH: digest}


def entries(folder: str | Path) -> dict[str, dict]:
    """Every tensor of the folder's weight files, by name: {file, dtype, shape, blake3}; a weight
    file other than safetensors (a PyTorch ``.bin``) as one entry ``file:<name>``. One pass."""
    blake3 = _blake3()
    out: dict[str, dict] = {}
    for path in sorted(p for p in Path(folder).iterdir() if p.is_file() and p.suffix in WEIGHTS):
        if path.suffix != ".safetensors":
            h = blake3()
            h.update_mmap(str(path))
            out[f"file:{path.name}"] = entry(path.name, "file", [], h.hexdigest())
            continue
        start, header = safetensors_layout(path)
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            view = memoryview(data)
            try:
                for name in sorted(header):
                    t = header[name]
                    a, b = t["data_offsets"]
                    digest = blake3(view[start + a : start + b]).hexdigest()
                    out[name] = entry(path.name, t["dtype"], t["shape"], digest)
            finally:
                view.release()
    return out


def identity(tensors: dict[str, dict]) -> str:
    """The weights of ``tensors`` (``entries``) in one digest: names, dtypes, shapes and tensor
    digests, not the files that hold them."""
    canon = json.dumps({n: [e["dtype"], e["shape"], e[HASH]] for n, e in sorted(tensors.items())}, sort_keys=True)
    return _blake3()(canon.encode()).hexdigest()


def _mac(body: dict, key: bytes) -> str:
    blake3 = _blake3()
    k = blake3(key, derive_key_context=KEY_CONTEXT).digest()
    return blake3(json.dumps(body, sort_keys=True).encode(), key=k).hexdigest()


def publish(
    tmp: str | Path,
    final: str | Path,
    binding: dict,
    key: bytes | None,
    tensors: dict[str, dict] | None = None,
    delta: dict | None = None,
) -> str:
    """Write the manifest of the weights in ``tmp`` (the folder being written, published as
    ``final``) and return their identity. ``binding``: the iteration and the job's fingerprint;
    with ``key`` (the run's secret) a MAC covers them, ``final``'s path and every digest.
    ``tensors``: the entries, where the writer computed them from the bytes it wrote
    (``otbflow.runtime.tensorfile``); otherwise one pass over the files. ``delta``: the folder's
    element-level delta from the policy before (``otbflow.runtime.delta``)."""
    tensors = entries(tmp) if tensors is None else tensors
    body = {
        "format": FORMAT,
        "hash": HASH,
        "folder": str(Path(final).resolve()),
        **binding,
        "weights": identity(tensors),
        "tensors": tensors,
        **({"delta": delta} if delta else {}),
    }
    # ``tmp`` is published whole in one rename (``otbflow.io.atomic_dir``): a plain write is enough
    (Path(tmp) / MANIFEST).write_text(json.dumps({**body, "mac": _mac(body, key) if key else None}, indent=1))
    return body["weights"]


def read(folder: str | Path) -> dict | None:
    """The folder's manifest, None where it has none or an unreadable one."""
    path = Path(folder) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("format") == FORMAT else None


def trusted(folder: str | Path, manifest: dict | None, key: bytes | None) -> bool:
    """Whether ``manifest`` is this folder's, written by a job that held ``key``: its MAC
    verifies and it names this folder."""
    if not key or not manifest or not isinstance(manifest.get("mac"), str):
        return False
    body = {k: v for k, v in manifest.items() if k != "mac"}
    import hmac

    return manifest.get("folder") == str(Path(folder).resolve()) and hmac.compare_digest(
        _mac(body, key), manifest["mac"]
    )


def check(folder: str | Path, manifest: dict, tensors: dict[str, dict]) -> None:
    """ManifestMismatch naming the tensors where ``tensors`` (read from the files) are not what
    the folder's ``manifest`` lists."""
    listed = manifest.get("tensors", {})
    bad = sorted(
        n
        for n in listed.keys() | tensors.keys()
        if {**listed.get(n, {}), "file": 0} != {**tensors.get(n, {}), "file": 0}
    )
    if bad:
        raise mismatch(folder, bad)


def mismatch(folder: str | Path, bad: list[str]) -> ManifestMismatch:
    """The error of a folder whose tensors ``bad`` are not what its manifest lists."""
    return ManifestMismatch(
        f"{folder}: {len(bad)} tensor(s) differ from its {MANIFEST} ({', '.join(bad[:5])}): the weight files "
        f"changed after the train job published them. Rerun that job, or delete {MANIFEST} to take the "
        "files as they are"
    )


def weights(folder: str | Path, key: bytes | None = None) -> tuple[str, dict[str, dict], bool]:
    """(identity, tensors, trusted) of the folder's weights: from a manifest trusted with ``key``
    (no pass over the files), otherwise from one pass, checked against the folder's manifest where
    it has one (ManifestMismatch)."""
    manifest = read(folder)
    if trusted(folder, manifest, key):
        return manifest["weights"], manifest["tensors"], True
    tensors = entries(folder)
    if manifest is not None:
        check(folder, manifest, tensors)
    return identity(tensors), tensors, False


def weights_digest(folder: str | Path, key: bytes | None = None) -> str:
    """The identity of the folder's weights (``weights``): which policy an optimizer state belongs
    to (its meta.json's ``policy_weights``), which weights a resident module or engine holds."""
    return weights(folder, key)[0]


def model_digest(folder: str | Path, key: bytes | None = None) -> str:
    """The weights' identity and config.json's bytes: the model the folder holds (the KL reference
    a warm train worker keeps for the jobs after)."""
    h = _blake3()(weights_digest(folder, key).encode())
    h.update((Path(folder) / "config.json").read_bytes())
    return h.hexdigest()
