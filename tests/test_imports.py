"""The import graph of otbflow's modules flows one way (stages -> library): the rooms stand on the
floors of tests/layers.py and import only downward, counting the imports inside functions too; no
circles; no stage module imports another; both generation backends
implement the one interface; a stage's code version covers what it imports and ignores formatting;
every pytest mark of the suite decorates a test."""

from __future__ import annotations

import ast
import importlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import layers
from conftest import REPO

from otbflow.pipeline import STAGES
from otbflow.runtime.codeversion import RUN_ONLY, WORKFLOW_ONLY, closure, direct_imports

PACKAGE = REPO / "src" / "otbflow"


def module_names() -> list[str]:
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def own_imports(name: str) -> set[str]:
    """What ``name`` imports, less its parent packages (which Python runs first, not it)."""
    parents = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
    return direct_imports(name, named=False) - parents - {name}


def test_no_import_circle():
    graph = {m: own_imports(m) for m in module_names()}
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


def test_every_room_stands_on_one_floor_and_imports_only_downward():
    """Each folder and root module of the package is a room of ``layers.LAYERS``, once; every import
    of one room by another (deferred ones too) points to a lower floor; no circle of rooms."""
    rooms = {layers.room(m) for m in module_names()}
    placed = [r for floor in layers.LAYERS for r in floor]
    assert len(placed) == len(set(placed)), "a room on two floors"
    assert set(placed) == rooms, (
        f"not on a floor: {sorted(rooms - set(placed))}; no such room: {sorted(set(placed) - rooms)}"
    )
    up = layers.upward(REPO)
    assert not up, "imports that do not point down a floor:\n" + "\n".join(
        f"{a} -> {b}: {w}" for (a, b), w in up.items()
    )
    assert layers.circles(REPO) == []


def test_the_layer_reading_on_a_built_package(tmp_path):
    """The reading against a package written here, whose arrows are known by construction: a
    top-level import, a deferred one inside a function, a relative one, "from package import
    module", and the parent-package import Python runs first (no arrow)."""
    src = tmp_path / "src" / "otbflow"
    files = {
        "__init__.py": "",
        "seeds.py": "import os\n",
        "io.py": "from otbflow import seeds\n",
        "runtime/__init__.py": "",
        "runtime/process.py": "import otbflow.runtime\n\ndef f():\n    from otbflow.io import x\n",
        "models/__init__.py": "",
        "models/policy.py": "from ..runtime import process\nfrom otbflow.engines.hf import y\n",
        "engines/__init__.py": "",
        "engines/hf.py": "from otbflow.models import policy\n",
    }
    for name, text in files.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_text(text)
    drawn = {pair: len(where) for pair, where in layers.arrows(tmp_path).items()}
    assert drawn == {
        ("io", "seeds"): 1,
        ("runtime", "io"): 1,
        ("models", "runtime"): 1,
        ("models", "engines"): 1,
        ("engines", "models"): 1,
    }
    assert set(layers.upward(tmp_path)) == {("runtime", "io"), ("models", "engines")}
    assert layers.circles(tmp_path) == [["engines", "models"]]
    assert layers.arrows(tmp_path)[("runtime", "io")] == ["runtime/process.py:4"]


def test_no_stage_imports_another_stage():
    stages = {m for m in module_names() if m.startswith("otbflow.stages.")}
    assert stages == {s.module for s in STAGES.values()}, "every stage module is in the stage table, and back"
    for stage in sorted(stages):
        assert not own_imports(stage) & (stages - {stage}), f"{stage} imports {own_imports(stage) & stages}"
    library = [m for m in module_names() if not m.startswith("otbflow.stages") and m not in ("otbflow.cli",)]
    for module in library:
        assert not own_imports(module) & stages, f"library module {module} imports a stage"


def test_engines_are_loaded_by_name():
    """The engine interface imports neither backend (vLLM is not importable in every
    environment); it names them, and the code versions follow the names."""
    assert not {"otbflow.engines.hf", "otbflow.engines.vllm"} & own_imports("otbflow.engines")
    assert {"otbflow.engines.hf", "otbflow.engines.vllm"} <= set(closure("otbflow.stages.rollout"))


def test_both_backends_implement_the_interface():
    from otbflow.engines import BACKENDS

    for name, entry in BACKENDS.items():
        module, cls = entry.target.split(":")
        backend = getattr(importlib.import_module(module), cls)
        assert backend.name == name
        for method in ("generate", "metadata"):
            assert callable(getattr(backend, method)), (name, method)


LOADED = """
import json, os, sys
import numpy, omegaconf, polars, pyarrow, torch, transformers  # what the stages import, paid once
out = {}
for module in sys.argv[1:]:
    read, write = os.pipe()
    if os.fork() == 0:  # a child per module, with no otbflow module loaded yet
        os.close(read)
        __import__(module)
        os.write(write, " ".join(m for m in sys.modules if m.startswith("otbflow")).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        out[module] = f.read().split()
    assert os.wait()[1] == 0, module
print(json.dumps(out))
"""


def loaded_by(modules: list[str]) -> dict[str, set[str]]:
    """The otbflow modules that importing each of ``modules`` loads: each imported in a child
    forked from one interpreter that has imported the libraries the stages use, and no otbflow
    module (as if in a fresh interpreter, whose imports of third-party libraries load no otbflow
    module, less their cost per module)."""
    cmd = [sys.executable, "-c", LOADED, *modules]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    return {module: set(names) for module, names in json.loads(res.stdout.splitlines()[-1]).items()}


def test_code_versions_cover_what_each_stage_imports():
    """Independent of the static reading: every otbflow module that importing a stage module
    actually loads is in the closure its code version hashes, except the modules that declare and
    digest the config and what only they load (codeversion.WORKFLOW_ONLY), and the live curves
    (codeversion.RUN_ONLY)."""
    stages = [s.module for s in STAGES.values()]
    loaded = loaded_by([*WORKFLOW_ONLY, *stages])
    via_config = set().union(*(loaded[m] for m in WORKFLOW_ONLY))
    for module in stages:
        missing = loaded[module] - set(closure(module)) - via_config - RUN_ONLY
        assert not missing, f"importing {module} loads {sorted(missing)}, which its code version does not hash"


def test_the_live_curves_are_in_no_code_version():
    """otbflow.runtime.tracking changes how a job reports, never what it writes: no stage's code version
    hashes it (editing it reruns nothing), and it imports no otbflow module that one would have to."""
    assert direct_imports("otbflow.runtime.tracking") == {"otbflow", "otbflow.runtime"}  # its parent packages only
    for stage in ("train", "evaluate"):
        assert "otbflow.runtime.tracking" in direct_imports(f"otbflow.stages.{stage}")
        assert "otbflow.runtime.tracking" not in closure(f"otbflow.stages.{stage}")


def versions(src, stages: list[str], cache: Path) -> dict[str, str]:
    """The stages' code versions as a new process computes them (with its versions cache in ``cache``)."""
    code = f"from otbflow.runtime.codeversion import code_version; print(' '.join(code_version(s) for s in {stages!r}))"
    env = {"PYTHONPATH": str(src), "XDG_CACHE_HOME": str(cache)}
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True).stdout
    return dict(zip(stages, out.split()))


def test_code_versions_ignore_formatting_and_follow_expressions(tmp_path):
    """Each step's versions come from the cache the step before wrote (codeversion.CACHE), and equal
    those of a process with an empty cache."""
    src, cache = tmp_path / "src", tmp_path / "cache"
    shutil.copytree(PACKAGE, src / "otbflow", ignore=shutil.ignore_patterns("__pycache__"))
    stages = ["advantages", "train", "shard"]
    before = versions(src, stages, cache)
    assert list(cache.glob("otbflow/code-versions-*.json")) and versions(src, stages, cache) == before
    est = src / "otbflow" / "algorithms" / "estimators.py"
    text = est.read_text()
    # a reformat (line length 60), a comment and a changed docstring: no version moves
    est.write_text(text.replace('"""Advantage estimators', '"""Estimators (reworded)', 1) + "\n# a comment\n")
    ruff = str(Path(sys.executable).with_name("ruff"))  # the dev extra's, beside this interpreter
    subprocess.run([ruff, "format", "--line-length", "60", "--no-cache", str(est)], check=True, capture_output=True)
    assert est.read_text() != text
    assert versions(src, stages, cache) == before == versions(src, stages, tmp_path / "empty1")
    # one changed expression: the stages that reach estimators move, shard does not
    assert "EPS_STD = 1e-6" in est.read_text()
    est.write_text(est.read_text().replace("EPS_STD = 1e-6", "EPS_STD = 1e-7"))
    after = versions(src, stages, cache)
    assert after["advantages"] != before["advantages"] and after["train"] != before["train"]
    assert after["shard"] == before["shard"]
    assert after == versions(src, stages, tmp_path / "empty2")


def test_a_moved_definition_keeps_every_code_version(tmp_path):
    """A pure move reruns nothing: ``derive_seed`` moved from otbflow/seeds.py to a new module (its
    imports with it, seeds.py importing it from there) leaves every stage's code version as it was,
    by hash of what the code does rather than where it lives; the same move with one changed
    constant moves the versions of the stages that reach it, and only theirs."""
    from otbflow.pipeline import STAGES

    src = tmp_path / "src"
    shutil.copytree(PACKAGE, src / "otbflow", ignore=shutil.ignore_patterns("__pycache__"))
    stages = sorted(STAGES)
    before = versions(src, stages, tmp_path / "cache0")
    seeds = src / "otbflow" / "seeds.py"
    text = seeds.read_text()
    start = text.index("def derive_seed(")
    moved = text[start:]
    assert "\ndef " not in moved[1:] and "import hashlib" in text  # the last definition of the file
    seeds.write_text(text[:start].replace("import hashlib\n", "from otbflow.keys import derive_seed\n"))
    (src / "otbflow" / "keys.py").write_text(f'"""Moved here."""\n\nimport hashlib\n\n\n{moved}')
    assert versions(src, stages, tmp_path / "cache1") == before
    (src / "otbflow" / "keys.py").write_text(f"import hashlib\n\n\n{moved.replace('[:8]', '[:7]')}")
    after = versions(src, stages, tmp_path / "cache2")
    reach = {stage for stage in stages if "otbflow.seeds" in closure(f"otbflow.stages.{stage}")}
    assert reach and reach != set(stages)
    assert {stage for stage in stages if after[stage] != before[stage]} == reach


def test_planning_imports_no_torch():
    """Every Snakemake start computes every rule's rerun trigger and code version: without
    importing torch (2-3 s on a small machine)."""
    code = (
        "import sys\n"
        "from otbflow.runtime.codeversion import code_version\n"
        "from otbflow.config import DEFAULT_CONFIG, load_config\n"
        "from otbflow.pipeline import STAGES, trigger\n"
        "cfg = load_config(DEFAULT_CONFIG)\n"
        "[(trigger(cfg, s), code_version(s)) for s in STAGES]\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_no_two_modules_share_a_name():
    """A module's file name says what it is, once: no two modules of the package share one (a
    stage and the library code it runs are told apart by their names, as prune and vocab_pruning)."""
    stems = [p.stem for p in PACKAGE.rglob("*.py") if p.stem not in ("__init__", "__main__")]
    assert len(stems) == len(set(stems)), sorted({s for s in stems if stems.count(s) > 1})


def _marks_of(node: ast.expr, aliases: set[str]) -> bool:
    """Whether the decorator ``node`` is a pytest mark: ``pytest.mark.NAME``, called or not, or a
    module-level name bound to one (``HEADS = pytest.mark.xdist_group("slurm_heads")``)."""
    while isinstance(node, (ast.Call, ast.Attribute)):
        if isinstance(node, ast.Attribute) and node.attr == "mark":
            return isinstance(node.value, ast.Name) and node.value.id == "pytest"
        node = node.func if isinstance(node, ast.Call) else node.value
    return isinstance(node, ast.Name) and node.id in aliases


def misplaced_marks(source: str) -> list[str]:
    """The functions of a test module's ``source`` that a pytest mark decorates but that pytest
    does not collect as tests (a name not starting with 'test'), fixtures aside: a mark there has
    no effect, so a ``slow`` test behind a helper that a refactor slipped in under its mark runs in
    every quick run. Each as 'name (line N)'."""
    tree = ast.parse(source)
    aliases = {
        t.id
        for stmt in tree.body
        if isinstance(stmt, ast.Assign) and _marks_of(stmt.value, set())
        for t in stmt.targets
        if isinstance(t, ast.Name) and t.id != "pytestmark"
    }
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("test"):
            continue
        decorators = [ast.unparse(d) for d in node.decorator_list]
        if any(d.startswith(("pytest.fixture", "fixture")) for d in decorators):
            continue
        if any(_marks_of(d, aliases) for d in node.decorator_list):
            found.append(f"{node.name} (line {node.lineno})")
    return found


def test_misplaced_marks_on_examples():
    """The check against hand-written modules: the refactor that lost tests/test_worker.py's slow
    mark (a helper between the mark and its test), a mark by alias, and the forms that are right."""
    lost = "import pytest\n@pytest.mark.slow\ndef helper():\n    pass\n\n\ndef test_run():\n    pass\n"
    assert misplaced_marks(lost) == ["helper (line 3)"]
    alias = "import pytest\nHEADS = pytest.mark.xdist_group('h')\n@HEADS\ndef heads(): pass\n"
    assert misplaced_marks(alias) == ["heads (line 4)"]
    right = (
        "import pytest\npytestmark = pytest.mark.slow\nHEADS = pytest.mark.xdist_group('h')\n"
        "@pytest.mark.skipif(True, reason='r')\n@pytest.mark.parametrize('x', [1])\ndef test_a(x): pass\n"
        "@HEADS\ndef test_b(): pass\n@pytest.fixture\ndef tiny(): pass\n"
        "@pytest.fixture(scope='module')\n@pytest.mark.usefixtures('tiny')\ndef wide(): pass\n"
        "class TestC:\n    @pytest.mark.slow\n    def test_d(self): pass\n"
        "@functools.cache\ndef helper(): pass\n"
    )
    assert misplaced_marks(right) == []


def test_every_mark_decorates_a_test():
    """No pytest mark in tests/*.py decorates a function that is not a test (``misplaced_marks``)."""
    found = {p.name: misplaced_marks(p.read_text()) for p in sorted((REPO / "tests").glob("*.py"))}
    assert not {k: v for k, v in found.items() if v}, f"pytest marks on functions that are not tests: {found}"


def test_no_module_is_over_700_lines_without_saying_why():
    """A module over 700 lines is two modules glued, unless its docstring says in one line why it
    is not ("Longer than 700 lines ...": the schema catalog)."""
    long = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        if len(text.splitlines()) > 700 and "Longer than 700 lines" not in (ast.get_docstring(ast.parse(text)) or ""):
            long[str(path.relative_to(PACKAGE))] = len(text.splitlines())
    assert not long, f"modules over 700 lines, no reason given: {long}"
