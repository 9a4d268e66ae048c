"""One head per results folder: a real run holds ``<results_dir>/.otbflow-head.json`` (its
record, with its working folder) from before its first job until Snakemake returns
(``ResultsLock``). Another head on the same results folder, from this working folder or any other,
is refused before it touches anything, naming the holder; a gone holder's lock is taken over (gone
as ``otbflow.ops.head`` tells), and when it ran from another working folder its jobs are stopped
and the outputs it had not seen finish (its ``.snakemake/incomplete/`` there) are removed so that
they are redone (``take_over_elsewhere``).

No torch, and no otbflow module but ``otbflow.ops.head`` and ``otbflow.ops.slurm`` (on the standard
library and ``otbflow.runtime.process``): the Snakefile imports this when it is parsed.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path

from otbflow.ops.head import Head, is_gone, stop_jobs
from otbflow.ops.slurm import HeadError, Log, incomplete_outputs

LOCK = ".otbflow-head.json"  # in the results folder: the head that holds it


class FolderHeld(HeadError):
    """Another head holds the results folder (it runs, or cannot be told gone)."""


class ResultsLock:
    """One head per results folder: ``<results>/.otbflow-head.json`` holds the record of the head
    that runs on it (whatever its working folder). Created whole in one step (a hard link of a
    written file: never half-written, and only one of two heads creates it); taken over only from a
    holder that ``is_gone``, as the records of ``Folder`` are."""

    def __init__(self, results_dir: str | Path):
        self.folder = Path(results_dir).resolve()
        self.path = self.folder / LOCK

    def holder(self) -> Head | None:
        """The head that holds the folder, None when none does."""
        try:
            return Head(**json.loads(self.path.read_text()))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError) as e:
            raise HeadError(f"the lock {self.path} cannot be read ({e}): remove it once no head runs there") from e

    def refusal(self, holder: Head, gone: bool | None, outcome: str = "nothing was run") -> str:
        """Who holds the folder, and how to free it."""
        how = "runs" if gone is False else "may still run (it cannot be asked from here)"
        where = f" from the working folder {holder.workdir}" if holder.workdir else ""
        return (
            f"otbflow: the results folder {self.folder} is held by the head {holder.describe()}{where}, "
            f"which {how}: one head per results folder, {outcome}. Wait for it to end, or stop it; "
            f"if it is gone, `snakemake --unlock` in its working folder (or removing {self.path}) frees the folder"
        )

    def acquire(self, me: Head, log: Log) -> Head | None:
        """Hold the folder for ``me``; returns the gone holder it was taken over from (None when it
        was free). FolderHeld, having written nothing, when another head holds it and is not gone."""
        taken: Head | None = None
        for _ in range(100):  # another turn when the lock was released or taken over meanwhile
            holder = self.holder()
            if holder is None:
                self.folder.mkdir(parents=True, exist_ok=True)
                tmp = self.folder / f"{LOCK}.{me.id}.tmp"
                tmp.write_text(json.dumps(asdict(me), indent=1))
                try:
                    os.link(tmp, self.path)
                    return taken
                except FileExistsError:
                    continue
                finally:
                    tmp.unlink(missing_ok=True)
            if holder.id == me.id:
                return taken
            gone = is_gone(holder, me)
            if not gone:
                raise FolderHeld(self.refusal(holder, gone))
            log(f"otbflow: the head {holder.describe()} that held {self.folder} is gone: the folder is taken over")
            stale = self.folder / f"{LOCK}.{me.id}.gone"
            try:
                os.rename(self.path, stale)
            except FileNotFoundError:
                continue
            moved = self.holder_at(stale)
            if moved is not None and moved.id != holder.id:  # another head's, taken over meanwhile: put back
                try:
                    os.link(stale, self.path)
                except FileExistsError:
                    pass
            else:
                taken = holder
            stale.unlink(missing_ok=True)
        raise HeadError(f"the lock {self.path} changed hands 100 times while this head tried to take it")

    @staticmethod
    def holder_at(path: Path) -> Head | None:
        try:
            return Head(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def release(self, me: Head) -> None:
        """Free the folder, if ``me`` holds it."""
        holder = self.holder_at(self.path)
        if holder is not None and holder.id == me.id:
            self.path.unlink(missing_ok=True)


def take_over_elsewhere(gone: Head, lock: ResultsLock, me: Head, log: Log) -> None:
    """The results folder was held by a head, now gone, of another working folder: stop its jobs
    (``stop_jobs``, with its folder's incomplete markers) and remove the outputs under the results
    folder that it had not seen finish, so that this head redoes them instead of taking a
    half-written file for a finished one. HeadError when its working folder cannot be read."""
    snakemake_dir = Path(gone.workdir) / ".snakemake"
    if not snakemake_dir.is_dir():
        raise HeadError(
            f"the head {gone.describe()} that held {lock.folder} is gone, but its working folder "
            f"{gone.workdir} has no .snakemake to say which outputs it left unfinished: run the same command "
            f"there, or remove what it was writing and {lock.path}"
        )
    log(f"otbflow: it ran from {gone.workdir}: its jobs are stopped, the outputs it left unfinished redone")
    stop_jobs([gone], snakemake_dir, me, log)
    for name in incomplete_outputs(snakemake_dir):
        path = Path(gone.workdir, name).resolve()
        if path.is_relative_to(lock.folder) and path != lock.path and (path.exists() or path.is_symlink()):
            log(f"otbflow: removing {path} (left unfinished)")
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
