"""Recovery times of comm.elastic: `python -m bench.elastic [--np 4] [--repeats 10]`.

shrink: N ranks loop a small all_reduce; one is SIGKILLed (victims in turn, rank 0, the store's
host, among them); measured is the time from the kill to the first all_reduce the survivors
complete on the shrunk communicator (CLOCK_MONOTONIC is one clock for every process of the
machine), for shared memory and for TCP (COMM_CHANNELS=tcp); each result is checked against
the sum over the survivors. grow: N-1 ranks grow by one; measured is the time from the
joiner's comm.join() call to the end of its first all_reduce on the grown communicator (its
interpreter start is not counted). Prints medians and every sample; --json writes them.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from comm.bootstrap import rendezvous

_RANK = r"""
import os, sys, time, numpy as np, comm
out = sys.argv[1]
world = comm.init()
c = world
x = np.ones(1)
c.all_reduce(x)
open(f"{out}.ready.{world.rank}", "w").close()
while True:
    x[:] = c.ranks[c.rank] + 1
    try:
        c.all_reduce(x)
    except comm.CommError:
        c = c.shrink()
        x[:] = c.ranks[c.rank] + 1
        c.all_reduce(x)
        done = time.monotonic()
        ok = x[0] == sum(u + 1 for u in c.ranks)
        with open(f"{out}.{c.ranks[c.rank]}", "w") as f:
            f.write(f"{done} {int(ok)}")
        time.sleep(60)   # ended by the benchmark: an exit now could fail a slower survivor's call
    time.sleep(0.001)
"""

_SURVIVOR = r"""
import os, sys, time, numpy as np, comm
out = sys.argv[1]
world = comm.init()
if world.rank == 0:
    with open(out + ".address.tmp", "w") as f:
        f.write(world.join_address())
    os.rename(out + ".address.tmp", out + ".address")
new = world.grow(1)
x = np.ones(1)
new.all_reduce(x)
assert x[0] == new.size
new.close()
os._exit(0)
"""

_JOINER = r"""
import os, sys, time, numpy as np, comm
out = sys.argv[1]
while not os.path.exists(out + ".address"):
    time.sleep(0.005)
address = open(out + ".address").read()
start = time.monotonic()
new = comm.join(address)
x = np.ones(1)
new.all_reduce(x)
took = time.monotonic() - start
with open(out + ".joined", "w") as f:
    f.write(f"{took} {int(x[0] == new.size)}")
new.close()
os._exit(0)
"""


def _spawn(code: str, n: int, out: str, env: dict, ranks=None) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", code, out], env=dict(env, RANK=str(r), WORLD_SIZE=str(n)))
            for r in (range(n) if ranks is None else ranks)]


def _wait(path: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.002)
    time.sleep(0.01)
    with open(path) as f:
        return f.read()


def _reap(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def shrink_once(n: int, victim: int, env: dict, tmp: str) -> tuple[float, bool]:
    out = os.path.join(tmp, f"shrink{time.monotonic_ns()}")
    procs = _spawn(_RANK, n, out, env)
    try:
        for r in range(n):
            _wait(f"{out}.ready.{r}", 120)
        time.sleep(0.2)   # looping
        killed = time.monotonic()
        procs[victim].send_signal(signal.SIGKILL)
        firsts = [_wait(f"{out}.{r}", 60).split() for r in range(n) if r != victim]
        return max(float(t) for t, _ in firsts) - killed, all(ok == "1" for _, ok in firsts)
    finally:
        _reap(procs)


def grow_once(n: int, env: dict, tmp: str) -> tuple[float, bool]:
    out = os.path.join(tmp, f"grow{time.monotonic_ns()}")
    procs = _spawn(_SURVIVOR, n - 1, out, env)
    procs += _spawn(_JOINER, n, out, env, ranks=[n - 1])
    try:
        took, ok = _wait(out + ".joined", 120).split()
        return float(took), ok == "1"
    finally:
        for p in procs:
            p.wait(timeout=60)
        _reap(procs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.elastic", description=__doc__.split("\n")[0])
    ap.add_argument("--np", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    base = dict(os.environ, MASTER_ADDR="127.0.0.1", COMM_TIMEOUT="30",
                COMM_SECRET=os.environ.get("COMM_SECRET") or os.urandom(16).hex(),
                PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    results: dict[str, list] = {}
    with tempfile.TemporaryDirectory(prefix="comm-elastic-") as tmp:
        for channels in ("auto", "tcp"):
            name = f"shrink {'shm' if channels == 'auto' else 'tcp'}"
            samples = results[name] = []
            for i in range(args.repeats):
                env = dict(base, COMM_CHANNELS=channels, MASTER_PORT=str(rendezvous.free_port()))
                victim = i % args.np
                took, ok = shrink_once(args.np, victim, env, tmp)
                samples.append({"victim": victim, "seconds": round(took, 4), "correct": ok})
        samples = results["grow"] = []
        for _ in range(max(3, args.repeats // 2)):
            env = dict(base, MASTER_PORT=str(rendezvous.free_port()))
            took, ok = grow_once(args.np, env, tmp)
            samples.append({"seconds": round(took, 4), "correct": ok})
    for name, samples in results.items():
        times = [s["seconds"] for s in samples]
        host = [s["seconds"] for s in samples if s.get("victim") == 0]
        line = f"{name:12s} {args.np} ranks: median {statistics.median(times):.3f} s, max {max(times):.3f} s"
        if host:
            line += f"; store host killed: median {statistics.median(host):.3f} s"
        line += f"; wrong results: {sum(not s['correct'] for s in samples)}"
        print(line)
        print("  samples:", " ".join(f"{t:.3f}" for t in times))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"np": args.np, "results": results}, f, indent=1)
    return 0 if all(s["correct"] for v in results.values() for s in v) else 1


if __name__ == "__main__":
    sys.exit(main())
