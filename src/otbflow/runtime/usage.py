"""What a results folder holds on disk (``used``: in all, per iteration folder, the train outputs',
and what the retention policy deleted, from the ``PRUNED.json`` records of
``otbflow.runtime.policy_folder``) and a byte count as people read it (``gib``). Read by the report
stage (``report/disk.json``) and by ``otbflow disk --results`` (``otbflow.ops.disk``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from otbflow.runtime.policy_folder import PRUNED


def used(results_dir: str | Path) -> dict:
    """Bytes under a results folder: in all, per iteration folder, the train outputs' (policies
    and optimizer states), and those the retention policy deleted (their PRUNED.json records)."""
    root = Path(results_dir)
    out = {"total": 0, "train_outputs": 0, "pruned": 0, "iterations": {}}
    for f in root.rglob("*"):
        if not f.is_file():
            continue
        if f.name == PRUNED:
            out["pruned"] += sum(r["bytes"] for r in json.loads(f.read_text())["removed"])
        size = f.stat().st_size
        out["total"] += size
        parts = f.relative_to(root).parts
        if len(parts) > 1 and re.fullmatch(r"iter_\d+", parts[0]):
            out["iterations"][parts[0]] = out["iterations"].get(parts[0], 0) + size
            if len(parts) > 2 and parts[1] == "train" and parts[2] in ("policy", "optimizer"):
                out["train_outputs"] += size
    out["iterations"] = dict(sorted(out["iterations"].items(), key=lambda kv: int(kv[0].split("_")[1])))
    return out


def gib(b: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20)):
        if b >= scale:
            return f"{b / scale:.3g} {unit}"
    return f"{b / 2**20:.3g} MiB"
