"""The guard the Snakefile calls when it is parsed (``guard``): a real run holds its results
folder (``otbflow.ops.results_lock``) and continues where a killed head of its working folder left
off (``otbflow.ops.head`` says how), a dry run says what the run would do, and the Slurm executor is
given no job whose command line its sbatch call would read as shell syntax (``wrap_refusal``).

No torch, and no otbflow module but ``otbflow.ops.head``, ``otbflow.ops.results_lock`` and
``otbflow.ops.slurm`` (on the standard library and ``otbflow.runtime.process``): the Snakefile
imports this when it is parsed. Snakemake's own modules are imported inside the functions.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from otbflow.ops.head import MARK, Folder, is_gone, this_process
from otbflow.ops.results_lock import FolderHeld, ResultsLock, take_over_elsewhere
from otbflow.ops.slurm import jobname_prefix

# The Slurm executor (snakemake-executor-plugin-slurm 2.x) submits each job's command line inside
# double quotes (sbatch --wrap="..."), run by a shell: there these characters are shell syntax
# even inside the single quotes the command line puts around each path.
WRAP_SYNTAX = "$`\\"


def wrap_refusal(paths: list[str]) -> str | None:
    """Why the Slurm executor cannot be given jobs whose command lines hold these paths (the
    results folder, the config's input paths), or None. Locally every path is quoted."""
    bad = [p for p in paths if any(c in p for c in WRAP_SYNTAX)]
    if not bad:
        return None
    return (
        f"otbflow: {bad[0]!r} holds a character among {' '.join(WRAP_SYNTAX)}: the Slurm executor passes each "
        'job\'s command line (with its input paths) to sbatch inside double quotes (--wrap="..."), where '
        "the shell would read it as syntax. Nothing was run: rename it (it is quoted everywhere else: such a "
        "path runs locally)"
    )


def run_kind(workflow, executor_plugin) -> str | None:
    """ "head" for a run that executes jobs from this process, "dry" for a dry run, "job" for the
    Snakemake that runs one job inside a cluster job, None for the rest (--touch, --nolock, a
    local subprocess)."""
    from snakemake_interface_executor_plugins.settings import ExecMode

    common = executor_plugin.common_settings
    mode = workflow.workflow_settings.exec_mode
    if mode == ExecMode.REMOTE:
        return "job"
    if mode != ExecMode.DEFAULT or common.touch_exec:
        return None
    if common.dryrun_exec:
        return "dry"
    return "head" if workflow.execution_settings.lock else None


def keep_incomplete_markers(workflow) -> None:
    """In the Snakemake of a cluster job: leave the incomplete markers to the head. That Snakemake
    marks its outputs incomplete again when it starts (without the Slurm id the head recorded)
    and unmarks them when it ends, without writing their metadata (the head does, once it has
    seen the job finish). A job that ends after its head died would otherwise leave its outputs
    looking finished, adopted by the next head unseen; with the markers kept, its Slurm id stays
    readable while it runs, and what no head saw finish is redone."""
    prepare = workflow._prepare_dag

    def prepare_keeping_markers(*args, **kwargs):
        out = prepare(*args, **kwargs)
        persistence = workflow.persistence
        persistence._mark_incomplete = lambda key, external_jobid: None
        persistence._unmark_incomplete = lambda key: None
        return out

    workflow._prepare_dag = prepare_keeping_markers


def guard(workflow, results_dir: str, job_paths: list[str] | tuple[str, ...] = ()) -> None:
    """Make ``workflow`` (the Snakefile's ``workflow``) hold its results folder while it executes,
    and take over from a killed head.

    Wraps ``workflow.execute``: Snakemake reads the folder's locks and incomplete markers there,
    after the Snakefile has been parsed, and only there is it known whether jobs will run (a dry
    run, --touch and a job's own Snakemake parse the same Snakefile). A real run takes the results
    folder's lock (``ResultsLock``) before anything else, and is refused there while another head
    holds it; it frees it when Snakemake returns. A dry run changes nothing and writes nothing: it
    says who holds the results folder, and plans the incomplete outputs as redone where no
    recorded head is alive, as the run would. Also names the Slurm executor's stage jobs
    ``otbflow-<hash>_<run uuid>`` (unless a prefix is set), leaves the incomplete markers to the
    head in a cluster job's own Snakemake (``keep_incomplete_markers``), and makes ``snakemake
    --unlock`` forget the recorded heads and free the results folder held from this working folder.
    Under the Slurm executor, a run whose results folder or ``job_paths`` (the config's input
    paths) its sbatch call would read as shell syntax is refused (``wrap_refusal``)."""
    from snakemake.exceptions import WorkflowError
    from snakemake.logging import logger

    execute, unlock = workflow.execute, workflow.unlock
    prefix = jobname_prefix(results_dir)

    def guarded_execute(*args, **kwargs):
        plugin = kwargs.get("executor_plugin", args[0] if args else None)
        settings = kwargs.get("executor_settings", args[1] if len(args) > 1 else None)
        kind = run_kind(workflow, plugin) if plugin is not None else None
        if kind is None:
            return execute(*args, **kwargs)
        if kind == "job":
            keep_incomplete_markers(workflow)
            return execute(*args, **kwargs)
        folder = Folder(Path(".snakemake").resolve())
        workdir = str(folder.root.parent)
        lock = ResultsLock(results_dir)
        if getattr(settings, "pass_command_as_script", True) is False:  # the Slurm executor's sbatch --wrap
            if refusal := wrap_refusal([str(lock.folder), *map(str, job_paths)]):
                raise WorkflowError(refusal)
        if kind == "dry":
            me = this_process(workdir=workdir)
            if (holder := lock.holder_at(lock.path)) is not None and holder.id != me.id:
                gone = is_gone(holder, me)
                if not gone:
                    logger.info(lock.refusal(holder, gone, outcome="a real run here is refused while it holds it"))
                elif holder.workdir and holder.workdir != workdir:
                    logger.info(
                        f"otbflow: the head {holder.describe()} that held {lock.folder} from {holder.workdir} is "
                        "gone: a real run takes the folder over and redoes the outputs it left unfinished"
                    )
            if not folder.alive(me, logger.info):
                workflow.dag_settings.force_incomplete = True
            return execute(*args, **kwargs)
        named = None
        if settings is not None and hasattr(settings, "jobname_prefix"):  # the Slurm executor
            settings.jobname_prefix = settings.jobname_prefix or prefix
            named = settings.jobname_prefix
        me = this_process(named, argv=sys.argv, workdir=workdir)
        try:
            gone = lock.acquire(me, logger.info)
        except FolderHeld as e:
            raise WorkflowError(str(e)) from None
        try:
            if gone is not None and gone.workdir and gone.workdir != workdir:
                take_over_elsewhere(gone, lock, me, logger.info)
            if folder.take_over(me, logger.info):
                workflow.dag_settings.force_incomplete = True
            os.environ[MARK] = me.id
            try:
                return execute(*args, **kwargs)
            finally:
                folder.forget(me)
        finally:
            lock.release(me)

    def guarded_unlock(*args, **kwargs):
        out = unlock(*args, **kwargs)
        folder = Folder(Path(".snakemake").resolve())
        folder.forget_all()
        lock = ResultsLock(results_dir)
        if (holder := lock.holder_at(lock.path)) is not None:
            if holder.workdir in ("", str(folder.root.parent)):
                lock.path.unlink(missing_ok=True)
                logger.info(f"otbflow: freed the results folder {lock.folder} (held by the head {holder.describe()})")
            else:
                logger.info(
                    f"otbflow: the results folder {lock.folder} is held from another working folder, "
                    f"{holder.workdir} (the head {holder.describe()}): unlock it there"
                )
        return out

    workflow.execute = guarded_execute
    workflow.unlock = guarded_unlock
