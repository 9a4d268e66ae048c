"""The pipeline's stages, one module each: ``Args`` (inputs and outputs) and ``run(cfg, args)``,
a thin layer over the library modules of ``otbflow``. What each stage reads from the config, its
help and its code version are declared in ``otbflow.pipeline``. No stage imports another."""
