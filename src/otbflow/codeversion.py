"""Code versions for Snakemake rerun triggers.

Snakemake cannot see edits inside an installed package, so every rule passes the version of
the code it runs as a ``params:`` value: a hash of the stage's modules and the shared modules.
Editing ``advantages.py`` then reruns the advantages rule (and what depends on its outputs).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
SHARED = (
    "__init__",
    "__main__",
    "cli",
    "config",
    "io",
    "schemas",
    "model",
    "tasks",
    "rewards",
    "codeversion",
    "progress",
)
STAGE_MODULES = {
    "bootstrap": ("bootstrap", "shard", "generation", "hf_engine"),
    "shard": ("shard",),
    "rollout": ("rollout", "generation", "hf_engine", "vllm_engine"),
    "features": ("features", "logits", "rollout_is"),
    "advantages": ("advantages",),
    "train": ("train", "train_state", "logits", "lr_schedule", "advantages", "rollout_is"),
    "evaluate": ("evaluate", "generation", "hf_engine", "vllm_engine"),
    "report": ("report",),
    "scaling": ("scaling", "logits", "rollout_is"),
    "variance": ("variance", "variance_options", "logits", "advantages", "rollout_is"),
    "experiment": ("experiment",),
}


def code_version(stage: str) -> str:
    h = hashlib.sha256()
    for name in sorted(set(SHARED + STAGE_MODULES[stage])):
        path = PACKAGE / f"{name}.py"
        h.update(name.encode())
        h.update(path.read_bytes() if path.exists() else b"")
    return h.hexdigest()[:16]
