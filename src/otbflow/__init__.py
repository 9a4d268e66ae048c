"""otbflow: an HPC batch pipeline for RL of language models with variance-reduced baselines."""

import time as _time

__version__ = "0.1.0"

STARTED_AT = _time.time()
"""When this process first imported otbflow (the first thing ``python -m otbflow`` and the ``otbflow``
script do): a stage job's start stamp, logged with its start-up time (otbflow.cli)."""
