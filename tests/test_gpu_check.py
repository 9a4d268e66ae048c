"""The GPU check's parts on the CPU (benchmarks/gpu/check.sh, to come): the bench_iteration settings it asks for."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))


def run(*args: str) -> subprocess.CompletedProcess:
    res = subprocess.run(
        [sys.executable, *args], cwd=REPO, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return res


def test_list_settings_names_what_check_sh_runs():
    from bench_iteration import SETTINGS

    listed = run("benchmarks/bench_iteration.py", "--list-settings").stdout.split()
    assert listed == list(SETTINGS) and {"grpo_s0", "grpo_s1"} <= set(listed)
