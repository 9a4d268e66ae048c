"""Run under torchrun by tests/test_train.py: several train-stage runs in one 2-process group
(one process start for all loss-aggregation modes). argv[1] is a JSON list of jobs, each with
``config`` (a YAML file) and the fields of ``otbflow.stages.train.Args``."""

import json
import logging
import sys

from otbflow.config import load_config
from otbflow.stages import train

logging.basicConfig(level=logging.INFO)  # the train stage's lines (ZeRO-3's partitioned load) on stderr

for job in json.loads(open(sys.argv[1]).read()):
    cfg = load_config(job.pop("config"))
    train.run(cfg, train.Args(**job))
