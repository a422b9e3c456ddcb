"""The bootstrap store and the connection handshake: only peers that know the secret get in,
and random or truncated bytes are refused without a crash or a hang."""
from __future__ import annotations

import socket
import struct
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import comm
from comm.bootstrap import auth
from comm.bootstrap.store import Store
from harness import free_port

SECRET = b"job-secret-for-tests"


@pytest.fixture
def store():
    port = free_port()
    s = Store.host_or_connect("127.0.0.1", port, rank=0, size=2, timeout=5, secret=SECRET)
    yield s, port
    s.close()


def test_right_secret_connects(store):
    s, port = store
    other = Store("127.0.0.1", port, rank=1, size=2, timeout=5, secret=SECRET)
    s.set("k", b"v")
    assert other.get("k") == b"v"
    other.close()


@pytest.mark.parametrize("secret", [b"wrong", None])
def test_wrong_or_missing_secret_refused(store, secret):
    s, port = store
    with pytest.raises(comm.CommError, match="refused us"):
        Store("127.0.0.1", port, rank=1, size=2, timeout=3, secret=secret)
    s.set("still", b"serving")
    assert s.get("still") == b"serving"


def test_server_without_secret_refuses_client_with_one():
    port = free_port()
    s = Store.host_or_connect("127.0.0.1", port, rank=0, size=1, timeout=5, secret=None)
    try:
        with pytest.raises(comm.CommError, match="disagrees on COMM_SECRET"):
            Store("127.0.0.1", port, rank=1, size=2, timeout=3, secret=SECRET)
    finally:
        s.close()


def _raw(port: int, payload: bytes, read: bool = True) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.settimeout(5)
        try:
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
            data = b""
            while read:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                data += chunk
            return data
        except OSError:   # reset, broken pipe, not connected: the server dropped us early
            return b""


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(payload=st.one_of(st.binary(max_size=300),
                         st.builds(lambda tail: auth.MAGIC + b"\1" + tail, st.binary(max_size=200)),
                         st.builds(lambda n: auth.MAGIC[:n], st.integers(0, len(auth.MAGIC)))))
def test_fuzzed_handshake_refused(store, payload):
    s, port = store
    start = time.monotonic()
    reply = _raw(port, payload)
    assert time.monotonic() - start < 5, "the server hung on fuzzed input"
    # the server only ever says hello (magic + flag + nonce): nothing is served without the proof
    assert len(reply) <= len(auth.MAGIC) + 1 + auth.NONCE
    s.set("alive", b"1")
    assert s.get("alive") == b"1"


def _frame_after_handshake(frame: bytes) -> None:
    """Send `frame` to a store as an authenticated client; whether the store answers or drops
    us, it must keep serving."""
    port = free_port()
    s = Store.host_or_connect("127.0.0.1", port, rank=0, size=1, timeout=5, secret=None)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            auth.client_handshake(sock, None, 5)
            sock.settimeout(5)
            try:  # the server may drop us at any point: that is the expected outcome
                sock.sendall(frame)
                sock.shutdown(socket.SHUT_WR)
                while sock.recv(4096):
                    pass
            except OSError:
                pass
        s.set("alive", b"1")
        assert s.get("alive") == b"1"
    finally:
        s.close()


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(op=st.integers(0, 255), klen=st.integers(0, 2**32 - 1), vlen=st.integers(0, 2**32 - 1),
       body=st.binary(max_size=64))
def test_fuzzed_frames_after_handshake_refused(op, klen, vlen, body):
    """An authenticated client sending malformed frames is dropped; the store lives on."""
    _frame_after_handshake(struct.pack("!BIdI", op, klen, 1.0, vlen) + body)


def test_no_pickle_on_the_wire(store):
    """Values are raw bytes: a pickle payload is stored and returned as bytes, never loaded."""
    import pickle
    s, _ = store
    payload = pickle.dumps(object)
    s.set("p", payload)
    assert s.get("p") == payload and isinstance(s.get("p"), bytes)


def test_unauthenticated_warning(capfd, monkeypatch):
    monkeypatch.setattr(auth, "_warned", False)
    auth.warn_unauthenticated()
    auth.warn_unauthenticated()
    err = capfd.readouterr().err
    assert err.count("connections are unauthenticated") == 1
    assert "Set the same secret on every rank, e.g. export COMM_SECRET=" in err


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=st.one_of(st.binary(max_size=64),
                      st.recursive(st.none() | st.booleans() | st.floats() | st.integers() | st.text(max_size=8),
                                   lambda inner: st.lists(inner, max_size=3)
                                   | st.dictionaries(st.sampled_from(["rank", "size", "agree", "x"]), inner, max_size=4),
                                   max_leaves=8).map(lambda v: __import__("json").dumps(v).encode())))
def test_fuzzed_join_refused(body):
    """Whatever a client claims in its join, the store answers or drops it; once every rank
    has joined, a misfit is refused alone and the job's store keeps serving."""
    from comm.bootstrap import store_wire as wire
    _frame_after_handshake(struct.pack("!BIdI", wire.JOIN, 0, 1.0, len(body)) + body)
