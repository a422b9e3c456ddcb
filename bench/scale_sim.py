"""The bootstrap at thousands of ranks, simulated with the library's real store:
`python -m bench.scale_sim --ranks 1024,4096 [--per-host 8] [--procs 8] [--anchors]`.

Every simulated rank is a thread holding a real comm.bootstrap.store.Store client, connected over TCP
to a real StoreServer, which runs in a process of its own as rank 0's process would host it
(the clients run in --procs worker processes, so that neither side's GIL is the other's bound).
Each rank joins, then makes the store exchanges comm.init makes before any data connection:
the topology gather (every rank's host id), the native engine's gather of its planned peers'
addresses (the engine's own plan, Engine.planned_peers, of the simulated topology), and its
two shared-memory gathers among each host's ranks, with payloads of the real sizes. Reported:
the time from the moment every rank has joined to the moment the last rank has every answer,
the store requests per rank, and a check that every rank received exactly the values it
asked for, as every other rank gave them (a wrong or missing answer fails the run).

--anchors also times, at each rank count, init's gathers with every rank's value sent to every
rank (as comm made them before gather_some); and at the smallest, one gather in the pattern comm
used before that (each rank sets its key, then gets every other rank's: N round trips per rank)
on the same store, and in that same pattern and with set + wait + multi_get on torch's TCPStore
(libuv) (the N-round-trip pattern is quadratic: minutes at 1024 ranks).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import sys
import threading
import time

from comm.bootstrap import rendezvous
from comm._native import _native
from comm.bootstrap.store import KeyValueStore, Store
from comm.bootstrap.store_host import StoreServer


def _info(rank: int, hosts: int, per_host: int) -> bytes:
    """The native engine's address record, as transports/native/__init__.py publishes it."""
    host = rank // per_host
    return json.dumps({"addr": f"198.18.{host >> 8}.{host & 255}", "port": 40000 + rank % 20000,
                       "token": f"{rank * 2654435761 % 2**64:032x}", "sockets": 4, "lazy": True}).encode()


class _Counting(Store):
    """A Store client that counts its round trips to the host."""

    requests = 0

    def _call(self, *args, **kwargs):
        self._root.requests += 1
        return super()._call(*args, **kwargs)


def _pattern_gather(store: Store, key: str, value: bytes, pattern: str) -> list[bytes]:
    if pattern == "rounds":   # comm before its one-round-trip gathers: a set, then a get per rank
        return KeyValueStore.all_gather(store, key, value)
    return store.all_gather(key, value)   # "gather", and "every" (init's gathers before gather_some)


def _host(rank: int, per_host: int) -> bytes:
    return f"sim-host-{rank // per_host:05d}".encode()


def _bootstrap(store: Store, rank: int, size: int, per_host: int, pattern: str, full: bool,
               expected: dict[str, list[bytes]], plan: list[list[int]]) -> bool:
    """The store exchanges of comm.init for one rank (full), or its first gather alone; True
    when every answer is what every rank gave. As transports/native/__init__.py makes them (pattern
    "gather"): the topology from every rank, the addresses of the planned peers only (`plan`:
    the engine's own plan of this topology), the shared-memory records of this host's ranks
    only; pattern "rounds" gathers every rank's value each time, a set and a get per rank, as
    comm did before. Checked by comparing whole answers: a real rank parses its answers on its
    own core; here thousands of ranks share two."""
    ok = _pattern_gather(store, "topology", _host(rank, per_host), pattern) == expected["topology"]
    if not full:
        return ok
    local = range(rank - rank % per_host, min(size, rank - rank % per_host + per_host))

    def exchange(key: str, want) -> bool:
        if pattern != "gather":   # every rank's value to every rank
            return _pattern_gather(store, key, expected[key][rank], pattern) == expected[key]
        return store.gather_some(key, expected[key][rank], want) == {r: expected[key][r] for r in want}

    ok &= exchange("native/info", [*plan[rank], rank])
    if per_host > 1:   # the shared-memory segments and the single-copy votes
        ok &= exchange("native/shm", local) & exchange("native/cma", local)
    return bool(ok)


def _expected(size: int, per_host: int) -> dict[str, list[bytes]]:
    hosts = (size + per_host - 1) // per_host
    return {"topology": [_host(r, per_host) for r in range(size)],
            "native/info": [_info(r, hosts, per_host) for r in range(size)],
            "native/shm": [json.dumps([100000 + r, 7]).encode() for r in range(size)],
            "native/cma": [b"1"] * size}


def _worker(ranks, size, per_host, port, pattern, full, go, out) -> None:
    """One worker process: a thread per simulated rank, each with its own Store client."""
    ready = threading.Barrier(len(ranks) + 1)
    expected = _expected(size, per_host)
    plan = _native.planned_peers_all([r // per_host for r in range(size)]) if full else []
    start = threading.Event()
    results = {}

    def rank_main(rank: int) -> None:
        try:
            store = _Counting("127.0.0.1", port, rank=rank, size=size, timeout=600, secret=None)
        except Exception as e:   # reported, not raised in a thread
            results[rank] = (False, 0, 0.0, repr(e))
            ready.wait()
            return
        ready.wait()
        start.wait()
        store.requests = 0
        try:
            ok = _bootstrap(store, rank, size, per_host, pattern, full, expected, plan)
            results[rank] = (ok, store.requests, time.monotonic(), "")
        except Exception as e:
            results[rank] = (False, store.requests, time.monotonic(), repr(e))
        finally:
            store.close()

    threading.stack_size(256 << 10)   # thousands of threads: their stacks need not be 8 MiB each
    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in ranks]
    for t in threads:
        t.start()
    ready.wait()
    out.send("joined")
    go.wait()
    start.set()
    for t in threads:
        t.join()
    out.send(results)


def _serve(size: int, port_out, stop) -> None:
    listener = rendezvous.listen_socket("127.0.0.1")
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(max(128, size))
    threading.stack_size(256 << 10)
    server = StoreServer(listener, None, 600, size=size, agree={}, where="simulation")
    port_out.send(listener.getsockname()[1])
    stop.wait()
    server.close()


def simulate(size: int, per_host: int, procs: int, pattern: str = "gather", full: bool = True) -> dict:
    """One simulated bootstrap of `size` ranks (full: every gather of init; else the first);
    the figures of the report."""
    ctx = mp.get_context("fork")
    stop, go = ctx.Event(), ctx.Event()
    port_r, port_w = ctx.Pipe(False)
    server = ctx.Process(target=_serve, args=(size, port_w, stop), daemon=True)
    server.start()
    port = port_r.recv()
    pipes, workers = [], []
    t0 = time.monotonic()
    for i in range(procs):
        r, w = ctx.Pipe(False)
        p = ctx.Process(target=_worker, args=(list(range(i, size, procs)), size, per_host, port, pattern, full, go, w),
                        daemon=True)
        p.start()
        pipes.append(r)
        workers.append(p)
    try:
        for r in pipes:
            r.recv()
        joined = time.monotonic() - t0
        began = time.monotonic()
        go.set()
        results = {}
        for r in pipes:
            results.update(r.recv())
    finally:
        stop.set()
        for p in workers + [server]:
            p.join(10)
            if p.is_alive():
                p.kill()
    errors = [f"rank {r}: {e}" for r, (_, _, _, e) in results.items() if e]
    wrong = [r for r, (ok, *_) in results.items() if not ok]
    ends = [t for (_, _, t, _) in results.values() if t]
    requests = [n for (_, n, _, _) in results.values()]
    what = ("comm store, " + {"gather": "one request per gather", "every": "every value to every rank",
                              "rounds": "set + a get per rank"}[pattern]
            + (": init's gathers" if full else ": one gather"))
    return {"ranks": size, "per_host": per_host, "pattern": what, "join_s": joined,
            "bootstrap_s": max(ends) - began if ends else float("nan"),
            "requests_per_rank": max(requests) if requests else 0,
            "ranks_right": size - len(wrong), "errors": errors[:3]}


def torch_anchor(size: int, procs: int, multi: bool) -> dict | None:
    """One gather of `size` ranks on torch's TCPStore (libuv): set + a get per rank, or set + wait +
    multi_get. None without torch."""
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    import datetime
    port = rendezvous.free_port()
    host = dist.TCPStore("127.0.0.1", port, world_size=None, is_master=True,
                         timeout=datetime.timedelta(seconds=600), wait_for_workers=False)
    ctx = mp.get_context("fork")
    go = ctx.Event()
    pipes, workers = [], []

    def worker(ranks, out):
        clients = {r: dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=600)) for r in ranks}
        ends, right = {}, {}

        def one(r):
            s = clients[r]
            s.set(f"g/{r}", str(r))
            keys = [f"g/{q}" for q in range(size)]
            if multi:
                s.wait(keys)
                vals = s.multi_get(keys)
            else:
                vals = [s.get(k) for k in keys]
            ends[r] = time.monotonic()
            right[r] = all(v == str(q).encode() for q, v in enumerate(vals))

        out.send("joined")
        go.wait()
        ts = [threading.Thread(target=one, args=(r,)) for r in ranks]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        out.send((ends, right))

    for i in range(procs):
        r, w = ctx.Pipe(False)
        p = ctx.Process(target=worker, args=(list(range(i, size, procs)), w), daemon=True)
        p.start()
        pipes.append(r)
        workers.append(p)
    for r in pipes:
        r.recv()
    began = time.monotonic()
    go.set()
    ends, right = {}, {}
    for r in pipes:
        e, ok = r.recv()
        ends.update(e)
        right.update(ok)
    for p in workers:
        p.join(10)
    del host
    return {"ranks": size, "pattern": "torch TCPStore, " + ("set + wait + multi_get" if multi else "set + a get per rank")
            + ": one gather",
            "gather_s": max(ends.values()) - began, "ranks_right": sum(right.values())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.scale_sim", description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="1024,4096", help="simulated rank counts, comma-separated")
    p.add_argument("--per-host", type=int, default=8, help="ranks per simulated host")
    p.add_argument("--procs", type=int, default=64,
                   help="worker processes the simulated ranks run in (a few dozen threads each: with "
                        "hundreds to a process, their GIL, not the store, is what the run measures)")
    p.add_argument("--anchors", action="store_true",
                   help="also init's gathers with every value sent to every rank (each size), and the old "
                        "N-round-trip gather and torch's TCPStore (the smallest rank count)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.ranks.split(",")]
    rows = []
    print(f"{'ranks':>6} {'hosts':>6} {'pattern':<56} {'join s':>7} {'bootstrap s':>11} {'requests/rank':>13} {'right':>6}")

    def show(r):
        rows.append(r)
        hosts = (r["ranks"] + args.per_host - 1) // args.per_host
        print(f"{r['ranks']:>6} {hosts:>6} {r['pattern']:<56} {r.get('join_s', float('nan')):>7.2f} "
              f"{r.get('bootstrap_s', r.get('gather_s')):>11.2f} {r.get('requests_per_rank', '-'):>13} "
              f"{r['ranks_right']:>6}", flush=True)
        for e in r.get("errors", []):
            print(f"    {e}")

    for size in sizes:
        show(simulate(size, args.per_host, args.procs, full=False))
        show(simulate(size, args.per_host, args.procs))
        if args.anchors:   # init's gathers as comm made them before each rank asked for what it needs
            show(simulate(size, args.per_host, args.procs, pattern="every"))
    if args.anchors:
        small = min(sizes)
        show(simulate(small, args.per_host, args.procs, pattern="rounds", full=False))
        for multi in (False, True):
            r = torch_anchor(small, args.procs, multi)
            if r is not None:
                show(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r["ranks_right"] == r["ranks"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
