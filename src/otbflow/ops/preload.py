"""Local stage jobs forked from a process that has already imported what they import (the preload server).

A small CPU stage job spends more of its time importing torch, transformers, DeepSpeed and otbflow
than working: the tiny run, each job in its own process, takes 2-3 times the CPU time it takes
preloaded (docs/measurements.md, "Preloaded stage jobs: the tiny run"). So ``python -m otbflow STAGE
...`` (every rule's command, and the worker client's fallback) first asks the preload server of its
interpreter, import path, environment and place (namespaces, cgroup, limits) to run it:

- the server, which imported all of it once, forks; the child takes the job's working folder,
  environment, ``sys.path``, arguments and standard streams (passed over a Unix socket) and runs
  ``otbflow.__main__`` as ``python -m otbflow`` would, in a process group of its own;
- the client (the job's own process) waits, relays the signals it gets to the child's group and ends
  as the child did (its exit status; killed by a signal, by the same signal).

With no server, the job runs in its own process, as before; the second job of a key within
``WINDOW_S`` starts its server in the background and waits for it to serve, as do the jobs that come
while it starts (its imports are paid once, not by each of them). A server exits after
``IDLE_S`` without a job, or once a source file it imported changes (the jobs after it run in their
own processes until a new server has loaded the new code).

The same outputs: the server only imports (no torch operation runs in it, so no thread pool is
forked half-made), and the child is the process a fresh ``python -m otbflow`` would be after its
imports (tests/test_preload.py compares the tiny run's fingerprints with and without). The ties to
the job hold (``otbflow.io.bind_to_job``): the client dies with the job's shell; its connection
closing makes the server kill the child's group at once, and the child publishes nothing once its
client or its shell has ended; a child dies with its server.

Where it is off, every job runs in its own process: ``OTBFLOW_PRELOAD=0``; inside a Slurm job (its
processes stay in the job's cgroup, limits and accounting); under torchrun (the ranks of a job of
several processes); on a host with a GPU (a CUDA driver that a preloaded module initialised cannot
be used in a forked child). The sockets and the servers' logs live in ``OTBFLOW_PRELOAD_DIR`` (by
default ``$XDG_RUNTIME_DIR/otbflow-preload``, or ``/tmp/otbflow-preload-<uid>``), a folder only its
owner can enter; a server serves its owner only.

The client imports no torch and no otbflow module but this one and ``otbflow.ops.dispatch``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import struct
import sys
import time
from pathlib import Path

IDLE_S = 120.0
"""A server with no job for this long exits (``OTBFLOW_PRELOAD_IDLE_S`` where the job that starts it has it)."""
WINDOW_S = 120.0
"""A key's second job within this long of its first starts its server."""
START_S = 10.0
"""How long a server waits for a connected client's request."""
READY_S = 60.0
"""How long a job waits for a server of its key that is starting (its imports) before it runs itself."""
PRELOADED = ("torch", "transformers", "deepspeed", "vllm.entrypoints.llm", "otbflow.cli")
"""What a server imports before it serves, where its environment has it (DeepSpeed in .venv, vLLM
in .venv-vllm, whose import is much of a small vLLM job's start-up), and every stage's module, the
modeling module of every architecture of otbflow.models.architectures.ARCHITECTURES, and matplotlib's pyplot on
the backend the stages that plot use (``otbflow.io.pyplot``; its import is much of a small plotting
job's start-up)."""
PER_JOB_ENV = ("OTBFLOW_", "SNAKEMAKE", "PYTEST_", "PWD", "OLDPWD", "SHLVL", "_", "PATH", "PYTHONPATH")
PER_JOB_ENV += ("TMPDIR", "TEMP", "TMP", "TEMPDIR", "MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")
PER_JOB_ENV += ("PYTORCH_NVML_BASED_CUDA_CHECK", "TORCHINDUCTOR_CACHE_DIR")
"""Environment variables (names, or prefixes ending in ``_``/``SNAKEMAKE``) that differ between
jobs and are read when a job runs, never at import (the temporary folder is looked up again in the
child; PYTHONPATH is in the key as the import path): a job's own values reach its child; the
server's key leaves them out (every other variable selects a server of its own: the thread counts
Snakemake sets per job, OMP_NUM_THREADS..., are read when a library loads). Among them: make's
own (a run started by ``make run``), and two that a process sets for itself once it has imported
DeepSpeed (``PYTORCH_NVML_BASED_CUDA_CHECK``) or used inductor (``TORCHINDUCTOR_CACHE_DIR``), which
the jobs it starts inherit (a worker's, a test's); torch reads them when it looks for a GPU or
compiles."""
GPU_DEVICES = ("/dev/nvidiactl", "/dev/kfd")
RELAYED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
CHILD = False
"""True in a job the server forked: its ``python -m otbflow`` runs the CLI, never a client."""


# ------------------------------------------------------------------------------------------
# Where, and for which jobs
# ------------------------------------------------------------------------------------------


def directory(create: bool = False) -> Path | None:
    """The sockets' folder, made (mode 0700) when ``create``; None when it is not this user's alone."""
    if path := os.environ.get("OTBFLOW_PRELOAD_DIR"):
        base = Path(path)
    elif runtime := os.environ.get("XDG_RUNTIME_DIR"):
        base = Path(runtime) / "otbflow-preload"
    else:
        base = Path("/tmp") / f"otbflow-preload-{os.getuid()}"
    if create:
        try:
            base.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError:
            return None
    try:
        st = base.lstat()
    except OSError:
        return None
    if not base.is_dir() or base.is_symlink() or st.st_uid != os.getuid() or st.st_mode & 0o077:
        return None
    return base


def per_job(name: str) -> bool:
    return any(name.startswith(p) if p.endswith(("_", "SNAKEMAKE")) else name == p for p in PER_JOB_ENV)


def server_key(env: dict[str, str], path: list[str], executable: str, place: list | None = None) -> str:
    """The server a job may use: its interpreter, its import path (less the working folder, which
    ``python -m`` puts first; each folder by its real path, once), its environment, less the
    per-job variables, and where the process is (``place``, by default this process's)."""
    return hashlib.sha256(json.dumps(key_parts(env, path, executable, place)).encode()).hexdigest()[:24]


def key_parts(env: dict[str, str], path: list[str], executable: str, place: list | None = None) -> list:
    kept = sorted((k, v) for k, v in env.items() if not per_job(k))
    folders = list(dict.fromkeys(os.path.realpath(p) for p in path[1:]))
    return [executable, folders, kept, this_place() if place is None else place]


def about(parts: list) -> dict:
    """A key's parts as a server's ``KEY.about`` shows them (the environment's values and the place
    by digest): two servers' files say which variable set them apart."""

    def digest(value) -> str:
        return hashlib.sha256(json.dumps(value).encode()).hexdigest()[:12]

    executable, folders, kept, place = parts
    return {"executable": executable, "path": folders, "env": {k: digest(v) for k, v in kept}, "place": digest(place)}


def this_place() -> list:
    """What a forked child keeps of its server, not of its job: the namespaces (a job under
    ``unshare`` sees other mounts), the cgroup, the resource limits and the priority. A job whose
    place differs uses (and starts) a server of its own place."""
    import resource

    spaces = []
    for ns in ("mnt", "user", "pid", "net", "ipc", "uts", "cgroup"):
        try:
            spaces.append(os.readlink(f"/proc/self/ns/{ns}"))
        except OSError:
            spaces.append("")
    try:
        cgroup = Path("/proc/self/cgroup").read_text()
    except OSError:
        cgroup = ""
    limits = [resource.getrlimit(getattr(resource, n)) for n in dir(resource) if n.startswith("RLIMIT_")]
    return [spaces, cgroup, limits, os.getpriority(os.PRIO_PROCESS, 0)]


def usable(argv: list[str], env: dict[str, str] | None = None) -> bool:
    """Whether a job of these arguments may ask a server (module docstring: where it is off)."""
    env = os.environ if env is None else env
    return (
        not CHILD
        and sys.platform == "linux"
        and hasattr(os, "pidfd_open")
        and sys.orig_argv[1:3] == ["-m", "otbflow"]  # no interpreter options (-X, -u, -O...)
        and bool(argv)
        and not argv[0].startswith("-")
        and env.get("OTBFLOW_PRELOAD", "1") != "0"
        and "SLURM_JOB_ID" not in env
        and "TORCHELASTIC_RUN_ID" not in env
        and not any(os.path.exists(p) for p in GPU_DEVICES)
    )


def is_stage(command: str) -> bool:
    """A stage's command (the server checks it against the stage table): a module of otbflow.stages."""
    return (Path(__file__).resolve().parents[1] / "stages" / f"{command.replace('-', '_')}.py").is_file()


# ------------------------------------------------------------------------------------------
# The client: the job's own process
# ------------------------------------------------------------------------------------------


def run(argv: list[str]) -> int | None:
    """``python -m otbflow ARGV``: the job's exit status once a server ran it; None where none did
    (the caller runs the job itself)."""
    if not usable(argv) or not is_stage(argv[0]) or (base := directory(create=True)) is None:
        return None
    key = server_key(dict(os.environ), sys.path, sys.executable)
    conn = connect(base, key)
    if conn is None and start_server(base, key):
        conn = wait_for_server(base, key)
    if conn is None:
        return None
    import otbflow
    from otbflow.runtime.process import die_with_parent

    die_with_parent()  # the job's shell killed: this client with it, and the server kills the child
    request = {
        "key": key,
        "argv": argv,
        "cwd": os.getcwd(),
        "env": dict(os.environ),
        "path": sys.path,
        "shell": os.getppid(),
        "client": os.getpid(),
        "started": otbflow.STARTED_AT,
        "umask": umask(),
        "cpus": sorted(os.sched_getaffinity(0)),
    }
    with conn:
        try:
            socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
            replies = conn.makefile("rb")
            first = json.loads(replies.readline() or b"{}")
        except (OSError, ValueError):
            return None  # the server went away before it took the job
        if "pid" not in first:
            return None  # refused (its sources changed, another key): the job runs here

        def relay(signum, frame):
            try:
                conn.sendall(json.dumps({"signal": signum}).encode() + b"\n")
            except OSError:
                pass

        for name in RELAYED:
            signal.signal(getattr(signal, name), relay)
        try:
            last = json.loads(replies.readline() or b"{}")
        except (OSError, ValueError):
            last = {}
    if "exit" in last:
        return int(last["exit"])
    if "signal" in last:  # the job's end by a signal is this process's (SIGKILL has no handler to reset)
        if last["signal"] not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(last["signal"], signal.SIG_DFL)
        os.kill(os.getpid(), last["signal"])
        return 128 + last["signal"]
    print(f"otbflow: the preload server ended before the job did (its log: {base / key}.log)", file=sys.stderr)
    return 1


def connect(base: Path, key: str) -> socket.socket | None:
    """A connection to the server of ``key``, or None where none serves."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with address(base / f"{key}.sock") as where:
            conn.connect(where)
    except OSError:
        conn.close()
        return None
    return conn


def wait_for_server(base: Path, key: str) -> socket.socket | None:
    """A connection to the server of ``key`` once it serves, while it is starting (its ``KEY.starting``
    mark, at most READY_S old): the job waits about as long as its own imports would take, and they
    are paid once. None where it did not come (the job runs itself)."""
    while True:
        fresh = younger(base / f"{key}.starting", READY_S)  # gone: it serves now, or it failed
        conn = connect(base, key)
        if conn is not None or not fresh:
            return conn
        time.sleep(0.05)


def younger(path: Path, seconds: float) -> bool:
    """Whether ``path`` exists and was modified less than ``seconds`` ago."""
    try:
        return time.time() - path.stat().st_mtime < seconds
    except OSError:
        return False


@contextlib.contextmanager
def address(path: Path):
    """A Unix socket's address for ``path``: the path, or where it is too long for one (108 bytes),
    the path through a descriptor of its folder (``/proc/self/fd/N/NAME``), open meanwhile."""
    if len(os.fsencode(path)) < 100:
        yield str(path)
        return
    fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)


def umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def start_server(base: Path, key: str) -> bool:
    """Start the server of this key in the background (in a session of its own, its output in its
    log) for the second job of the key within WINDOW_S, unless one holds its lock (it is starting, or
    exiting). The first job only leaves its mark (``KEY.seen``): a key asked for once (a rerun of
    one stage, a job in a namespace of its own) never pays a server's imports. Whether a server of
    the key is starting (``KEY.starting``, made here and removed by the server once it serves or
    gives up): a job that finds one waits for it (``wait_for_server``)."""
    import fcntl
    import subprocess

    starting = base / f"{key}.starting"
    if younger(starting, READY_S):
        return True
    with contextlib.suppress(OSError):
        starting.unlink()  # a server that died while it started
    seen = base / f"{key}.seen"
    if not younger(seen, WINDOW_S):
        seen.touch()
        return False
    try:
        with open(base / f"{key}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    starting.touch()
    with contextlib.suppress(OSError):
        text = json.dumps(about(key_parts(dict(os.environ), sys.path, sys.executable)), indent=1)
        (base / f"{key}.about").write_text(text)
    # the first job's environment, less what marks a job (the head's mark: otbflow.ops.head)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTBFLOW_", "SNAKEMAKE", "PYTEST_"))}
    with open(base / f"{key}.log", "ab") as log:
        subprocess.Popen(
            [sys.executable, "-m", "otbflow.ops.preload", str(base), key, os.environ.get("OTBFLOW_PRELOAD_IDLE_S", "")],
            cwd=os.getcwd(),  # where the import path's relative entries are (the key resolved them here)
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
        )
    return True


def stop(base: Path) -> None:
    """End every server whose record is in ``base`` (SIGTERM): the test suite's at its end."""
    for record in base.glob("*.json"):
        try:
            os.kill(json.loads(record.read_text())["pid"], signal.SIGTERM)
        except (OSError, ValueError, KeyError):
            pass


# ------------------------------------------------------------------------------------------
# The server
# ------------------------------------------------------------------------------------------


def preload() -> None:
    import importlib

    for name in PRELOADED:
        try:
            importlib.import_module(name)
        except ImportError:  # not in this environment (DeepSpeed in vLLM's, vLLM in .venv)
            pass
    from otbflow.models.architectures import ARCHITECTURES
    from otbflow.pipeline import STAGES

    for stage in STAGES.values():
        importlib.import_module(stage.module)
    for arch in ARCHITECTURES:
        try:
            importlib.import_module(f"transformers.models.{arch}.modeling_{arch}")
        except ImportError:
            pass
    try:
        from otbflow.io import pyplot

        pyplot()  # the report, scaling, variance and experiment stages plot
    except ImportError:  # no matplotlib (vLLM's environment)
        pass


def sources() -> dict[str, tuple[int, int]]:
    """What a server's imports were read from: otbflow's modules (mtime, size) and the import
    path's folders (mtime: a package installed or removed changes its folder)."""
    out = {}
    files = [getattr(m, "__file__", None) for name, m in list(sys.modules.items()) if name.split(".")[0] == "otbflow"]
    for path in [*filter(None, files), *(p for p in sys.path[1:] if p)]:
        try:
            st = os.stat(path)
            out[path] = (st.st_mtime_ns, st.st_size)
        except OSError:
            out[path] = (-1, -1)
    return out


def peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def read_request(conn: socket.socket) -> tuple[dict, list[int]]:
    conn.settimeout(START_S)
    data, fds = b"", []
    while not data.endswith(b"\n"):
        chunk, got, _, _ = socket.recv_fds(conn, 1 << 16, 3)
        if not chunk:
            raise ConnectionError("the client left before its request")
        data += chunk
        fds += got
    conn.settimeout(None)
    return json.loads(data), fds


def child(request: dict, fds: list[int], keep: list) -> None:
    """In the forked child: become the job, run ``python -m otbflow``, exit with its status."""
    global CHILD
    import atexit
    import runpy
    import tempfile
    import threading
    import traceback

    import otbflow
    from otbflow.runtime.process import die_with_parent

    CHILD = True
    code = 1
    try:
        os.setpgid(0, 0)
        die_with_parent()  # a child of a killed server dies with it
        for name in (*RELAYED, "SIGCHLD"):
            signal.signal(getattr(signal, name), signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for thing in keep:  # the server's: its listener, lock, the other jobs' connections and pidfds
            os.close(thing) if isinstance(thing, int) else thing.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.umask(request["umask"])
        os.sched_setaffinity(0, request["cpus"])
        os.environ.clear()
        os.environ.update(request["env"])
        tempfile.tempdir = None  # looked up again, in the job's environment
        sys.path[:] = request["path"]
        otbflow.PARENT_AT_START, otbflow.PRELOAD_CLIENT = request["shell"], request["client"]
        otbflow.STARTED_AT = request["started"]
        sys.argv = ["otbflow", *request["argv"]]
        try:
            runpy.run_module("otbflow", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if e.code is not None and not isinstance(e.code, int):
                print(e.code, file=sys.stderr)
        threading._shutdown()  # what the interpreter's exit does: non-daemon threads, then atexit
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def serve(base: Path, key: str, idle_s: float = IDLE_S) -> int:
    """Serve the jobs of ``key`` until idle for ``idle_s`` (or retired); the ``KEY.starting`` mark of
    the job that started it goes once it serves, or once it gives up."""
    try:
        return _serve(base, key, idle_s)
    finally:
        (base / f"{key}.starting").unlink(missing_ok=True)


def _serve(base: Path, key: str, idle_s: float) -> int:
    import fcntl
    import gc
    import selectors

    lock = open(base / f"{key}.lock", "a")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return 0  # another server of this key runs (or exits)
    if server_key(dict(os.environ), sys.path, sys.executable) != key:
        print(f"preload {key}: this interpreter's key is another one: not serving", flush=True)
        return 1
    from otbflow.pipeline import STAGES

    began = time.monotonic()
    preload()
    loaded, me = sources(), os.getpid()
    print(f"preload {key}: pid {me}, {len(sys.modules)} modules in {time.monotonic() - began:.1f} s", flush=True)
    sock_path = base / f"{key}.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp = base / f".{key}.{me}.sock"
    with address(tmp) as where:
        listener.bind(where)
    listener.listen(64)
    record = base / f"{key}.json"
    record.write_text(json.dumps({"pid": me, "python": sys.executable, "path": sys.path[1:], "started": time.time()}))
    os.replace(tmp, sock_path)  # clients see a socket only once it serves
    (base / f"{key}.starting").unlink(missing_ok=True)  # the jobs waiting for it connect
    gc.freeze()  # the children's collections never walk (and copy) the preloaded objects

    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, ("accept", None))
    children: dict[int, tuple[socket.socket, int]] = {}
    last, serving = time.monotonic(), True

    def retire(why: str) -> None:
        nonlocal serving
        if serving:
            print(f"preload {key}: {why}: no new jobs", flush=True)
            serving = False
            sel.unregister(listener)
            listener.close()
            sock_path.unlink(missing_ok=True)  # this server's: another of its key waits for the lock

    signal.signal(signal.SIGTERM, lambda *_: retire("SIGTERM"))
    while serving or children:
        if serving and not children and time.monotonic() - last > idle_s:
            retire(f"idle {idle_s:g} s")
            continue
        for item, _ in sel.select(timeout=1.0):
            what, pid = item.data
            if what == "accept":
                try:
                    conn, _ = listener.accept()
                except OSError:
                    continue
                try:
                    request, fds = read_request(conn)
                except (OSError, ValueError) as e:
                    print(f"preload {key}: a bad request ({e})", flush=True)
                    conn.close()
                    continue
                refusal = None
                if peer_uid(conn) != os.getuid():
                    refusal = "another user"
                elif request.get("key") != key:
                    refusal = "another key"
                elif not request.get("argv") or request["argv"][0].replace("-", "_") not in STAGES:
                    refusal = "not a stage"
                elif sources() != loaded:
                    refusal = "its sources changed"
                if refusal:
                    for fd in fds:
                        os.close(fd)
                    try:
                        conn.sendall(json.dumps({"refused": refusal}).encode() + b"\n")
                    except OSError:
                        pass
                    conn.close()
                    if refusal == "its sources changed":
                        retire(refusal)
                    continue
                sys.stdout.flush()
                pid = os.fork()
                if pid == 0:
                    child(request, fds, [sel, listener, lock, conn, *(x for pair in children.values() for x in pair)])
                for fd in fds:
                    os.close(fd)
                pidfd = os.pidfd_open(pid)
                children[pid] = (conn, pidfd)
                sel.register(conn, selectors.EVENT_READ, ("client", pid))
                sel.register(pidfd, selectors.EVENT_READ, ("exit", pid))
                try:
                    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
                except OSError:
                    pass
                print(f"preload {key}: {' '.join(request['argv'][:1])} as {pid} for {request['client']}", flush=True)
            elif what == "client":
                conn = children[pid][0]
                try:
                    data = conn.recv(4096)
                except OSError:
                    data = b""
                if not data:  # the client is gone: so is the job
                    sel.unregister(conn)
                    _kill(pid, signal.SIGKILL)
                    continue
                for line in data.splitlines():
                    try:
                        _kill(pid, int(json.loads(line)["signal"]))
                    except (ValueError, KeyError, TypeError):
                        pass
            elif what == "exit":
                conn, pidfd = children.pop(pid)
                sel.unregister(pidfd)
                os.close(pidfd)
                _, status = os.waitpid(pid, 0)
                if os.WIFSIGNALED(status):
                    reply = {"signal": os.WTERMSIG(status)}
                else:
                    reply = {"exit": os.waitstatus_to_exitcode(status)}
                try:
                    conn.sendall(json.dumps(reply).encode() + b"\n")
                except OSError:
                    pass
                try:
                    sel.unregister(conn)
                except (KeyError, ValueError):
                    pass
                conn.close()
                last = time.monotonic()
    record.unlink(missing_ok=True)
    return 0


def _kill(pid: int, sig: int) -> None:
    """The child's process group (the job and what it started), or the child alone before it made one."""
    try:
        os.killpg(pid, sig)
    except OSError:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


if __name__ == "__main__":
    sys.exit(serve(Path(sys.argv[1]), sys.argv[2], float(sys.argv[3] or IDLE_S)))
