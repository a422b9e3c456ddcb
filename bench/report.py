"""Output: nccl-tests tables, the comparison table, JSON and the PNG plot (rank 0 only).

JSON schema "comm-bench/1" (stable; fields are only ever added, never renamed):

    {"schema": "comm-bench/1",
     "command": [argv...], "world_size": int, "launcher": str, "host": str, "time": ISO-8601 UTC,
     "settings": {"min_bytes", "max_bytes", "step_bytes", "step_factor", "iters", "warmup_iters",
                  "check", "average": "rank0"|"avg"|"min"|"max", "time_budget_s", "root", "runs"},
     "transports": [{"name", "kind": "comm"|"torch"|"anchor", "status": "ok"|"skipped"|"failed",
                     "reason": str|null}],
     "results": [{"transport", "benchmark", "dtype": str|null, "redop": str|null, "root": int (-1: none),
                  "size_bytes": int, "count": int,
                  "out_of_place": MODE|null, "in_place": MODE|null, "run": int (the repetition, 0-based, of --runs)}],
                 in the order they were measured (bench/sweep.py: interleaved per size)
     "summary": [{"transport", "benchmark", "dtype", "redop", "avg_busbw_gbps", "wrong": int|null}]}
    MODE = {"time_us": float, "algbw_gbps": float, "busbw_gbps": float, "wrong": int|null, "iters": int}

kind "torch": this library's torch.distributed backend (transport torch-comm).
GB/s are 1e9 bytes/s; time_us is per operation, aggregated over ranks as -a says; wrong is
summed over ranks (null when -c 0). A missing mode (not supported by that library) is null.
"""
from __future__ import annotations

import datetime
import importlib.util
import json
import os
import socket
import statistics
import sys
import time

from comm.core.types import DType, ReduceOp

from .measure import AVERAGES, Row

SCHEMA = "comm-bench/1"
MODES = ("out-of-place", "in-place")
DTYPE_NAMES = {DType.INT8: "int8", DType.UINT8: "uint8", DType.INT16: "int16", DType.INT32: "int32",
               DType.INT64: "int64", DType.FLOAT16: "half", DType.FLOAT32: "float",
               DType.FLOAT64: "double", DType.BFLOAT16: "bfloat16", DType.BOOL: "bool"}
OP_NAMES = {ReduceOp.SUM: "sum", ReduceOp.PRODUCT: "prod", ReduceOp.MAX: "max", ReduceOp.MIN: "min",
            ReduceOp.AVG: "avg", ReduceOp.PREMUL_SUM: "mulsum", ReduceOp.BAND: "band",
            ReduceOp.BOR: "bor", ReduceOp.BXOR: "bxor"}

_LEFT = "%12s  %12s  %8s  %6s  %6s"
_MODE_HEAD = "  %7s  %6s  %6s %6s"
_MODE_ROW = "  %7s  %6s  %6s  %5s"


def dtype_name(d: DType | None) -> str:
    return "-" if d is None else DTYPE_NAMES[d]


def op_name(op: ReduceOp | None) -> str:
    return "none" if op is None else OP_NAMES[op]


def format_time(us: float) -> str:
    """nccl-tests' adaptive precision."""
    if us >= 10000:
        return "%7.0f" % us
    if us >= 100:
        return "%7.1f" % us
    return "%7.2f" % us


def header() -> str:
    width = len(_MODE_ROW % ("", "", "", ""))
    top = "#" + " " * (len(_LEFT % (("",) * 5)) - 1) + "out-of-place".center(width) + "in-place".center(width)
    names = "#" + (_LEFT % ("size", "count", "type", "redop", "root"))[1:]
    names += (_MODE_HEAD % ("time", "algbw", "busbw", "#wrong")) * 2
    units = "#" + (_LEFT % ("(B)", "(elements)", "", "", ""))[1:]
    units += (_MODE_HEAD % ("(us)", "(GB/s)", "(GB/s)", "")) * 2
    return "\n".join([top.rstrip(), names, units.rstrip()])


def format_row(row: Row) -> str:
    out = _LEFT % (row.size, row.count, dtype_name(row.dtype), op_name(row.op), row.root)
    for mode in MODES:
        m = row.modes.get(mode)
        if m is None:
            out += _MODE_ROW % ("N/A", "N/A", "N/A", "N/A")
        else:
            out += _MODE_ROW % (format_time(m.time_us), "%6.2f" % m.algbw, "%6.2f" % m.busbw,
                                "N/A" if m.wrong is None else m.wrong)
    return out


def footer(rows: list[Row]) -> str:
    wrongs = [m.wrong for r in rows for m in r.modes.values() if m is not None and m.wrong is not None]
    busbws = [m.busbw for r in rows for m in r.modes.values() if m is not None]
    bad = sum(wrongs)
    avg = sum(busbws) / len(busbws) if busbws else 0.0
    return (f"# Out of bounds values : {bad} {'OK' if bad == 0 else 'FAILED'}\n"
            f"# Avg bus bandwidth    : {avg:g} \n#")


def _key(row: Row) -> tuple:
    return (row.bench, row.dtype, row.op, row.root)


def common_mode(group: list[Row]) -> str | None:
    """The mode every row of `group` has (out-of-place first), else None."""
    return next((m for m in MODES if all(r.modes.get(m) for r in group)), None)


def shown_mode(row: Row, mode: str | None):
    """The Mode of `row` a table or plot shows: `mode` (common_mode), or where the rows have
    none in common, out-of-place if the row has it, else in-place."""
    return row.modes.get(mode) if mode else (row.modes.get("out-of-place") or row.modes.get("in-place"))


def comparison(rows: list[Row], transports: list[str], anchors: tuple[str, ...],
               bounds: dict[str, float] | None = None) -> str:
    """For each (benchmark, dtype, op): busbw of every transport per size and its ratio to the
    first anchor in the --transport list (the first transport when no anchor ran); ratio > 1 is
    faster than the anchor; `bounds` (benchmark -> GB/s, a simulated cluster's link bound) adds
    a column. Out-of-place numbers when every transport has them, else in-place;
    a '*' marks a transport whose other mode had to stand in. Unswept benchmarks (barrier)
    show the time in us instead of busbw. With several repetitions (--runs, Row.run): the
    median busbw, and the median ratio with its range, each ratio taken within one repetition
    (whose transports were measured side by side, bench/sweep.py); a number that is the median
    of fewer repetitions than the header says (a transport that failed) is followed by [k]."""
    ran = [t for t in transports if any(r.transport == t for r in rows)]
    if len(ran) < 2 and not bounds:
        return ""
    ref = next((t for t in ran if t in anchors), ran[0])
    others = [t for t in ran if t != ref]
    runs = sorted({r.run for r in rows})
    out = []
    for key in dict.fromkeys(_key(r) for r in rows):
        group = [r for r in rows if _key(r) == key]
        mode = common_mode(group)
        table = {(r.transport, r.size, r.run): r for r in group}
        bench, dtype, op, _ = key
        timed = all(r.size == 0 for r in group)
        label = " ".join(x for x in (bench, dtype is not None and dtype_name(dtype), op is not None and op_name(op)) if x)
        many = (f", median of {len(runs)} interleaved repetitions, ratio range in ()" if len(runs) > 1
                else ", 1 repetition")
        out.append(f"# Comparison: {label}: {'time (us)' if timed else 'busbw (GB/s)'}, "
                   f"{mode or 'out-of-place, * = in-place'}{many}; ratio = speed relative to {ref}")
        ratios = [f"{t}/{ref}" for t in others]
        bound = (bounds or {}).get(bench)
        w = max([12] + [len(x) for x in ran + ratios])
        wr = max(w, 16 if len(runs) > 1 else 0)   # "1.23 (0.98-1.40)"
        out.append("#" + ("%11s" % "size") + "".join("  %*s" % (w, x) for x in ran)
                   + "".join("  %*s" % (wr, x) for x in ratios) + ("  %*s" % (w, "link bound") if bound else ""))
        for size in sorted({r.size for r in group}):
            picked = {}   # transport -> ([Mode or None per run], star)
            for t in ran:
                ms, star = [], " "
                for run in runs:
                    r = table.get((t, size, run))
                    m = shown_mode(r, mode) if r else None
                    if m and not mode and not r.modes.get("out-of-place"):
                        star = "*"
                    ms.append(m)
                picked[t] = (ms, star)
            line = "%12d" % size
            for t in ran:
                ms, star = picked[t]
                values = [m.time_us if timed else m.busbw for m in ms if m is not None]
                text = ("%.2f" if timed else "%.3f") % statistics.median(values) if values else "N/A"
                if values and len(values) < len(runs):
                    text += f"[{len(values)}]"
                line += "  %*s%s" % (w - 1, text, star)
            for t in others:   # same size and factor: the busbw ratio is the inverse time ratio
                pairs = zip(picked[ref][0], picked[t][0])
                rs = [a.time_us / b.time_us for a, b in pairs if a is not None and b is not None and b.time_us > 0]
                text = "N/A" if not rs else "%.2f" % statistics.median(rs)
                if len(rs) > 1:
                    text += " (%.2f-%.2f)" % (min(rs), max(rs))
                if rs and len(rs) < len(runs):
                    text += f"[{len(rs)}]"
                line += "  %*s" % (wr, text)
            if bound and not timed:
                line += "  %*.3f" % (w, bound)
            out.append(line)
        out.append("#")
    return "\n".join(out)


def _mode_json(m) -> dict | None:
    if m is None:
        return None
    return {"time_us": m.time_us, "algbw_gbps": m.algbw, "busbw_gbps": m.busbw, "wrong": m.wrong,
            "iters": m.iters}


def to_json(rows: list[Row], transports: list[dict], settings: dict, argv: list[str], world) -> dict:
    results = [{"transport": r.transport, "benchmark": r.bench,
                "dtype": None if r.dtype is None else r.dtype.name.lower(),
                "redop": None if r.op is None else OP_NAMES[r.op], "root": r.root,
                "size_bytes": r.size, "count": r.count,
                "out_of_place": _mode_json(r.modes.get("out-of-place")),
                "in_place": _mode_json(r.modes.get("in-place")), "run": r.run} for r in rows]
    summary = []
    for key in dict.fromkeys((r.transport,) + _key(r)[:3] for r in rows):
        group = [r for r in rows if (r.transport,) + _key(r)[:3] == key]
        modes = [m for r in group for m in r.modes.values() if m is not None]
        wrongs = [m.wrong for m in modes]
        summary.append({"transport": key[0], "benchmark": key[1],
                        "dtype": None if key[2] is None else key[2].name.lower(),
                        "redop": None if key[3] is None else OP_NAMES[key[3]],
                        "avg_busbw_gbps": sum(m.busbw for m in modes) / len(modes),
                        "wrong": None if None in wrongs else sum(wrongs)})
    return {"schema": SCHEMA, "command": list(argv), "world_size": world.size, "launcher": world.launcher,
            "host": socket.gethostname(),
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "settings": settings, "transports": transports, "results": results, "summary": summary}


def write_json(path: str, doc: dict) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


PANELS_PER_FILE = 12   # 4 rows of 3 stay readable on a screen; more panels go to further files
COLUMNS = 3


def plot_unavailable() -> str | None:
    """None when --plot can work here, else why not and what to install."""
    if importlib.util.find_spec("matplotlib") is None:
        return "matplotlib is not installed; pip install matplotlib (or the test extra: pip install -e '.[test]')"
    return None


def plot_files(path: str, panels: int) -> list[str]:
    """FILE.png, then FILE-2.png, FILE-3.png, ... : PANELS_PER_FILE panels each, none dropped."""
    stem, ext = os.path.splitext(path)
    pages = max(1, -(-panels // PANELS_PER_FILE))
    return [path] + [f"{stem}-{page}{ext or '.png'}" for page in range(2, pages + 1)]


def plot(path: str, rows: list[Row], transports: list[str], log_y: bool = False) -> list[str]:
    """busbw against size, one line per transport, one panel per (benchmark, dtype, op); returns
    the files written (every panel is in one of them)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in dict.fromkeys(_key(r) for r in rows) if any(r.size for r in rows if _key(r) == k)]
    files = plot_files(path, len(keys))
    for page, file in enumerate(files):
        chunk = keys[page * PANELS_PER_FILE:(page + 1) * PANELS_PER_FILE]
        cols = max(1, min(COLUMNS, len(chunk)))
        lines = max(1, -(-len(chunk) // cols))
        fig, axes = plt.subplots(lines, cols, figsize=(6 * cols, 4 * lines), squeeze=False)
        for ax in axes.flat[len(chunk):]:
            ax.set_visible(False)
        for ax, key in zip(axes.flat, chunk):
            _panel(ax, key, [r for r in rows if _key(r) == key], transports, log_y)
        if len(files) > 1:
            fig.suptitle(f"{os.path.basename(path)}: part {page + 1} of {len(files)}")
        fig.tight_layout()
        fig.savefig(file, format="png", dpi=100)
        plt.close(fig)
    return files


def _panel(ax, key: tuple, group: list[Row], transports: list[str], log_y: bool) -> None:
    mode = common_mode(group)
    for t in transports:
        per_size: dict[int, list[float]] = {}   # several with --runs: their median is drawn
        for r in group:
            if r.transport == t:
                per_size.setdefault(r.size, []).append(shown_mode(r, mode).busbw)
        if per_size:
            ax.plot(*zip(*sorted((size, statistics.median(v)) for size, v in per_size.items())),
                    marker="o", markersize=3, label=t)
    bench, dtype, op, _ = key
    ax.set_title(" ".join(x for x in (bench, dtype is not None and dtype_name(dtype),
                                      op is not None and op_name(op), mode) if x))
    ax.set_xscale("log", base=2)
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel("size (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()


class Printer:
    """Rank 0's stdout (tables) and stderr (progress). Progress never splits a table line:
    on a terminal it is one line rewritten in place and erased before stdout is written;
    otherwise it is a whole line at most every few seconds."""

    def __init__(self, active: bool, out=None, err=None):
        self.active = active
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self._tty = hasattr(self.err, "isatty") and self.err.isatty()
        self._shown = False
        self._last = 0.0

    def line(self, text: str) -> None:
        if not self.active:
            return
        self._clear()
        self.out.write(text + "\n")
        self.out.flush()

    def progress(self, text: str) -> None:
        if not self.active or not text:
            return
        if self._tty:
            self.err.write("\r\033[K" + text[:150])
            self._shown = True
        elif time.monotonic() - self._last > 5:
            self.err.write(f"[bench] {text}\n")
            self._last = time.monotonic()
        self.err.flush()

    def _clear(self) -> None:
        if self._shown:
            self.err.write("\r\033[K")
            self.err.flush()
            self._shown = False

    def note(self, text: str) -> None:
        """A one-line message for the user on stderr (rank 0)."""
        if self.active:
            self._clear()
            self.err.write(text + "\n")
            self.err.flush()


def settings_json(opts, args) -> dict:
    return {"min_bytes": args.minbytes, "max_bytes": args.maxbytes, "step_bytes": args.stepbytes,
            "step_factor": args.stepfactor, "iters": opts.iters, "warmup_iters": opts.warmup,
            "check": opts.check, "average": AVERAGES[opts.average], "time_budget_s": args.time_budget,
            "root": opts.root, "runs": args.runs}
