"""docs/data.md 'A real model and dataset': its three commands, with a tiny Qwen2 + BPE + chat folder in
place of the checkpoint and a GSM8K-layout file in place of the dataset, all for real: the data
check (the shard stage), the whole workflow on the dataset (with the SMALL sizes layered on, so
that it takes a minute) and the HTML report. A wrong layout stops the first command."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import polars as pl
import yaml
from conftest import REPO, SMALL

from otbflow import schemas
from otbflow.io import read_table

MODEL = "/models/Qwen2.5-0.5B-Instruct"
DATA = "/data/gsm8k/train.parquet"


def readme_commands() -> list[str]:
    section = (REPO / "docs" / "data.md").read_text().split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


def run(line: str, cwd: Path, *extra: str) -> subprocess.CompletedProcess:
    argv = shlex.split(line)
    argv[0] = str(Path(sys.executable).with_name(Path(argv[0]).name))  # .venv/bin/<tool> of this venv
    if Path(argv[0]).name == "snakemake":
        argv[1:1] = ["-s", str(REPO / "Snakefile")]
    return subprocess.run(argv + list(extra), cwd=cwd, capture_output=True, text=True, stdin=subprocess.DEVNULL)


def test_readme_real_model_commands(tmp_path, qwen2_bpe_policy):
    lines = readme_commands()
    assert len(lines) == 3 and all(MODEL in x or DATA in x for x in lines)
    rows = [
        {
            "question": f"Ann has {i} pens and gets {i + 2} more. How many pens?",
            "answer": f"{i}+{i + 2}=<<{i}+{i + 2}={2 * i + 2}>>{2 * i + 2}\n#### {2 * i + 2}",
        }
        for i in range(80)
    ]
    data = tmp_path / "gsm8k_train.parquet"
    pl.DataFrame(rows).write_parquet(data)
    lines = [
        x.replace(MODEL, str(qwen2_bpe_policy)).replace(DATA, str(data)).replace("--cores 8", "--cores 2")
        for x in lines
    ]
    res = run(lines[0], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    ev = read_table(tmp_path / "results/data/eval.parquet", schemas.PROMPTS)
    assert ev.height == 64 and ev["prompt"][0].startswith("Ann has") and set(ev["data_source"]) == {"gsm8k"}
    work = tmp_path / "run"
    work.mkdir()
    res = run(lines[1], work, "-n")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    planned = set(re.findall(r"^rule (\w+):", res.stdout, flags=re.M))
    assert {"shard", "rollout", "features", "train", "evaluate", "report"} <= planned and "bootstrap" not in planned
    res = run(lines[1], work, "--until", "shard")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert read_table(work / "results/data/train/shard_0.parquet", schemas.PROMPTS).height == 8
    # the whole run on the dataset (SMALL sizes), then its report
    (work / "small.yaml").write_text(yaml.safe_dump(SMALL | {"task": {"n_eval": 4}}))
    res = run(lines[1], work, "--configfile", str(work / "small.yaml"))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    ro = read_table(work / "results/iter_0/rollout/shard_0.parquet", schemas.ROLLOUTS)
    assert ro["prompt"][0].startswith("Ann has") and ro["reward"].is_in([0.0, 1.0]).all()  # scored by the math reward
    progress = read_table(work / "results/report/progress.parquet", schemas.PROGRESS)
    assert progress["policy"].to_list() == ["initial", "iter_0"]
    res = run(lines[2], work, "--configfile", str(work / "small.yaml"))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "accuracy.png" in (work / "results/report.html").read_text(errors="ignore")
    # a wrong layout stops the first command, naming the file and the column
    pl.DataFrame({"question": ["x"] * 80}).write_parquet(data)
    res = run(lines[0], tmp_path)
    assert res.returncode != 0 and f"{data}: missing column 'answer'" in res.stderr
