"""The stage table (src/otbflow/pipeline.py) against the workflow: each stage's ``dag`` keys are
the config keys that shape its rule's jobs in the DAG that Snakemake builds from workflow/rules/."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

from conftest import REPO

from otbflow.pipeline import STAGES

# Every job of the workflow (forceall), as `snakemake --dag` builds them, one list per config: per
# rule its jobs' wildcards, input and output files and conda environment. In one process: each
# Snakemake start pays the Slurm executor plugin's import (seconds where no Slurm answers), once.
PROBE = r"""
import contextlib, io, json, sys, tempfile
from pathlib import Path

from snakemake.api import SnakemakeApi
from snakemake.settings.types import ConfigSettings, DAGSettings, OutputSettings, Quietness, ResourceSettings

snakefile, configs = Path(sys.argv[1]), json.loads(sys.argv[2])
out = []
for config in configs:
    with tempfile.TemporaryDirectory() as workdir, SnakemakeApi(OutputSettings(quiet={Quietness.ALL})) as api:
        workflow = api.workflow(
            ResourceSettings(cores=1), ConfigSettings(config=config), snakefile=snakefile, workdir=Path(workdir)
        )
        dag = workflow.dag(DAGSettings(forceall=True, print_dag_as="dot"))
        with contextlib.redirect_stdout(io.StringIO()):
            dag.printdag()
        rules = {}
        for job in workflow._workflow.dag.jobs:
            env = job.conda_env_spec
            rules.setdefault(job.rule.name, []).append(
                [sorted(job.wildcards.items()), sorted(map(str, job.input)), sorted(map(str, job.output)),
                 str(getattr(env, "file", env))]
            )
        out.append({rule: sorted(jobs) for rule, jobs in rules.items()})
print("DAGS " + json.dumps(out))
"""


def dags(configs: list[dict]) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    res = subprocess.run(
        [sys.executable, "-c", PROBE, str(REPO / "Snakefile"), json.dumps(configs)],
        capture_output=True,
        text=True,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    line = next(line for line in reversed(res.stdout.splitlines()) if line.startswith("DAGS "))
    return json.loads(line[5:])


def nested(key: str, value) -> dict:
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


BF16 = {"dtype": "bfloat16"}


def merge(a: dict, b: dict) -> dict:
    out = copy.deepcopy(a)
    for k, v in b.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def test_each_stage_declares_the_config_keys_that_shape_its_jobs(tmp_path):
    """A key is in a stage's ``dag`` exactly when changing it changes that rule's jobs in the DAG
            Snakemake builds (which jobs exist, the files each reads and writes, its conda environment):
            each key below changed on each of several base configs (the default; with a reward model, so
            that the score rule exists; keeping every policy or every optimizer state, so that each
            retention key alone decides prune jobs; a dataset task, whose files the shard reads; Slurm
        workers, whose train worker decides where the AdamW state is written; a run that publishes
    bf16 policies, whose last one the export rule writes in fp32; a key that needs others beside
    it, rollout.stream, on the default base with them). Every
            key of any stage's ``dag`` has a change here."""
    policy = tmp_path / "policy"  # what the config check reads of a folder: config.json and file names
    policy.mkdir()
    (policy / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_positions": 1024, "vocab_size": 64}))
    (policy / "tokenizer.json").write_text("{}")
    reward_model = tmp_path / "reward_model"
    reward_model.mkdir()
    rm_config = {"model_type": "gpt2", "architectures": ["GPT2ForSequenceClassification"], "num_labels": 1}
    (reward_model / "config.json").write_text(json.dumps(rm_config | {"n_positions": 1024}))
    (reward_model / "tokenizer.json").write_text("{}")
    for name, answer in (("a", 2), ("b", 3)):
        (tmp_path / f"{name}.jsonl").write_text(json.dumps({"prompt": f"1+{answer - 1}", "answer": str(answer)}) + "\n")
    # what rollout.staleness >= 1 needs, at every staleness; ZeRO-1, which train.bf16 needs
    stale = {"train": {"rollout_is": "token", "zero_stage": 1}}
    bases = [
        stale,
        merge(stale, nested("task.reward_model.path", str(reward_model))),
        merge(stale, nested("retention.policy_every", 0)),
        merge(stale, nested("retention.optimizer", "all")),
        merge(stale, {"model": {"path": str(policy)}, "task": {"name": "dataset", "path": str(tmp_path / "a.jsonl")}}),
        # a train worker: train.optimizer_every: null means 5 (otbflow.runtime.adamw), two checkpoints in 10
        # iterations; publishing bf16 policies: the export rule writes the last one in fp32
        merge(stale, {"workers": {"slurm": True}, "iterations": 10, "train": {"bf16": True}, "model": BF16}),
    ]
    changes = {
        "iterations": 5,
        "shard.n_shards": 3,
        "model.path": str(policy),
        "rollout.staleness": 1,
        "rollout.backend": "vllm",
        "task.reward_model.path": str(reward_model),
        "task.path": str(tmp_path / "b.jsonl"),
        "task.eval_path": str(tmp_path / "b.jsonl"),
        "train.reset_optimizer": True,
        "train.kl_coef": 0.1,
        "train.optimizer_every": 2,
        "train.bf16": False,
        "model.dtype": "float32",
        "workers.slurm": True,
        "workers.train": 0,
        "evaluate.every": 2,
        "retention.policy_every": 2,
        "retention.optimizer": "all",
    }
    # a key whose change needs others beside it: changed on the default base with them, against that
    # base with them (the other bases' features do not meet it)
    context = {"rollout.stream": {"rollout": {"staleness": 1, "take_newer": "step"}}}
    changes["rollout.stream"] = True
    assert {key for stage in STAGES.values() for key in stage.dag} <= set(changes)
    key_bases = {key: [merge(bases[0], context[key])] if key in context else bases for key in changes}
    changed = [merge(base, nested(key, value)) for key, value in changes.items() for base in key_bases[key]]
    found = dags(bases + [key_bases[key][0] for key in context] + changed)
    before = {key: found[: len(bases)] for key in changes}
    for i, key in enumerate(context):
        before[key] = [found[len(bases) + i]]
    after = iter(found[len(bases) + len(context) :])
    shaped = {key: set() for key in changes}
    for key in changes:
        for old in before[key]:
            new = next(after)
            shaped[key] |= {rule for rule in old.keys() | new.keys() if old.get(rule) != new.get(rule)} - {"all"}
    declared = {key: {name for name, stage in STAGES.items() if stage.rule and key in stage.dag} for key in changes}
    wrong = [
        f"{key}: shapes {sorted(shaped[key] - declared[key])} undeclared; "
        f"declared by {sorted(declared[key] - shaped[key])} that it does not shape"
        for key in changes
        if shaped[key] != declared[key]
    ]
    assert not wrong, "\n".join(["the stage table's dag keys against the rules' jobs:", *wrong])
