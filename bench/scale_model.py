"""An alpha-beta cost model of the engine's algorithm choices, fitted on this machine and
extrapolated to 1k-16k ranks on 8-128 hosts: `python -m bench.scale --model`.

A message of s bytes costs alpha + s * beta: alpha_net / beta_net between hosts (one TCP
connection over a host's link), alpha_shm / beta_shm inside a host (shared memory). Ranks of
one host that send across at once share its link: a step costs alpha_net plus the bytes that
leave the host times beta_net. The rendezvous store serves one request in c_req and sends
its replies at beta_store per byte (its host's link at most: beta_net).

Fitted from real runs (bench/scale_rank.py --sweep), the best of 30 each: an all_reduce of two
ranks of one host and of two ranks on two hosts, 8 B - 16 MiB (pair_steps: the steps of the
algorithm that runs at each size); beta the slope between the two largest sizes, alpha from
those up to 1 KiB (fit_robust); a real
comm.bootstrap.store.Store on loopback, hammered by clients in another process, gives c_req and
beta_store. Checked: all_reduce and all_to_all at several sizes on the shapes that ran, model
next to measurement (the ratio says how far to trust the extrapolation; on a machine of few
cores the ranks also wait for CPU, which the model does not count).

Algorithms (n = H hosts x L ranks per host, m bytes):
    all_reduce  ring        2(n-1) steps of m/n, ranks in host order (one link crossing per host)
                rd          recursive doubling: log2 n steps of m; steps across hosts carry L
                            ranks' m over one link
                tree        binomial reduce then broadcast: 2 log2 n steps of m
                2l-shard    ring reduce-scatter in the host, ring all-reduce of each rank's 1/L
                            with its peers on the other hosts (L lanes share the link), ring
                            all-gather in the host; the engine pipelines the host and network
                            lanes, so their bandwidth terms overlap
                2l-halving  2l-shard with recursive halving / doubling across hosts in place of
                            the ring (2 log2 H steps, the same bytes; not in the engine)
                2l-leader   tree reduce to a host leader, rd among the leaders, tree broadcast
                            in the host (the engine's form below 64 KiB)
    all_to_all  pairwise    n-1 steps of one block m/n (n-L of them across hosts, L at once)
                2l-agg      per-host aggregation: L-1 steps in the host (H blocks each), H-1
                            steps across with L blocks to the same local rank of each host
    bootstrap   store-N     today's store all_gather: a set and n gets per rank, served one by
                            one (n(n+1) requests)
                store-1     one request per rank, the host answers when all have arrived
                ring        one store exchange (own address, the neighbour's), then a ring
                            all-gather of the blobs among the ranks (NCCL's bootstrap)
                host-agg    each host's blobs gathered to its leader, store-1 among leaders,
                            the table broadcast in the host
"""
from __future__ import annotations

import math
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np

RD_MAX = 64 << 10            # select.cc kRdMaxBytes, twolevel.cc kRdMaxBytes
SHARD_MIN = 64 << 10         # twolevel.cc kShardMinBytes
CMA_MIN = 256 << 10          # select.cc cma_min_bytes(ALL_REDUCE)
BLOB = 512                   # bytes each rank puts into a bootstrap all_gather (addresses, handles)
EXTRAPOLATE = [(8, 128), (16, 64), (128, 8), (32, 128), (128, 32), (64, 128), (128, 128)]
AR_SIZES = [8, 64 << 10, 1 << 20, 64 << 20]
A2A_SIZES = [1 << 20, 64 << 20]


@dataclass
class Fit:
    alpha_net: float    # s
    beta_net: float     # s/B
    alpha_shm: float
    beta_shm: float
    c_req: float        # s per store request
    beta_store: float   # s/B of store replies


def fit_line(sizes, times, steps=None) -> tuple[float, float]:
    """alpha, beta minimising the relative error of steps * alpha + size * beta (small and
    large messages count alike; steps 1 unless given); both kept non-negative."""
    s, t = np.asarray(sizes, float), np.asarray(times, float)
    k = np.ones_like(t) if steps is None else np.asarray(steps, float)
    a = np.stack([k / t, s / t], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    if alpha < 0 or beta < 0:   # one of them does not show at these sizes: fit the other alone
        alpha, beta = (0.0, float(np.median(t / s))) if alpha < 0 else (float(np.median(t)), 0.0)
    return float(alpha), float(beta)


def fit_robust(sizes, times, steps=None) -> tuple[float, float, list[bool]]:
    """beta from the two largest sizes (the slope between them: past a rate-limited link's
    bucket, which the sizes below it cross for free), alpha the least time of the sizes up to
    1 KiB (latency-bound; waiting for the CPU only adds); and which points the
    line passes within 3x of (on a shared machine one size can catch a descheduled rank in
    every sample)."""
    k = [1] * len(sizes) if steps is None else list(steps)
    order = sorted(range(len(sizes)), key=lambda i: sizes[i])
    hi, mid = order[-1], order[-2]   # both take as many steps (above RD_MAX for the pair)
    beta = max(0.0, (times[hi] - times[mid]) / (sizes[hi] - sizes[mid]))
    small = [t / n for s, t, n in zip(sizes, times, k) if s <= 1 << 10]   # latency-bound sizes
    alpha = max(0.0, min(small, default=0.0) - min(sizes) * beta)
    kept = [1 / 3 < t / (n * alpha + s * beta) < 3 for s, t, n in zip(sizes, times, k)]
    return alpha, beta, kept


def _log2(n: int) -> int:
    return math.ceil(math.log2(n)) if n > 1 else 0


class Model:
    def __init__(self, f: Fit):
        self.f = f

    def _net(self, steps: float, link_bytes: float) -> float:
        return steps * self.f.alpha_net + link_bytes * self.f.beta_net

    def _shm(self, steps: float, nbytes: float) -> float:
        return steps * self.f.alpha_shm + nbytes * self.f.beta_shm

    # ---- all_reduce ----
    def ring(self, h: int, l: int, m: float) -> float:
        n = h * l
        per = self.f.alpha_net + m / n * self.f.beta_net if h > 1 else self.f.alpha_shm + m / n * self.f.beta_shm
        return 2 * (n - 1) * per

    def rd(self, h: int, l: int, m: float) -> float:
        n = h * l
        inside, across = _log2(l), _log2(n) - _log2(l)
        extra = 0 if n & (n - 1) == 0 else 2   # the ranks beyond a power of two fold in and out
        step_across = self.f.alpha_net + l * m * self.f.beta_net
        return self._shm(inside, inside * m) + across * step_across + extra * step_across

    def tree(self, h: int, l: int, m: float) -> float:
        inside, across = _log2(l), _log2(h * l) - _log2(l)
        return 2 * (self._shm(inside, inside * m) + self._net(across, across * m))

    def shard(self, h: int, l: int, m: float) -> float:
        host_alpha, host_bw = 2 * (l - 1) * self.f.alpha_shm, 2 * (l - 1) * m / l * self.f.beta_shm
        net_alpha, net_bw = 2 * (h - 1) * self.f.alpha_net, 2 * (h - 1) * m / h * self.f.beta_net
        return host_alpha + net_alpha + max(host_bw, net_bw)

    def halving(self, h: int, l: int, m: float) -> float:
        host_alpha, host_bw = 2 * (l - 1) * self.f.alpha_shm, 2 * (l - 1) * m / l * self.f.beta_shm
        net_alpha, net_bw = 2 * _log2(h) * self.f.alpha_net, 2 * (h - 1) * m / h * self.f.beta_net
        return host_alpha + net_alpha + max(host_bw, net_bw)

    def leader(self, h: int, l: int, m: float) -> float:
        return 2 * self._shm(_log2(l), _log2(l) * m) + self.rd(h, 1, m)

    def all_reduce(self, h: int, l: int, m: float) -> dict[str, float]:
        out = {"ring": self.ring(h, l, m), "rd": self.rd(h, l, m), "tree": self.tree(h, l, m)}
        if l > 1:
            out["2l-shard"], out["2l-halving"] = self.shard(h, l, m), self.halving(h, l, m)
            out["2l-leader"] = self.leader(h, l, m)
        return out

    # ---- all_to_all (m: one rank's whole buffer) ----
    def pairwise(self, h: int, l: int, m: float) -> float:
        n = h * l
        b = m / n
        return self._shm(l - 1, (l - 1) * b) + self._net(n - l, (n - l) * l * b)

    def aggregated(self, h: int, l: int, m: float) -> float:
        b = m / (h * l)
        return self._shm(l - 1, (l - 1) * h * b) + self._net(h - 1, (h - 1) * l * l * b)

    def all_to_all(self, h: int, l: int, m: float) -> dict[str, float]:
        out = {"pairwise": self.pairwise(h, l, m)}
        if l > 1:
            out["2l-agg"] = self.aggregated(h, l, m)
        return out

    # ---- bootstrap: an all_gather of `blob` bytes per rank ----
    def bootstrap(self, h: int, l: int, blob: int = BLOB) -> dict[str, float]:
        n, f = h * l, self.f
        egress = max(f.beta_store, f.beta_net)   # the store's host sends through its own link
        return {"store-N": n * (n + 1) * f.c_req + n * n * blob * egress,
                "store-1": n * f.c_req + n * n * blob * egress,
                "ring": 2 * n * f.c_req + (n - 1) * (f.alpha_net + blob * f.beta_net),
                "host-agg": (l - 1) * (f.alpha_shm + blob * f.beta_shm) + h * f.c_req + h * n * blob * egress
                + _log2(l) * (f.alpha_shm + n * blob * f.beta_shm)}


def engine_choice(kind: str, h: int, l: int, m: float) -> str:
    """The model's name for what native/src/algorithms/select.cc (and twolevel.cc) run across hosts:
    two levels whenever some host holds several ranks, else recursive doubling up to
    RD_MAX and the ring above; all_to_all: the aggregated form, else pairwise."""
    if kind == "all_reduce":
        if h > 1 and l > 1:
            return "2l-shard" if m >= SHARD_MIN else "2l-leader"
        return "rd" if m <= RD_MAX else "ring"
    return "2l-agg" if h > 1 and l > 1 else "pairwise"


def crossover(model: Model, h: int, l: int, a: str, b: str, lo: float = 1, hi: float = 1 << 30) -> float | None:
    """The size where all_reduce algorithm b starts to beat a (bisection on a log scale)."""
    def faster_b(m):
        t = model.all_reduce(h, l, m)
        return t[b] < t[a]
    if faster_b(lo) or not faster_b(hi):
        return None
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if faster_b(mid) else (mid, hi)
    return hi


# ---- measuring -----------------------------------------------------------------------------
_CLIENTS = r"""
import sys, threading, time
from comm.bootstrap.store import Store
port, k, reps, big = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
stores = [Store("127.0.0.1", port, rank=i + 1, size=k + 1, timeout=60, secret=None) for i in range(k)]
def work(s):
    for _ in range(reps):
        s.get("small")
threads = [threading.Thread(target=work, args=(s,)) for s in stores]
t = time.perf_counter()
[th.start() for th in threads]
[th.join() for th in threads]
small = (time.perf_counter() - t) / (k * reps)
t = time.perf_counter()
for _ in range(big):
    stores[0].get("big")
print(small, (time.perf_counter() - t) / big)
"""


def measure_store(clients: int = 8, reps: int = 300, big_reps: int = 20, tries: int = 3) -> tuple[float, float]:
    """c_req (throughput of the store's host under `clients` concurrent clients) and
    beta_store (a 1 MiB value's reply time per byte), on loopback: the best of `tries`."""
    from comm.bootstrap import rendezvous
    from comm.bootstrap.store import Store
    best = (math.inf, math.inf)
    for _ in range(tries):
        port = rendezvous.free_port()
        host = Store.host_or_connect("127.0.0.1", port, rank=0, size=clients + 1, timeout=60, secret=None)
        try:
            host.set("small", b"x" * 64)
            host.set("big", b"x" * (1 << 20))
            out = subprocess.run([sys.executable, "-c", _CLIENTS, str(port), str(clients), str(reps), str(big_reps)],
                                 capture_output=True, text=True, timeout=120)
            if out.returncode != 0:
                raise RuntimeError(f"store clients failed: {out.stderr.strip().splitlines()[-1:]}")
            c_req, big = (float(v) for v in out.stdout.split())
        finally:
            host.close()
        best = (min(best[0], c_req), min(best[1], max(0.0, big - c_req) / (1 << 20)))
    return best


def pair_steps(size: int, local: bool) -> int:
    """Steps of an all_reduce of two ranks (select.cc): across hosts recursive doubling up to
    RD_MAX (one exchange), the ring above (two of half the buffer); inside a host the direct
    path, rd, then from 64 KiB the ring and from 256 KiB the single-copy cma (one each but the ring)."""
    if local:
        return 2 if RD_MAX < size < CMA_MIN else 1
    return 1 if size <= RD_MAX else 2


def fit_from(rows: list[dict], store: tuple[float, float]) -> tuple[Fit, dict]:
    """The fit, and which sizes each line found off it."""
    sweeps = [r["sweep"] for r in rows if "sweep" in r]
    fitted, dropped = [], {}
    for key in ("pair_local", "pair_remote"):
        pair = next((s[key] for s in sweeps if s[key]), None)
        if not pair:
            raise RuntimeError("the fit needs a run with two hosts and two ranks on a host (e.g. 2x2)")
        sizes = [int(k) for k in pair]
        alpha, beta, kept = fit_robust(sizes, list(pair.values()), [pair_steps(m, key == "pair_local") for m in sizes])
        fitted.append((alpha, beta))
        dropped[key] = {m for m, ok in zip(sizes, kept) if not ok}
    (a_s, b_s), (a_n, b_n) = fitted
    return Fit(a_n, b_n, a_s, b_s, *store), dropped


# ---- printing ------------------------------------------------------------------------------
def _t(seconds: float) -> str:
    for unit, scale in (("s", 1), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds * 1e6:.2g} us"


def _size(b: float) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if b >= scale:
            return f"{b / scale:g}{unit}"
    return f"{b:g}"


def _table(head: list[str], lines: list[list[str]]) -> str:
    width = [max([len(head[i])] + [len(ln[i]) for ln in lines]) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(ln, width)) for ln in [head, *lines])


def fit_table(f: Fit, rows: list[dict], dropped: dict) -> str:
    lines = []
    for r in rows:
        s = r.get("sweep")
        if not s:
            continue
        for key, what, (a, b) in (("pair_local", "one host", (f.alpha_shm, f.beta_shm)),
                                  ("pair_remote", "two hosts", (f.alpha_net, f.beta_net))):
            for size, t in s[key].items():
                model = pair_steps(int(size), key == "pair_local") * a + int(size) * b
                used = "outlier" if int(size) in dropped.get(key, ()) else "yes"
                lines.append([f"{r['hosts']}x{r['per_host']}", what, _size(int(size)), used, _t(t), _t(model),
                              f"{t / model:.2f}"])
        break
    return _table(["shape", "fitted to", "size", "used", "measured", "model", "meas/model"], lines)


def check_table(model: Model, rows: list[dict]) -> list[list[str]]:
    """Measured collectives next to the model of the algorithm the engine ran, with the ranks
    per core of this machine (beyond one, ranks wait for the CPU, which the model does not
    count)."""
    import os
    cores = len(os.sched_getaffinity(0))
    lines = []
    for r in rows:
        h, l = r["hosts"], r["per_host"]
        if h < 2 or r.get("transport", "native") != "native" or r.get("status") != "ok":
            continue
        points = []
        if "sweep" in r:
            points += [("all_reduce", int(k), t) for k, t in r["sweep"]["all_reduce"].items()]
            points += [("all_to_all", int(k), t) for k, t in r["sweep"]["all_to_all"].items()]
        else:
            points.append(("all_reduce", 1 << 20, r["all_reduce_1mib_ms"] / 1e3))
        for kind, size, t in points:
            algo = engine_choice(kind, h, l, size)
            want = (model.all_reduce if kind == "all_reduce" else model.all_to_all)(h, l, size)[algo]
            lines.append([f"{h}x{l}", str(h * l), f"{h * l / cores:.3g}", kind, _size(size), algo, _t(t), _t(want),
                          f"{t / want:.2f}"])
    return lines


def extrapolation(model: Model) -> tuple[list[list[str]], list[list[str]]]:
    ar, a2a = [], []
    for h, l in EXTRAPOLATE:
        for kind, sizes, fn, out in (("all_reduce", AR_SIZES, model.all_reduce, ar),
                                     ("all_to_all", A2A_SIZES, model.all_to_all, a2a)):
            for m in sizes:
                t = fn(h, l, m)
                best = min(t, key=t.get)
                pick = engine_choice(kind, h, l, m)
                out.append([f"{h}x{l}", str(h * l), _size(m)] + [_t(v) for v in t.values()] +
                           [best, pick, f"{t[pick] / t[best]:.2f}"])
    return ar, a2a


def report(f: Fit, rows: list[dict], dropped: dict) -> str:
    model = Model(f)
    def rate(beta: float) -> str:
        return f"{1 / beta / 1e9:.3g} GB/s" if beta else "unbounded"

    out = [f"# fitted on this machine: between hosts alpha {f.alpha_net * 1e6:.1f} us, {rate(f.beta_net)}; "
           f"inside a host alpha {f.alpha_shm * 1e6:.1f} us, {rate(f.beta_shm)}; "
           f"store {f.c_req * 1e6:.0f} us/request, replies {rate(f.beta_store)}",
           "# the fitted points: all_reduce of two ranks, the best of 30",
           fit_table(f, rows, dropped),
           "# model vs measured: the algorithm the engine runs (select.cc), slowest rank's time"]
    checks = check_table(model, rows)
    head = ["shape", "ranks", "per core", "op", "size", "algorithm", "measured", "model", "meas/model"]
    out.append(_table(head, checks) if checks else "(no measured run across hosts)")
    ar, a2a = extrapolation(model)
    out += ["# extrapolated: all_reduce (m: the buffer)",
            _table(["shape", "ranks", "m", "ring", "rd", "tree", "2l-shard", "2l-halving", "2l-leader", "fastest",
                    "engine", "engine/fastest"], ar),
            "# extrapolated: all_to_all (m: one rank's whole buffer)",
            _table(["shape", "ranks", "m", "pairwise", "2l-agg", "fastest", "engine", "engine/fastest"], a2a),
            f"# extrapolated: bootstrap, an all_gather of {BLOB} B per rank"]
    boot = []
    for h, l in EXTRAPOLATE:
        t = model.bootstrap(h, l)
        boot.append([f"{h}x{l}", str(h * l)] + [_t(v) for v in t.values()] + [min(t, key=t.get)])
    out.append(_table(["shape", "ranks", "store-N", "store-1", "ring", "host-agg", "fastest"], boot))
    for h, l in ((8, 1), (128, 1)):
        x = crossover(model, h, l, "rd", "ring")
        out.append(f"# {h}x{l}: the ring overtakes rd from {_size(x) if x else 'never (<1G)'} "
                   f"(the engine switches at {_size(RD_MAX)})")
    for h, l in sorted(set(EXTRAPOLATE) | {(2, 8), (8, 8)}):
        x = crossover(model, h, l, "2l-leader", "2l-shard")
        out.append(f"# {h}x{l}: the sharded two-level all_reduce overtakes the leader form from "
                   f"{_size(x) if x else 'never (<1G)'} (the engine switches at {_size(SHARD_MIN)})")
    return "\n".join(out)


def main(args, run_shape) -> int:
    """The model's report; run_shape is bench.scale's (the real runs the fit is made from)."""
    import json
    from .cluster import unavailable
    measured = []
    if args.measured:
        with open(args.measured) as fh:
            measured = json.load(fh)["results"]
    why = unavailable()
    if why:
        print(f"bench.scale --model: {why} (the fit needs real runs across simulated hosts)", file=sys.stderr)
        return 2
    rows = []
    for h, l in args.shapes or [(2, 2), (4, 4), (8, 8)]:
        rows += run_shape(h, l, ["native"], args, sweep=True)
    failed = [r for r in rows if r["status"] != "ok" or r.get("sweep", {}).get("wrong")]
    for r in failed:
        print(f"# {r['hosts']}x{r['per_host']}: {r['reason'] or 'wrong results'}", file=sys.stderr)
    t = time.perf_counter()
    fit, dropped = fit_from([r for r in rows if r["status"] == "ok"], measure_store())
    print(f"# bench.scale --model: link {args.link_rate or 'unlimited'}; fit and checks took "
          f"{time.perf_counter() - t:.1f} s beyond the runs")
    print(report(fit, rows + measured, dropped))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"schema": "comm-bench-scale-model/1", "link_rate": args.link_rate, "fit": asdict(fit),
                       "runs": rows}, fh, indent=1)
        print(f"# wrote {args.json}")
    return 1 if failed else 0
