"""One rank of `python -m bench.scale`: started by bench/scale.py in a simulated host's network
namespace with torchrun's variables, it times its own set-up and first collectives and writes
what it measured to OUTDIR/<rank>.json (the job's clock is CLOCK_MONOTONIC, one clock for every
process of the machine; T0 is when the driver started the first rank).

    python -m bench.scale_rank OUTDIR TRANSPORT T0 ITERS [--sweep]

Phases, in order: imports (the `start` time), init (`ready`), then OUTDIR/<rank>.ready and a
wait for OUTDIR/go (the driver writes it once every rank is ready, so the first collective
starts together everywhere and pays its connections, not the slowest rank's start-up), the
first all_reduce of 1 MiB and the first all_to_all, checked, ITERS timed all_reduce of 1 MiB,
then every other collective kind once, checked, and the descriptors and RSS of the process.
--sweep (native only) adds what the cost model (bench/scale_model.py) is fitted to and
checked against: all_reduce between two ranks of one host and of two hosts, and all_reduce and
all_to_all of every rank at several sizes.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time

if __name__ == "__main__":
    OUTDIR, TRANSPORT, T0, ITERS = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
    SWEEP = "--sweep" in sys.argv[5:]
else:   # imported, not run (the test suite imports every module): nothing to do
    OUTDIR, TRANSPORT, T0, ITERS, SWEEP = "", "native", 0.0, 0, False
STEADY = 1 << 20                  # bytes of the steady-state all_reduce
SMALL = 1024                      # float32 elements per block of the other collectives
PAIR_SIZES = [8, 1 << 10, 16 << 10, 128 << 10, 1 << 20, 4 << 20, 16 << 20]
AR_SIZES = [8, 1 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20]
A2A_SIZES = [1 << 10, 64 << 10, 1 << 20]   # one rank's whole buffer


def _watch_parent() -> None:
    """Leave when the driver is gone (killed outright), so no rank outlives its job."""
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(3)


if __name__ == "__main__":
    threading.Thread(target=_watch_parent, daemon=True).start()

import numpy as np  # noqa: E402

if TRANSPORT == "gloo":
    import torch  # noqa: E402
    import torch.distributed as dist  # noqa: E402
else:
    import comm  # noqa: E402

started = time.monotonic()


def descriptors() -> int:
    return len(os.listdir("/proc/self/fd")) - 1    # less the listing's own


def rss_mib(field: str = "VmRSS") -> float:
    """VmRSS counts the shared-memory pages this rank touched (shared with its host's ranks);
    RssAnon is its own memory alone."""
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
    return kib / 1024


class Native:
    """comm's calls on numpy arrays."""

    def __init__(self):
        self.c = comm.init()
        self.rank, self.size = self.c.rank, self.c.size

    def array(self, n, fill=0.0):
        return np.full(n, fill, dtype=np.float32)

    def values(self, x):
        return x

    def all_reduce(self, x): self.c.all_reduce(x)
    def reduce_scatter(self, out, x): self.c.reduce_scatter(out, x)
    def all_gather(self, out, x): self.c.all_gather(out, x)
    def broadcast(self, x): self.c.broadcast(x, root=0)
    def reduce(self, x): self.c.reduce(x, root=0)
    def all_to_all(self, out, x): self.c.all_to_all(out, x)
    def barrier(self): self.c.barrier()

    def exchange(self, x, y, dst, src):
        w = self.c.isend(x, dst)
        self.c.recv(y, src)
        w.wait()

    def close(self):
        self.c.close()


class Gloo:
    """torch.distributed with gloo on CPU tensors: the same calls."""

    def __init__(self):
        dist.init_process_group("gloo")
        self.rank, self.size = dist.get_rank(), dist.get_world_size()

    def array(self, n, fill=0.0):
        return torch.full((n,), fill, dtype=torch.float32)

    def values(self, x):
        return x.numpy()

    def all_reduce(self, x): dist.all_reduce(x)
    def reduce_scatter(self, out, x): dist.reduce_scatter_tensor(out, x)
    def all_gather(self, out, x): dist.all_gather_into_tensor(out, x)
    def broadcast(self, x): dist.broadcast(x, 0)
    def reduce(self, x): dist.reduce(x, 0)
    def all_to_all(self, out, x): dist.all_to_all_single(out, x)
    def barrier(self): dist.barrier()

    def exchange(self, x, y, dst, src):
        w = dist.isend(x, dst)
        dist.recv(y, src)
        w.wait()

    def close(self):
        dist.destroy_process_group()


def timed(fn, *args) -> float:
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


def wrong(got, want) -> int:
    return int(np.count_nonzero(np.asarray(got) != np.asarray(want, dtype=np.float32)))


def all_to_all_case(t, block):
    """x's block j holds rank*n + j, so out's block j must hold j*n + rank."""
    n, r = t.size, t.rank
    x = t.array(n * block)
    t.values(x)[:] = np.repeat(np.arange(n, dtype=np.float32) + r * n, block)
    return x, t.array(n * block), np.repeat(np.arange(n, dtype=np.float32) * n + r, block)


def every_kind(t) -> dict:
    """Each remaining collective kind once on SMALL-element blocks: #wrong per kind."""
    n, r, k = t.size, t.rank, SMALL
    out = {}
    x, y = t.array(n * k), t.array(k)
    t.values(x)[:] = np.repeat(np.arange(n, dtype=np.float32) + r, k)
    t.reduce_scatter(y, x)
    out["reduce_scatter"] = wrong(t.values(y), np.full(k, n * (n - 1) / 2 + n * r))
    x, y = t.array(k, r), t.array(n * k)
    t.all_gather(y, x)
    out["all_gather"] = wrong(t.values(y), np.repeat(np.arange(n), k))
    x = t.array(k, 7.0 if r == 0 else 0.0)
    t.broadcast(x)
    out["broadcast"] = wrong(t.values(x), np.full(k, 7.0))
    x = t.array(k, r + 1)
    t.reduce(x)
    out["reduce"] = wrong(t.values(x), np.full(k, n * (n + 1) / 2)) if r == 0 else 0
    t.barrier()
    out["barrier"] = 0
    x, y = t.array(k, r), t.array(k, -1.0)
    t.exchange(x, y, (r + 1) % n, (r - 1) % n)
    out["send_recv"] = wrong(t.values(y), np.full(k, (r - 1) % n))
    return out


def exchange_pair(c) -> dict:
    """all_reduce on a communicator of two ranks, per size: the best of 30 (of 10 from 4 MiB,
    sizes that show a rate-limited link's rate past its bucket). What one step of the
    algorithms costs, inside a host or across (bench/scale_model.py knows which algorithm runs
    at each size). A p2p ping-pong would also measure the wake-ups of the p2p driver thread,
    which on a loaded machine take a millisecond."""
    times = {}
    for size in PAIR_SIZES:
        x = np.ones(max(1, size // 4), dtype=np.float32)
        samples = [timed(c.all_reduce, x) for _ in range(35 if size <= 1 << 20 else 12)][2:]
        times[size] = min(samples)
    return times


def pairs(t, per_host: int) -> tuple[dict, dict]:
    """Rank 0 with rank 1 (its host) and with rank per_host (the next host), each pair on a
    communicator of its own. The other ranks sleep on a file meanwhile: waiting in a collective
    they would poll, and on a machine of few cores take the CPU the two need."""
    out = []
    for i, peer in enumerate((1, per_host)):
        done = os.path.join(OUTDIR, f"pair{i}")
        usable = peer < t.size and (i == 1) == (peer >= per_host)
        pair = t.c.split(0 if usable and t.rank in (0, peer) else None) if usable else None
        if pair is not None:
            out.append(exchange_pair(pair))
            if t.rank == 0:
                open(done, "w").close()
        else:
            out.append({})
            while usable and t.rank not in (0, peer) and not os.path.exists(done):
                time.sleep(0.05)
    return out[0], out[1]


def sweep(t, per_host: int) -> dict:
    """What the cost model is fitted to (ping-pongs) and checked against (collectives)."""
    n, r = t.size, t.rank
    out = {"all_reduce": {}, "all_to_all": {}, "wrong": 0}
    t.barrier()
    out["pair_local"], out["pair_remote"] = pairs(t, per_host)
    reps = max(5, ITERS)   # each time: the best of reps, as the ping-pongs
    for size in AR_SIZES:
        x = t.array(max(1, size // 4), r + 1)
        t.all_reduce(x)
        t.barrier()
        out["all_reduce"][size] = min(timed(t.all_reduce, x) for _ in range(reps))
        t.values(x)[:] = r + 1
        t.all_reduce(x)
        out["wrong"] += wrong(t.values(x), np.full(len(t.values(x)), n * (n + 1) / 2))
    for size in A2A_SIZES:
        block = max(1, size // 4 // n)
        x, y, want = all_to_all_case(t, block)
        t.all_to_all(y, x)
        t.barrier()
        out["all_to_all"][size] = min(timed(t.all_to_all, y, x) for _ in range(reps))
        out["wrong"] += wrong(t.values(y), want)
    return out


def main() -> None:
    fds_base, rss_base, anon_base = descriptors(), rss_mib(), rss_mib("RssAnon")
    cpu = time.process_time()   # every thread's: on a shared machine the wall time says little
    t = Gloo() if TRANSPORT == "gloo" else Native()
    ready = time.monotonic()
    result = {"rank": t.rank, "start_s": started - T0, "ready_s": ready - T0,
              "init_cpu_s": time.process_time() - cpu,
              "fds_base": fds_base, "fds_init": descriptors(), "rss_base_mib": rss_base,
              "anon_base_mib": anon_base}
    mark = os.path.join(OUTDIR, f"{t.rank}.ready")
    with open(mark + ".tmp", "w") as f:
        f.write(str(ready - T0))
    os.rename(mark + ".tmp", mark)
    while not os.path.exists(os.path.join(OUTDIR, "go")):
        time.sleep(0.02)
    n, r = t.size, t.rank
    x = t.array(STEADY // 4, r + 1)
    result["first_all_reduce_s"] = timed(t.all_reduce, x)
    result["wrong"] = {"all_reduce": wrong(t.values(x), np.full(STEADY // 4, n * (n + 1) / 2))}
    x, y, want = all_to_all_case(t, SMALL // 4)
    result["first_all_to_all_s"] = timed(t.all_to_all, y, x)
    result["wrong"]["all_to_all"] = wrong(t.values(y), want)
    x = t.array(STEADY // 4, 1.0)
    t.all_reduce(x)
    t.barrier()
    result["all_reduce_1mib_s"] = sum(timed(t.all_reduce, x) for _ in range(ITERS)) / ITERS
    result["wrong"].update(every_kind(t))
    result["fds"], result["rss_mib"], result["anon_mib"] = descriptors(), rss_mib(), rss_mib("RssAnon")
    if SWEEP:
        result["sweep"] = sweep(t, int(os.environ["LOCAL_WORLD_SIZE"]))
    t.barrier()   # nobody leaves while a peer may still need it
    path = os.path.join(OUTDIR, f"{r}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.rename(path + ".tmp", path)
    t.close()


if __name__ == "__main__":
    try:
        main()
    except BaseException as e:   # the driver shows the first failing rank's last line
        print(f"rank {os.environ.get('RANK')}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        os._exit(1)
    os._exit(0)
