"""The policy update: the optimizer steps of one iteration (``trainer``), ranks and the DeepSpeed
engine (``distributed``), what a train job keeps on disk (``state``) and what its throughput is
measured against (``hardware``)."""
