"""The bootstrap store's wire protocol, shared by its host (comm.bootstrap.store_host) and its clients
(comm.bootstrap.store): a request is a frame (op, key, timeout, value), a reply a status and bytes. Frames
are length-prefixed and size-checked; values are raw bytes (never pickled)."""
from __future__ import annotations

import errno
import socket
import struct

from . import auth

SET, GET, ADD, JOIN, AGREE, GATHER = 1, 2, 3, 4, 5, 6
OK, TIMEOUT, MISMATCH, REFUSED, EXCLUDED, GONE = 0, 1, 2, 3, 4, 5
HDR = struct.Struct("!BIdI")        # op, key length, timeout (s), value length
REPLY = struct.Struct("!BI")        # status, reply length
# A gather's value: member, group size, watch list length, wanted members (EVERY: all), then the
# watch list (JSON), the wanted members (uint32 each) and the member's value.
GATHER_HDR = struct.Struct("!IIII")
EVERY = 0xFFFFFFFF
MAX_GROUP = 1 << 20                   # members of one gather
MAX_KEY = 4096
MAX_VALUE = 1 << 20                   # bootstrap data is addresses and small metadata


def recv_frame(sock: socket.socket) -> tuple[int, str, float, bytes]:
    op, klen, timeout, vlen = HDR.unpack(auth.recv_exact(sock, HDR.size))
    if op not in (SET, GET, ADD, JOIN, AGREE, GATHER) or klen > MAX_KEY or vlen > MAX_VALUE or not timeout >= 0:
        raise ConnectionError("malformed store request")
    key = auth.recv_exact(sock, klen).decode("utf-8", "strict")
    return op, key, timeout, auth.recv_exact(sock, vlen)


# Running out of descriptors (the host's accept loop pauses; a client says so at once).
FD_ERRORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
