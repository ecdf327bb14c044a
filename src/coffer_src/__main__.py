"""`python -m coffer_src`: the command line, run from the sources (users run the generated coffer.py)."""

import sys

from coffer_src.cli import main

sys.exit(main())
