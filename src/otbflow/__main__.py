"""``python -m otbflow``. The guard matters: vLLM starts its engine in a spawned process, which
imports this module again as ``__mp_main__`` and must not run the CLI a second time."""

import sys

if __name__ == "__main__":
    from otbflow.ops import preload

    # a stage job: the preload server runs it where one serves this interpreter (otbflow.ops.preload)
    if (code := preload.run(sys.argv[1:])) is not None:
        sys.exit(code)
    import gc

    gc.disable()  # the CLI's own imports too: otbflow.cli.main turns the collector back on
    from otbflow.cli import main

    sys.exit(main())
