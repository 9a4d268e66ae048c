"""``python -m otbflow``. The guard matters: vLLM starts its engine in a spawned process, which
imports this module again as ``__mp_main__`` and must not run the CLI a second time."""

import sys

from otbflow.cli import main

if __name__ == "__main__":
    sys.exit(main())
