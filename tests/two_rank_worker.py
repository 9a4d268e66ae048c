"""Run under torchrun by tests/test_train.py: several train-stage runs in one 2-process group
(one process start for all loss-aggregation modes). argv[1] is a JSON list of jobs, each with
``config`` (a YAML file) and the fields of ``otbflow.stages.train.Args``.

Once every job has written its outputs, both ranks meet, destroy the process group and leave
with os._exit: in 2 of 6 CI runs on 2026-11-26 a rank of this script aborted in C++ teardown at
interpreter exit ("terminate called without an active exception") after its last job had written
everything, which failed the test on an exit code unrelated to the gradients it checks."""

import json
import logging
import os
import sys

import torch.distributed as dist

from otbflow.config import load_config
from otbflow.stages import train

logging.basicConfig(level=logging.INFO)  # the train stage's lines (ZeRO-3's partitioned load) on stderr

for job in json.loads(open(sys.argv[1]).read()):
    cfg = load_config(job.pop("config"))
    train.run(cfg, train.Args(**job))
if dist.is_initialized():
    dist.barrier()
    dist.destroy_process_group()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
