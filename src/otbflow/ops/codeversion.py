"""Code versions for Snakemake rerun triggers.

Snakemake cannot see edits inside an installed package, so every rule passes the version of the
code it runs as a ``params:`` value: a hash over the stage's module and every otbflow module it
reaches by its imports (at any depth, lazy imports included) or names as ``"otbflow.x"`` (the
engine registry loads its backends by name), with their parent packages; not the config module
and the stage table (``WORKFLOW_ONLY``), nor the live curves (``RUN_ONLY``). The hash is over each
module's syntax tree without docstrings (formatting, comments and docstrings do not rerun a
finished workflow; a changed expression does). Nothing is imported: the modules are parsed.
"""

from __future__ import annotations

import ast
import hashlib
import re
from functools import cache
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]
# Neither hashed nor followed: the modules that declare, check and digest the config (and the
# train stage's checkpoint identity uses). What they declare reaches a stage through its config
# trigger, not through its code: a new bound, help text or declared key reruns nothing, and a
# registry they import for its names (the allowed values of an option) is hashed where a stage
# imports it to run its code.
WORKFLOW_ONLY = {"otbflow.config", "otbflow.pipeline", "otbflow.ops.codeversion"}
# Neither hashed nor followed either: code that changes how a job reports, never what it writes
# (the live curves, which import no other otbflow module), so that editing it reruns nothing.
RUN_ONLY = {"otbflow.ops.tracking"}
_NAMED = re.compile(r"^(otbflow(?:\.\w+)+)(?::\w+)?$")


@cache
def module_file(name: str) -> Path | None:
    """The source file of otbflow module ``name`` (None when there is none)."""
    parts = name.split(".")[1:]
    if not parts:
        return PACKAGE / "__init__.py"
    for path in (PACKAGE.joinpath(*parts[:-1], parts[-1] + ".py"), PACKAGE.joinpath(*parts, "__init__.py")):
        if path.is_file():
            return path
    return None


@cache
def _tree(name: str) -> ast.Module:
    return ast.parse(module_file(name).read_text())


@cache
def direct_imports(name: str, named: bool = True) -> frozenset[str]:
    """The otbflow modules that module ``name`` imports (and, with ``named``, names in a string
    such as ``"otbflow.engines.hf:HFBackend"``), and its parent packages."""
    package = name if module_file(name).name == "__init__.py" else name.rsplit(".", 1)[0]
    found = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}  # parent packages
    for node in ast.walk(_tree(name)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
        elif (
            named and isinstance(node, ast.Constant) and isinstance(node.value, str) and (m := _NAMED.match(node.value))
        ):
            found |= {m.group(1), m.group(1).rsplit(".", 1)[0]}  # "otbflow.x.Class" names a class of otbflow.x
    return frozenset(m for m in found if m.split(".")[0] == "otbflow" and module_file(m) is not None)


def closure(name: str) -> list[str]:
    """Module ``name`` and every otbflow module it reaches, sorted."""
    seen, todo = set(), [name]
    while todo:
        mod = todo.pop()
        if mod not in seen:
            seen.add(mod)
            todo += sorted(direct_imports(mod) - seen - WORKFLOW_ONLY - RUN_ONLY)
    return sorted(seen)


@cache
def normalized(name: str) -> str:
    """The module's syntax tree without docstrings (and other bare string statements, such as
    the docstrings under dataclass fields), as text."""
    tree = ast.parse(module_file(name).read_text())  # a copy: _tree's is not changed
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            kept = [s for s in body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
            node.body = kept or [ast.Pass()]
    return ast.dump(tree, annotate_fields=False, include_attributes=False)


def code_version(stage: str) -> str:
    """The code version of ``stage`` (its module otbflow.stages.<stage> and what it reaches)."""
    h = hashlib.sha256()
    for mod in closure(f"otbflow.stages.{stage}"):
        h.update(mod.encode())
        h.update(normalized(mod).encode())
    return h.hexdigest()[:16]
