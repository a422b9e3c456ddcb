"""Connection handshake: a version check, and with a job secret a two-way HMAC challenge.

Runs on every bootstrap and data connection before any buffer is allocated or any state
changes. Built on the standard library's `hmac` and `secrets`: no cryptography by hand.
"""
from __future__ import annotations

import contextlib
import hashlib
import hmac
import secrets
import socket
import sys

MAGIC = b"COMMv1\0"             # protocol and version; one more byte says whether a secret is used
NONCE = 32
DIGEST = hashlib.sha256().digest_size
_warned = False


class HandshakeError(ConnectionError):
    """The peer does not speak this protocol or does not know the secret."""


class SecretMismatch(HandshakeError):
    """One side has COMM_SECRET set and the other has not."""


class Unanswered(HandshakeError):
    """The server closed the connection before greeting us (it was over its connection cap,
    or going away): worth another try, unlike a refusal."""


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly n bytes, or ConnectionError if the peer closes first."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def _hello(secret: bytes | None) -> bytes:
    return MAGIC + (b"\1" if secret else b"\0")


def _check_hello(hello: bytes, secret: bytes | None, who: str) -> None:
    if hello[:len(MAGIC)] != MAGIC:
        raise HandshakeError(f"{who} does not speak this protocol")
    if hello[-1:] != _hello(secret)[-1:]:
        mine = "set" if secret else "not set"
        raise SecretMismatch(f"{who} disagrees on COMM_SECRET (it is {mine} here): refused")


def _mac(secret: bytes, label: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(secret, label + a + b, hashlib.sha256).digest()


def warn_unauthenticated() -> None:
    global _warned
    if not _warned:
        _warned = True
        print("comm: COMM_SECRET is not set; connections are unauthenticated (anyone who can reach the "
              "rendezvous port can join the job). Set the same secret on every rank, e.g. "
              "export COMM_SECRET=$(python3 -c 'import secrets; print(secrets.token_hex(16))') "
              "before launching (python -m bench --np does this itself)", file=sys.stderr)


@contextlib.contextmanager
def _bounded(sock: socket.socket, timeout: float):
    """Run a handshake step under `timeout`; any socket trouble becomes a HandshakeError."""
    old = sock.gettimeout()
    sock.settimeout(timeout)
    try:
        yield
    except HandshakeError:
        raise
    except (OSError, ConnectionError) as e:
        raise HandshakeError(f"handshake failed: {e}") from None
    finally:
        sock.settimeout(old)


def server_handshake(sock: socket.socket, secret: bytes | None, timeout: float) -> None:
    """Accepting side. Raises HandshakeError (and the caller closes the socket) on any doubt."""
    with _bounded(sock, timeout):
        nonce_s = secrets.token_bytes(NONCE)
        sock.sendall(_hello(secret) + (nonce_s if secret else b""))
        _check_hello(recv_exact(sock, len(MAGIC) + 1), secret, "peer")
        if secret:
            nonce_c = recv_exact(sock, NONCE)
            proof = recv_exact(sock, DIGEST)
            if not hmac.compare_digest(proof, _mac(secret, b"client", nonce_s, nonce_c)):
                raise HandshakeError("peer failed the secret challenge (wrong or missing COMM_SECRET)")
            sock.sendall(_mac(secret, b"server", nonce_c, nonce_s))


def client_handshake(sock: socket.socket, secret: bytes | None, timeout: float) -> None:
    """Connecting side: proves the secret, then checks that the server knows it too."""
    with _bounded(sock, timeout):
        try:
            hello = recv_exact(sock, len(MAGIC) + 1)
        except ConnectionError as e:   # not socket.timeout: a server that never answers is not busy
            raise Unanswered(f"the server closed the connection before greeting us ({e})") from None
        sock.sendall(_hello(secret))
        _check_hello(hello, secret, "server")
        if secret:
            nonce_s = recv_exact(sock, NONCE)
            nonce_c = secrets.token_bytes(NONCE)
            sock.sendall(nonce_c + _mac(secret, b"client", nonce_s, nonce_c))
            try:
                proof = recv_exact(sock, DIGEST)
            except ConnectionError:   # the server checked our proof and hung up
                raise HandshakeError("the server refused our secret proof: its COMM_SECRET differs from "
                                     "this rank's (set the same one on every rank)") from None
            if not hmac.compare_digest(proof, _mac(secret, b"server", nonce_c, nonce_s)):
                raise HandshakeError("server failed the secret challenge")
