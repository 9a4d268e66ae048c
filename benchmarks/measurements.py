"""docs/measurements.md, generated: every measured figure the docs quote, with the machine, the
date and the command that measured it.

One file per measurement, ``benchmarks/measured/NAME.json``, with the keys

- ``title``: what was measured (a heading of the page; its anchor is ``#NAME``);
- ``topic``: the page's section it belongs to (one of ``TOPICS``);
- ``command``: the command that measured it, as typed from the checkout's root;
- ``machine``: the machine (a sentence, or ``machine.run_record()``'s mapping) and ``date``;
- ``source``: where the figures come from: the command's JSON output (kept under ``raw``, or in the
  file itself), or, for measurements made before this page existed, the docs that quoted them
  (their raw output was not kept);
- ``figures``: ``[what, value]`` pairs, each value as the docs quote it (a number with its unit);
- ``notes`` (optional): how to read them (load on the machine, repeats, what varies).

Prose docs link to ``docs/measurements.md#NAME`` instead of copying a table; a figure they do quote
must be on this page (``tests/test_docs_facts.py``).

    python benchmarks/measurements.py           # writes docs/measurements.md
    python benchmarks/measurements.py --check   # fails if docs/measurements.md is not what it would write
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MEASURED = REPO / "benchmarks" / "measured"
DOC = REPO / "docs" / "measurements.md"
TOPICS = {
    "run": "A whole run",
    "rollout": "Rollout and rewards",
    "features": "Features and estimators",
    "train": "Training",
    "iteration": "Iterations, start-up and warm workers",
    "workflow": "Planning, CI and the test suite",
}
REQUIRED = ("title", "topic", "command", "machine", "date", "source", "figures")


def machine_text(machine) -> str:
    if isinstance(machine, str):
        return machine
    parts = [f"{machine.get('cpu')}, {machine.get('cores')} cores"]
    if machine.get("gpu"):
        parts.append(str(machine["gpu"]))
    parts += [f"{k} {machine[k]}" for k in ("python", "torch", "transformers") if machine.get(k)]
    return "; ".join(parts)


def date_text(date: str) -> str:
    """An ISO date and time as its day; anything else (``not recorded``) as it is."""
    return date[:10] if re.match(r"\d{4}-\d{2}-\d{2}", date) else date


def load(folder: Path = MEASURED) -> dict[str, dict]:
    """Every record, by file stem; a record that lacks a key or names an unknown topic is an error."""
    records = {}
    for path in sorted(folder.glob("*.json")):
        record = json.loads(path.read_text())
        missing = [k for k in REQUIRED if k not in record]
        if missing:
            raise SystemExit(f"{path}: missing {', '.join(missing)} (see benchmarks/measurements.py)")
        if record["topic"] not in TOPICS:
            raise SystemExit(f"{path}: topic {record['topic']!r} is not one of {', '.join(TOPICS)}")
        for pair in record["figures"]:
            if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
                raise SystemExit(f"{path}: a figure is a [what, value] pair of strings, not {pair!r}")
        records[path.stem] = record
    return records


def render(records: dict[str, dict]) -> str:
    lines = [
        "# Measurements",
        "",
        "Written by `python benchmarks/measurements.py` from `benchmarks/measured/*.json` (do not edit by hand; "
        "`--check` is run by the tests). Every figure the other docs quote is here, with the command that "
        "measured it, the machine and the date. Figures from one run on a shared machine vary from run to run: "
        "where a measurement was repeated, the value is the range it spanned.",
        "",
    ]
    for topic, heading in TOPICS.items():
        mine = sorted((r["date"], name) for name, r in records.items() if r["topic"] == topic)
        if not mine:
            continue
        lines += [f"## {heading}", ""]
        for _, name in mine:
            r = records[name]
            lines += [
                f'<a id="{name}"></a>',
                "",
                f"### {r['title']}",
                "",
                f"`{r['command']}`  ",
                f"{machine_text(r['machine'])}; {date_text(r['date'])}. Source: {r['source']}.",
                "",
                "| what | value |",
                "| --- | ---: |",
            ]
            lines += [f"| {what} | {value} |" for what, value in r["figures"]]
            lines.append("")
            if r.get("notes"):
                lines += [r["notes"], ""]
    return "\n".join(lines).rstrip() + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="compare with docs/measurements.md instead of writing it")
    ns = p.parse_args()
    text = render(load())
    if ns.check:
        if not DOC.exists() or DOC.read_text() != text:
            sys.stderr.write(f"{DOC} is not what benchmarks/measurements.py writes: run it and commit the result\n")
            return 1
        print(f"{DOC} is up to date")
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
