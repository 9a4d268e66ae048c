"""What a benchmark ran on and how it was started, for its JSON (shared by the benchmarks; this folder
is on ``sys.path`` when one of them runs as a script)."""

from __future__ import annotations

import os
import platform
import shlex
import sys
from datetime import datetime
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name, with its family and model where /proc/cpuinfo gives them (one name,
    such as 'AMD EPYC', covers several generations)."""
    info = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if not line.strip():
            break  # the first processor's block
        key, _, value = line.partition(":")
        info[key.strip()] = value.strip()
    name = info.get("model name") or platform.processor()
    if "cpu family" in info and "model" in info:
        name += f" (family {info['cpu family']}, model {info['model']})"
    return name


def run_record() -> dict:
    """The command (as typed: ``python`` and the script's path from the checkout's root), the date,
    and the machine: CPU, cores, GPU (``torch.cuda.get_device_name``; None without CUDA), torch,
    CUDA and transformers versions."""
    import torch
    import transformers

    script = Path(sys.argv[0]).resolve()
    try:
        script = script.relative_to(Path(__file__).resolve().parents[1])
    except ValueError:
        pass
    cuda = torch.cuda.is_available()
    return {
        "command": shlex.join(["python", str(script), *sys.argv[1:]]),
        "date": datetime.now().isoformat(timespec="seconds"),
        "machine": {
            "cpu": cpu_model(),
            "cores": os.cpu_count(),
            "gpu": torch.cuda.get_device_name(0) if cuda else None,
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda if cuda else None,
            "transformers": transformers.__version__,
        },
    }
