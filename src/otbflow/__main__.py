"""``python -m otbflow``. The guard matters: vLLM starts its engine in a spawned process, which
imports this module again as ``__mp_main__`` and must not run the CLI a second time."""

import sys

if __name__ == "__main__":
    import gc

    gc.disable()  # the CLI's own imports too: otbflow.cli.main turns the collector back on
    from otbflow.cli import main

    sys.exit(main())
