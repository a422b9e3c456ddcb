"""torch's backend autoload for comm-collectives: `import torch` registers the "comm" backend.

The wheel installs this file as the top-level module `comm_collectives_autoload` (pyproject's
wheel.packages), a name no other project uses, and the `torch.backends` entry point names it.
It must not live inside `comm`: Jupyter's PyPI package is also imported as `comm` (ipykernel
depends on it), and where that one has replaced ours, an entry point inside `comm` fails to
import and torch's autoload turns that into "Failed to load the backend extension", so
`import torch` itself fails. Here a foreign `comm` costs one warning and nothing else.

This folder holds only this file: the editable install puts the folder on sys.path.
"""
from __future__ import annotations

import warnings

FIX = ("install comm-collectives into its own virtual environment (python3 -m venv .venv), "
       "without Jupyter's `comm` package (a dependency of ipykernel), which has the same import name")


def foreign_comm() -> str | None:
    """None when `import comm` gives this library, else what it gives and how to fix that."""
    try:
        import comm
    except Exception as e:  # noqa: BLE001  (whatever a broken or foreign package raises)
        return f"`import comm` failed ({type(e).__name__}: {e}); {FIX}"
    if getattr(comm, "DISTRIBUTION", None) != "comm-collectives":
        where = getattr(comm, "__file__", None) or list(getattr(comm, "__path__", []))
        return f"`import comm` gives another package of that name ({where}), not comm-collectives; {FIX}"
    return None


def register() -> None:
    """Entry point of torch's `torch.backends` group, called at `import torch`. It never raises:
    torch would fail its own import over it."""
    problem = foreign_comm()
    if problem is not None:
        warnings.warn(f'torch backend "comm" not registered: {problem}', RuntimeWarning, stacklevel=2)
        return
    try:
        # The package registers the backend as its import ends. Where its own import is what
        # started `import torch` (it imports torch before any module of its own), this finds it
        # mid-import, does nothing, and the package registers once torch is imported.
        import comm.torch  # noqa: F401
    except Exception as e:  # noqa: BLE001
        warnings.warn(f'torch backend "comm" not registered: importing comm.torch failed '
                      f"({type(e).__name__}: {e})", RuntimeWarning, stacklevel=2)
