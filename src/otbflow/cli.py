"""``otbflow <stage>``: one sub-command per stage of the stage table (``otbflow.pipeline``).

Each stage module defines an ``Args`` dataclass (its inputs and outputs; the field docstrings are
the help text) and ``run(cfg, args)``; the table gives its one-line help and the config keys of
its ``--help``. Every sub-command takes ``--config FILE`` and trailing ``key.sub=value``
overrides, loaded by the same ``otbflow.config.load_config`` that the Snakefile uses.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import importlib
import logging
import os
import sys
import time
import typing

import otbflow
from otbflow.config import DEFAULT_CONFIG, Config, ConfigError, describe_section, field_docs, load_config
from otbflow.io import JobGoneError, SchemaError, bind_to_job
from otbflow.pipeline import STAGES, Stage, by_command, job_resources

TOOLS = {
    "config": "print the validated config (or every key with its help)",
    "schema-doc": "print the Parquet schema reference (docs/schema.md)",
    "submit": "run the workflow on Slurm from a head job (snakemake --workflow-profile slurm)",
    "disk": "the disk a run will take (policies, optimizer states, data) under its retention policy",
    "experiment-member": "write one experiment member's resolved config (used by workflow/experiment.smk)",
    "worker": "a warm worker: runs one kind of stage job after another in one process (docs/workers.md)",
}


def _add_args_dataclass(parser: argparse.ArgumentParser, cls: type) -> None:
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        kind = hints[f.name]
        if kind is bool:
            parser.add_argument(flag, dest=f.name, action="store_true", help=docs.get(f.name, ""))
            continue
        if typing.get_origin(kind) is typing.Union:  # Optional[X]
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        if typing.get_origin(kind) is list:
            parser.add_argument(
                flag,
                dest=f.name,
                nargs="+",
                type=typing.get_args(kind)[0],
                required=required,
                default=None if required else f.default_factory(),
                help=docs.get(f.name, ""),
            )
            continue
        parser.add_argument(
            flag,
            dest=f.name,
            type=kind,
            required=required,
            default=None if required else f.default,
            help=docs.get(f.name, ""),
        )


def describe_key(key: str) -> str:
    """One line of help for a config key (a whole section: every key of it)."""
    node, cls = Config(), Config
    parts = key.split(".")
    for part in parts[:-1]:
        node = getattr(node, part)
        cls = type(node)
    value = getattr(node, parts[-1])
    if dataclasses.is_dataclass(value):
        return describe_section(key)
    return f"  {key} (default {value!r}): {field_docs(cls).get(parts[-1], '')}"


def keys_epilog(stage: Stage) -> str:
    """The config keys of a stage, as the stage table declares them for the default config."""
    cfg = load_config(DEFAULT_CONFIG)
    groups = [
        ("config keys that change this stage's outputs (with the default config):", stage.outputs(cfg)),
        ("config keys that change how it runs, not what it writes:", stage.execution),
        ("config keys that shape the workflow around it (the Snakefile reads them):", stage.dag),
    ]
    lines = [line for title, keys in groups if keys for line in (title, *(describe_key(k) for k in keys))]
    if stage.rule:
        res = ", ".join(f"{k}={v}" for k, v in job_resources(cfg, stage.name).items())
        where = stage.resources if isinstance(stage.resources, str) else stage.name
        lines += [f"resources of its jobs (resources.{where} overrides each; runtime in minutes):", f"  {res}"]
    return "\n".join(lines) or "this stage reads no config key"


class SubcommandParser(argparse.ArgumentParser):
    """A sub-command's parser. A stage's epilog (its config keys) is written when its help is
    printed: it loads the default config and reads every key's help from the source (0.2 to 1 s),
    which a job that runs the stage does not need."""

    def __init__(self, *args, stage: Stage | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.stage = stage

    def format_help(self) -> str:
        if self.stage is not None and self.epilog is None:
            self.epilog = keys_epilog(self.stage)
        return super().format_help()


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The full parser of ``command``; the other sub-commands are listed without importing
    their modules (so ``otbflow rollout`` does not import DeepSpeed)."""
    parser = argparse.ArgumentParser(
        prog="otbflow", description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=SubcommandParser)
    for stage in STAGES.values():
        name, help_text = stage.command, stage.help
        if name != command:
            sub.add_parser(name, help=help_text)
            continue
        mod = importlib.import_module(stage.module)
        p = sub.add_parser(
            name,
            help=help_text,
            description=(mod.__doc__ or help_text).strip(),
            formatter_class=argparse.RawDescriptionHelpFormatter,
            stage=stage,
        )
        p.add_argument("--config", default=None, help="config YAML (default: config/config.yaml)")
        _add_args_dataclass(p, mod.Args)
        p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. rollout.group_size=8")
    for name, help_text in TOOLS.items():
        if name == "submit":
            from otbflow.ops import submit

            p = sub.add_parser(
                name, help=help_text, description=submit.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
            )
            submit.add_arguments(p)
            continue
        if name == "disk":
            from otbflow.ops import disk

            p = sub.add_parser(
                name, help=help_text, description=disk.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
            )
            disk.add_arguments(p)
            continue
        p = sub.add_parser(name, help=help_text)
        if name == "worker":
            from otbflow.ops.dispatch import KINDS

            p.description = (
                "Serve the stage jobs of one kind that the workflow of one results folder hands out; "
                + "; ".join(f"{k}: {', '.join(v)}" for k, v in KINDS.items())
                + ". Stops on SIGTERM or SIGINT, after --idle-exit seconds without a job, or after --max-jobs jobs."
            )
            p.add_argument("kind", choices=list(KINDS), help="which stages it runs")
            p.add_argument("--results", required=True, help="the run's results folder (results_dir)")
            p.add_argument("--idle-exit", type=float, default=0.0, help="end after this many seconds idle (0: never)")
            p.add_argument("--max-jobs", type=int, default=0, help="end after this many jobs (0: never)")
            p.add_argument(
                "--retire-after",
                type=float,
                default=0.0,
                metavar="SECONDS",
                help="take no new job this long after the start, and end (0: never; a Slurm worker's time limit)",
            )
            p.add_argument(
                "--tasks",
                type=int,
                default=1,
                help="train: the processes (DeepSpeed ranks) of the train jobs it serves, resources.train.tasks; "
                "started with srun inside a Slurm job, torchrun elsewhere",
            )
            p.add_argument("--cpus-per-task", type=int, default=1, help="with --tasks under srun: CPUs per rank")
        if name == "experiment-member":
            for flag in ("--experiment", "--run", "--policy", "--scaling", "--out"):
                p.add_argument(flag, required=True)
            p.add_argument("--seed", type=int, required=True)
        if name == "config":
            p.add_argument("--config", default=None)
            p.add_argument("--help-keys", action="store_true", help="list every key with its help")
            p.add_argument("--json-schema", action="store_true", help="print the config's JSON schema")
            p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    return parser


WORKER_RANKS = "OTBFLOW_WORKER_RANKS"
"""Set by ``otbflow worker --tasks N`` for the ranks its launcher starts (each runs the same command)."""


def _launch_worker_ranks(ns) -> None:
    """``otbflow worker train --tasks N``: this process becomes N ranks, each the same command,
    started by the launcher of train jobs (``dispatch.launcher``: srun in a Slurm job, torchrun
    elsewhere); returns in each of them."""
    if ns.kind != "train":
        raise SystemExit(f"otbflow worker: --tasks is for the train worker, not {ns.kind} (one process each)")
    if os.environ.get(WORKER_RANKS) == str(ns.tasks):
        return
    from otbflow.ops.dispatch import launcher

    os.environ[WORKER_RANKS] = str(ns.tasks)
    command = [*launcher(ns.tasks, ns.cpus_per_task), sys.executable, "-m", "otbflow", *sys.argv[1:]]
    sys.stdout.flush()
    os.execvp(command[0], command)


def end_startup(program: bool) -> None:
    """The program's start-up is over: what it loaded (the modules, above all torch's and
    transformers') is moved out of the collector's reach for good (``gc.freeze``), and the
    collector is turned back on for the work. No-op for a caller in its own process."""
    if program and not gc.isenabled():
        gc.freeze()
        gc.enable()


def main(argv: list[str] | None = None) -> int:
    """The CLI. As the program (no ``argv``: ``python -m otbflow``, the ``otbflow`` script) it
    loads the config and the stage's modules with the garbage collector off: the imports create
    millions of objects and hardly any garbage, and the collector walked them all again and again
    (0.5-0.7 s of a torch stage's start-up); ``end_startup`` turns it back on."""
    program = argv is None
    if program:
        gc.disable()  # (``python -m otbflow`` turned it off before importing this module)
    try:
        code = _main(sys.argv[1:] if program else argv, program)
    finally:
        if program:
            gc.enable()  # a stage raised, or argparse exited
    if program:
        # The process exits next; the interpreter's last collections at exit walked every object
        # still alive (1.2-1.5 s after a torch stage). Frozen, they are not walked: the exit
        # handlers and the modules' teardown run as before.
        gc.freeze()
    return code


def _main(argv: list[str], program: bool) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if program and argv and argv[0] in {stage.command for stage in STAGES.values()}:
        try:  # a stage job: it dies with its job, and publishes nothing once its job has ended
            bind_to_job(otbflow.PARENT_AT_START)
        except JobGoneError as e:
            print(f"otbflow {argv[0]}: error: {e}", file=sys.stderr)
            return 2
    parser = build_parser(argv[0] if argv else None)
    ns = parser.parse_args(argv)
    if ns.command in TOOLS:
        end_startup(program)
    from otbflow.config import DEFAULT_CONFIG, describe_all, to_yaml

    try:
        if ns.command == "submit":
            from otbflow.ops.submit import main as submit_main

            return submit_main(ns)
        if ns.command == "disk":
            from otbflow.ops.disk import main as disk_main

            return disk_main(ns)
        if ns.command == "worker":
            from otbflow.ops.worker import main as worker_main

            if ns.tasks > 1:
                _launch_worker_ranks(ns)  # returns in each rank the launcher started
            run_stage = functools.partial(_main, program=False)
            return worker_main(ns.kind, ns.results, run_stage, ns.idle_exit, ns.max_jobs, ns.retire_after, ns.tasks)
        if ns.command == "experiment-member":
            from otbflow.studies.experiment_config import write_member_config

            write_member_config(ns.experiment, ns.run, ns.seed, ns.policy, ns.scaling, ns.out)
            return 0
        if ns.command == "schema-doc":
            from otbflow.schemas import schema_markdown

            print(schema_markdown())
            return 0
        if ns.command == "config":
            if ns.help_keys:
                print(describe_all())
                return 0
            if ns.json_schema:
                import json

                from otbflow.config import json_schema

                print(json.dumps(json_schema(), indent=1, ensure_ascii=False))
                return 0
            print(to_yaml(load_config(ns.config or DEFAULT_CONFIG, ns.overrides)), end="")
            return 0
        cfg = load_config(ns.config or DEFAULT_CONFIG, ns.overrides)
        mod = importlib.import_module(by_command(ns.command).module)
        args = mod.Args(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(mod.Args)})
        end_startup(program)
        # the job's own start stamp: this line's time minus the start-up it reports
        logging.getLogger("otbflow").info("%s started %.2f s ago", ns.command, time.time() - otbflow.STARTED_AT)
        start = time.perf_counter()
        mod.run(cfg, args)
        logging.getLogger("otbflow").info("%s finished in %.1f s", ns.command, time.perf_counter() - start)
        return 0
    except (ConfigError, SchemaError, JobGoneError) as e:
        print(f"otbflow {ns.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
