"""A config never runs code (issue 35): every path and interpreter that reaches a shell is quoted.

A results folder named with a space, quotes, ``$(...)``, backticks and ``;``, and an interpreter
(rollout.python, and Snakemake's own, which the jobs and torchrun use) in a folder named so too,
run the tiny workflow's first iteration with every output inside that folder and no payload
executed; a dry run shows every rule's command with each such path one word. Config strings
that become paths are checked: braces, control characters, a leading '-' or an empty
results_dir, and experiment or run names that are not plain folder names, are refused naming
the key, before any job."""

from __future__ import annotations

import dataclasses
import importlib
import re
import shlex
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml
from conftest import REPO, TINY

from otbflow.cli import build_parser
from otbflow.config import DEFAULT_CONFIG, ConfigError, load_config
from otbflow.io import read_metadata
from otbflow.pipeline import STAGES

# each would create a MARKER file in the job's working folder if it reached a shell unquoted
PAYLOAD = "res 'q\" $(touch MARKER1) `touch MARKER2`; touch MARKER3"


@pytest.fixture(scope="module")
def odd_python(tmp_path_factory) -> Path:
    """This interpreter, with its packages, as ``<folder with a space, quotes and $(...)>/bin/python``
    (a virtual environment's layout: pyvenv.cfg beside bin/, lib/ linked to this one's)."""
    root = tmp_path_factory.mktemp("env") / "venv 'q\" $(touch PYMARK)"
    (root / "bin").mkdir(parents=True)
    (root / "pyvenv.cfg").write_text(
        f"home = {Path(sys.executable).resolve().parent}\ninclude-system-site-packages = false\n"
    )
    (root / "lib").symlink_to(Path(sys.prefix) / "lib")
    (root / "bin" / "python").symlink_to(Path(sys.executable).resolve())
    python = root / "bin" / "python"
    check = subprocess.run([python, "-c", "import snakemake, otbflow"], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr[-2000:]
    return python


def layer(tmp_path: Path, python: Path, policy: Path, **extra) -> Path:
    """config/tiny.yaml's layer for these runs: one iteration, one shard, a ready policy (no bootstrap),
    two training processes (the launcher), the engine stages on ``python``, results in PAYLOAD."""
    cfg = {
        "results_dir": PAYLOAD,
        "iterations": 1,
        "model": {"path": str(policy)},
        "shard": {"n_shards": 1},
        "rollout": {"python": str(python)},
        "resources": {"train": {"tasks": 2}},
        **extra,
    }
    path = tmp_path / "layer.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def snakemake(python: Path, work: Path, *args: str, snakefile: Path = REPO / "Snakefile"):
    """Snakemake run by ``python`` (so that the jobs' interpreter and torchrun's are it too)."""
    cmd = [str(python), "-m", "snakemake", "-s", str(snakefile), "--directory", str(work), "--cores", "2", *args]
    return subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)


def no_payload_ran(*folders: Path) -> None:
    for folder in folders:
        found = [p for p in folder.rglob("*") if re.fullmatch(r"(MARKER\d|PYMARK)", p.name)]
        assert not found, f"a payload ran: {found}"


@pytest.mark.slow
@pytest.mark.xdist_group("workflow")
def test_a_results_folder_with_shell_syntax_is_only_a_name(tmp_path, odd_python, tiny_policy):
    """Iteration 0 (shard, rollout, features, advantages, train on two processes) with its results in
    PAYLOAD and every interpreter in a folder named like it: all outputs in that folder, the train
    job ran two ranks, no payload ran; a dry run afterwards plans nothing."""
    work = tmp_path / "work"
    work.mkdir()
    configs = ["--configfile", str(TINY), str(layer(tmp_path, odd_python, tiny_policy))]
    target = f"{PAYLOAD}/iter_0/train/metrics.parquet"
    res = snakemake(odd_python, work, target, *configs)
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-5000:]
    no_payload_ran(tmp_path, odd_python.parents[1], Path.cwd())
    assert sorted(p.name for p in work.iterdir()) == [".snakemake", PAYLOAD]
    r = work / PAYLOAD
    assert read_metadata(r / "iter_0/train/metrics.parquet")["world_size"] == 2
    for rule in ("shard", "rollout", "features", "advantages", "train"):
        assert list((r / "logs" / rule).glob("*.log")), rule
    assert "rollout" in (r / "logs/rollout/iter_0_shard_0.log").read_text()
    dry = snakemake(odd_python, work, target, "-n", *configs)
    assert dry.returncode == 0 and "Nothing to be done" in dry.stdout + dry.stderr, dry.stdout[-3000:]


def test_every_rule_quotes_its_paths(tmp_path, odd_python, tiny_policy):
    """A dry run of every rule (two iterations, a pruned iteration, the KL reference, the studies
    and the report) prints each command: every path in PAYLOAD is one word of it, and so is the
    interpreter, in the command and in the launcher's script."""
    work = tmp_path / "work"
    configs = ["--configfile", str(TINY), str(layer(tmp_path, odd_python, tiny_policy, iterations=2))]
    more = ["retention={policy_every: 10, optimizer: last}", "train={kl_coef: 0.1}"]
    res = snakemake(odd_python, work, *configs, "-n", "-p", "--config", *more)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    commands = [c for c in re.findall(r"^Shell command: (.*)$", res.stdout, flags=re.M) if c != "None"]
    rules = set(re.findall(r"^(?:local)?rule (\w+):", res.stdout, flags=re.M)) - {"all"}
    assert rules == {"shard", "rollout", "features", "advantages", "train", "publish_optimizer", "prune"} | {
        "evaluate",
        "report",
        "scaling",
        "variance_pool",
        "variance",
    }
    parsed = set()
    for command in commands:
        words = shlex.split(command)
        # the flags are those of the stage's CLI (its Args): the command parses, nothing left over
        start = next(i for i, w in enumerate(words) if w.replace("-", "_") in STAGES)
        args = build_parser(words[start]).parse_args(words[start : words.index(">")])
        assert args.overrides == [], command
        parsed.add(words[start].replace("-", "_"))
        paths = [w for w in words if "MARKER" in w]
        assert paths and all(w == PAYLOAD or w.startswith(f"{PAYLOAD}/") for w in paths), command
        assert str(odd_python) in words, command
        if "bash" in words:  # the launcher: its script starts the interpreter as one word too
            script = words[words.index("-c") + 1]
            assert str(odd_python) in shlex.split(script.replace(";", " ")), script
    assert parsed == rules
    assert not work.joinpath(PAYLOAD).exists()
    no_payload_ran(tmp_path)


def test_the_rules_flags_are_the_stages_args():
    """The flags a rule's command gets (otbflow.pipeline.Stage.flags, read from the stage module's
    source) are the fields of its imported Args dataclass: names, which are required, lists, switches."""
    for stage in STAGES.values():
        module = importlib.import_module(stage.module)
        hints = typing.get_type_hints(module.Args)
        expected = [
            (
                f.name,
                f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
                typing.get_origin(hints[f.name]) is list,
                hints[f.name] is bool,
            )
            for f in dataclasses.fields(module.Args)
        ]
        assert [(f.name, f.required, f.is_list, f.is_switch) for f in stage.flags] == expected, stage.name


@pytest.mark.parametrize(
    "value, why",
    [
        ("", "not empty"),
        ("-rf", "not starting with '-'"),
        ("results_{k}", "free of braces"),
        ("results\nx", "free of control characters"),
    ],
)
def test_a_results_dir_that_cannot_be_a_path_is_refused(tmp_path, value, why):
    """Refused by the config loader (every CLI) and by the workflow before any job, naming the key."""
    with pytest.raises(ConfigError, match=re.escape(f"config key 'results_dir': must be a path, {why}")):
        load_config(DEFAULT_CONFIG, extra={**yaml.safe_load(TINY.read_text()), "results_dir": value})
    (tmp_path / "layer.yaml").write_text(yaml.safe_dump({"results_dir": value}))
    res = subprocess.run(
        [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(tmp_path / "w")]
        + ["--cores", "1", "--configfile", str(TINY), str(tmp_path / "layer.yaml")],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    assert res.returncode != 0 and "config key 'results_dir'" in res.stdout + res.stderr, res.stderr[-2000:]
    written = [p for p in (tmp_path / "w").rglob("*") if p.is_file() and ".snakemake" not in p.parts]
    assert not written, written


def test_an_experiment_name_is_a_folder_of_results(tmp_path):
    """An experiment named '../../../x' would plan its outputs outside results/: refused before
    any job, naming the key, writing nothing; a name with shell syntax is one word of every
    command."""
    exp = yaml.safe_load((REPO / "config/experiments/tiny.yaml").read_text())

    def dry_run(name: str):
        path = tmp_path / "exp.yaml"
        path.write_text(yaml.safe_dump(exp | {"experiment": name}))
        cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO / "workflow/experiment.smk"), "-n", "-p"]
        cmd += ["--directory", str(tmp_path / "w"), "--cores", "2", "--configfile", str(path)]
        return subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)

    res = dry_run("../../../x")
    out = res.stdout + res.stderr
    assert res.returncode != 0 and "config key 'experiment': must be a folder name, free of slashes" in out, out[-2000:]
    res = dry_run("exp $(touch MARKER1)")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    commands = [c for c in re.findall(r"^Shell command: (.*)$", res.stdout, flags=re.M) if c != "None"]
    assert commands
    for command in commands:
        words = shlex.split(command)
        assert all(re.search(r"results/exp \$\(touch MARKER1\)(/|$)", w) for w in words if "MARKER" in w), command
    assert not (tmp_path / "w" / "results").exists()
    no_payload_ran(tmp_path)


def test_the_slurm_executor_refuses_paths_its_sbatch_call_would_run(tmp_path):
    """The Slurm executor wraps each job's command line in double quotes (sbatch --wrap="..."),
    where $(...) and backticks run even inside the single quotes around a path: with the slurm
    profile, such a results folder (or model.path) is refused before any job, naming it and
    writing nothing. (No Slurm needed: refused before the first sbatch.)"""
    work = tmp_path / "work"
    layer = tmp_path / "layer.yaml"
    policy = tmp_path / "p `touch MARKER2`"  # a folder that passes the policy check: its name is refused
    policy.mkdir()
    (policy / "config.json").write_text("{}")
    (policy / "tokenizer.json").write_text("{}")
    for cfg, named in [
        ({"results_dir": "r $(touch MARKER1)"}, str(work / "r $(touch MARKER1)")),
        ({"model": {"path": str(tmp_path / "p `touch MARKER2`")}}, str(tmp_path / "p `touch MARKER2`")),
    ]:
        layer.write_text(yaml.safe_dump(cfg))
        args = ["--workflow-profile", str(REPO / "slurm"), "--slurm-no-account", "--configfile", str(TINY), str(layer)]
        res = snakemake(Path(sys.executable), work, *args)
        out = res.stdout + res.stderr
        assert res.returncode != 0 and f"otbflow: {named!r} holds a character among" in out, out[-3000:]
        assert "Nothing was run" in out and "rule " not in res.stdout
        assert sorted(p.name for p in work.iterdir()) == [".snakemake"]
    no_payload_ran(tmp_path)
