"""What a process is, read from Linux's /proc: the boot it belongs to, its state, parent and start
(a pid and start time name one process of one boot, against pid reuse), and its tie to its parent.
The one home of these facts: the Slurm head, the worker dispatch and the job binding all ask here.
Standard library only (the Snakefile and the import-light client import it)."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

HEARTBEAT_S = 1.0
"""How often a worker touches its heartbeat, and a client its own."""
STALE_S = 10.0
"""A heartbeat older than this is a gone process (a worker, or a client on another host)."""


def boot_id() -> str:
    """This machine's boot (/proc/sys/kernel/random/boot_id); '' where there is none."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def process_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start in clock ticks after boot) of a process; None when there is none."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) ": fields 3, 4, ...
    return fields[0], int(fields[1]), int(fields[19])


def process_start(pid: int) -> int | None:
    """The start of process ``pid`` in clock ticks after boot; None when there is none, or only its
    zombie."""
    stat = process_stat(pid)
    return None if stat is None or stat[0] in "ZX" else stat[2]


def me() -> dict:
    """This process: host, pid, start, boot (what tells it gone)."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": process_start(os.getpid()), "boot": boot_id()}


def here(record: dict) -> bool:
    """Whether the process of ``record`` (``me()``'s keys) ran on this host since its last boot."""
    return record.get("host") == socket.gethostname() and record.get("boot") == boot_id()


def die_with_parent() -> None:
    """On Linux, have the kernel end this process with its parent (``prctl(PR_SET_PDEATHSIG)``,
    SIGKILL); kept across ``execv``. Nothing where there is no prctl."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def modified(path: Path) -> float | None:
    """The modification time of the file ``path`` (None: none there), read from a descriptor of
    it: opening a file on a shared filesystem (NFS) fetches its attributes anew (close-to-open),
    where a plain stat may answer from a cache up to a minute old."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        return os.fstat(fd).st_mtime
    finally:
        os.close(fd)


def alive(record: dict, heartbeat: Path, by_pid_here: bool = False) -> bool:
    """Whether the process of ``record`` (``me()``'s keys) runs: on this host and boot by its pid
    and start; elsewhere by its heartbeat file being fresher than ``STALE_S``. A process found here
    must also have a fresh heartbeat (one that stopped beating is hung), but with ``by_pid_here``:
    a slow process on a loaded machine is still waited for."""
    if here(record):
        if process_start(int(record["pid"])) != record.get("start"):
            return False
        if by_pid_here:
            return True
    beat = modified(heartbeat)
    return beat is not None and time.time() - beat < STALE_S
