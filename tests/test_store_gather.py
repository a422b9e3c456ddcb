"""The store's gather: one request and one reply per member (comm.bootstrap.gathers), over real sockets
with a real StoreServer; the ranks are threads of this process, each with its own Store."""
from __future__ import annotations

import json
import socket
import struct
import threading
import time

import pytest

from comm.bootstrap import auth
from comm.bootstrap import store_host, store_wire as wire
from comm.core.errors import CommError, CommTimeout, InvalidArgument, Mismatch, PeerFailure
from comm.bootstrap.store import Store


def _host(size: int, timeout: float = 20.0):
    """A listening store host and the port it serves on."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(256)
    server = store_host.StoreServer(listener, None, timeout, size=size, agree={}, where="test")
    return server, listener.getsockname()[1]


def _clients(port: int, size: int, n: int | None = None, timeout: float = 20.0) -> list[Store]:
    """Ranks 0 .. n-1 (all `size` by default) of a group of `size`, joined."""
    out: list = [None] * (size if n is None else n)

    def one(r):
        out[r] = Store("127.0.0.1", port, rank=r, size=size, timeout=timeout, secret=None)

    threads = [threading.Thread(target=one, args=(r,)) for r in range(len(out))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(out), "a client did not join"
    return out


def _each(stores, fn) -> list:
    """fn(rank, store) on a thread per rank; its result or the exception it raised."""
    results: list = [None] * len(stores)

    def run(r):
        try:
            results[r] = fn(r, stores[r])
        except BaseException as e:   # compared by the test
            results[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


class _Counting(Store):
    requests = 0

    def _call(self, *args, **kwargs):
        self._root.requests += 1
        return super()._call(*args, **kwargs)


@pytest.fixture
def host():
    made = []

    def make(size, timeout=20.0):
        server, port = _host(size, timeout)
        made.append(server)
        return port

    yield make
    for s in made:
        s.close()


def test_gather_in_rank_order_one_request_each(host):
    size = 48
    port = host(size)
    stores = [_Counting("127.0.0.1", port, rank=r, size=size, timeout=20, secret=None) for r in range(size)]
    for s in stores:
        s.requests = 0
    values = [bytes([r % 256]) * (r * 7 % 300) for r in range(size)]   # of every length, empty too
    results = _each(stores, lambda r, s: s.all_gather("k", values[r]))
    assert all(res == values for res in results)
    assert [s.requests for s in stores] == [1] * size
    # scoped views gather apart: same key, other groups (even ranks, odd ranks)
    halves = _each(stores, lambda r, s: s.scoped(f"half{r % 2}", rank=r // 2, size=size // 2)
                   .all_gather("k", str(r).encode()))
    for r, res in enumerate(halves):
        assert res == [str(q).encode() for q in range(r % 2, size, 2)]
    # a barrier is a gather too; every member's value is a key of its own, as a set would make it
    assert _each(stores, lambda r, s: s.barrier("b")) == [None] * size
    assert stores[0].get(f"k/{size - 1}") == values[size - 1]
    for s in stores:
        s.close()


def test_timeout_names_the_missing(host):
    port = host(4)
    stores = _clients(port, 4)

    def gather(r, s):
        return s.all_gather("k", b"v") if r != 2 else None

    for s in stores:
        s.timeout = 1.0
    results = _each(stores, gather)
    for r in (0, 1, 3):
        assert isinstance(results[r], CommTimeout), results[r]
        assert "members 2 of 4" in str(results[r]) and f"rank {r}" in str(results[r])
    for s in stores:
        s.close()


def _departure_seen(view) -> None:
    """Until the host has seen the watched rank 2 leave: a GET watching it ends with PeerFailure."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            view.get("never-set", timeout=0.2)
        except PeerFailure:
            return
        except CommTimeout:
            continue


@pytest.mark.parametrize("leaves", ["while the others wait", "before the others gather"])
def test_watched_member_leaving_ends_the_wait(host, leaves):
    """Rank 2 leaves without contributing: the members waiting are told at once, and so is a
    member that gets there after it left (its departure woke only those already waiting: in
    shrink, a member dying while the others connected cost the last to arrive a full timeout)."""
    port = host(3)
    stores = _clients(port, 3)
    views = [s.scoped("g", watch=[0, 1, 2]) for s in stores]
    if leaves == "before the others gather":
        stores[2].close()
        _departure_seen(views[0])
    else:
        threading.Timer(0.5, stores[2].close).start()
    started = time.monotonic()
    results = _each(views[:2], lambda r, s: s.all_gather("k", b"v"))
    assert time.monotonic() - started < 5   # not the 20 s timeout
    for res in results:
        assert isinstance(res, PeerFailure) and res.peer == 2, res
    for s in stores[:2]:
        s.close()


def test_disagreements_are_errors(host):
    port = host(3)
    stores = _clients(port, 3)
    for s in stores:
        s.timeout = 2.0
    # rank 2 believes it is member 1 of 2: whoever comes second learns of the disagreement
    results = _each(stores, lambda r, s: s.scoped("g", rank=1 if r == 2 else r, size=2 if r == 2 else 3)
                    .all_gather("k", b"v") if r != 1 else None)
    assert any(isinstance(res, Mismatch) and "disagree on the size" in str(res) for res in results), results
    for s in stores:
        s.close()


def test_a_value_set_by_hand_counts(host):
    """A member's value set with a plain set (before or while the others gather) completes the
    gather as its own request would: the host's keys are the gather's values."""
    port = host(3)
    stores = _clients(port, 3)
    stores[2].set("k/2", b"by hand")
    results = _each(stores[:2], lambda r, s: s.all_gather("k", str(r).encode()))
    assert results == [[b"0", b"1", b"by hand"]] * 2
    late = threading.Timer(0.3, stores[2].set, args=("late/2", b"late"))
    late.start()
    results = _each(stores[:2], lambda r, s: s.all_gather("late", str(r).encode()))
    assert results == [[b"0", b"1", b"late"]] * 2
    late.join()   # the gather completes before the set's own reply: close its store after that
    for s in stores:
        s.close()


def test_members_that_want_some_values_get_only_those(host):
    """gather_some: one round trip like all_gather, but each member's reply holds only the
    members it named (a planned peer's address at thousands of ranks), while any member's value
    stays readable with a plain get; a rank out of the group is refused before anything is sent."""
    port = host(4)
    stores = _clients(port, 4)
    wants = [[1], [0, 2, 3], [], [3, 3, 0]]
    results = _each(stores, lambda r, s: s.gather_some("addr", f"a{r}".encode(), wants[r]))
    assert results == [{1: b"a1"}, {0: b"a0", 2: b"a2", 3: b"a3"}, {}, {0: b"a0", 3: b"a3"}]
    assert stores[2].get("addr/1") == b"a1"
    mixed = _each(stores, lambda r, s: s.all_gather("mix", b"%d" % r) if r % 2 else s.gather_some("mix", b"%d" % r, [r]))
    assert mixed == [{0: b"0"}, [b"0", b"1", b"2", b"3"], {2: b"2"}, [b"0", b"1", b"2", b"3"]]
    with pytest.raises(InvalidArgument, match="asks for rank 4, not in the group of 4"):
        stores[0].gather_some("bad", b"", [4])
    for s in stores:
        s.close()


def test_a_member_that_does_not_read_holds_up_nobody(host):
    """Replies of several MiB: a member that stops reading fills its socket; the others still get
    theirs (the writer never blocks on one member)."""
    size = 8
    port = host(size)
    stores = _clients(port, size, size - 1)   # ranks 0-6; rank 7 is a raw connection that never reads
    raw = socket.create_connection(("127.0.0.1", port))
    auth.client_handshake(raw, None, 5)
    body = json.dumps({"rank": size - 1, "size": size, "agree": {}}).encode()
    raw.sendall(wire.HDR.pack(wire.JOIN, 0, 5.0, len(body)) + body)
    assert struct.unpack("!BI", auth.recv_exact(raw, 5))[0] == 0
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    big = b"z" * (1000 << 10)   # an 8 MB reply: more than the kernel buffers for one connection
    value = wire.GATHER_HDR.pack(size - 1, size, 0, wire.EVERY) + big
    raw.sendall(wire.HDR.pack(wire.GATHER, 1, 20.0, len(value)) + b"k" + value)
    results = _each(stores, lambda r, s: s.all_gather("k", big))
    assert all(res == [big] * size for res in results), [type(r) for r in results]
    raw.close()
    for s in stores:
        s.close()


def test_malformed_gather_drops_only_that_connection(host):
    port = host(2)
    stores = _clients(port, 2, 1)
    raw = socket.create_connection(("127.0.0.1", port))
    auth.client_handshake(raw, None, 5)
    body = json.dumps({"rank": 1, "size": 2, "agree": {}}).encode()
    raw.sendall(wire.HDR.pack(wire.JOIN, 0, 5.0, len(body)) + body)
    auth.recv_exact(raw, 5)
    bad = struct.pack("!III", 5, 2, 0)   # member 5 of a group of 2
    raw.sendall(wire.HDR.pack(wire.GATHER, 1, 5.0, len(bad)) + b"k" + bad)
    assert raw.recv(16) == b""   # dropped
    stores[0].set("still", b"here")
    assert stores[0].get("still") == b"here"
    stores[0].close()


def test_host_closing_answers_the_waiting(host):
    server, port = _host(2)
    stores = _clients(port, 2)
    threading.Timer(0.5, server.close).start()
    started = time.monotonic()
    res = _each(stores[:1], lambda r, s: s.all_gather("k", b"v"))[0]
    assert isinstance(res, CommError) and time.monotonic() - started < 10, res
    for s in stores:
        s.close()


_HOST_OF_MANY = r"""
import os, sys
from comm.bootstrap.store import Store
host = Store.host_or_connect("127.0.0.1", int(sys.argv[1]), rank=0, size=int(sys.argv[2]), timeout=20,
                             secret=b"s" * 16)
print(len(os.listdir("/proc/self/fd")), flush=True)
print(b"|".join(host.all_gather("k", b"0")).decode(), flush=True)
sys.stdin.readline()
if sys.argv[3] == "close":
    host.close()
    print("closed", flush=True)
else:
    os._exit(0)   # rank 0 gone without closing anything: the host must go with it
"""


def _ended(pid: int) -> bool:
    """Gone, or a zombie (ended; its new parent has not reaped it yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("end", ["close", "exit"])
def test_host_of_many_ranks_in_its_own_process(end):
    """From OWN_PROCESS_FROM ranks the store's host is a child of rank 0: rank 0 holds no
    connection per rank, the store works, and the child ends with rank 0 (closed or gone)."""
    import os
    import subprocess
    import sys
    from harness import ROOT, free_port
    from comm.bootstrap.store_process import OWN_PROCESS_FROM
    size, port = OWN_PROCESS_FROM, free_port()
    rank0 = subprocess.Popen([sys.executable, "-c", _HOST_OF_MANY, str(port), str(size), end],
                             env=dict(os.environ, PYTHONPATH=ROOT), stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        stores = [None] * size

        def one(r):
            stores[r] = Store("127.0.0.1", port, rank=r, size=size, timeout=20, secret=b"s" * 16)
        threads = [threading.Thread(target=one, args=(r,)) for r in range(1, size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        fds = int(rank0.stdout.readline())
        assert fds < size, f"rank 0 holds {fds} descriptors: the connections are its own"
        got = _each(stores[1:], lambda r, s: s.all_gather("k", str(r + 1).encode()))
        want = "|".join(map(str, range(size)))
        assert rank0.stdout.readline().strip() == want
        assert all(b"|".join(g).decode() == want for g in got), got
        children = subprocess.run(["pgrep", "-P", str(rank0.pid)], capture_output=True, text=True).stdout.split()
        assert len(children) == 1, children
        rank0.stdin.write("go\n")
        rank0.stdin.flush()
        if end == "close":
            assert rank0.stdout.readline() == "closed\n"
        assert rank0.wait(30) == 0
        deadline = time.monotonic() + 10
        while not _ended(int(children[0])) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _ended(int(children[0])), "the store's host outlived rank 0"
        with pytest.raises(CommError):
            stores[1].get("k/0", timeout=2)   # the host is gone: StoreLost
        for s in stores[1:]:
            s.close()
    finally:
        rank0.kill()
        rank0.wait()
