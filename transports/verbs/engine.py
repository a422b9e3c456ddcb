"""The verbs messaging engine: one RC queue pair per peer, one completion queue, rendezvous
messages over RDMA WRITE WITH IMMEDIATE (see wire.py), credit flow control (credits.py),
registrations through the cache (regcache.py). It implements comm.algorithms.P2P.

Thread-safe through one lock: the progress thread (collectives) and user threads waiting on
send/recv all drive progress by polling the completion queue, one at a time; waiters sleep
outside the lock.
"""
from __future__ import annotations

import random
import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field

import numpy as np

from comm.errors import Aborted, CommError, CommTimeout, InvalidArgument, Mismatch, PeerFailure

from . import device as dev
from .credits import CREDIT_RESERVE, CreditWindow, Outbox
from .device import E, pv
from .regcache import Registration, RegistrationCache
from .wire import (ID_SPACE, MAX_WRITE_BYTES, SLOT_BYTES, ClearToSend, Imm, Kind, PeerAddress, QPEntry, WriteSpec,
                   decode_address, decode_cts, decode_imm, encode_address, encode_cts, encode_imm,
                   gid_bytes, payload_writes)

CREDITS = 16          # messages in flight per peer: enough to keep a ring's pipeline busy
_SCRATCH = 64         # registered bytes for empty messages and receive requests' SGEs
# A message is at most 4 writes, so CREDITS messages fit the send queue (4 * depth requests).
MAX_MESSAGE_BYTES = 4 * MAX_WRITE_BYTES


def check_size(nbytes: int) -> None:
    if nbytes > MAX_MESSAGE_BYTES:
        raise InvalidArgument(f"a verbs message is limited to {MAX_MESSAGE_BYTES >> 30} GiB, got "
                              f"{nbytes} bytes; send it in pieces")


@dataclass(eq=False)
class Message:
    """One send or receive: a contiguous byte range on `device`, owned by `owner`."""

    peer: int
    tag: int
    addr: int
    nbytes: int
    device: str
    device_index: int
    owner: object
    done: bool = False
    error: CommError | None = None
    reg: Registration | None = field(default=None, repr=False)


@dataclass(eq=False)
class _Peer:
    qp: object
    window: CreditWindow
    outbox: Outbox
    remote_inbox: int = 0
    remote_rkey: int = 0
    ctrl_seq: int = 0                                            # CTS records sent (slot cursor)
    sends: dict = field(default_factory=lambda: defaultdict(deque))   # tag -> Messages waiting
    cts: dict = field(default_factory=lambda: defaultdict(deque))     # tag -> ClearToSend waiting
    recvs: dict = field(default_factory=dict)                    # receive id -> Message
    next_id: int = 0


def _owner_region(arr: np.ndarray) -> tuple[tuple[int, int], np.ndarray | None]:
    """The whole allocation behind a numpy view, and the array that owns it (None when no array
    does, e.g. a view of foreign memory: then the registration is dropped after the operation)."""
    root = arr
    while isinstance(root.base, np.ndarray):
        root = root.base
    start = root.__array_interface__["data"][0]
    return (start, start + root.nbytes), (root if root.flags.owndata else None)


class Engine:
    def __init__(self, rank: int, size: int, port: dev.Port, timeout: float, hop_limit: int = 64):
        self.rank, self.size, self.timeout = rank, size, timeout
        self.port = port
        self._hop_limit = hop_limit
        self._failure: CommError | None = None
        self.lock = threading.RLock()
        self.ctx = pv.device.Context(name=port.device)
        self.pd = pv.pd.PD(self.ctx)
        depth = CREDITS + CREDIT_RESERVE
        # Per peer at most `depth` receive and 4 * depth send completions can be pending.
        self.cq = pv.cq.CQ(self.ctx, max(1, size - 1) * 5 * depth, None, None, 0)
        self.cache = RegistrationCache(lambda s, n, d: dev.register(self.pd, s, n, d),
                                       lambda mr: mr.close())
        # Inbox: CREDITS slots per peer that only that peer writes; outbox: our staged CTS records.
        self._inbox = np.zeros(size * CREDITS * SLOT_BYTES, np.uint8)
        self._outbox = np.zeros(size * CREDITS * SLOT_BYTES, np.uint8)
        self._scratch = np.zeros(_SCRATCH, np.uint8)
        self._inbox_mr = dev.register(self.pd, self._inbox.ctypes.data, self._inbox.nbytes, "cpu")[0]
        self._outbox_mr = dev.register(self.pd, self._outbox.ctypes.data, self._outbox.nbytes, "cpu")[0]
        self._scratch_mr = dev.register(self.pd, self._scratch.ctypes.data, _SCRATCH, "cpu")[0]
        self.peers: dict[int, _Peer] = {}
        self._by_qpn: dict[int, int] = {}
        self._psn = {}
        self._wr_seq = 0
        self._in_flight: dict[int, tuple[int, Message | None]] = {}   # wr_id -> (peer, send or None)
        for peer in range(size):
            if peer != rank:
                self._create_qp(peer, depth)

    # ---- connection set-up -----------------------------------------------------------------
    def _create_qp(self, peer: int, depth: int) -> None:
        cap = pv.qp.QPCap(max_send_wr=4 * depth, max_recv_wr=depth, max_send_sge=1, max_recv_sge=1)
        init = pv.qp.QPInitAttr(qp_type=E.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap)
        attr = pv.qp.QPAttr(port_num=self.port.port)
        attr.qp_access_flags = E.IBV_ACCESS_LOCAL_WRITE | E.IBV_ACCESS_REMOTE_WRITE
        qp = pv.qp.QP(self.pd, init, attr)           # RC with attributes: left in INIT
        window = CreditWindow(CREDITS)
        self.peers[peer] = _Peer(qp, window, Outbox(window))
        self._by_qpn[qp.qp_num] = peer
        self._psn[peer] = random.getrandbits(24)

    def address(self) -> bytes:
        """This rank's record for the address exchange."""
        slot_bytes = CREDITS * SLOT_BYTES
        entries = []
        for r in range(self.size):
            p = self.peers.get(r)
            entries.append(QPEntry(p.qp.qp_num if p else 0, self._psn.get(r, 0),
                                   self._inbox.ctypes.data + r * slot_bytes, self._inbox_mr.rkey))
        return encode_address(PeerAddress(self.port.port, self.port.mtu, self.port.lid,
                                          self.port.gid_index, gid_bytes(self.port.gid_text),
                                          CREDITS, tuple(entries)))

    def connect(self, records: list[bytes]) -> None:
        """Bring every QP to RTS from the peers' records and post its receive requests. The
        caller barriers afterwards, so no one writes to a QP that is not ready."""
        for peer, p in self.peers.items():
            remote = decode_address(records[peer], self.size)
            mine = remote.entries[self.rank]
            if remote.slots != CREDITS:
                raise CommError(f"rank {peer} uses {remote.slots} credits, we use {CREDITS}: mixed versions")
            attr = pv.qp.QPAttr(port_num=self.port.port)
            attr.qp_access_flags = E.IBV_ACCESS_LOCAL_WRITE | E.IBV_ACCESS_REMOTE_WRITE
            attr.path_mtu = min(self.port.mtu, remote.mtu)
            attr.dest_qp_num, attr.rq_psn, attr.sq_psn = mine.qpn, mine.psn, self._psn[peer]
            attr.max_dest_rd_atomic, attr.max_rd_atomic = 1, 1
            # RNR should never happen (credits); retries cover a busy fabric, not a dead peer.
            attr.min_rnr_timer, attr.timeout, attr.retry_cnt, attr.rnr_retry = 12, 14, 7, 7
            if self.port.link_layer == E.IBV_LINK_LAYER_ETHERNET or remote.lid == 0:
                # pyverbs' default hop_limit of 1 stops RoCE v2 at the first router.
                gr = pv.addr.GlobalRoute(dgid=pv.addr.GID(remote.gid_text()), sgid_index=self.port.gid_index,
                                         hop_limit=self._hop_limit)
                attr.ah_attr = pv.addr.AHAttr(port_num=self.port.port, is_global=1, gr=gr, dlid=remote.lid)
            else:
                attr.ah_attr = pv.addr.AHAttr(port_num=self.port.port, dlid=remote.lid)
            p.qp.to_rts(attr)
            p.remote_inbox, p.remote_rkey = mine.inbox_addr, mine.inbox_rkey
            for _ in range(CREDITS + CREDIT_RESERVE):
                self._post_recv(p)

    def _post_recv(self, p: _Peer) -> None:
        # WRITE WITH IMMEDIATE lands where the writer says; the receive request only needs to
        # exist, and pyverbs insists on one SGE.
        sge = pv.wr.SGE(self._scratch.ctypes.data, _SCRATCH, self._scratch_mr.lkey)
        p.qp.post_recv(pv.wr.RecvWR(wr_id=0, num_sge=1, sg=[sge]))

    # ---- posting ---------------------------------------------------------------------------
    def isend(self, peer: int, tag: int, arr: np.ndarray) -> Message:
        region, owner = _owner_region(arr)
        return self.send_range(peer, tag, arr.ctypes.data, arr.nbytes, "cpu", 0, owner, region)

    def irecv(self, peer: int, tag: int, arr: np.ndarray) -> Message:
        region, owner = _owner_region(arr)
        return self.recv_range(peer, tag, arr.ctypes.data, arr.nbytes, "cpu", 0, owner, region)

    def send_range(self, peer, tag, addr, nbytes, device, device_index, owner, region=None) -> Message:
        check_size(nbytes)
        with self.lock:
            self._raise_failure()
            msg = Message(peer, tag, addr, nbytes, device, device_index, owner)
            msg.reg = self._register(msg, region)
            self.peers[peer].sends[tag].append(msg)
            self._match(peer, tag)
            return msg

    def recv_range(self, peer, tag, addr, nbytes, device, device_index, owner, region=None) -> Message:
        check_size(nbytes)
        with self.lock:
            self._raise_failure()
            msg = Message(peer, tag, addr, nbytes, device, device_index, owner)
            msg.reg = self._register(msg, region)
            p = self.peers[peer]
            rid = p.next_id
            p.next_id = (rid + 1) % ID_SPACE
            p.recvs[rid] = msg
            local = msg.reg.iova(addr) if nbytes else 0
            p.outbox.push((Kind.CTRL, ClearToSend(tag, rid, nbytes, local, msg.reg.rkey if nbytes else 0)))
            self._flush(peer)
            return msg

    def _register(self, msg: Message, region) -> Registration | None:
        if msg.nbytes == 0:
            return None        # empty messages use the scratch region
        if msg.device == "cuda":
            dev.cuda_bind(msg.device_index)
            region = region or dev.cuda_allocation(msg.addr)
        return self.cache.acquire(msg.addr, msg.nbytes, region=region, owner=msg.owner, device=msg.device)

    def _match(self, peer: int, tag: int) -> None:
        """Pair sends with clear-to-send records of the same tag, in order."""
        p = self.peers[peer]
        sends, ctss = p.sends[tag], p.cts[tag]
        while sends and ctss:
            msg, cts = sends.popleft(), ctss.popleft()
            if cts.nbytes != msg.nbytes:
                self._finish(msg, Mismatch(f"send of {msg.nbytes} bytes to rank {peer} (tag {tag}) met a "
                                           f"receive of {cts.nbytes} bytes"))
                p.outbox.push((Kind.DATA, cts, None))
            else:
                p.outbox.push((Kind.DATA, cts, msg))
        self._flush(peer)

    def _flush(self, peer: int) -> None:
        p = self.peers[peer]
        p.outbox.flush(lambda item, credits: self._post_message(peer, item, credits))
        if not len(p.outbox) and p.window.needs_explicit_return():
            credit = encode_imm(Imm(Kind.CREDIT, p.window.to_return(), 0))
            self._post_writes(peer, [self._empty_write(p, credit)], None)

    def _post_message(self, peer: int, item, credits: int) -> None:
        p = self.peers[peer]
        if item[0] is Kind.CTRL:
            slot = p.ctrl_seq % CREDITS
            p.ctrl_seq += 1
            offset = (peer * CREDITS + slot) * SLOT_BYTES
            record = encode_cts(item[1])
            self._outbox[offset:offset + len(record)] = np.frombuffer(record, np.uint8)
            imm = encode_imm(Imm(Kind.CTRL, credits, slot))
            write = WriteSpec(self._outbox.ctypes.data + offset, len(record), self._outbox_mr.lkey,
                              p.remote_inbox + slot * SLOT_BYTES, p.remote_rkey, imm, True)
            self._post_writes(peer, [write], None)
            return
        _, cts, msg = item
        imm = encode_imm(Imm(Kind.DATA, credits, cts.recv_id, error=msg is None))
        if msg is None or msg.nbytes == 0:
            self._post_writes(peer, [self._empty_write(p, imm)], msg)
        else:
            self._post_writes(peer, payload_writes(msg.reg.iova(msg.addr), msg.reg.lkey, cts.addr,
                                                   cts.rkey, msg.nbytes, imm), msg)

    def _empty_write(self, p: _Peer, imm: int) -> WriteSpec:
        """A zero-byte write: only its immediate matters."""
        return WriteSpec(self._scratch.ctypes.data, 0, self._scratch_mr.lkey, p.remote_inbox,
                         p.remote_rkey, imm, True)

    def _post_writes(self, peer: int, writes: list[WriteSpec], msg: Message | None) -> None:
        qp = self.peers[peer].qp
        for w in writes:
            sge = pv.wr.SGE(w.local_addr, w.length, w.lkey)
            opcode = E.IBV_WR_RDMA_WRITE if w.imm is None else E.IBV_WR_RDMA_WRITE_WITH_IMM
            wr_id = self._next_wr(peer, msg) if w.signaled else 0   # unsignaled: no completion
            wr = pv.wr.SendWR(wr_id=wr_id, opcode=opcode,
                              num_sge=1, sg=[sge], send_flags=E.IBV_SEND_SIGNALED if w.signaled else 0)
            if w.imm is not None:
                wr.imm_data = w.imm
            wr.set_wr_rdma(w.rkey, w.remote_addr)
            qp.post_send(wr)

    def _next_wr(self, peer: int, msg: Message | None) -> int:
        self._wr_seq += 1
        self._in_flight[self._wr_seq] = (peer, msg)
        return self._wr_seq

    # ---- completions -----------------------------------------------------------------------
    def progress(self) -> bool:
        """Poll the completion queue once; True when something happened."""
        with self.lock:
            return self._poll()

    def _poll(self) -> bool:
        n, wcs = self.cq.poll(16)
        for wc in wcs:
            if wc.status != E.IBV_WC_SUCCESS:
                peer = self._by_qpn.get(wc.qp_num)
                self._fail(PeerFailure(f"connection to rank {peer} failed (work completion status "
                                       f"{wc.status}: the peer died or the fabric dropped it)", peer=peer))
                break
            if wc.opcode == E.IBV_WC_RECV_RDMA_WITH_IMM:
                peer = self._by_qpn[wc.qp_num]
                try:
                    self._on_message(peer, decode_imm(wc.imm_data))
                except (ValueError, KeyError) as e:   # WireError is a ValueError
                    self._fail(CommError(f"protocol error from rank {peer}: {e}"))
                    break
            else:
                _, msg = self._in_flight.pop(wc.wr_id, (None, None))
                if msg is not None:
                    self._finish(msg, None)     # RC acked: the payload is in the peer's buffer
        return n > 0

    def _on_message(self, peer: int, imm: Imm) -> None:
        p = self.peers[peer]
        self._post_recv(p)
        p.window.restore(imm.credits)
        if imm.kind is Kind.CTRL:
            offset = (peer * CREDITS + imm.value) * SLOT_BYTES
            cts = decode_cts(self._inbox[offset:offset + SLOT_BYTES].tobytes())
            p.window.processed()
            p.cts[cts.tag].append(cts)
            self._match(peer, cts.tag)
        elif imm.kind is Kind.DATA:
            p.window.processed()
            msg = p.recvs.pop(imm.value)
            if imm.error:
                self._finish(msg, Mismatch(f"rank {peer} sent a different size than this receive of "
                                           f"{msg.nbytes} bytes (tag {msg.tag})"))
            else:
                if msg.device == "cuda" and msg.nbytes:
                    dev.cuda_bind(msg.device_index)
                    dev.cuda_flush_rdma_writes()
                self._finish(msg, None)
        self._flush(peer)

    def _finish(self, msg: Message, error: CommError | None) -> None:
        if msg.reg is not None:
            self.cache.release(msg.reg)
            msg.reg = None
        msg.error, msg.done = error, True

    # ---- waiting and failure ---------------------------------------------------------------
    def wait(self, handles, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.0
        while True:
            self._raise_failure()
            for msg in handles:
                if msg.error is not None:
                    raise msg.error
            if all(m.done for m in handles):
                return
            if self.progress():
                pause = 0.0
                continue
            if deadline is not None and time.monotonic() >= deadline:
                raise CommTimeout(f"verbs messages not completed within {timeout:g} s (a peer is slow, "
                                  "hung, or posted a different operation)")
            time.sleep(pause)      # back off: ranks share CPUs with the application
            pause = min(pause * 2 or 1e-6, 1e-3)

    def forget_unowned(self) -> None:
        """End of an operation: registrations of memory no array here owns must not outlive it."""
        with self.lock:
            self.cache.drop_unowned()

    def test(self, msg: Message) -> bool:
        self._raise_failure()
        self.progress()
        if msg.error is not None:
            raise msg.error
        return msg.done

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    def _fail(self, error: CommError) -> None:
        if self._failure is None:
            self._failure = error

    def abort(self) -> None:
        self._fail(Aborted("the verbs communicator was aborted"))

    def close(self) -> None:
        """Destroy QPs, then registrations, then the PD and device (verbs' required order)."""
        with self.lock:
            self._close()

    def _close(self) -> None:
        for p in self.peers.values():
            p.qp.close()
        self.cq.close()
        self.cache.clear()
        for mr in (self._inbox_mr, self._outbox_mr, self._scratch_mr):
            mr.close()
        self.pd.close()
        self.ctx.close()

