import sys

from otbflow.cli import main

sys.exit(main())
