"""The import graph of otbflow's modules flows one way (stages -> core): no circles, counting the
imports inside functions too; both generation backends implement the one interface."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "src" / "otbflow"


def imports(path: Path) -> set[str]:
    """otbflow modules that ``path`` imports anywhere in its body."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("otbflow"):
            names = [node.module] if node.module != "otbflow" else [f"otbflow.{a.name}" for a in node.names]
            out |= {n.split(".")[1] for n in names if "." in n}
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".")[1] for a in node.names if a.name.startswith("otbflow.")}
    return out - {path.stem}


def test_no_import_circle():
    graph = {p.stem: imports(p) for p in PACKAGE.glob("*.py")}
    state: dict[str, str] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            assert state.get(nxt) != "open", f"import circle: {' -> '.join(trail + [node, nxt])}"
            if nxt not in state:
                visit(nxt, trail + [node])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
    assert "rollout" not in graph["vllm_engine"] and "rollout" not in graph["hf_engine"]
    assert {"generation"} <= graph["vllm_engine"] & graph["hf_engine"]
    assert not {"hf_engine", "vllm_engine", "rollout"} & graph["generation"]


def test_both_backends_implement_the_interface():
    from otbflow.engines import BACKENDS

    for name, target in BACKENDS.items():
        module, cls = target.split(":")
        backend = getattr(importlib.import_module(module), cls)
        assert backend.name == name
        for method in ("generate", "metadata"):
            assert callable(getattr(backend, method)), (name, method)


def test_code_versions_cover_what_each_stage_imports():
    """A stage's code version (its rules' rerun trigger) hashes every otbflow module the stage
    module imports, directly or through others, so that editing any of them reruns the stage.
    The shared modules are hashed for every stage; what they import inside functions (the config
    check's estimator names, the CLI's sub-commands) is not followed."""
    from otbflow.codeversion import SHARED, STAGE_MODULES

    graph = {p.stem: imports(p) for p in PACKAGE.glob("*.py")}
    for stage, hashed in STAGE_MODULES.items():
        reached, todo = set(), [stage]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt not in reached:
                    reached.add(nxt)
                    if nxt not in SHARED:
                        todo.append(nxt)
        missing = reached - set(hashed) - set(SHARED) - {"codeversion"}
        assert not missing, f"stage {stage} imports {sorted(missing)}, which its code version does not hash"


def test_the_snakefile_reads_the_variance_keys_without_torch():
    """Every Snakemake start computes the variance rule's rerun trigger: without importing torch
    (2-3 s on a small machine)."""
    import subprocess
    import sys

    code = "import sys, otbflow.variance_options; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
