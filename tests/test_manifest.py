"""Policy manifests (otbflow.runtime.manifest): a BLAKE3 digest per tensor, written by the train job
that publishes a policy, trusted by a warm worker's readers where its MAC verifies with the run's
key, checked in one pass otherwise; the resident module takes only the tensors that changed.

References: the safetensors library's own reader and blake3 over numpy's bytes of each tensor,
never the module's parser."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import blake3
import pytest
import torch
import train_helpers
from safetensors.torch import load_file, save_file
from train_helpers import run_stage

from otbflow.runtime import manifest, resident, retention
from otbflow.runtime.policy_folder import policy_weights

# the module-scoped fixtures of train_helpers: a policy and features for the train stage
policy_dir = train_helpers.policy_dir
features_path = train_helpers.features_path

KEY = b"0123456789abcdef" * 4


def digest_of(t: torch.Tensor) -> str:
    """BLAKE3 of a tensor's little-endian bytes, by a path the manifest module does not take."""
    return blake3.blake3(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def policy_copy(src, dst):
    shutil.copytree(src, dst)
    (dst / manifest.MANIFEST).unlink(missing_ok=True)
    return dst


def published(tiny_policy, tmp_path, name="policy", key=KEY, iteration=3):
    """A copy of the tiny policy with the manifest a train job writes (``publish``)."""
    out = policy_copy(tiny_policy, tmp_path / name)
    manifest.publish(out, out, {"iteration": iteration, "job_fingerprint": "f" * 16}, key)
    return out


def test_every_tensor_has_the_digest_of_its_bytes(tiny_policy, tmp_path):
    """Each entry: the dtype, shape and BLAKE3 of the tensor that safetensors loads (bfloat16 too)."""
    folder = policy_copy(tiny_policy, tmp_path / "p")
    state = load_file(folder / "model.safetensors")
    state["extra_bf16"] = torch.randn(3, 5).to(torch.bfloat16)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    got = manifest.entries(folder)
    assert set(got) == set(state)
    for name, t in state.items():
        assert got[name]["shape"] == list(t.shape), name
        assert got[name]["blake3"] == digest_of(t), name
    assert got["extra_bf16"]["dtype"] == "BF16"
    # the identity says which weights, not which files hold them: two shards give the same
    a, b = dict(list(state.items())[: len(state) // 2]), dict(list(state.items())[len(state) // 2 :])
    (folder / "model.safetensors").unlink()
    save_file(a, folder / "model-00001-of-00002.safetensors")
    save_file(b, folder / "model-00002-of-00002.safetensors")
    assert manifest.identity(manifest.entries(folder)) == manifest.identity(got)


def test_a_manifest_is_trusted_only_with_the_run_key_in_its_own_folder(tiny_policy, tmp_path):
    folder = published(tiny_policy, tmp_path)
    listed = manifest.read(folder)
    assert listed["iteration"] == 3 and listed["job_fingerprint"] == "f" * 16
    assert manifest.trusted(folder, listed, KEY)
    assert not manifest.trusted(folder, listed, b"another run's key" * 2)
    assert not manifest.trusted(folder, listed, None)
    moved = tmp_path / "copied"
    shutil.copytree(folder, moved)  # a copied run: another folder
    assert not manifest.trusted(moved, manifest.read(moved), KEY)
    for field, value in (("iteration", 4), ("job_fingerprint", "0" * 16), ("weights", "0" * 64)):
        assert not manifest.trusted(folder, {**listed, field: value}, KEY), field
    # an unkeyed manifest (a run without workers) is never trusted
    plain = published(tiny_policy, tmp_path, "plain", key=None)
    assert manifest.read(plain)["mac"] is None and not manifest.trusted(plain, manifest.read(plain), KEY)


def test_a_trusted_manifest_is_not_checked_against_the_files_and_another_is(tiny_policy, tmp_path):
    """A trusted manifest answers without reading the weight files; without the key, the one pass
    finds the tensor whose bytes changed and names it."""
    folder = published(tiny_policy, tmp_path)
    before = manifest.weights_digest(folder, KEY)
    state = load_file(folder / "model.safetensors")
    name = sorted(state)[1]
    state[name] = state[name] + 1
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    assert manifest.weights(folder, KEY) == (before, manifest.read(folder)["tensors"], True)
    with pytest.raises(manifest.ManifestMismatch, match=name.replace(".", r"\.")):
        manifest.weights(folder, None)
    # a folder without a manifest (model.path) is read in one pass, never refused
    bare = policy_copy(tiny_policy, tmp_path / "bare")
    identity, tensors, trusted = manifest.weights(bare, KEY)
    assert not trusted and identity == manifest.identity(manifest.entries(tiny_policy))


def test_the_resident_module_takes_only_the_tensors_that_changed(tiny_policy, tmp_path, monkeypatch):
    """A warm reader: the second folder differs from the first in two tensors; with its manifest
    trusted, two tensors are read and the module equals a fresh load of the second folder."""
    from otbflow.models.policy import _load_policy

    first = published(tiny_policy, tmp_path, "first")
    second = policy_copy(tiny_policy, tmp_path / "second")
    state = load_file(second / "model.safetensors")
    changed = sorted(state)[:2]
    for name in changed:
        state[name] = state[name] + 0.25
    save_file(state, second / "model.safetensors", metadata={"format": "pt"})
    manifest.publish(second, second, {"iteration": 4, "job_fingerprint": "e" * 16}, KEY)
    monkeypatch.setattr(resident, "_held", {})
    monkeypatch.setattr(resident, "ENABLED", True)
    monkeypatch.setattr(resident, "KEY", KEY)
    resident.policy(first, "float32", None, _load_policy)
    model, _ = resident.policy(second, "float32", None, _load_policy)
    read = {k: resident.LAST_LOAD[k] for k in ("tensors", "bytes", "trusted")}
    assert read == {"tensors": 2, "bytes": sum(state[n].nbytes for n in changed), "trusted": True}
    fresh, _ = _load_policy(second, "float32", None)
    for (n, p), (m, q) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert n == m and torch.equal(p, q), n
    resident.policy(second, "float32", None, _load_policy)
    assert resident.LAST_LOAD["tensors"] == 0 and resident.LAST_LOAD["bytes"] == 0

    # a third folder, published as the second, whose file was changed afterwards: a reader that holds
    # the first reads the two tensors, one of them does not match its digest; the job fails naming it
    # and the resident module is dropped (it may hold tensors of two policies)
    third = policy_copy(second, tmp_path / "third")
    manifest.publish(third, third, {"iteration": 4, "job_fingerprint": "e" * 16}, KEY)
    state[changed[0]] = state[changed[0]] * 3
    save_file(state, third / "model.safetensors", metadata={"format": "pt"})
    resident.policy(first, "float32", None, _load_policy)
    with pytest.raises(manifest.ManifestMismatch, match=changed[0].replace(".", r"\.")):
        resident.policy(third, "float32", None, _load_policy)
    assert not any(k.startswith("policy:") for k in resident._held)  # the tokenizer may stay
    # the second, whose manifest a reader holding it trusts, is not read again: a change made to its
    # files after publication is not seen by that reader, which computes with the weights published
    resident.policy(second, "float32", None, _load_policy)
    save_file(state, second / "model.safetensors", metadata={"format": "pt"})
    resident.policy(second, "float32", None, _load_policy)
    assert resident.LAST_LOAD["tensors"] == 0


@pytest.mark.parametrize("arch", ["gpt2", "qwen2", "llama"])
@pytest.mark.parametrize(
    "dtype, cast_to", [("float32", None), ("bfloat16", torch.float32), ("float32", torch.bfloat16)]
)
def test_a_warm_workers_first_load_is_from_pretrained_s_module(arch, dtype, cast_to, tmp_path, monkeypatch):
    """A warm worker's first load of a folder builds the module without its weights and reads every
    tensor into it: its parameters and buffers (the rotary frequencies included), config and
    generation config are those of transformers' from_pretrained of the same folder, bitwise, for
    tied (GPT-2, Qwen2) and untied (Llama) heads, and cast after as the cold load casts; the
    digests it computed while reading are those of a read-back of the file; and a folder whose file
    changed after its manifest was written is refused."""
    from conftest import tiny_config

    from otbflow.models.policy import _load_policy, build_char_tokenizer, build_tiny_model, load_policy

    tok = build_char_tokenizer()
    model = build_tiny_model(tiny_config(f"model.arch={arch}").model, tok, seed=0)
    folder = tmp_path / "policy"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    monkeypatch.setattr(resident, "_held", {})
    monkeypatch.setattr(resident, "ENABLED", True)
    ours, _ = load_policy(folder, dtype, cast_to)
    assert resident._held[f"policy:{dtype}:{cast_to}"].tensors == manifest.entries(folder)
    theirs, _ = _load_policy(folder, dtype, cast_to)
    for kind in ("named_parameters", "named_buffers"):
        a, b = dict(getattr(ours, kind)(remove_duplicate=False)), dict(getattr(theirs, kind)(remove_duplicate=False))
        assert sorted(a) == sorted(b), kind
        for name in b:
            assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    assert ours.config.to_dict() == theirs.config.to_dict()
    assert ours.generation_config.to_dict() == theirs.generation_config.to_dict()
    if arch != "llama":
        assert ours.get_output_embeddings().weight is ours.get_input_embeddings().weight

    state = load_file(folder / "model.safetensors")
    manifest.publish(folder, folder, {"iteration": 1, "job_fingerprint": "f" * 16}, None)
    name = sorted(state)[0]
    state[name] = state[name] + 1
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    monkeypatch.setattr(resident, "_held", {})
    with pytest.raises(manifest.ManifestMismatch, match=name.replace(".", r"\.")):
        load_policy(folder, dtype, cast_to)


def test_a_published_policy_and_its_manifest_survive_pruning(tiny_policy, tmp_path):
    folder = published(tiny_policy, tmp_path)
    listed = manifest.read(folder)
    retention.prune_folder(folder, "weights", "a test", policy_weights(folder))
    assert manifest.read(folder) == listed and not list(folder.glob("*.safetensors"))


def test_the_train_job_publishes_its_policy_with_a_manifest(policy_dir, features_path, tmp_path):
    """The train stage's output folder holds a manifest bound to its iteration and job, which a
    reader without the key checks in one pass; its identity is what the optimizer state names."""
    _, args = run_stage(policy_dir, features_path, tmp_path, "train.mini_batch_size=8", optimizer=str(tmp_path / "opt"))
    listed = manifest.read(args.out)
    assert listed["iteration"] == 0 and len(listed["job_fingerprint"]) == 16 and listed["mac"] is None
    assert listed["folder"] == str(Path(args.out).resolve())
    identity, tensors, trusted = manifest.weights(args.out)
    assert not trusted and identity == listed["weights"]
    saved = load_file(Path(args.out) / "model.safetensors")
    assert {n: e["blake3"] for n, e in tensors.items()} == {n: digest_of(t) for n, t in saved.items()}
    assert json.loads((tmp_path / "opt" / "meta.json").read_text())["policy_weights"] == identity
