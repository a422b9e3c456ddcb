"""Make installed packages unimportable in this process, as if they were not installed.

    import hide_packages; hide_packages.hide(["mpi4py"])

Every finder on sys.meta_path is wrapped so that it finds nothing for a hidden package or any
of its submodules: `import mpi4py` raises ModuleNotFoundError naming it, and
importlib.util.find_spec("mpi4py") returns None, exactly as on a machine without it. (A finder
that raised instead would make find_spec raise, which no real machine does.) Finders appended
to sys.meta_path later (pytest's assertion rewriter, for its own test files) find test modules
only, never site-packages.

`python tests/hide_packages.py PKG[,PKG...] -m MODULE ARGS...` runs a module (pytest, bench)
with those packages hidden, in its child processes too (rank processes, mpirun's and torchrun's
ranks): they inherit HIDE_PACKAGES and a PYTHONPATH entry whose sitecustomize hides them at start.
"""
from __future__ import annotations

import atexit
import os
import runpy
import shutil
import sys
import tempfile


class _Hiding:
    def __init__(self, finder, hidden: frozenset[str]):
        self._finder, self._hidden = finder, hidden

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] in self._hidden:
            return None
        find = getattr(self._finder, "find_spec", None)
        return None if find is None else find(fullname, path, target)

    def invalidate_caches(self):
        if hasattr(self._finder, "invalidate_caches"):
            self._finder.invalidate_caches()

    def __getattr__(self, name):   # anything else a tool asks of the finder it wraps
        return getattr(self._finder, name)


def hide(packages) -> None:
    hidden = frozenset(packages)
    loaded = sorted(m for m in sys.modules if m.partition(".")[0] in hidden)
    if loaded:   # a .pth file imported it at start-up: hiding now would prove nothing
        raise RuntimeError(f"already imported before hiding: {', '.join(loaded)}")
    sys.meta_path[:] = [_Hiding(f, hidden) for f in sys.meta_path]


SITECUSTOMIZE = """import os, runpy
runpy.run_path(os.environ["HIDE_PACKAGES_WITH"])["hide"](os.environ["HIDE_PACKAGES"].split(","))
"""


def hide_in_children(packages: str) -> None:
    """Make every Python process started from here on hide `packages` (comma-separated)."""
    site = tempfile.mkdtemp(prefix="hide-packages-")
    atexit.register(shutil.rmtree, site, True)
    with open(os.path.join(site, "sitecustomize.py"), "w") as f:
        f.write(SITECUSTOMIZE)
    os.environ.update(HIDE_PACKAGES=packages, HIDE_PACKAGES_WITH=os.path.abspath(__file__),
                      PYTHONPATH=os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH")) if p))


if __name__ == "__main__":
    if len(sys.argv) < 4 or sys.argv[2] != "-m":
        sys.exit(f"usage: {sys.argv[0]} PKG[,PKG...] -m MODULE [ARGS...]")
    hide(p for p in sys.argv[1].split(",") if p)
    hide_in_children(sys.argv[1])
    module = sys.argv[3]
    sys.argv = [module] + sys.argv[4:]
    sys.path[0] = os.getcwd()   # as `python -m` has it, not this file's folder
    runpy.run_module(module, run_name="__main__", alter_sys=True)
