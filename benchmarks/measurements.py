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

A benchmark's record is written by running it through ``record``: the benchmark prints its JSON,
which the record keeps under ``raw`` with the command, the machine (the JSON's ``machine``, else
this one's CPU and cores) and the date; each ``--figure WHAT PATH UNIT`` is the value at PATH
(keys joined by ``/``; a list of repeats reads as its range), and ``figure_paths`` keeps them, so
that ``rerun NAME`` measures the same figures again:

    python benchmarks/measurements.py record dry_run_planning --title "Planning a 500-iteration run" \
        --topic workflow --figure "3,500 jobs planned (-q)" plan_seconds s \
        -- python benchmarks/bench_dry_run.py --iterations 500 --repeats 3
    python benchmarks/measurements.py rerun dry_run_planning
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
from datetime import datetime
from pathlib import Path

# the checkout the script was started from (not resolved: a sandbox that links to this file writes its own records)
REPO = Path(__file__).absolute().parents[1]
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


def json_output(stdout: str) -> dict:
    """The JSON object a benchmark printed last (log lines may come before it)."""
    starts = [m.start() for m in re.finditer(r"^\{", stdout, flags=re.M)]
    for start in reversed(starts):
        try:
            return json.loads(stdout[start:])
        except json.JSONDecodeError:
            continue
    raise SystemExit(f"the command printed no JSON object:\n{stdout[-2000:]}")


def figure_value(raw: dict, path: str, unit: str) -> str:
    """The value at ``path`` in ``raw`` as the page shows it: a number with its unit; a list of
    repeats as its range."""
    value = raw
    for key in path.split("/"):
        value = value[int(key)] if isinstance(value, list) else value[key]

    def number(x) -> str:
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            return str(x)
        return f"{x:,}" if isinstance(x, int) else f"{x:,.2f}" if abs(x) < 1000 else f"{x:,.0f}"

    if isinstance(value, list):
        lo, hi = min(value), max(value)
        text = number(lo) if lo == hi else f"{number(lo)}\u2013{number(hi)}"
    else:
        text = number(value)
    return f"{text} {unit}".strip()


def this_machine() -> dict:
    """This machine's CPU (benchmarks/machine.py) and cores, for a benchmark whose JSON names none."""
    from machine import cpu_model  # beside this script

    return {"cpu": cpu_model(), "cores": os.cpu_count()}


def record(name: str, title: str, topic: str, figures: list[list[str]], command: list[str], notes: str = "") -> Path:
    """Run ``command`` from the checkout's root and write ``benchmarks/measured/NAME.json`` from the
    JSON it prints (module docstring)."""
    if topic not in TOPICS:
        raise SystemExit(f"--topic must be one of {', '.join(TOPICS)}, not {topic!r}")
    res = subprocess.run(command, cwd=REPO, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if res.returncode != 0:
        raise SystemExit(
            f"{shlex.join(command)} failed ({res.returncode}):\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
        )
    raw = json_output(res.stdout)
    out = {
        "title": title,
        "topic": topic,
        "command": shlex.join(command),
        "machine": raw.get("machine") or this_machine(),
        "date": datetime.now().isoformat(timespec="seconds"),
        "source": "the command's JSON output (raw)",
        "figures": [[what, figure_value(raw, path, unit)] for what, path, unit in figures],
        "figure_paths": figures,
        **({"notes": notes} if notes else {}),
        "raw": raw,
    }
    path = MEASURED / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    tmp.replace(path)
    return path


def write_page(check: bool) -> int:
    text = render(load())
    if check:
        if not DOC.exists() or DOC.read_text() != text:
            sys.stderr.write(f"{DOC} is not what benchmarks/measurements.py writes: run it and commit the result\n")
            return 1
        print(f"{DOC} is up to date")
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC}")
    return 0


def main() -> int:
    argv = sys.argv[1:]
    if argv[:1] == ["record"]:
        command = argv[argv.index("--") + 1 :] if "--" in argv else []
        p = argparse.ArgumentParser(prog="measurements.py record", description=record.__doc__)
        p.add_argument("name")
        p.add_argument("--title", required=True)
        p.add_argument("--topic", required=True, choices=list(TOPICS))
        p.add_argument("--figure", nargs=3, action="append", default=[], metavar=("WHAT", "PATH", "UNIT"))
        p.add_argument("--notes", default="")
        ns = p.parse_args(argv[1 : argv.index("--") if "--" in argv else len(argv)])
        if not command or not ns.figure:
            p.error("a command after -- and at least one --figure are needed")
        path = record(ns.name, ns.title, ns.topic, ns.figure, command, ns.notes)
        print(f"wrote {path}")
        return write_page(check=False)
    if argv[:1] == ["rerun"]:
        if len(argv) != 2:
            raise SystemExit("usage: measurements.py rerun NAME")
        old = load()[argv[1]]
        if "figure_paths" not in old:
            raise SystemExit(f"{argv[1]} was not written by `record` (no figure_paths): record it anew")
        path = record(
            argv[1], old["title"], old["topic"], old["figure_paths"], shlex.split(old["command"]), old.get("notes", "")
        )
        print(f"wrote {path}")
        return write_page(check=False)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="compare with docs/measurements.md instead of writing it")
    return write_page(p.parse_args(argv).check)


if __name__ == "__main__":
    sys.exit(main())
