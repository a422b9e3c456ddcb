"""`python -m bench.scale`: real ranks across simulated hosts (root only), and the cost model."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from bench import scale
from bench.cluster import unavailable
from bench.scale_model import Fit, Model, crossover, engine_choice, fit_line, fit_robust

from harness import ROOT
from reference import HAVE_TORCH

PY = sys.executable
NO_CLUSTER = unavailable()
COLUMNS = ["shape", "ranks", "transport", "start", "s", "init", "s", "init", "cpu", "ms", "1st", "ar", "ms",
           "1st", "a2a", "ms", "ar", "1M", "ms", "fds", "init", "fds", "fds", "r0", "rss", "MiB", "anon", "MiB",
           "checked"]


def _scale(args, timeout=240):
    env = dict(os.environ, PYTHONPATH=ROOT)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    p = subprocess.run([PY, "-m", "bench.scale", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=timeout)
    return p.returncode, p.stdout, p.stderr


@pytest.mark.parametrize("bad", [["--hosts", "2"], ["--shapes", "2by8"],
                                 ["--hosts", "2", "--np", "2", "--transport", "nccl"],
                                 ["--hosts", "2", "--np", "2", "--shapes", "2x2"], [],
                                 ["--model", "--shapes", "2x1,1x4"], ["--hosts", "2", "--np", "2", "--link-rate", "fast"],
                                 ["--hosts", "2", "--np", "2", "--time-budget", "0"]])
def test_usage_mistakes(bad):
    with pytest.raises(SystemExit):
        scale.parse_args(bad)


@pytest.mark.skipif(NO_CLUSTER is not None, reason=f"{NO_CLUSTER}")
def test_two_hosts_of_two_ranks(tmp_path):
    transports = ["native", "gloo"] if HAVE_TORCH else ["native"]
    out_json = tmp_path / "scale.json"
    rc, out, err = _scale(["--hosts", "2", "--np", "2", "--transport", ",".join(transports), "--json", str(out_json)])
    assert rc == 0, out + err
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:3] == ["shape", "ranks", "transport"])
    assert lines[head].split() == COLUMNS
    rows = [line.split() for line in lines[head + 1:head + 1 + len(transports)]]
    assert [r[2] for r in rows] == transports and all(r[:2] == ["2x2", "4"] and r[-1] == "ok" for r in rows), out
    results = json.loads(out_json.read_text())["results"]
    for r in results:
        assert r["status"] == "ok" and r["wrong"] == 0
        assert r["checked"] == sorted(["all_reduce", "all_to_all", "reduce_scatter", "all_gather", "broadcast",
                                       "reduce", "barrier", "send_recv"])
        assert 0 < r["start_s"] <= r["init_s"] and r["fds"] >= r["fds_base"] > 0 and r["rss_mib"] >= r["anon_mib"] > 10


@pytest.mark.skipif(NO_CLUSTER is not None, reason=f"{NO_CLUSTER}")
def test_a_run_past_its_budget_is_reported_not_waited_for():
    """A million timed all_reduces of 1 MiB cannot end in 3 s: the row says so, the run does
    not wait for them, and no rank is left behind."""
    start = time.monotonic()
    rc, out, err = _scale(["--hosts", "2", "--np", "1", "--transport", "native", "--time-budget", "3",
                           "--iters", "1000000"], timeout=60)
    assert rc == 1 and "did not finish in 3 s (" in out, out + err
    assert time.monotonic() - start < 30
    left = subprocess.run(["pgrep", "-f", "bench.scale_rank .* native .* 1000000"], capture_output=True, text=True)
    assert left.stdout == "", left.stdout


def test_fit_reproduces_its_points_and_leaves_out_an_outlier():
    sizes = [8, 1 << 10, 16 << 10, 128 << 10, 1 << 20]
    alpha, beta = fit_line(sizes, [30e-6 + s / 1e9 for s in sizes])
    assert alpha == pytest.approx(30e-6, rel=1e-6) and beta == pytest.approx(1e-9, rel=1e-6)
    # noise on one point moves the fit, not past it
    alpha, beta = fit_line(sizes, [30e-6 + s / 1e9 for s in sizes[:-1]] + [1.2 * (30e-6 + sizes[-1] / 1e9)])
    assert 25e-6 < alpha < 35e-6 and 1e-9 < beta < 1.3e-9
    # the bench's fit: beta from the largest sizes, alpha the least of the small ones; a size whose
    # every sample caught a descheduled rank (2 ms for 8 B) is shown as off the line
    times = [2e-3] + [30e-6 + s / 1e9 for s in sizes[1:]]
    alpha, beta, kept = fit_robust(sizes, times)
    assert kept == [False, True, True, True, True]
    assert alpha == pytest.approx(30e-6 + (1024 - 8) * 1e-9, rel=1e-6) and beta == pytest.approx(1e-9, rel=1e-6)
    # a rate-limited link: small sizes at the wire's speed, large ones at the link's
    sizes = [8, 1 << 10, 16 << 10, 4 << 20, 16 << 20]
    times = [10e-6, 10.5e-6, 20e-6, 30e-3, 130e-3]
    alpha, beta, kept = fit_robust(sizes, times)
    assert beta == pytest.approx(100e-3 / (12 << 20)) and alpha == pytest.approx(10e-6 - 8 * beta)
    assert kept == [True, True, False, True, True]   # 16 KiB crossed inside the bucket: off the line


def test_ring_and_rd_cross_where_the_formulas_say():
    """rd: log2 n (alpha + m beta); ring: 2(n-1)(alpha + m/n beta), one rank per host; equal
    at m* = alpha (2(n-1) - log2 n) / (beta (log2 n - 2(n-1)/n))."""
    f = Fit(alpha_net=50e-6, beta_net=1 / 10e9, alpha_shm=2e-6, beta_shm=1 / 20e9, c_req=50e-6, beta_store=1e-10)
    model, n = Model(f), 128
    want = f.alpha_net * (2 * (n - 1) - 7) / (f.beta_net * (7 - 2 * (n - 1) / n))
    got = crossover(model, n, 1, "rd", "ring")
    assert got == pytest.approx(want, rel=1e-6)
    below, above = model.all_reduce(n, 1, want / 2), model.all_reduce(n, 1, want * 2)
    assert below["rd"] < below["ring"] and above["ring"] < above["rd"]
    # across many hosts: at 64 MiB the engine's sharded two-level form beats every flat form and
    # the leader form (only bandwidth counts); at 8 B the leader form is within 5% of the
    # fastest (flat rd takes 3 steps inside a host of 8, the leader form 6); in between, the ring
    # across 128 hosts pays 254 alphas where recursive halving pays 14, so the crossover from
    # the leader form to the sharded one grows with the hosts
    t = model.all_reduce(128, 8, 64 << 20)
    assert engine_choice("all_reduce", 128, 8, 64 << 20) == "2l-shard"
    assert t["2l-shard"] < min(t["ring"], t["rd"], t["tree"], t["2l-leader"])
    t = model.all_reduce(128, 8, 8)
    assert t[engine_choice("all_reduce", 128, 8, 8)] <= 1.05 * min(t.values())
    t = model.all_reduce(128, 8, 1 << 20)
    assert t["2l-halving"] < t["2l-leader"] < t["2l-shard"]
    assert crossover(model, 8, 8, "2l-leader", "2l-shard") < crossover(model, 128, 8, "2l-leader", "2l-shard")
    # one request per rank beats n per rank; the store's reply bytes (n^2) then dominate
    boot = model.bootstrap(2048, 8)
    assert boot["store-1"] < boot["store-N"] / 10 and boot["host-agg"] < boot["store-1"]


def test_engine_choice_follows_the_selection_table():
    assert engine_choice("all_reduce", 8, 8, 8) == "2l-leader"
    assert engine_choice("all_reduce", 8, 8, 1 << 20) == "2l-shard"
    assert engine_choice("all_reduce", 8, 1, 64 << 10) == "rd"
    assert engine_choice("all_reduce", 8, 1, (64 << 10) + 4) == "ring"
    assert engine_choice("all_to_all", 8, 8, 1 << 20) == "2l-agg"
    assert engine_choice("all_to_all", 8, 1, 1 << 20) == "pairwise"


def _simulate(*extra: str) -> list[list[str]]:
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.run([PY, "-m", "bench.scale_sim", "--ranks", "64", "--per-host", "8", "--procs", "2", *extra],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = [line.split() for line in p.stdout.splitlines()[1:] if line.strip() and line.split()[0].isdigit()]
    ours = [r for r in rows if "comm" in r and "one request" in " ".join(r)]
    assert len(ours) == 2 and all(r[0] == "64" and r[-1] == "64" for r in ours), p.stdout
    assert [r[-2] for r in ours] == ["1", "4"], p.stdout   # requests per rank: one gather; init's four
    return rows


def test_bootstrap_simulation_every_rank_right():
    """bench.scale_sim: 64 simulated ranks (real Store clients in 2 processes) against a real
    store: one request per gather, every rank holding exactly what it asked for."""
    _simulate()


@pytest.mark.slow
def test_bootstrap_simulation_anchors():
    """The simulation's anchors beside it: init's gathers sending every value to every rank, the
    old set + get per rank, and torch's TCPStore where torch is installed."""
    rows = _simulate("--anchors")
    for pattern in ("every value to every rank", "set + a get per rank"):
        row = next(r for r in rows if pattern in " ".join(r) and "comm" in r)
        assert row[0] == "64" and row[-1] == "64", rows
    assert sum("TCPStore" in " ".join(r) for r in rows) == (2 if HAVE_TORCH else 0), rows