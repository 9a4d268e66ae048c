"""The floors of otbflow's house, and its structure read from the code's own imports.

Each folder of the package (and each root module) is a room; the rooms stand on the floors of
``LAYERS``, top to bottom, and a module imports only rooms of the floors below its own (deferred
imports inside functions included: they climb as much as the others) or modules of its own room.
Rooms that share a floor are independent: neither imports the other. tests/test_imports.py holds
the order; run as a script, this prints the figures the layering is judged by, as JSON:

    python tests/layers.py [REPO]

rooms, floors (the longest chain of arrows, counted in rooms, a circle's as one), arrows (room to room), the upward
arrows against ``LAYERS`` (with their file:line), circles (sets of rooms that reach each other),
and the largest source files.
"""

from __future__ import annotations

import ast
import functools
import json
import sys
from collections import defaultdict
from pathlib import Path

LAYERS: tuple[tuple[str, ...], ...] = (
    ("__main__",),  # python -m otbflow: a stage job through the preload server, or the CLI
    ("cli",),  # the otbflow command
    ("stages", "ops"),  # the stages; what runs them (workers, dispatch, preload, the Slurm head, submit)
    ("training", "studies"),  # the policy update; the offline studies (variance, scaling, experiments)
    ("pipeline",),  # the stage table
    ("config",),  # the config's sections, loading, rules and schema
    ("engines",),  # generation backends, prompt rendering, sampling groups
    ("models",),  # architectures, policies, logits statistics, tasks, reward models
    ("algorithms",),  # estimators, losses, rewards, shaping: what the science is
    ("io",),  # Parquet and atomic outputs, input checks, the job binding
    ("runtime",),  # job-side services: process facts, policy folders, resident state, retention, code versions
    ("schemas", "seeds", "registry", "progress", "otbflow"),  # the ground ("otbflow": the package's __init__)
)
"""The floors, top to bottom."""

FLOOR = {room: i for i, rooms in enumerate(LAYERS) for room in rooms}


def package(repo: Path) -> Path:
    return repo / "src" / "otbflow"


def modules(repo: Path) -> dict[str, Path]:
    """Every module of the package by its dotted name."""
    root = package(repo)
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def room(module: str) -> str:
    """The room of a module: its folder under otbflow, or its own name for a root module."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "otbflow"


@functools.cache
def imports(repo: Path) -> tuple[tuple[str, str, int], ...]:
    """(importer, imported, line) for every import of an otbflow module by another, at any depth of
    the importer's syntax tree, less the parent packages that Python runs first; read once per
    folder (arrows, upward arrows, circles and floors all draw on it)."""
    mods = modules(repo)
    found = []
    for name, path in mods.items():
        pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        parents = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                # "from otbflow.x import y": module otbflow.x.y when there is one, otbflow.x otherwise
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for target in targets:
                if target in mods and target != name and not (target in parents and isinstance(node, ast.Import)):
                    found.append((name, target, node.lineno))
    return tuple(sorted(set(found)))


def arrows(repo: Path) -> dict[tuple[str, str], list[str]]:
    """Room -> room arrows, each with the places ("path:line") that draw it."""
    root = package(repo)
    mods = modules(repo)
    drawn: dict[tuple[str, str], list[str]] = defaultdict(list)
    for importer, imported, line in imports(repo):
        a, b = room(importer), room(imported)
        if a != b:
            drawn[(a, b)].append(f"{mods[importer].relative_to(root)}:{line}")
    return dict(sorted(drawn.items()))


def upward(repo: Path) -> dict[tuple[str, str], list[str]]:
    """The arrows that do not point to a lower floor (a room missing from ``LAYERS`` counts as one)."""
    return {
        (a, b): where
        for (a, b), where in arrows(repo).items()
        if a not in FLOOR or b not in FLOOR or FLOOR[b] <= FLOOR[a]
    }


def circles(repo: Path) -> list[list[str]]:
    """The strongly connected sets of more than one room (Tarjan)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in arrows(repo):
        graph[a].add(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted({room(m) for m in modules(repo)}):
        if v not in index:
            visit(v)
    return found


def floors(repo: Path) -> int:
    """The longest chain of arrows, counted in rooms, a circle's rooms counted as one."""
    merged = {r: r for r in {room(m) for m in modules(repo)}}
    for part in circles(repo):
        for r in part:
            merged[r] = "+".join(part)
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in arrows(repo):
        if merged[a] != merged[b]:
            graph[merged[a]].add(merged[b])
    depth: dict[str, int] = {}

    def height(v: str) -> int:
        if v not in depth:
            depth[v] = 1 + max((height(w) for w in graph[v]), default=0)
        return depth[v]

    return max(height(r) for r in set(merged.values()))


def figures(repo: Path, largest: int = 8) -> dict:
    files = sorted(package(repo).rglob("*.py"), key=lambda p: -len(p.read_text().splitlines()))
    return {
        "rooms": len({room(m) for m in modules(repo)}),
        "floors": floors(repo),
        "arrows": len(arrows(repo)),
        "upward_arrows": {f"{a} -> {b}": where for (a, b), where in upward(repo).items()},
        "circles": circles(repo),
        "largest_files": {
            str(p.relative_to(package(repo).parent)): len(p.read_text().splitlines()) for p in files[:largest]
        },
    }


if __name__ == "__main__":
    print(json.dumps(figures(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parents[1]), indent=1))
