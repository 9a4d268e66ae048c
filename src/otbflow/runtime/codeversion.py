"""Code versions for Snakemake rerun triggers.

Snakemake cannot see edits inside an installed package, so every rule passes the version of the
code it runs as a ``params:`` value: a hash over the stage's module and every otbflow module it
reaches by its imports (at any depth, lazy imports included) or names as ``"otbflow.x"`` (the
engine registry loads its backends by name), with their parent packages; not the config module
and the stage table (``WORKFLOW_ONLY``), nor the live curves (``RUN_ONLY``). The hash is over what
the code does: the multiset of the modules' top-level definitions and statements, each as its
syntax tree without docstrings and without import statements, never a module's name or path
(``definitions``). Formatting, comments and docstrings do not rerun a finished workflow, nor does
moving a definition to another module; a changed expression does. Nothing is imported: the modules
are parsed.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
from functools import cache
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]
# Neither hashed nor followed: the modules that declare, check and digest the config (and the
# train stage's checkpoint identity uses). What they declare reaches a stage through its config
# trigger, not through its code: a new bound, help text or declared key reruns nothing, and a
# registry they import for its names (the allowed values of an option) is hashed where a stage
# imports it to run its code.
WORKFLOW_ONLY = {"otbflow.config", "otbflow.pipeline", "otbflow.runtime.codeversion"}
# Neither hashed nor followed either: code that changes how a job reports, never what it writes
# (the live curves, which import no other otbflow module), so that editing it reruns nothing.
RUN_ONLY = {"otbflow.runtime.tracking"}
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
    such as ``"otbflow.engines.hf_backend:HFBackend"``), and its parent packages."""
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


def _outside(module: str) -> bool:
    """Whether ``module`` is one of WORKFLOW_ONLY and RUN_ONLY, or a module of such a package (the
    config package's sections, loading, rules)."""
    return any(module == m or module.startswith(m + ".") for m in WORKFLOW_ONLY | RUN_ONLY)


def closure(name: str) -> list[str]:
    """Module ``name`` and every otbflow module it reaches, sorted."""
    seen, todo = set(), [name]
    while todo:
        mod = todo.pop()
        if mod not in seen:
            seen.add(mod)
            todo += sorted(m for m in direct_imports(mod) - seen if not _outside(m))
    return sorted(seen)


def _bare(node: ast.AST) -> ast.AST:
    """``node`` without its docstrings (and other bare string statements, such as the docstrings
    under dataclass fields) and without import statements, at any depth: in every list of
    statements (a body, an ``else`` or a ``finally``)."""
    for inner in ast.walk(node):
        for field in ("body", "orelse", "finalbody"):
            statements = getattr(inner, field, None)
            if isinstance(statements, list) and all(isinstance(s, ast.stmt) for s in statements):
                kept = [
                    s
                    for s in statements
                    if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))
                    and not isinstance(s, (ast.Import, ast.ImportFrom))
                ]
                setattr(inner, field, kept or ([ast.Pass()] if field == "body" else []))
    return node


@cache
def definitions(name: str) -> tuple[str, ...]:
    """Module ``name``'s top-level statements other than imports and docstrings (its functions,
    classes, constants, registrations), each as the text of its bare syntax tree (``_bare``): what a
    definition does, not where it lives, so that one moved to another module of the closure hashes
    the same."""
    tree = ast.parse(module_file(name).read_text())  # a copy: _tree's is not changed
    return tuple(
        ast.dump(s, annotate_fields=False, include_attributes=False)
        for s in _bare(tree).body
        if not isinstance(s, ast.Pass)
    )


# Parsing every module a stage reaches was the largest part of each Snakemake start's planning (the
# rules' params hold each stage's version), and every job of a run on Slurm starts Snakemake. The
# versions are kept in a file of the user's cache, with the files each was computed from (modification
# time, change time, size, inode; the package's folders too: a new module is a new entry of a folder),
# as Python keeps its bytecode; a cache that cannot be read or written is computed again.
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "otbflow"


def code_version(stage: str) -> str:
    """The code version of ``stage`` (its module otbflow.stages.<stage> and what it reaches); from
    the cache while none of the files it was computed from has changed."""
    versions = _cache()
    entry = versions.get(stage)
    if entry and all(_signature(path) == sig for path, sig in entry["files"].items()):
        return entry["version"]
    # the files' signatures before they are read: a file changed meanwhile is read again next time
    before = {str(p): _signature(p) for p in [PACKAGE, *PACKAGE.rglob("*")] if p.is_dir() or p.suffix == ".py"}
    h = hashlib.sha256()
    modules = closure(f"otbflow.stages.{stage}")
    for definition in sorted(d for mod in modules for d in definitions(mod)):
        h.update(definition.encode())
        h.update(b"\0")
    version = h.hexdigest()[:16]
    files = {str(module_file(m)) for m in modules} | {p for p in before if Path(p).is_dir()}
    versions[stage] = {"version": version, "files": {p: before.get(p, []) for p in sorted(files)}}
    _save(versions)
    return version


def _signature(path: str) -> list[int]:
    try:
        st = os.stat(path)
    except OSError:
        return []
    return [st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino]


def _cache_file() -> Path:
    return CACHE / f"code-versions-{hashlib.sha256(str(PACKAGE).encode()).hexdigest()[:16]}.json"


@cache
def _cache() -> dict:
    try:
        return json.loads(_cache_file().read_text())
    except (OSError, ValueError):
        return {}


def _save(versions: dict) -> None:
    path = _cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(versions))
        tmp.replace(path)
    except OSError:
        pass
