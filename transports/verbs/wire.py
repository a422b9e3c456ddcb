"""What the verbs transport puts on the wire, as pure functions: no pyverbs here.

Address exchange (through the bootstrap store, once per communicator): each rank publishes one
record, a fixed header and one entry per rank of the group, packed with `struct` in network
byte order and size-checked on decode (never pickled: a store value is untrusted bytes).

Messages: every message is an RDMA WRITE WITH IMMEDIATE, so it consumes one receive work
request at the peer and produces one completion there carrying the 32-bit immediate:

    bits 31-30 kind     CTRL (a clear-to-send record landed in inbox slot `value`),
                        DATA (the receive with id `value` is complete),
                        CREDIT (only returns credits)
    bit  29    error    DATA only: the sender refused the message (size mismatch); nothing written
    bits 28-22 credits  receive slots the sender of this message has freed for its reader
    bits 21-0  value    slot index or receive id

A receive is rendezvous: the receiver registers its buffer and sends a CTS record
(tag, id, bytes, address, rkey) into the sender's inbox; the sender writes the payload straight
into that buffer (zero copy, GPU memory included) and tells the receiver with DATA|id.
"""
from __future__ import annotations

import enum
import ipaddress
import socket
import struct
from dataclasses import dataclass

MAGIC = b"CVRB"
VERSION = 1

# magic, version, port, mtu (ibv_mtu 1..5), lid, gid index, slot count, group size, gid
_HEADER = struct.Struct("!4sHBBHBxHI16s")
# per rank: QP number, initial PSN, inbox address (slots for the reader), inbox rkey
_ENTRY = struct.Struct("!IIQI")


class WireError(ValueError):
    """A peer's record or message is malformed (truncated, foreign, or out of range)."""


@dataclass(frozen=True)
class QPEntry:
    qpn: int
    psn: int
    inbox_addr: int
    inbox_rkey: int


@dataclass(frozen=True)
class PeerAddress:
    """One rank's connection record; entries[j] is its QP for rank j and the inbox j writes to."""

    port: int
    mtu: int
    lid: int
    gid_index: int
    gid: bytes             # 16 bytes, zeros when the port has none (plain InfiniBand)
    slots: int             # credits: receive slots per peer
    entries: tuple[QPEntry, ...]

    def gid_text(self) -> str:
        """The GID in the colon form pyverbs' GID() takes."""
        return ":".join(self.gid[i:i + 2].hex() for i in range(0, 16, 2))


def gid_bytes(text: str) -> bytes:
    """pyverbs' GID text (eight groups of four hex digits) -> 16 bytes."""
    return ipaddress.IPv6Address(text).packed


def encode_address(addr: PeerAddress) -> bytes:
    if len(addr.gid) != 16:
        raise WireError(f"a GID has 16 bytes, got {len(addr.gid)}")
    head = _HEADER.pack(MAGIC, VERSION, addr.port, addr.mtu, addr.lid, addr.gid_index,
                        addr.slots, len(addr.entries), addr.gid)
    return head + b"".join(_ENTRY.pack(e.qpn, e.psn, e.inbox_addr, e.inbox_rkey) for e in addr.entries)


def decode_address(data: bytes, expect_ranks: int) -> PeerAddress:
    """Parse a record; WireError unless it is exactly a record for a group of expect_ranks."""
    if len(data) < _HEADER.size:
        raise WireError(f"address record of {len(data)} bytes is shorter than its header")
    magic, version, port, mtu, lid, gid_index, slots, count, gid = _HEADER.unpack_from(data)
    if magic != MAGIC or version != VERSION:
        raise WireError("not a verbs address record of this version (another library or version?)")
    if count != expect_ranks or len(data) != _HEADER.size + count * _ENTRY.size:
        raise WireError(f"address record has {len(data)} bytes for {count} ranks; expected "
                        f"{_HEADER.size + expect_ranks * _ENTRY.size} for {expect_ranks}")
    if not 1 <= mtu <= 5 or not 1 <= slots <= MAX_CREDITS or port == 0:
        raise WireError(f"address record out of range (mtu code {mtu}, {slots} slots, port {port})")
    entries = tuple(QPEntry(*_ENTRY.unpack_from(data, _HEADER.size + i * _ENTRY.size)) for i in range(count))
    if any(e.qpn >= 1 << 24 or e.psn >= 1 << 24 for e in entries):
        raise WireError("QP number or PSN wider than 24 bits")
    return PeerAddress(port, mtu, lid, gid_index, gid, slots, entries)


# ---- immediates ---------------------------------------------------------------------------
class Kind(enum.IntEnum):
    CTRL = 1
    DATA = 2
    CREDIT = 3


MAX_CREDITS = (1 << 7) - 1      # the credits field; also the most slots a peer may have
ID_SPACE = 1 << 22              # receive ids and slot indices wrap here


@dataclass(frozen=True)
class Imm:
    kind: Kind
    credits: int
    value: int
    error: bool = False


def encode_imm(imm: Imm) -> int:
    """The immediate as it goes into a work request (network byte order, as verbs expects)."""
    if not 0 <= imm.credits <= MAX_CREDITS or not 0 <= imm.value < ID_SPACE:
        raise WireError(f"immediate field out of range: {imm}")
    word = (imm.kind << 30) | (int(imm.error) << 29) | (imm.credits << 22) | imm.value
    return socket.htonl(word)


def decode_imm(raw: int) -> Imm:
    word = socket.ntohl(raw)
    try:
        kind = Kind(word >> 30)
    except ValueError:
        raise WireError(f"immediate {word:#010x} has no message kind") from None
    return Imm(kind, (word >> 22) & MAX_CREDITS, word & (ID_SPACE - 1), bool(word >> 29 & 1))


# ---- clear-to-send records (the payload of CTRL messages) ---------------------------------
_CTS = struct.Struct("!IIQQI")   # tag, receive id, bytes, remote address, rkey
SLOT_BYTES = 64                  # one inbox slot; a CTS record fits with room to spare


@dataclass(frozen=True)
class ClearToSend:
    tag: int
    recv_id: int
    nbytes: int
    addr: int      # where the payload goes, in the receiver MR's address space (iova)
    rkey: int


def encode_cts(cts: ClearToSend) -> bytes:
    return _CTS.pack(cts.tag, cts.recv_id, cts.nbytes, cts.addr, cts.rkey)


def decode_cts(slot: bytes) -> ClearToSend:
    if len(slot) < _CTS.size:
        raise WireError(f"inbox slot of {len(slot)} bytes cannot hold a clear-to-send record")
    cts = ClearToSend(*_CTS.unpack_from(slot))
    if cts.recv_id >= ID_SPACE:
        raise WireError(f"clear-to-send receive id {cts.recv_id} out of range")
    return cts


# ---- work requests, described before pyverbs builds them -----------------------------------
MAX_WRITE_BYTES = 1 << 30        # below every NIC's max_msg_sz (2 GiB on most)


@dataclass(frozen=True)
class WriteSpec:
    """One RDMA WRITE (with immediate when `imm` is set) from local (addr, lkey) to remote."""

    local_addr: int
    length: int
    lkey: int
    remote_addr: int
    rkey: int
    imm: int | None       # encoded immediate, or None for a plain RDMA WRITE
    signaled: bool


def payload_writes(local_addr: int, lkey: int, remote_addr: int, rkey: int, nbytes: int,
                   imm: int) -> list[WriteSpec]:
    """A payload as RDMA WRITEs of at most MAX_WRITE_BYTES; only the last carries the immediate
    and asks for a completion (RC delivers in order, so it also vouches for the ones before)."""
    pieces = [(off, min(MAX_WRITE_BYTES, nbytes - off)) for off in range(0, nbytes, MAX_WRITE_BYTES)]
    if not pieces:
        pieces = [(0, 0)]    # an empty message still needs its immediate
    last = len(pieces) - 1
    return [WriteSpec(local_addr + off, n, lkey, remote_addr + off, rkey,
                      imm if i == last else None, i == last)
            for i, (off, n) in enumerate(pieces)]
