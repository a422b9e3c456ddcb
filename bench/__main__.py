"""`python -m bench`: see bench/__init__.py and `python -m bench --help`."""
import importlib.util
import sys

if importlib.util.find_spec("comm_collectives_autoload"):   # installed: is `import comm` still ours?
    from comm_collectives_autoload import foreign_comm
    if foreign_comm():
        sys.exit(f"python -m bench: {foreign_comm()}")

from bench.cli import main  # noqa: E402  (after the check: a foreign comm fails this import)

sys.exit(main())
