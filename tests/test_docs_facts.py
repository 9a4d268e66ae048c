"""The docs' facts have one home each:

- a measured figure (a number with a unit of time, size, throughput, a percentage or a ratio ×) in
  the README or a prose page of docs/ is on the generated page docs/measurements.md, which names
  its command, machine and date (``benchmarks/measurements.py``); a paragraph whose figures are
  no measurement (a config value, a hand-computed example, a bound a test asserts) says so with
  the marker ``<!-- not measured: why -->``;
- every link between the docs reaches a file and a heading that exist, and every section that a
  doc, a docstring or a script names in words ("docs/training.md, 'The decode loop'") is a heading
  of that file.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

# generated pages: their figures are computed, and they are checked against their generators
GENERATED = {"measurements.md", "scale.md", "schema.md"}
PROSE = [REPO / "README.md", *sorted(p for p in (REPO / "docs").glob("*.md") if p.name not in GENERATED)]
MARKER = "<!-- not measured"
NUMBER = r"\d[\d,]*(?:\.\d+)?"
FIGURE = re.compile(
    rf"(?<![\w.,/-])({NUMBER}(?:\s?[–-]\s?{NUMBER})?)[ \u00a0\u2009]?"
    r"(ms|s|min|h|kB|KB|MB|MiB|GB|GiB|TB|TiB|tokens/s|%|×|x)(?![\w/]| ?=)"
)


def figures(text: str) -> list[str]:
    """The figures of a text, normalised: no space between number and unit, ``x`` as ×."""
    return [f"{number}{'×' if unit == 'x' else unit}" for number, unit in FIGURE.findall(text)]


def prose_paragraphs(text: str) -> list[str]:
    """The text of a Markdown page without code: fenced blocks, inline code and link targets
    dropped; split into paragraphs, each list item and table row its own."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    text = re.sub(r"\]\([^)]*\)", "]", text)
    return [p for p in re.split(r"\n\s*\n|\n(?=\s*(?:[-*] |\d+\. |\|))", text) if p.strip()]


def test_the_measurements_page_is_what_its_generator_writes():
    subprocess.run([sys.executable, "benchmarks/measurements.py", "--check"], cwd=REPO, check=True)


def test_the_figure_pattern_on_examples():
    """By hand: what counts as a figure, and how it is normalised."""
    text = "took 7 min 25 s, 1,024 tokens at 10,800–13,500 tokens/s; 0.76× and 3-4x; fp32 16 MiB; p 0.05"
    assert figures(text) == ["7min", "25s", "10,800–13,500tokens/s", "0.76×", "3-4×", "16MiB"]
    assert figures("shard_0 iter_3 v1.2 x86-64 1e-6 seed 5 s=1") == []


@pytest.mark.parametrize("doc", PROSE, ids=lambda p: p.name)
def test_prose_figures_are_on_the_measurements_page(doc):
    page = set(figures((REPO / "docs" / "measurements.md").read_text()))
    missing = []
    for paragraph in prose_paragraphs(doc.read_text()):
        if MARKER in paragraph:
            continue
        missing += [(f, paragraph.strip()[:80]) for f in figures(paragraph) if f not in page]
    assert not missing, (
        f"{doc.name} quotes figures that docs/measurements.md does not hold (add the measurement to "
        f"benchmarks/measured/ and link to it, or mark a paragraph '{MARKER}: why -->'): {missing}"
    )


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but hyphens dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower()).replace(" ", "-")


def anchors(path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {slug(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)} | set(re.findall(r'<a id="([^"]+)"', text))


def headings(path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return [h.replace("`", "") for h in re.findall(r"^#+ (.+)$", text, flags=re.M)]


def test_doc_links_reach_a_file_and_a_heading():
    broken = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # a web address
            file, _, anchor = target.partition("#")
            path = (doc.parent / file).resolve() if file else doc
            if not path.exists():
                broken.append(f"{doc.name}: {target} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                broken.append(f"{doc.name}: {target} (no such heading)")
    assert not broken, broken


SECTION_REF = re.compile(r"(docs/[a-z_]+\.md|README(?:\.md)?)[,:]? +[\"'“]([A-Z][^\"'”\n]{2,80})[\"'”]")


def test_named_sections_exist():
    """'docs/X.md, "Section"' and 'README, "Section"' in docs, code, scripts and configs (the
    config docstrings feed --help-keys and the schema) name a heading of that file (its text,
    backticks dropped, begins with the name)."""
    sources = [REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "src").rglob("*.py")]
    sources += [*(REPO / "benchmarks").rglob("*.py"), *(REPO / "benchmarks").rglob("*.sh")]
    sources += [*(REPO / "workflow").rglob("*"), REPO / "Snakefile"]
    sources += [*(REPO / "config").rglob("*.yaml"), *(REPO / "tests").glob("*.py"), REPO / "Makefile"]
    sources = [p for p in sources if p.is_file() and p.name != "test_docs_facts.py"]
    refs = 0
    missing = []
    for source in sources:
        text = re.sub(r"\s+", " ", source.read_text(errors="replace"))
        for doc, section in SECTION_REF.findall(text):
            refs += 1
            path = REPO / (doc if doc.startswith("docs/") else "README.md")
            if not any(h.startswith(section) for h in headings(path)):
                missing.append(f"{source.relative_to(REPO)}: {doc}, '{section}'")
    assert refs >= 10
    assert not missing, f"sections named that do not exist: {missing}"


def test_the_readme_places_every_module_on_its_floor():
    """The README's code map is the house: its rows are the floors of tests/layers.py, top to
    bottom, and each module of the package (the stages as stages/) is named in its floor's row."""
    import layers

    package = REPO / "src" / "otbflow"
    section = (REPO / "README.md").read_text().split("## Where to change what", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| ---")][1:]
    assert len(rows) == len(layers.LAYERS)
    modules = [p for p in package.rglob("*.py") if p.stem != "__init__" and p.parent.name != "stages"]
    assert len(modules) >= 30
    misplaced = []
    for path in modules:
        name = ".".join(path.relative_to(package.parent).with_suffix("").parts)
        if f"`{path.name}`" not in rows[layers.FLOOR[layers.room(name)]]:
            misplaced.append(str(path.relative_to(package)))
    assert not misplaced, f"README, 'Where to change what', does not place {misplaced} on their floor's row"


ARROW = re.compile(r"\b(\w+)(?: \([^)]*\))?\s*─►\s*(\w+)")


def test_the_readme_stage_diagram_is_the_workflow(tmp_path):
    """The README's stage diagram names every stage of the stage table that has a rule of the
    run's workflow, and no other; each arrow it draws from one stage to another ("rollout ─►
    features") is an edge of the rule graph that the real Snakemake plans for the tiny config."""
    from otbflow.pipeline import STAGES

    text = (REPO / "README.md").read_text().split("## The stages", 1)[1]
    diagram = text.split("```", 2)[1]
    words = set(re.findall(r"\b[a-z_]+\b", diagram))
    stages = {name for name, stage in STAGES.items() if stage.rule}
    assert words & set(STAGES) == stages, (
        f"drawn but no rule: {words & set(STAGES) - stages}; rules not drawn: {stages - words}"
    )
    drawn = {(a, b) for a, b in ARROW.findall(diagram) if a in STAGES and b in STAGES}
    assert {("rollout", "features"), ("advantages", "train"), ("evaluate", "report")} <= drawn
    snakemake = str(Path(sys.executable).with_name("snakemake"))
    cmd = [snakemake, "-s", str(REPO / "Snakefile"), "--directory", str(tmp_path), "--cores", "1"]
    cmd += ["--configfile", str(REPO / "config" / "tiny.yaml"), "-n", "--rulegraph"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, stdin=subprocess.DEVNULL).stdout
    label = dict(re.findall(r'^\s*(\d+)\[label = "(\w+)"', out, flags=re.M))
    edges = {(label[a], label[b]) for a, b in re.findall(r"^\s*(\d+) -> (\d+)", out, flags=re.M)}
    planned = set(label.values())
    missing = {(a, b) for a, b in drawn if a in planned and b in planned} - edges
    assert not missing, f"the README draws {missing}, which the workflow's rule graph does not have"
