"""Set-up at scale: `python -m bench.scale --hosts H --np N [--transport native,gloo]`.

Real ranks (N per host) on H simulated hosts (bench/cluster.py: network namespaces, root only),
each transport in turn in the same cluster: how long the job takes to start (init: from the
first rank's launch to the last rank ready), the first all_reduce (1 MiB) and the first
all_to_all (both checked, started together once every rank is ready), the steady all_reduce
of 1 MiB, and per rank the descriptors, RSS and anonymous RSS (RSS less the files and the
shared memory mapped, which RSS counts in every rank of a host) after every collective kind ran
(all_reduce, reduce_scatter, all_gather, broadcast, reduce, all_to_all, barrier, a send/recv
ring; each checked). Several shapes (`--shapes 2x8,8x8`) add how each number grows from one to the next.

    python -m bench.scale --shapes 2x8,8x8 --transport native,gloo --json scale.json
    python -m bench.scale --model                  # the cost model (bench/scale_model.py)

Start-up is CPU-bound on a small machine, and gloo's grows fast with the ranks: every run has
`--time-budget` seconds, after which its ranks are killed and the row says "did not finish".
Namespaces and ranks are removed on every exit (an error, Ctrl-C, SIGTERM).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from comm.bootstrap import rendezvous

from .launch import _child_env

TRANSPORTS = ("native", "gloo")
METRICS = [  # key, column head, format
    ("start_s", "start s", "{:.1f}"), ("init_s", "init s", "{:.1f}"), ("init_cpu_ms", "init cpu ms", "{:.0f}"),
    ("first_all_reduce_ms", "1st ar ms", "{:.1f}"), ("first_all_to_all_ms", "1st a2a ms", "{:.1f}"),
    ("all_reduce_1mib_ms", "ar 1M ms", "{:.1f}"), ("fds_init", "fds init", "{:d}"),
    ("fds", "fds", "{:d}"), ("fds_r0", "fds r0", "{:d}"), ("rss_mib", "rss MiB", "{:.0f}"), ("anon_mib", "anon MiB", "{:.0f}")]


def parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for part in text.split(","):
        try:
            h, n = (int(v) for v in part.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"shape {part!r}: expected HOSTSxRANKS_PER_HOST, e.g. 8x8") from None
        if not (1 <= h <= 250 and n >= 1):
            raise argparse.ArgumentTypeError(f"shape {part!r}: 1-250 hosts, at least 1 rank per host")
        shapes.append((h, n))
    return shapes


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, help="simulated hosts (with --np)")
    p.add_argument("--np", type=int, help="ranks per host (with --hosts)")
    p.add_argument("--shapes", type=parse_shapes, help="several HxN shapes, e.g. 2x8,8x8")
    p.add_argument("--transport", default="native,gloo", help="native, gloo or both (default native,gloo)")
    p.add_argument("--time-budget", type=float, default=300.0,
                   help="seconds each run may take from launch to its last result (default 300)")
    p.add_argument("--iters", type=int, default=10, help="timed all_reduce iterations (default 10)")
    p.add_argument("--link-rate", help="limit each host's link, e.g. 1gbit (tc tbf)")
    p.add_argument("--json", help="write every result to this file")
    p.add_argument("--model", action="store_true", help="the alpha-beta cost model: fit, check, extrapolate")
    p.add_argument("--measured", help="with --model: also check it against this --json of a run")
    a = p.parse_args(argv)
    a.transports = [t.strip() for t in a.transport.split(",") if t.strip()]
    for t in a.transports:
        if t not in TRANSPORTS:
            p.error(f"--transport {t!r}: expected one of {', '.join(TRANSPORTS)}")
    if (a.hosts is None) != (a.np is None):
        p.error("--hosts and --np go together")
    if a.hosts is not None:
        if a.shapes:
            p.error("give --hosts/--np or --shapes, not both")
        a.shapes = parse_shapes(f"{a.hosts}x{a.np}")
    if not a.shapes and not a.model:
        p.error("give --hosts H --np N, --shapes, or --model")
    if a.model and a.shapes and not any(h > 1 and n > 1 for h, n in a.shapes):
        p.error("--model is fitted to a shape of two hosts or more with two ranks or more on each (e.g. 2x2)")
    if a.link_rate:
        from .cluster import rate_bits
        try:
            rate_bits(a.link_rate)
        except ValueError as e:
            p.error(f"--link-rate: {e}")
    if a.time_budget <= 0 or a.iters < 1:
        p.error("--time-budget and --iters must be positive")
    return a


class Job:
    """The ranks of one run, their result files, and their end (always: kill what is left)."""

    def __init__(self, cluster, per_host: int, transport: str, port: int, iters: int, budget: float,
                 sweep: bool = False):
        self.dir = tempfile.mkdtemp(prefix="comm-scale-")
        self.n = cluster.hosts * per_host
        self.budget = budget
        self.procs: list[subprocess.Popen] = []
        env = dict(_child_env(), GLOO_SOCKET_IFNAME=cluster.dev)
        env.setdefault("COMM_TIMEOUT", f"{budget:g}")
        hosts = cluster.placement(per_host)
        self.t0 = time.monotonic()
        cmd = [sys.executable, "-m", "bench.scale_rank", self.dir, transport, repr(self.t0), str(iters)]
        cmd += ["--sweep"] if sweep else []
        try:
            for r, (h, e) in enumerate(zip(hosts, cluster.rank_env(hosts, port))):
                with open(os.path.join(self.dir, f"{r}.err"), "w") as err:
                    self.procs.append(subprocess.Popen(cluster.exec_prefix(h) + cmd, env=dict(env, **e),
                                                       stdout=err, stderr=subprocess.STDOUT, start_new_session=True))
        except BaseException:   # interrupted while launching: the ranks started so far go too
            self.close()
            raise

    def _count(self, suffix: str) -> int:
        return sum(1 for f in os.listdir(self.dir) if f.endswith(suffix))

    def wait(self) -> tuple[list[dict], str | None]:
        """Every rank's result, or those there are and why the run failed."""
        go, why = False, None
        while True:
            if not go and self._count(".ready") == self.n:
                open(os.path.join(self.dir, "go"), "w").close()
                go = True
            if self._count(".json") == self.n:
                break
            failed = [r for r, p in enumerate(self.procs) if p.poll() not in (None, 0)]
            if failed:
                why = f"rank {failed[0]} failed: {self._last_line(failed[0])}"
                break
            if time.monotonic() - self.t0 > self.budget:
                why = f"did not finish in {self.budget:g} s ({self._count('.ready')}/{self.n} ranks ready)"
                break
            time.sleep(0.1)
        if why is None:   # every result is in: let the ranks close, then end any that hang there
            end = time.monotonic() + 30
            while time.monotonic() < end and any(p.poll() is None for p in self.procs):
                time.sleep(0.1)
        results = []
        for r in range(self.n):
            try:
                with open(os.path.join(self.dir, f"{r}.json")) as f:
                    results.append(json.load(f))
            except FileNotFoundError:
                pass
        return results, why

    def _last_line(self, rank: int) -> str:
        with open(os.path.join(self.dir, f"{rank}.err"), errors="replace") as f:
            lines = [line.strip() for line in f if line.strip()]
        return lines[-1] if lines else f"exit status {self.procs[rank].returncode}"

    def close(self) -> None:
        with signals_held():
            self._close()

    def _close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except OSError:
                    pass
        for p in self.procs:
            p.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


# What a rank costs the machine, in MiB, as measured at 2x8 and 8x8: its own memory (RssAnon:
# native 21, gloo 149, and page tables) and, for native, its share of its host's shared
# memory: a collective ring and a 128 KiB p2p ring per local peer (native/src/channels/shm/shm.h: 2 MiB
# rings up to 8 peers, beyond that 16 MiB shared among them, at least 512 KiB each).
RANK_MIB = {"native": 30, "gloo": 160}


def shared_mib(transport: str, per_host: int) -> float:
    if transport != "native":
        return 0.0
    peers = max(1, per_host - 1)
    ring = 2.0 if peers <= 8 else max(0.5, 16.0 / peers)
    return per_host * (ring + 0.125)


def memory_short(hosts: int, per_host: int, transport: str) -> str | None:
    """Why this machine cannot hold the ranks, or None: a run that would push it into swap or
    the OOM killer (of everything else it runs too) is refused before it starts."""
    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:")) / 1024
    need = hosts * per_host * (RANK_MIB[transport] + shared_mib(transport, per_host))
    if need > 0.8 * avail:
        return (f"not started: {hosts * per_host} ranks need about {need / 1024:.1f} GiB, "
                f"{avail / 1024:.1f} GiB available")
    return None


@contextlib.contextmanager
def signals_held():
    """Clean-up runs to its end: a second Ctrl-C (or a SIGTERM after it) waits until it is done."""
    sigs = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def summarize(results: list[dict], hosts: int, per_host: int, transport: str, why: str | None) -> dict:
    """One row: the worst rank of each measure (the job waits for its slowest rank)."""
    row = {"hosts": hosts, "per_host": per_host, "ranks": hosts * per_host, "transport": transport,
           "status": "ok" if why is None else "failed", "reason": why}
    if why is not None:
        return row
    worst = {k: max(r[k] for r in results) for k in ("start_s", "ready_s", "fds_base", "fds_init", "fds",
                                                      "rss_mib", "rss_base_mib", "anon_mib", "anon_base_mib",
                                                      "first_all_reduce_s",
                                                      "first_all_to_all_s", "all_reduce_1mib_s")}
    kinds: dict[str, int] = {}
    for r in results:
        for kind, w in r["wrong"].items():
            kinds[kind] = kinds.get(kind, 0) + w
    # below comm.bootstrap.store_process.OWN_PROCESS_FROM ranks, rank 0's process hosts the rendezvous
    # store (as torch's TCPStore): one socket per rank, its own column
    others = [r for r in results if r["rank"] != 0] or results
    row.update(start_s=worst["start_s"], init_s=worst["ready_s"],
               init_median_s=statistics.median(r["ready_s"] for r in results),
               init_cpu_ms=statistics.median(r["init_cpu_s"] for r in results) * 1e3,
               first_all_reduce_ms=worst["first_all_reduce_s"] * 1e3,
               first_all_to_all_ms=worst["first_all_to_all_s"] * 1e3,
               all_reduce_1mib_ms=worst["all_reduce_1mib_s"] * 1e3,
               fds_base=worst["fds_base"], fds_init=worst["fds_init"], fds=max(r["fds"] for r in others),
               fds_r0=next((r["fds"] for r in results if r["rank"] == 0), worst["fds"]),
               rss_mib=worst["rss_mib"], rss_base_mib=worst["rss_base_mib"],
               anon_mib=worst["anon_mib"], anon_base_mib=worst["anon_base_mib"],
               wrong=sum(kinds.values()), wrong_by_kind=kinds, checked=sorted(kinds))
    if any("sweep" in r for r in results):
        row["sweep"] = merge_sweeps([r["sweep"] for r in results if "sweep" in r])
    if row["wrong"]:
        row["status"] = "wrong"
    return row


def merge_sweeps(sweeps: list[dict]) -> dict:
    """Every time: the slowest rank's (of those that took part)."""
    out = {"pair_local": {}, "pair_remote": {}, "all_reduce": {}, "all_to_all": {},
           "wrong": sum(s["wrong"] for s in sweeps)}
    for s in sweeps:
        for key in ("pair_local", "pair_remote", "all_reduce", "all_to_all"):
            for size, t in s[key].items():
                out[key][size] = max(out[key].get(size, 0.0), t)
    return out


def run_shape(hosts: int, per_host: int, transports: list[str], args, sweep: bool = False) -> list[dict]:
    from .cluster import NetnsCluster
    rows = []
    cluster = NetnsCluster(hosts, args.link_rate)
    try:
        for i, transport in enumerate(transports):
            short = memory_short(hosts, per_host, transport)
            if short:
                rows.append(summarize([], hosts, per_host, transport, short))
                continue
            print(f"# {hosts}x{per_host} {transport}: running ...", file=sys.stderr, flush=True)
            job = Job(cluster, per_host, transport, rendezvous.DEFAULT_PORT + i, args.iters, args.time_budget, sweep)
            try:
                results, why = job.wait()
            finally:
                job.close()
            rows.append(summarize(results, hosts, per_host, transport, why))
    finally:
        with signals_held():
            cluster.close()
    return rows


def _cell(row: dict, key: str, fmt: str) -> str:
    return fmt.format(row[key]) if key in row else "-"


def table(rows: list[dict]) -> str:
    head = ["shape", "ranks", "transport"] + [m[1] for m in METRICS] + ["checked"]
    lines = []
    for row in rows:
        cells = [f"{row['hosts']}x{row['per_host']}", str(row["ranks"]), row["transport"]]
        if row["status"] == "failed":
            lines.append(cells + [f"FAILED: {row['reason']}"])
            continue
        cells += [_cell(row, k, f) for k, _, f in METRICS]
        cells.append("ok" if row["wrong"] == 0 else f"{row['wrong']} wrong ({row['wrong_by_kind']})")
        lines.append(cells)
    return _render(head, lines)


def _render(head: list[str], lines: list[list[str]]) -> str:
    width = [max([len(head[i])] + [len(ln[i]) for ln in lines if len(ln) == len(head)]) for i in range(len(head))]
    out = ["  ".join(h.rjust(w) for h, w in zip(head, width))]
    for ln in lines:
        if len(ln) == len(head):
            out.append("  ".join(c.rjust(w) for c, w in zip(ln, width)))
        else:   # a failed run: its reason in place of the numbers
            out.append("  ".join(c.rjust(w) for c, w in zip(ln[:3], width)) + "  " + ln[3])
    return "\n".join(out)


def growth(rows: list[dict]) -> str:
    """Each transport from one shape to the next: the ratio of every measure (descriptors and
    RSS also as a difference per rank)."""
    head = ["transport", "from", "to", "ranks"] + [m[1] for m in METRICS]
    lines = []
    for transport in dict.fromkeys(r["transport"] for r in rows):
        mine = [r for r in rows if r["transport"] == transport and r["status"] != "failed"]
        for a, b in zip(mine, mine[1:]):
            cells = [transport, f"{a['hosts']}x{a['per_host']}", f"{b['hosts']}x{b['per_host']}",
                     f"x{b['ranks'] / a['ranks']:.2g}"]
            for key, _, fmt in METRICS:
                if key not in a or key not in b:
                    cells.append("-")
                elif key in ("fds", "fds_r0", "fds_init", "rss_mib", "anon_mib"):
                    cells.append(f"{b[key] - a[key]:+.0f}")
                else:
                    cells.append(f"x{b[key] / a[key]:.2f}" if a[key] else "-")
            lines.append(cells)
    return _render(head, lines) if lines else ""


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)

    def stop(signum, frame):   # unwind, so every namespace and rank goes
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)
    # Ctrl-C unwinds too, even where a shell started us with SIGINT ignored (a background job)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return _model(args) if args.model else _runs(args)
    except KeyboardInterrupt:   # the ranks and namespaces are gone by now (run_shape unwound)
        print("bench.scale: interrupted", file=sys.stderr)
        return 130


def _model(args) -> int:
    from . import scale_model
    return scale_model.main(args, run_shape)


def _runs(args) -> int:
    from .cluster import unavailable
    why = unavailable()
    if why:
        print(f"bench.scale: {why}", file=sys.stderr)
        return 2
    if "gloo" in args.transports and importlib.util.find_spec("torch") is None:
        print("# gloo: skipped: torch is not installed (pip install torch)")
        args.transports.remove("gloo")
    rows = []
    for hosts, per_host in args.shapes:
        rows += run_shape(hosts, per_host, args.transports, args)
    print(f"# bench.scale: {', '.join(f'{h}x{n}' for h, n in args.shapes)} (hosts x ranks per host), "
          f"link {args.link_rate or 'unlimited'}; per rank, the slowest rank's value; init from launch")
    print(table(rows))
    g = growth(rows)
    if g:
        print("# growth from one shape to the next (ratio; descriptors and RSS: difference per rank)")
        print(g)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"schema": "comm-bench-scale/1", "command": sys.argv, "link_rate": args.link_rate,
                       "results": rows}, f, indent=1)
        print(f"# wrote {args.json}")
    bad = [r for r in rows if r["status"] != "ok"]
    for r in bad:
        print(f"# {r['hosts']}x{r['per_host']} {r['transport']}: {r['reason'] or r['status']}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
