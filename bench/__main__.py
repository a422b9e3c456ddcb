"""`python -m bench`: see bench/__init__.py and `python -m bench --help`."""
import sys

from bench.cli import main

sys.exit(main())
