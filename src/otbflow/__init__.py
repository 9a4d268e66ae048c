"""otbflow: an HPC batch pipeline for RL of language models with variance-reduced baselines."""

import os as _os
import time as _time

__version__ = "0.1.0"

STARTED_AT = _time.time()
"""When this process first imported otbflow (the first thing ``python -m otbflow`` and the ``otbflow``
script do): a stage job's start stamp, logged with its start-up time (otbflow.cli)."""

PARENT_AT_START = _os.getppid()
"""This process's parent at that moment: for a stage job, the job (its shell), to which the CLI ties
the stage (otbflow.io.bind_to_job) once it has started."""

PRELOAD_CLIENT: int | None = None
"""In a job that the preload server runs (``otbflow.ops.preload``), the pid of the job's client: the
process that stands for the job in its shell, and whose parent ``PARENT_AT_START`` then is."""
