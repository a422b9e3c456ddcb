"""Helper of test_elastic: N rounds of agreement among 4 forked processes (store and
standby listeners only, as comm.init sets them up), one SIGKILLed at a random moment.
Prints one JSON line per round: the victim, the flags and each survivor's decision."""
import json
import os
import random
import select
import signal
import sys
import time

from comm.elastic import Membership
from comm.bootstrap.rendezvous import free_port
from comm.bootstrap.store import Store

N = 4


def rank_main(rank, port, flag, ready_w, out_w, go_r, end_r):
    store = Store.host_or_connect("127.0.0.1", port, rank=rank, size=N, timeout=10, secret=None)
    if rank == 0:
        os.write(ready_w, b"l")   # listening: the others need not retry their connections
    m = Membership(store, rank, "127.0.0.1", 10)
    m.publish(store.scoped("w"))
    os.write(ready_w, b"r")
    os.read(go_r, 1)
    decision = m.agree("round", range(N), flag, set(), 10)
    os.write(out_w, (json.dumps([rank, decision]) + "\n").encode())
    os.read(end_r, 1)   # stay (and keep hosting) until every survivor has its answer
    os._exit(0)


def one_round(rng):
    port = int(os.environ.get("BASE_PORT", "0")) or free_port()
    flags = [rng.randrange(1 << 8) | 0x100 for _ in range(N)]
    ready_r, ready_w = os.pipe()
    out_r, out_w = os.pipe()
    go_r, go_w = os.pipe()
    end_r, end_w = os.pipe()
    pids = []
    for rank in range(N):
        pid = os.fork()
        if pid == 0:
            try:
                rank_main(rank, port, flags[rank], ready_w, out_w, go_r, end_r)
            finally:
                os._exit(1)
        pids.append(pid)
        if rank == 0:
            os.read(ready_r, 1)
    for _ in range(N):
        os.read(ready_r, 1)
    victim = rng.randrange(N)
    t0 = time.monotonic()
    os.write(go_w, b"g" * N)
    time.sleep(rng.uniform(0, 0.01))
    os.kill(pids[victim], signal.SIGKILL)
    decisions, buf = {}, b""
    deadline = time.monotonic() + 30
    while not set(range(N)) - {victim} <= decisions.keys() and time.monotonic() < deadline:
        if select.select([out_r], [], [], 1.0)[0]:
            buf += os.read(out_r, 4096)
        *lines, buf = buf.split(b"\n")
        for line in lines:
            rank, decision = json.loads(line)
            decisions[rank] = decision
    os.write(end_w, b"x" * N)
    for pid in pids:
        os.waitpid(pid, 0)
    for fd in (ready_r, ready_w, out_r, out_w, go_r, go_w, end_r, end_w):
        os.close(fd)
    return {"victim": victim, "flags": flags, "decisions": decisions, "s": round(time.monotonic() - t0, 3)}


if __name__ == "__main__":
    rng = random.Random(int(os.environ.get("SEED", "1")))
    for _ in range(int(sys.argv[1])):
        print(json.dumps(one_round(rng)), flush=True)
