"""The torch backend registers whatever is imported first, under torchrun, a plain environment
and explicit arguments; comm.init and init_process_group("comm") share torchrun's rendezvous.

torch's backend autoload imports comm.torch from inside `import torch`: a module of comm that
imports torch and is reached by the autoload half-imported breaks the registration (every rank
warned "torch backend "comm" not registered" and init_process_group("comm") failed). Each rank
process here imports one module before anything else of comm or torch, as a user's script
would, then joins a 2-rank default group on "comm" and all-reduces. The other modules of comm
are imported one after another in one process, which must print nothing and never import torch:
then importing any of them first cannot start torch's autoload, and leaves comm whole for a
later `import torch`, which is the "comm first" row.

The jobs run two at a time, each rank of a job with a first import of its own (every rank
process spends a second or more importing torch), and each case is checked by its own test.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import importlib.util
import json
import os
import secrets
import signal
import subprocess
import sys
import time

import pytest

from harness import ROOT, free_port
from harness import slow as harness_slow

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")

# comm.torch.torchft imports torchft: imported first only where torchft is installed
TORCH_MODULES = sorted("comm.torch" + ("" if name == "__init__.py" else "." + name[:-3])
                       for name in os.listdir(os.path.join(ROOT, "comm", "torch"))
                       if name.endswith(".py") and (name != "torchft.py" or importlib.util.find_spec("torchft")))
OTHER_MODULES = sorted(
    ".".join(os.path.relpath(os.path.join(d, name), ROOT)[:-3].split(os.sep)).removesuffix(".__init__")
    for d, _, files in os.walk(os.path.join(ROOT, "comm"))
    if not os.path.relpath(d, ROOT).startswith((os.path.join("comm", "torch"), os.path.join("comm", "_")))
    for name in files if name.endswith(".py"))
FIRST = ["comm", "torch"] + TORCH_MODULES
MODES = ["torchrun", "env", "explicit"]


def _autoload_missing() -> str | None:
    if not any(e.value.startswith("comm_collectives_autoload:")
               for e in importlib.metadata.entry_points(group="torch.backends")):
        return "comm-collectives is not installed (pip install -e .): torch has no entry point to call"
    return None


# A rank of the matrix. argv: mode, the comma-separated first imports (one per rank), and with
# explicit arguments this rank and the init_method port. Nothing but the standard library runs
# before its first import.
RANK = r"""
import importlib, json, os, sys, warnings
warnings.simplefilter("always")   # every warning shows, however often it was raised before
mode, firsts = sys.argv[1], sys.argv[2].split(",")
rank = int(sys.argv[3]) if mode == "explicit" else int(os.environ["RANK"])
importlib.import_module(firsts[rank])
import torch
import torch.distributed as dist
registered = "comm" in dist.Backend.backend_list
if mode == "explicit":
    dist.init_process_group("comm", init_method=f"tcp://127.0.0.1:{sys.argv[4]}", rank=rank, world_size=2)
else:
    dist.init_process_group("comm")
t = torch.full((3,), rank + 1.0)
dist.all_reduce(t)
print(json.dumps({"first": firsts[rank], "rank": dist.get_rank(), "registered": registered,
                  "backend": dist.get_backend(), "sum": t.tolist()}), flush=True)
dist.destroy_process_group()
"""

# comm's own API and torch's process group in one torchrun job: issue 24's script.
BOTH = r"""
import json, os
import numpy as np
import comm


def listening() -> list[int]:
    # the TCP ports this process listens on (torchrun's agent serves the rendezvous)
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            mine.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:   # the listing's own descriptor, closed by now
            pass
    ports = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f"socket:[{f[9]}]" in mine:
                ports.append(int(f[1].rsplit(":", 1)[1], 16))
    return ports


world = comm.init()
x = np.full(3, world.rank + 1.0, np.float32)
world.all_reduce(x)
import torch
import torch.distributed as dist
dist.init_process_group("comm")
t = torch.full((3,), dist.get_rank() + 1.0)
dist.all_reduce(t)
torch_ranks = np.zeros(world.size, np.int64)   # torch's rank of each comm rank, gathered by comm
world.all_gather(torch_ranks, np.array([dist.get_rank()], np.int64))
ports = listening()
world.close()
again = comm.init()   # a second world joins torchrun's store too, clear of the first one's keys
y = np.full(3, again.rank + 10.0, np.float32)
again.all_reduce(y)
print(json.dumps({"rank": world.rank, "size": world.size, "torch_rank": dist.get_rank(),
                  "torch_size": dist.get_world_size(), "torch_ranks": torch_ranks.tolist(), "comm": x.tolist(),
                  "torch": t.tolist(), "again": y.tolist(), "listening": ports}), flush=True)
again.close()
dist.destroy_process_group()
"""


def _env(**extra) -> dict:
    """This environment without any launcher's variables, with a job secret (else every rank
    says connections are unauthenticated) and one compute thread (else torchrun says it set it)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                        "COMM_TRANSPORT", "TORCH_DEVICE_BACKEND_AUTOLOAD")
           and not k.startswith(("TORCHELASTIC_", "OMPI_", "PMI_", "SLURM_"))}
    env.update(COMM_SECRET=secrets.token_hex(16), OMP_NUM_THREADS="1", COMM_TIMEOUT="60",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])), **extra)
    return env


def _torchrun(script: list[str], env: dict) -> subprocess.Popen:
    return _popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                   "127.0.0.1", "--master-port", str(free_port())] + script, env)


def _start(script: str, mode: str, firsts: list[str]) -> list[subprocess.Popen]:
    """One 2-rank job of `script` (RANK) whose rank r imports firsts[r] first."""
    argv = [script, mode, ",".join(firsts)]
    if mode == "torchrun":
        return [_torchrun(argv, _env())]
    argv = [sys.executable] + argv
    if mode == "env":
        env = _env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2")
        return [_popen(argv, dict(env, RANK=str(r))) for r in range(2)]
    port, env = str(free_port()), _env()
    return [_popen(argv + [str(r), port], env) for r in range(2)]


def _popen(argv: list[str], env: dict) -> subprocess.Popen:
    # a session of its own: a job past its time is killed with torchrun's ranks
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _finish(procs: list[subprocess.Popen], overdue: bool) -> tuple[int, str, str]:
    if overdue:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
    outs = [p.communicate() for p in procs]
    return max(p.returncode for p in procs), "".join(o for o, _ in outs), "".join(e for _, e in outs)


def _run(jobs: list, parallel: int = 2, timeout: float = 300) -> dict:
    """Run (keys, start) jobs `parallel` at a time: two jobs keep two cores busy, while all of
    them at once starve each other on a busy machine (a torch import then takes minutes).
    Each of a job's keys -> (exit status, stdout, stderr) of the job."""
    pending, running, results = list(jobs), [], {}
    while pending or running:
        while pending and len(running) < parallel:
            keys, start = pending.pop(0)
            running.append((keys, start(), time.monotonic()))
        for job in list(running):
            keys, procs, began = job
            overdue = time.monotonic() - began > timeout
            if overdue or all(p.poll() is not None for p in procs):
                running.remove(job)
                results.update(dict.fromkeys(keys, _finish(procs, overdue)))
        time.sleep(0.05)
    return results


def _reports(out: str) -> list[dict]:
    """The ranks' JSON reports. torchrun relays both ranks' stdout into one stream, where two
    lines can arrive joined ('{...}{...}'): read object after object, not line by line."""
    decoder, reports, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(out) and out[i].isspace():
            i += 1
        if i == len(out):
            return reports
        report, i = decoder.raw_decode(out, i)
        reports.append(report)


def _pairs(names: list[str]) -> list[list[str]]:
    names = names + names[:len(names) % 2]   # an odd count: the last job repeats the first name
    return [names[i:i + 2] for i in range(0, len(names), 2)]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory, request):
    """The jobs the selected tests of this module read: (mode, first import) -> (exit, stdout,
    stderr) of the job that rank ran in; "others" and "both" likewise."""
    scripts = tmp_path_factory.mktemp("torch_import")
    rank, both = scripts / "rank.py", scripts / "both.py"
    rank.write_text(RANK)
    both.write_text(BOTH)
    code = ("import importlib, sys, warnings; warnings.simplefilter('always')\n"
            f"for name in {OTHER_MODULES!r}:\n"
            "    importlib.import_module(name)\n"
            "    print(name, 'torch' in sys.modules)")
    jobs = [(["others"], lambda: [_popen([sys.executable, "-c", code], _env())]),
            (["both"], lambda: [_torchrun([str(both)], _env())])]
    jobs += [([(mode, first) for first in pair], functools.partial(_start, str(rank), mode, pair))
             for mode in MODES for pair in _pairs(FIRST)]
    wanted = {_key(item) for item in request.session.items if item.module is request.module}
    return _run([job for job in jobs if wanted & set(job[0])])


def _key(item):
    """The job key a test of this module reads."""
    if item.originalname == "test_other_modules_import_silently_without_torch":
        return "others"
    if item.originalname == "test_comm_init_and_process_group_under_torchrun":
        return "both"
    return item.callspec.params["mode"], item.callspec.params["first"]


def _matrix() -> list:
    """(mode, first import): under torchrun, the launcher users run, what scripts import first
    (comm, torch, comm.torch), and the other modes for the first pair (comm, torch) in the quick
    suite; the whole matrix (every module of comm.torch first) with -m slow."""
    quick = [("torchrun", first) for first in FIRST[:3]] + [(mode, first) for mode in MODES[1:] for first in FIRST[:2]]
    return quick + harness_slow(*[(mode, first) for mode in MODES for first in FIRST if (mode, first) not in quick])


@pytest.mark.slow
def test_other_modules_import_silently_without_torch(jobs):
    code, out, err = jobs["others"]
    assert (code, err) == (0, ""), (code, out, err)
    assert out.splitlines() == [f"{name} False" for name in OTHER_MODULES], out
    assert len(OTHER_MODULES) > 10 and "comm.communicator" in OTHER_MODULES, OTHER_MODULES


@pytest.mark.parametrize("mode, first", _matrix())
def test_backend_registered_whatever_comes_first(jobs, mode, first):
    if first in ("comm", "torch") and _autoload_missing():
        pytest.skip(_autoload_missing())   # only the entry point registers the backend then
    code, out, err = jobs[(mode, first)]
    assert code == 0 and err == "", (code, out, err[-4000:])
    ranks = _reports(out)
    assert sorted(r["rank"] for r in ranks) == [0, 1], out
    mine = [r for r in ranks if r["first"] == first]
    assert mine and all(r["registered"] and r["backend"] == "comm" for r in mine), out
    assert all(r["sum"] == [3.0, 3.0, 3.0] for r in ranks), out


def test_comm_init_and_process_group_under_torchrun(jobs):
    """Issue 24's script: both over torchrun's store (the ranks listen on no port: no second
    rendezvous), the same ranks, the same sums; a second comm.init joins cleanly."""
    code, out, err = jobs["both"]
    assert code == 0 and err == "", (code, out, err[-4000:])
    ranks = sorted(_reports(out), key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == [0, 1], out
    for r in ranks:
        assert (r["size"], r["torch_size"], r["torch_rank"]) == (2, 2, r["rank"]), r
        assert r["torch_ranks"] == [0, 1], r   # comm rank i is torch rank i, on every rank
        assert r["comm"] == r["torch"] == [3.0, 3.0, 3.0] and r["again"] == [21.0, 21.0, 21.0], r
        assert r["listening"] == [], r
