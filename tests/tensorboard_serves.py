"""The docs' ``tensorboard --logdir results/tensorboard``, run for a moment: starts it on a free
port, waits until it serves the curves of a finished run (a train job's loss, an evaluation's
greedy accuracy), prints what it serves and stops it. tests/test_docs_commands.py runs it.

    python tests/tensorboard_serves.py results/tensorboard
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
import urllib.request

WANT = {"train/iter_0": "train/loss", "evaluate/initial": "evaluate/greedy_accuracy"}


def main(logdir: str, timeout: float = 120.0) -> int:
    proc = subprocess.Popen(
        ["tensorboard", "--logdir", logdir, "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    deadline = time.time() + timeout
    try:
        url = None
        while url is None and time.time() < deadline and proc.poll() is None:
            url = next((m.group(1) for line in list(lines) if (m := re.search(r"(http://\S+?:\d+/)", line))), None)
            time.sleep(0.2)
        if url is None:
            print("tensorboard did not start:\n" + "".join(lines), file=sys.stderr)
            return 1
        tags: dict = {}
        while time.time() < deadline:  # it loads the event files in the background
            tags = json.load(urllib.request.urlopen(url + "data/plugin/scalars/tags", timeout=10))
            if all(tag in tags.get(run, {}) for run, tag in WANT.items()):
                print(f"{url} serves {len(tags)} runs: " + ", ".join(f"{r} ({len(t)} curves)" for r, t in tags.items()))
                return 0
            time.sleep(1)
        print(f"{url} served {json.dumps(tags)[:2000]}, without {WANT}", file=sys.stderr)
        return 1
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
