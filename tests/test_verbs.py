"""Verbs transport: the parts that need no RDMA device (wire formats, registration cache, credit
accounting, work-request building) run everywhere; the rest skips with the reason discovery
gives ("no RDMA device" on a machine without one)."""
from __future__ import annotations

import socket

import numpy as np
import pytest

import comm
from transports import base
from transports.verbs import wire
from transports.verbs.credits import CREDIT_RESERVE, CreditWindow, Outbox
from transports.verbs.regcache import RegistrationCache
from transports.verbs.wire import ClearToSend, Imm, Kind, PeerAddress, QPEntry, WireError

VERBS_REASON = base.unavailable_reason("verbs")


def _address(n=3, **kw) -> PeerAddress:
    fields = dict(port=1, mtu=5, lid=7, gid_index=3, gid=wire.gid_bytes("fe80:0000:0000:0000:0202:c9ff:fe00:0001"),
                  slots=16, entries=tuple(QPEntry(0x100 + i, 0xABC00 + i, 0x7F0000001000 + i * 1024, 0xBEEF)
                                          for i in range(n)))
    fields.update(kw)
    return PeerAddress(**fields)


# ---- address exchange ---------------------------------------------------------------------------
def test_address_round_trip():
    addr = _address()
    data = wire.encode_address(addr)
    assert wire.decode_address(data, 3) == addr
    assert addr.gid_text() == "fe80:0000:0000:0000:0202:c9ff:fe00:0001"


@pytest.mark.parametrize("cut", [0, 1, 10, 39, 40, 41, 60, -1])
def test_address_truncated_is_refused(cut):
    data = wire.encode_address(_address())
    with pytest.raises(WireError):
        wire.decode_address(data[:cut] if cut >= 0 else data + b"\0", 3)


def test_address_garbage_and_foreign_records_are_refused():
    data = wire.encode_address(_address())
    rng = np.random.default_rng(1)
    with pytest.raises(WireError):
        wire.decode_address(rng.bytes(len(data)), 3)
    with pytest.raises(WireError, match="version"):
        wire.decode_address(b"XXXX" + data[4:], 3)
    with pytest.raises(WireError, match="3 ranks"):
        wire.decode_address(data, 4)                      # a record for another group size
    bad_mtu = bytearray(data)
    bad_mtu[7] = 9                                        # mtu code outside ibv_mtu
    with pytest.raises(WireError, match="out of range"):
        wire.decode_address(bytes(bad_mtu), 3)
    with pytest.raises(WireError, match="24 bits"):
        wire.decode_address(wire.encode_address(_address(entries=(QPEntry(1 << 24, 0, 0, 0),) * 3)), 3)


# ---- immediates and clear-to-send records --------------------------------------------------------
@pytest.mark.parametrize("imm", [Imm(Kind.CTRL, 0, 0), Imm(Kind.DATA, 127, wire.ID_SPACE - 1),
                                 Imm(Kind.DATA, 5, 12345, error=True), Imm(Kind.CREDIT, 64, 0)])
def test_immediate_round_trip(imm):
    raw = wire.encode_imm(imm)
    assert 0 <= raw < 1 << 32
    assert wire.decode_imm(raw) == imm
    # verbs carries the immediate in network byte order: the top bits are the kind
    assert socket.ntohl(raw) >> 30 == imm.kind


def test_immediate_out_of_range_and_kindless():
    with pytest.raises(WireError):
        wire.encode_imm(Imm(Kind.DATA, 128, 0))
    with pytest.raises(WireError):
        wire.encode_imm(Imm(Kind.DATA, 0, wire.ID_SPACE))
    with pytest.raises(WireError, match="kind"):
        wire.decode_imm(socket.htonl(5))


def test_cts_round_trip_and_truncation():
    cts = ClearToSend(tag=(1 << 31) | 7, recv_id=99, nbytes=1 << 33, addr=0x7F00DEAD0000, rkey=0x1234)
    slot = wire.encode_cts(cts).ljust(wire.SLOT_BYTES, b"\0")
    assert len(slot) == wire.SLOT_BYTES
    assert wire.decode_cts(slot) == cts
    with pytest.raises(WireError):
        wire.decode_cts(slot[:10])


# ---- work requests --------------------------------------------------------------------------------
def test_payload_write_small_message_is_one_signaled_write_with_immediate():
    (w,) = wire.payload_writes(0x1000, 11, 0x9000, 22, 4096, imm=0xAABBCCDD)
    assert (w.local_addr, w.length, w.lkey, w.remote_addr, w.rkey) == (0x1000, 4096, 11, 0x9000, 22)
    assert w.imm == 0xAABBCCDD and w.signaled


def test_payload_write_empty_message_still_carries_the_immediate():
    (w,) = wire.payload_writes(0x1000, 11, 0x9000, 22, 0, imm=5)
    assert w.length == 0 and w.imm == 5 and w.signaled


def test_payload_write_large_message_is_split_and_only_the_last_notifies():
    n = 2 * wire.MAX_WRITE_BYTES + 10
    writes = wire.payload_writes(0, 1, 1 << 40, 2, n, imm=9)
    assert [w.length for w in writes] == [wire.MAX_WRITE_BYTES, wire.MAX_WRITE_BYTES, 10]
    assert [w.imm for w in writes] == [None, None, 9]
    assert [w.signaled for w in writes] == [False, False, True]
    assert [w.remote_addr - (1 << 40) for w in writes] == [w.local_addr for w in writes]


# ---- registration cache -----------------------------------------------------------------------------
class FakeNic:
    def __init__(self):
        self.live, self.calls = {}, []

    def register(self, start, length, device):
        handle = len(self.calls)
        self.calls.append((start, length, device))
        self.live[handle] = (start, length)
        return handle, 100 + handle, 200 + handle, start

    def deregister(self, handle):
        del self.live[handle]


def _cache(**kw):
    nic = FakeNic()
    return nic, RegistrationCache(nic.register, nic.deregister, **kw)


def test_cache_hit_on_covering_registration():
    nic, cache = _cache()
    owner = object()
    reg = cache.acquire(0x1000, 100, region=(0x1000, 0x5000), owner=owner)
    cache.release(reg)
    inner = cache.acquire(0x2000, 0x1000)           # a slice of the same allocation
    assert inner is reg and reg.iova(0x2000) == 0x2000
    assert (cache.hits, cache.misses, len(nic.calls)) == (1, 1, 1)
    cache.release(inner)
    straddling = cache.acquire(0x4F00, 0x200)        # crosses the end: not covered
    assert straddling is not reg and len(nic.calls) == 2


def test_cache_iova_of_dmabuf_style_registration():
    cache = RegistrationCache(lambda s, n, d: (object(), 1, 2, 0), lambda h: None)
    reg = cache.acquire(0x7000_0000, 64, region=(0x7000_0000, 0x7010_0000), device="cuda")
    assert reg.iova(0x7000_0040) == 0x40              # dma-buf MRs count from the buffer's start


def test_cache_evicts_least_recently_used_but_never_pinned():
    nic, cache = _cache(max_entries=2)
    a = cache.acquire(0x1000, 10, owner=1)
    b = cache.acquire(0x2000, 10, owner=2)
    cache.release(b)
    cache.release(a)                                 # a is now the most recently used
    c = cache.acquire(0x3000, 10, owner=3)           # evicts b, the least recently used
    assert {v[0] for v in nic.live.values()} == {0x1000, 0x3000}
    d = cache.acquire(0x4000, 10, owner=4)           # a idle, c and d pinned: a goes
    assert {v[0] for v in nic.live.values()} == {0x3000, 0x4000}
    e = cache.acquire(0x5000, 10, owner=5)           # everything pinned: over the limit for now
    assert len(cache) == 3
    for reg in (c, d, e):
        cache.release(reg)
    assert len(cache) == 2


def test_cache_byte_budget_and_release_errors():
    nic, cache = _cache(max_bytes=100)
    a = cache.acquire(0x1000, 80, owner=1)
    cache.release(a)
    b = cache.acquire(0x2000, 80, owner=2)
    assert cache.registered_bytes == 80 and len(nic.live) == 1
    cache.release(b)
    with pytest.raises(ValueError):
        cache.release(b)
    with pytest.raises(ValueError):
        cache.acquire(0x1000, 0)
    with pytest.raises(ValueError):
        cache.acquire(0x1000, 10, region=(0x1004, 0x2000))


def test_cache_drops_unowned_and_clears_on_close():
    nic, cache = _cache()
    owned = cache.acquire(0x1000, 10, owner=object())
    foreign = cache.acquire(0x2000, 10)               # owner unknown: cached for one operation
    cache.release(foreign)
    cache.drop_unowned()
    assert [v[0] for v in nic.live.values()] == [0x1000]
    cache.release(owned)
    cache.clear()
    assert not nic.live and len(cache) == 0


# ---- credit flow control ------------------------------------------------------------------------------
def test_credits_never_negative_and_exhaustion_blocks():
    w = CreditWindow(4)
    assert [w.try_take() for _ in range(6)] == [True] * 4 + [False] * 2
    assert w.available == 0
    w.restore(3)
    assert w.available == 3
    with pytest.raises(ValueError):
        w.restore(2)                                 # more than were ever spent
    with pytest.raises(ValueError):
        CreditWindow(0)
    with pytest.raises(ValueError):
        CreditWindow(wire.MAX_CREDITS + 1)


def test_outbox_waits_for_credits_keeps_order_and_piggybacks_returns():
    w = CreditWindow(4)
    box = Outbox(w)
    posted = []
    for i in range(7):
        box.push(i)
    w.processed()
    w.processed()                                    # two messages from the peer processed
    assert box.flush(lambda m, c: posted.append((m, c))) == 4
    assert posted == [(0, 2), (1, 0), (2, 0), (3, 0)]   # the returns ride on the first message
    assert len(box) == 3 and w.available == 0
    assert box.flush(lambda m, c: posted.append((m, c))) == 0   # exhausted: the rest wait
    w.restore(2)                                     # the peer returned two credits
    assert box.flush(lambda m, c: posted.append((m, c))) == 2
    assert [m for m, _ in posted] == list(range(6)) and len(box) == 1


def test_explicit_credit_return_threshold_and_overrun():
    w = CreditWindow(8)
    for _ in range(3):
        w.processed()
    assert not w.needs_explicit_return()
    w.processed()
    assert w.needs_explicit_return()                 # half the window is owed
    assert w.to_return() == 4 and w.owed == 0
    for _ in range(8):
        w.processed()
    with pytest.raises(ValueError, match="more than its"):
        w.processed()                                # the peer ignored flow control
    assert CREDIT_RESERVE >= 2                       # at most two unread CREDIT messages


# ---- discovery -----------------------------------------------------------------------------------------
def test_discovery_reason_is_clear_without_a_device():
    if VERBS_REASON is None:
        pytest.skip("an RDMA device is present: this checks the message given without one")
    assert "RDMA device" in VERBS_REASON or "pyverbs" in VERBS_REASON
    with pytest.raises(comm.TransportUnavailable, match="verbs"):
        comm.init(transport="verbs")


def test_missing_pyverbs_gives_the_install_hint():
    from transports.verbs import device
    if device.pv is not None:
        pytest.skip("pyverbs is importable here: the hint is for machines without it")
    with pytest.raises(comm.TransportUnavailable, match=r"apt-get install python3-pyverbs rdma-core"):
        comm.init(transport="verbs")


ROCE_V1, ROCE_V2 = 0, 1   # ibv_gid_type_sysfs, what Context.query_gid_type returns
ZERO = "0000:0000:0000:0000:0000:0000:0000:0000"
LINK_LOCAL = "fe80:0000:0000:0000:0202:c9ff:fe00:0001"
IPV4_MAPPED = "0000:0000:0000:0000:0000:ffff:c612:0001"


def test_gid_choice_takes_the_first_non_zero_roce_v2_entry():
    from transports.verbs.device import choose_gid
    table = [(0, LINK_LOCAL, ROCE_V1), (1, LINK_LOCAL, ROCE_V2), (2, IPV4_MAPPED, ROCE_V1),
             (3, IPV4_MAPPED, ROCE_V2)]
    assert choose_gid(table, ethernet=True, wanted=-1) == 1
    assert choose_gid(table[2:], ethernet=True, wanted=-1) == 3
    # a zero GID is never chosen, even typed v2; no v2 at all falls back to index 0
    assert choose_gid([(0, LINK_LOCAL, ROCE_V1), (5, ZERO, ROCE_V2)], ethernet=True, wanted=-1) == 0
    # verbs.h's IBV_GID_TYPE_ROCE_V2 (2) is not what the sysfs query returns
    assert choose_gid([(0, LINK_LOCAL, ROCE_V1), (1, IPV4_MAPPED, 2)], ethernet=True, wanted=-1) == 0


def test_gid_choice_respects_configuration_and_infiniband():
    from transports.verbs.device import choose_gid
    table = [(0, LINK_LOCAL, ROCE_V1), (1, IPV4_MAPPED, ROCE_V2)]
    assert choose_gid(table, ethernet=True, wanted=7) == 7     # COMM_VERBS_GID_INDEX wins
    assert choose_gid(table, ethernet=False, wanted=-1) == 0   # InfiniBand: routed by LID


def test_hop_limit_is_declared_and_configurable(monkeypatch):
    from comm import config
    assert config.get("COMM_VERBS_HOP_LIMIT") == 64
    monkeypatch.setenv("COMM_VERBS_HOP_LIMIT", "8")
    assert config.get("COMM_VERBS_HOP_LIMIT") == 8


def _ring_exchange(world):
    x = np.full(1000, world.rank + 1, np.float32)
    world.all_reduce(x)
    peer = (world.rank + 1) % world.size
    got = np.empty(17, np.int64)
    r = world.irecv(got, (world.rank - 1) % world.size, tag=5)
    world.send(np.arange(17, dtype=np.int64) + world.rank, peer, tag=5)
    r.wait()
    return float(x[0]), int(got[0])


@pytest.mark.skipif(VERBS_REASON is not None, reason=f"verbs: {VERBS_REASON}")
def test_two_ranks_over_verbs():
    from harness import run_ranks
    results = run_ranks(_ring_exchange, 2, transport="verbs", timeout=120)
    assert results == [(3.0, 1), (3.0, 0)]
