"""`python -m bench`: command line and the run over transports and benchmarks."""
from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys

from comm.core import config
from comm.core.types import DType, ReduceOp, op_allowed
from transports import base

from . import cluster, report
from .benchmarks import load_all
from .launch import Control, StepFailed, find_mpirun, launch_on_hosts, launched, placement, self_launch
from .measure import Options
from .runners import ANCHORS, NAMES, make_runner
from .sweep import medians, sweep

DTYPES = {"int8": DType.INT8, "char": DType.INT8, "uint8": DType.UINT8, "int16": DType.INT16,
          "int32": DType.INT32, "int": DType.INT32, "int64": DType.INT64,
          "half": DType.FLOAT16, "float16": DType.FLOAT16, "fp16": DType.FLOAT16,
          "float": DType.FLOAT32, "float32": DType.FLOAT32, "fp32": DType.FLOAT32,
          "double": DType.FLOAT64, "float64": DType.FLOAT64, "fp64": DType.FLOAT64,
          "bfloat16": DType.BFLOAT16, "bf16": DType.BFLOAT16, "bool": DType.BOOL}
ALL_DTYPES = [DType.INT8, DType.UINT8, DType.INT16, DType.INT32, DType.INT64, DType.FLOAT16,
              DType.FLOAT32, DType.FLOAT64, DType.BFLOAT16]
OPS = {"sum": ReduceOp.SUM, "prod": ReduceOp.PRODUCT, "product": ReduceOp.PRODUCT, "max": ReduceOp.MAX,
       "min": ReduceOp.MIN, "avg": ReduceOp.AVG, "mulsum": ReduceOp.PREMUL_SUM,
       "premul_sum": ReduceOp.PREMUL_SUM, "band": ReduceOp.BAND, "bor": ReduceOp.BOR, "bxor": ReduceOp.BXOR}
ALL_OPS = [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.AVG, ReduceOp.PREMUL_SUM]
KINDS = {"comm": "this library", "torch": "this library through torch.distributed"}
AVERAGE_NAMES = {"0": 0, "rank0": 0, "1": 1, "avg": 1, "2": 2, "min": 2, "3": 3, "max": 3}

EPILOG = """\
transports: this library's by name (native, mpi, ucx, nccl, verbs), torch-comm (torch.distributed
  on this library's backend "comm"), and the anchors gloo (torch.distributed), mpi-raw (plain
  mpi4py calls; needs an MPI launcher) and comm-p2p (this library's send / recv doing what the
  one-sided benchmarks put, get, put_signal and kv do).
launch: mpirun -np N python -m bench ... | torchrun --nproc-per-node N -m bench ... |
  srun -n N python -m bench ... | python -m bench --np N ... (self-launch; uses mpirun
  when mpi-raw is requested and an mpirun is found, unless --no-mpirun).
example: python -m bench --np 2 all_reduce -b 8 -e 64M -f 2 --transport native,mpi-raw,gloo
"""


def parse_size(text: str) -> int:
    """'8', '64K', '1.5M', '1G', '64MB', '2GiB' -> bytes (K/M/G are powers of 1024, as nccl-tests)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([kKmMgGtT]?)(?:i?[bB])?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: use a number with an optional K, M or G")
    unit = 1024 ** " KMGT".index(m.group(2).upper() or " ")
    return int(float(m.group(1)) * unit)


def _choice(table: dict, what: str):
    def parse(text: str):
        key = text.lower()
        if key == "all":
            return "all"
        if key not in table:
            raise argparse.ArgumentTypeError(f"unknown {what} {text!r}; one of: all, {', '.join(table)}")
        return table[key]
    return parse


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if value < 0:
            raise argparse.ArgumentTypeError(f"{text} must not be negative")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench", epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                description="Collective benchmarks with nccl-tests conventions, "
                                            "for several transports side by side.")
    p.add_argument("benchmarks", nargs="*", metavar="BENCHMARK",
                   help="all_reduce (default), reduce_scatter, all_gather, broadcast, reduce, all_to_all, "
                        "all_to_all_v, sendrecv, barrier, any added module, or all")
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("32M"), help="smallest size (32M)")
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("32M"), help="largest size (32M)")
    p.add_argument("-i", "--stepbytes", type=parse_size, default=parse_size("1M"),
                   help="size increment when -f is 1 (1M)")
    p.add_argument("-f", "--stepfactor", type=_positive(int), default=1, help="size multiplier (1: use -i)")
    p.add_argument("-n", "--iters", type=_positive(int), default=20, help="timed iterations (20)")
    p.add_argument("-w", "--warmup_iters", type=_positive(int), default=5, help="warmup iterations (5)")
    p.add_argument("-c", "--check", type=_positive(int), default=1, help="check results: 1 (default) or 0")
    p.add_argument("-d", "--datatype", type=_choice(DTYPES, "dtype"), default=DType.FLOAT32,
                   help="float (default), half, bfloat16, double, int8, uint8, int16, int32, int64, bool, or all")
    p.add_argument("-o", "--op", type=_choice(OPS, "op"), default=ReduceOp.SUM,
                   help="sum (default), prod, min, max, avg, mulsum, band, bor, bxor, or all")
    p.add_argument("-r", "--root", type=_positive(int), default=0, help="root of broadcast/reduce (0)")
    p.add_argument("-a", "--average", type=_choice(AVERAGE_NAMES, "average"), default=1,
                   help="time reported over ranks: 0 rank 0, 1 avg (default), 2 min, 3 max")
    p.add_argument("-T", "--timeout", type=float, default=None,
                   help="seconds any operation may take (default COMM_TIMEOUT)")
    p.add_argument("--transport", default=None,
                   help="comma-separated list, e.g. native,mpi-raw,gloo (default COMM_TRANSPORT)")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON (schema comm-bench/1)")
    p.add_argument("--plot", metavar="FILE.png", help="write busbw against size as a PNG (needs matplotlib); "
                                                      f"more than {report.PANELS_PER_FILE} panels continue in FILE-2.png, ...")
    p.add_argument("--plot-logy", action="store_true", help="log scale for busbw in the plot (small sizes readable)")
    p.add_argument("--np", type=_positive(int), default=0, help="self-launch this many local ranks")
    p.add_argument("--no-mpirun", action="store_true", help="self-launch plain processes even for mpi-raw")
    p.add_argument("--hosts", type=_positive(int), default=0,
                   help="self-launch on this many simulated hosts (network namespaces, root only), "
                        "--np ranks on each")
    p.add_argument("--link-rate", metavar="RATE", default=None,
                   help="with --hosts: limit each host's link to RATE each way (e.g. 2gbit); the "
                        "comparison then shows the link bound of busbw")
    p.add_argument("--compress", metavar="FORMATS", default=None,
                   help="compressed collectives (bf16,fp8) against the exact path, with --hosts: "
                        "runs python -m bench.compress (effective busbw, link bound, measured error) "
                        "for all_reduce and reduce_scatter + all_gather, float32")
    p.add_argument("--time-budget", type=float, default=0.25,
                   help="seconds of timed iterations per size and mode before -n is cut, shared by "
                        "the --runs repetitions (0.25; 0: never cut)")
    p.add_argument("--runs", type=_positive(int), default=3,
                   help="repetitions of every size on every transport (3), interleaved: at each size "
                        "each repetition measures every transport once, side by side; tables and "
                        "comparison give the median, and the comparison the range of the ratios "
                        "taken within each repetition (a shared machine's speed drifts between minutes)")
    p.add_argument("--persistent", action="store_true",
                   help="time this library's persistent form (all_reduce_init ...: set up once, run each "
                        "iteration) instead of the one-shot calls")
    p.add_argument("--async", dest="async_op", action="store_true",
                   help="time every library's asynchronous form waited for at once: async_op=True then "
                        "wait() (mpi-raw: MPI_Iallreduce ... then MPI_Wait); with --persistent, "
                        "h.start(); h.wait()")
    return p


# Presets: a benchmark name that also sets the flags the user did not give.
# decode times microsecond operations: 20 iterations would measure noise, so it takes 2000
# (--time-budget still cuts the slow anchors short).
PRESETS = {"decode": {"minbytes": ("-b", "4K"), "maxbytes": ("-e", "256K"), "stepfactor": ("-f", "2"),
                      "datatype": ("-d", "bfloat16"), "iters": ("-n", "2000"), "warmup_iters": ("-w", "200"),
                      "transport": ("--transport", "native,mpi-raw,gloo")},
           # kv: the block sizes of a paged KV cache (16-256 KiB), each row a request of 32 blocks
           "kv": {"minbytes": ("-b", "16K"), "maxbytes": ("-e", "256K"), "stepfactor": ("-f", "2"),
                  "transport": ("--transport", "native,comm-p2p,mpi-raw")}}


def _apply_presets(args, argv: list[str]) -> None:
    given = {a.split("=")[0] for a in argv}
    parser = build_parser()
    for name in args.benchmarks:
        for dest, (flag, value) in PRESETS.get(name, {}).items():
            if not {flag, "--" + dest} & given:
                setattr(args, dest, parser.parse_args([flag, value]).__dict__[dest])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked before anything starts: a mistake exits 2 with argparse's usage line."""
    p = build_parser()
    args = p.parse_args(argv)
    _apply_presets(args, list(sys.argv[1:] if argv is None else argv))
    args.transports = [t.strip() for t in (args.transport or config.get("COMM_TRANSPORT")).split(",") if t.strip()]
    known = base.names() + list(NAMES)
    unknown = [t for t in args.transports if t not in known]
    if unknown or not args.transports:
        p.error(f"--transport: unknown {', '.join(map(repr, unknown)) or 'empty list'}; known: {', '.join(known)}")
    if args.runs < 1:
        p.error("--runs must be at least 1")
    if args.average == "all":
        p.error("-a takes 0, 1, 2 or 3")
    if not sizes(args):
        p.error(f"no size to measure: -b {args.minbytes} is larger than -e {args.maxbytes}")
    missing = [n for n in args.benchmarks if n != "all" and n not in load_all()]
    if missing:
        p.error(f"unknown benchmark {', '.join(missing)}; known: {', '.join(load_all())}, all")
    if args.hosts and not args.np:
        p.error("--hosts needs --np (ranks on each host)")
    if args.link_rate and not args.hosts:
        p.error("--link-rate needs --hosts")
    if args.link_rate:
        try:
            cluster.rate_bits(args.link_rate)
        except ValueError as e:
            p.error(f"--link-rate: {e}")
    if args.plot and report.plot_unavailable():
        p.error(f"--plot: {report.plot_unavailable()}")
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            p.error(f"{flag} {path}: no such directory")   # found now, not after the sweep
    return args


def sizes(args) -> list[int]:
    out, size = [], args.minbytes
    while size <= args.maxbytes:
        out.append(size)
        nxt = size * args.stepfactor if args.stepfactor > 1 else size + args.stepbytes
        if nxt <= size:
            break
        size = nxt
    return out


def _benchmarks(args, known: dict) -> list:
    names = args.benchmarks or ["all_reduce"]
    if "all" in names:
        names = list(known)
    return [known[n] for n in names]   # parse_args refused unknown names


def _ops(args, bench, dtype: DType) -> list:
    if not bench.reduces:
        return [None]
    ops = ALL_OPS if args.op == "all" else [args.op]
    return [op for op in ops if op_allowed(op, dtype)]


def main(argv: list[str] | None = None, out=None, err=None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw)
    benches = _benchmarks(args, load_all())
    if args.compress:   # its own comparison: compressed results are not bit-exact (bench/compress.py)
        ops = {"all_reduce": "all_reduce", "reduce_scatter": "rs_ag", "all_gather": "rs_ag"}
        chosen = sorted({ops[b.name] for b in benches if b.name in ops}) or ["all_reduce", "rs_ag"]
        return subprocess.call([sys.executable, "-m", "bench.compress", "--hosts", str(args.hosts or 1), "--np", str(args.np or 2), "-b", str(args.minbytes),
                              "-e", str(args.maxbytes), "-f", str(max(2, args.stepfactor)), "--formats", args.compress,
                              "--ops", ",".join(chosen), "--runs", str(args.runs)]
                             + (["--link-rate", args.link_rate] if args.link_rate else [])
                             + (["--json", args.json] if args.json else []))
    if args.hosts and not launched():
        return launch_on_hosts(raw, args.hosts, args.np, args.link_rate, err or sys.stderr)
    if args.np and not launched():
        use_mpirun = "mpi-raw" in args.transports and not args.no_mpirun
        if use_mpirun and find_mpirun() is None:
            print("mpi-raw: needs mpirun (none found); the other transports run", file=err or sys.stderr)
        return self_launch(raw, args.np, use_mpirun)
    world = placement()
    timeout = args.timeout or config.get("COMM_TIMEOUT")
    ctl = Control(world, timeout + 60)
    try:
        return _run(args, raw, benches, world, ctl, report.Printer(world.rank == 0, out, err))
    finally:
        ctl.close()


def _preamble(pr: report.Printer, args, world, opts: Options, ctl: Control) -> None:
    procs = ctl.gather([os.getpid(), socket.gethostname()])
    step = f"{args.stepfactor}(factor)" if args.stepfactor > 1 else f"{args.stepbytes}(bytes)"
    pr.line(f"# comm bench: {' '.join(b for b in (args.benchmarks or ['all_reduce']))}")
    pr.line(f"# nranks {world.size} launcher {world.launcher} minBytes {args.minbytes} maxBytes {args.maxbytes} "
            f"step: {step} warmup iters: {opts.warmup} iters: {opts.iters} validation: {opts.check} "
            f"average: {report.AVERAGES[opts.average]} time budget: {args.time_budget:g} s "
            f"runs: {args.runs} (interleaved)")
    pr.line("#")
    for r, (pid, host) in enumerate(procs):
        pr.line(f"#  Rank {r:2d} Pid {pid:7d} on {host:>12s} device cpu")
    pr.line("#")


def _run(args, raw, benches, world, ctl: Control, pr: report.Printer) -> int:
    # the budget is per size and mode: the repetitions share it, so --runs costs no more time
    # where the budget cuts -n (large sizes)
    opts = Options(sizes(args), args.iters, args.warmup_iters, args.check, args.average, args.root,
                   args.time_budget / max(1, args.runs), args.timeout)
    if args.root >= world.size and any(b.rooted for b in benches):
        pr.note(f"root {args.root} is not a rank of this {world.size}-rank job")
        return 2
    _preamble(pr, args, world, opts, ctl)
    rows, status, failed = [], [], []   # failed: why the exit status is 1
    dtypes = ALL_DTYPES if args.datatype == "all" else [args.datatype]
    # Every transport stays up for the whole run, so that each size measures them side by side
    # (bench/sweep.py); one that fails is measured no more, and the others go on.
    live = _start(args, world, ctl, pr, status, failed)
    failures: dict[str, str] = {}
    try:
        for bench in benches:
            if world.size < bench.min_ranks:
                pr.line(f"# {bench.name}: skipped: needs at least {bench.min_ranks} ranks")
                continue
            mine = sweep(bench, live, failures, dtypes, lambda b, d: _ops(args, b, d), args, opts, world, ctl, pr)
            _print_tables(pr, bench, live, mine, args.runs)
            rows += mine
    finally:
        for name in reversed(live):   # a torch group made second goes before the default group
            _teardown(live[name])
    for name, why in failures.items():
        failed.append(f"{name} failed ({why})")
        _set_status(status, name, live[name].kind, "failed", why)
    bounds = None
    if args.link_rate:
        per_host = world.size // args.hosts
        bounds = {b.name: cluster.link_bound(b.name, args.hosts, per_host, args.link_rate) for b in benches}
        for name, bound in bounds.items():
            if bound:
                pr.line(f"# link bound of {name}: busbw <= {bound:.3f} GB/s ({args.hosts} hosts x {per_host} "
                        f"ranks, links of {args.link_rate} each way)")
    table = report.comparison(rows, args.transports, ANCHORS, bounds)
    if table:
        pr.line(table)
    if any(m.wrong for r in rows for m in r.modes.values() if m is not None):
        failed.append("#wrong is not 0: some results were wrong")
    if not rows:
        skipped = "; ".join(f"{s['name']}: {s['reason']}" for s in status if s["status"] == "skipped")
        failed.append("nothing was measured" + (f" ({skipped})" if skipped else ""))
    if world.rank == 0:
        written = []
        if args.json:
            report.write_json(args.json, report.to_json(rows, status, report.settings_json(opts, args), raw, world))
            written.append(args.json)
        if args.plot and rows:
            written += report.plot(args.plot, rows, args.transports, log_y=args.plot_logy)
        for path in written:
            pr.line(f"# wrote {path}")
        for why in failed:
            pr.note(f"exit status 1: {why}")
    return 1 if failed else 0


def _set_status(status: list, name: str, kind: str, state: str, reason: str | None) -> None:
    """Record how transport `name` went, in place of what was recorded for it before."""
    entry = {"name": name, "kind": kind, "status": state, "reason": reason}
    at = next((i for i, s in enumerate(status) if s["name"] == name), None)
    if at is None:
        status.append(entry)
    else:
        status[at] = entry


def _teardown(runner) -> None:
    try:
        runner.teardown()
    except Exception as e:  # a transport that failed may not close cleanly; the run goes on
        print(f"# {runner.name}: teardown: {e}", file=sys.stderr)


def _start(args, world, ctl: Control, pr: report.Printer, status: list, failed: list) -> dict:
    """Set up every transport, in --transport order: name -> runner. One that cannot run here is
    skipped, one that cannot start is failed; both are recorded and left out."""
    live = {}
    for name in args.transports:
        runner = make_runner(name, args.persistent, args.async_op)
        reasons = ctl.gather(runner.unavailable(world.launcher))
        reason = next((f"rank {r}: {x}" if world.size > 1 and len(set(reasons)) > 1 else x
                       for r, x in enumerate(reasons) if x), None)
        if reason:
            pr.line(f"# {name}: skipped: {reason}")
            _set_status(status, name, runner.kind, "skipped", reason)
            continue
        port = ctl.fresh_port()
        try:
            try:
                runner.setup(world.rank, world.size, world.addr, port, args.timeout)
            except Exception as e:
                ctl.fail(e)
            ctl.gather("up")
        except StepFailed as e:
            failed.append(f"{name} could not start ({e})")
            pr.line(f"# {name}: failed: cannot start ({e})")
            _set_status(status, name, runner.kind, "failed", f"cannot start: {e}")
            _teardown(runner)
            continue
        _set_status(status, name, runner.kind, "ok", None)
        live[name] = runner
    return live


def _print_tables(pr: report.Printer, bench, live: dict, rows: list, runs: int) -> None:
    """Each transport's nccl-tests table of one benchmark: per size, the repetition of median time."""
    for name, runner in live.items():
        mine = [r for r in rows if r.transport == name]
        pr.line(f"# Transport: {name} ({KINDS.get(runner.kind, 'anchor')})")
        pr.line(f"# Collective test: {bench.name}")
        if runs > 1:
            pr.line(f"# each row: the repetition of median time of {runs}, interleaved with the other transports")
        pr.line(report.header())
        shown = medians(mine)
        for row in shown:
            pr.line(report.format_row(row))
        pr.line(report.footer(shown))
