"""The next policy as a train job writes it (``otbflow.training.publish``): the files transformers'
own ``save_pretrained`` writes, digests equal to a read-back of the file, and the element-level
delta a warm reader applies instead of reading the weights (``otbflow.runtime.delta``)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_config
from safetensors import safe_open
from safetensors.torch import load_file

from otbflow.models.policy import _load_policy, build_char_tokenizer, build_tiny_model
from otbflow.runtime import manifest, resident
from otbflow.runtime.policy_folder import DELTA
from otbflow.training.publish import full_fp32_state_dict, save_policy, written_names

KEY = b"fedcba9876543210" * 4


def engine_of(model):
    return SimpleNamespace(module=SimpleNamespace(policy=model))


@pytest.mark.parametrize("arch", ["gpt2", "qwen2", "llama"])
def test_the_policy_folder_is_what_save_pretrained_writes(arch, tmp_path):
    """Tied output heads (GPT-2, Qwen2) and an untied one (Llama): the same tensor names and bytes,
    config and generation config as ``save_pretrained`` of the same cast weights, the safetensors
    metadata transformers expects, and manifest digests equal to a read-back of the file."""
    tok = build_char_tokenizer()
    model = build_tiny_model(tiny_config(f"model.arch={arch}").model, tok, seed=0)
    tok.save_pretrained(tmp_path / "input")
    state = full_fp32_state_dict(engine_of(model), keep=True)
    save_policy(
        engine_of(model), state, str(tmp_path / "input"), str(tmp_path / "ours"), {"iteration": 1}, torch.bfloat16
    )
    once: dict[int, torch.Tensor] = {}  # tied names share one tensor, as save_pretrained finds them
    cast = {n: once.setdefault(id(t), t.to(torch.bfloat16)) for n, t in state.items()}
    model.save_pretrained(tmp_path / "theirs", state_dict=cast)
    model.config.dtype = "bfloat16"  # what the files hold (save_pretrained writes the module's)
    model.config.save_pretrained(tmp_path / "theirs")
    ours, theirs = load_file(tmp_path / "ours/model.safetensors"), load_file(tmp_path / "theirs/model.safetensors")
    assert sorted(ours) == sorted(theirs)
    for name in theirs:
        assert ours[name].dtype == torch.bfloat16 and torch.equal(ours[name], theirs[name]), name
    for name in ("config.json", "generation_config.json"):
        assert json.loads((tmp_path / "ours" / name).read_text()) == json.loads(
            (tmp_path / "theirs" / name).read_text()
        )
    with safe_open(tmp_path / "ours/model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
    assert manifest.read(tmp_path / "ours")["tensors"] == manifest.entries(tmp_path / "ours")
    assert not (tmp_path / "ours" / DELTA).exists()  # no warm worker: no copy to compare with


def test_a_warm_reader_applies_the_delta_from_the_policy_it_holds(tmp_path, monkeypatch):
    """A warm train worker publishes P0, then P1 from it (a few elements of one tensor changed,
    most of another): P1's delta lists exactly the elements whose bf16 bits differ (counted here
    from the two files), a reader holding P0 reads only the delta and then holds a fresh load of P1
    bitwise; a delta whose bytes changed after publication is refused and the module dropped; a
    base whose file changed after publication gives no delta."""
    monkeypatch.setattr(resident, "_held", {})
    monkeypatch.setattr(resident, "ENABLED", True)
    monkeypatch.setattr(resident, "KEY", KEY)
    tok = build_char_tokenizer()
    model = build_tiny_model(tiny_config("model.arch=qwen2").model, tok, seed=0)
    tok.save_pretrained(tmp_path / "input")
    engine = engine_of(model)
    p0, p1 = str(tmp_path / "p0"), str(tmp_path / "p1")
    save_policy(
        engine, full_fp32_state_dict(engine, True), str(tmp_path / "input"), p0, {"iteration": 0}, torch.bfloat16
    )
    assert "delta" not in manifest.read(p0)  # its input has no manifest to check a base against
    state = full_fp32_state_dict(engine, True)
    names = [n for n in written_names(state) if state[n].dim() == 2]  # not the tied output head's name
    few, most = names[0], names[1]
    with torch.no_grad():
        state[few].view(-1)[[3, 17, 40]] += 1.0
        state[most].mul_(1.5)
    save_policy(engine, state, p0, p1, {"iteration": 1}, torch.bfloat16)

    a, b = load_file(Path(p0, "model.safetensors")), load_file(Path(p1, "model.safetensors"))
    differ = {n: int((a[n].view(torch.int16) != b[n].view(torch.int16)).sum()) for n in a}
    section = manifest.read(p1)["delta"]
    assert section["base"] == manifest.read(p0)["weights"] and section["elements"] == sum(differ.values())
    assert differ[few] == 3 and {n.rsplit("@", 1)[0] for n in section["tensors"]} == {n for n, d in differ.items() if d}
    assert section["bytes"] == Path(p1, DELTA).stat().st_size < Path(p1, "model.safetensors").stat().st_size / 2

    resident.policy(p0, "bfloat16", None, _load_policy)
    held, _ = resident.policy(p1, "bfloat16", None, _load_policy)
    assert resident.LAST_LOAD["bytes"] == section["bytes"] and resident.LAST_LOAD["delta_elements"] == sum(
        differ.values()
    )
    fresh, _ = _load_policy(p1, "bfloat16", None)
    for (n, p), (m, q) in zip(held.state_dict().items(), fresh.state_dict().items()):
        assert n == m and torch.equal(p, q), n

    # the delta's bytes changed after publication: refused by its digest, naming the entry
    raw = bytearray(Path(p1, DELTA).read_bytes())
    raw[-1] ^= 0xFF
    Path(p1, DELTA).write_bytes(bytes(raw))
    resident.drop()
    resident.policy(p0, "bfloat16", None, _load_policy)
    with pytest.raises(manifest.ManifestMismatch):
        resident.policy(p1, "bfloat16", None, _load_policy)
    assert not any(k.startswith("policy:") for k in resident._held)

    # P0's file changed after publication: P2, published from it, has no delta (its base is not
    # the weights P0's readers hold)
    raw = bytearray(Path(p0, "model.safetensors").read_bytes())
    raw[-1] ^= 0xFF
    Path(p0, "model.safetensors").write_bytes(bytes(raw))
    save_policy(engine, state, p0, str(tmp_path / "p2"), {"iteration": 2}, torch.bfloat16)
    assert "delta" not in manifest.read(tmp_path / "p2") and not (tmp_path / "p2" / DELTA).exists()
