"""Going on after a failure: agree, shrink and grow (ULFM's verbs, ncclCommShrink, torchft's
reconfiguration), over the rendezvous store, which survives its host.

Every process of a job has a uid (its world rank; newcomers get the next free one) and, from
init on, a standby listener whose address every process knows (published through the store
at init and at every grow). When the store's host dies, each survivor tries the standby
listeners in uid order, skipping itself-known dead ones: a refused connection is a dead
process, a handshake that does not come within the timeout a hung one. The first that
answers becomes the host (its standby thread starts a StoreServer on the first connection it
accepts), so every survivor lands on the lowest live uid without the old host's help.

Agreement is decided by the host (comm.bootstrap.agreement); each survivor replays the decisions it
has seen onto a new host, so a decision some saw is the decision for all. shrink agrees on
the failed ranks, connects a new communicator of the rest (new sockets, new shared memory,
store keys under the new epoch: nothing of it can be reached by an excluded rank, which the
host also refuses), then agrees that every member connected; a member lost meanwhile starts
another round without it.

A transport whose library keeps its own groups and can go on after a failure by itself (mpi,
through MPI's ULFM: Transport.ulfm) revokes, agrees and shrinks with the library's calls
instead; the store is not involved then.
"""
from __future__ import annotations

import collections
import contextlib
import json
import socket
import threading
import zlib

from . import checks
from .bootstrap import auth, rendezvous
from .core import log
from .core.errors import CommError, Excluded, InvalidArgument, Mismatch, Revoked, TransportUnavailable
from .bootstrap.store import Store, StoreLost
from .bootstrap.store_host import StoreServer

LEDGER = 64   # decisions a process replays onto a new host: more than any shrink in flight needs


class Membership:
    """This process in an elastic job: its uid, the store's host, every process's standby
    address, the uids known failed, and the recent agreement decisions."""

    def __init__(self, store: Store, uid: int, bind_addr: str | None, timeout: float):
        self.store, self.uid, self.timeout = store, uid, timeout
        self.host = 0   # uid of the store's host
        self.standby: dict[int, tuple[str, int]] = {}
        self.failed: set[int] = set()
        self.ledger: collections.OrderedDict[str, tuple[dict, list]] = collections.OrderedDict()
        self._server: StoreServer | None = None
        self._closed = False
        self._lock = threading.Lock()
        addr = bind_addr or store.local_address()
        self._listener = rendezvous.listen_socket(addr)   # the store's family: IPv4 or IPv6
        try:
            self._listener.bind((addr, 0))
            self._listener.listen(128)
        except OSError:
            self._listener.close()
            raise
        self.address = self._listener.getsockname()[:2]
        self._thread = threading.Thread(target=self._standby, name="comm-standby", daemon=True)
        self._thread.start()
        store.membership = self

    def publish(self, store, uids: list[int] | None = None) -> list[int]:
        """Exchange uids and standby addresses with the members of `store`'s group (a scoped
        view: every member calls it); returns the members' uids by rank."""
        mine = json.dumps([self.uid, *self.address]).encode()
        entries = [json.loads(v) for v in store.all_gather("elastic/standby", mine)]
        for uid, addr, port in entries:
            self.standby[uid] = (addr, port)
        return [e[0] for e in entries]

    # ---- the store's next host -------------------------------------------------------------
    def _standby(self) -> None:
        """Waits for the first survivor that chose this process as the store's new host."""
        try:
            first = self._listener.accept()
        except OSError:
            return   # closed
        with self._lock:
            if self._closed:
                first[0].close()
                return
            self._server = StoreServer(self._listener, self.store._secret, self.timeout, size=0, agree={},
                                       where=f"{self.address[0]}:{self.address[1]}",
                                       next_uid=max(self.standby, default=self.uid) + 1, first=first)
            # what this process saw decided stays decided, even if no other survivor saw it
            with self._server._cond:
                for key, (decision, _) in self.ledger.items():
                    self._server._agreements.contribute(key, self.uid, {"decided": decision, "ack": True}, 0)
        log.debug(self.uid, "store: this process hosts the store now (its host was lost)")

    def failover(self, timeout: float) -> None:
        """The store's host is gone: move to the lowest live uid's standby listener."""
        old = self.host
        if old in self.standby and self._reach(old, timeout, greet=False) is None:
            self.failed.add(old)   # its process is gone, not just our connection to it
        for uid in sorted(self.standby):
            if uid == old or uid in self.failed:
                continue
            sock = self._reach(uid, timeout)
            if sock is None:
                self.failed.add(uid)
                continue
            try:
                self.store.reconnect(sock, {"uid": self.uid})
            except StoreLost:   # it died while we joined
                self.failed.add(uid)
                continue
            self.host = uid
            log.debug(self.uid, f"store: moved to the host of uid {uid} (uid {old} was lost)")
            for key, (decision, members) in list(self.ledger.items()):
                self.store.agree(key, {"decided": decision, "ack": True, "members": members}, timeout)
            return
        raise CommError("lost the rendezvous store and no survivor could host a new one",
                        rank=self.uid, op="shrink")

    def _reach(self, uid: int, timeout: float, greet: bool = True) -> socket.socket | None:
        """A connection past the handshake to uid's standby listener; None: dead or hung.
        greet=False: only whether a process still listens there (the connection is closed)."""
        try:
            sock = socket.create_connection(self.standby[uid], timeout=timeout)
        except OSError:   # refused: no process listens there any more
            return None
        if not greet:
            sock.close()
            return sock
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            auth.client_handshake(sock, self.store._secret, timeout)   # a hung process never greets
            sock.settimeout(None)
            return sock
        except (OSError, auth.HandshakeError):
            sock.close()
            return None

    def call(self, fn, timeout: float):
        """fn() against the store, moving to a new host as often as hosts die."""
        while True:
            try:
                return fn()
            except StoreLost:
                self.failover(timeout)

    # ---- agreement ---------------------------------------------------------------------------
    def agree(self, key: str, members, flag: int, failed: set[int], timeout: float) -> dict:
        """Decide with the other members (comm.bootstrap.agreement): vote, then acknowledge the decision.
        A decision held when the host died was replayed, acknowledged, onto the new one."""
        members = list(members)

        def contribute():
            if key in self.ledger:
                return self.ledger[key][0]
            seen = sorted((failed | self.failed) & set(members))
            decision = self.store.agree(key, {"members": members, "flag": flag, "failed": seen}, timeout)
            self.ledger[key] = (decision, members)
            while len(self.ledger) > LEDGER:
                self.ledger.popitem(last=False)
            self.store.agree(key, {"ack": True, "members": members}, timeout)
            return decision

        decision = self.call(contribute, timeout)
        self.failed.update(decision["failed"])
        return decision

    def close(self) -> None:
        with self._lock:
            self._closed = True
            server = self._server
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)   # wakes the standby thread's accept
        self._listener.close()
        self._thread.join(timeout=5)
        if server is not None:
            server.close()


def membership(world, op: str) -> Membership:
    """The Membership behind communicator `world`, or why it has none."""
    s = world.session
    reason = getattr(type(s.transport), "elastic", None)
    if reason:
        raise TransportUnavailable(f"{op} is not available on transport {world.transport!r}: {reason}",
                                   rank=world.rank, op=op)
    m = getattr(getattr(s.ctx.store, "_root", None), "membership", None)
    if m is None:
        raise InvalidArgument(f"{op} needs a communicator made by comm.init() or comm.join() (this one "
                              "bootstraps through another store, e.g. torchrun's)", rank=world.rank, op=op)
    if s.closed:
        s.refuse(op)
    return m


def _ulfm(world, op: str) -> bool:
    """True where the transport's library revokes, agrees and shrinks (MPI's ULFM), raising
    TransportUnavailable where this job cannot (the library lacks ULFM, or it runs without it)."""
    s = world.session
    if not s.transport.ulfm:
        return False
    missing = s.transport.ulfm_missing()
    if missing:
        raise TransportUnavailable(f"{op} is not available on transport {world.transport!r}: {missing}",
                                   rank=world.rank, op=op)
    if s.closed or s.foreign:
        s.refuse(op)
    return True


def _library(world, op: str, call, *args):
    """call(*args) on a ulfm transport, its failures as CommErrors of this rank and op."""
    try:
        return call(*args)
    except CommError as e:
        raise e.locate(world.rank, op) from None
    except Exception as e:   # the library's own exception type (mpi4py's MPI.Exception)
        raise world.session.transport.error(e).locate(world.rank, op) from None


def _key(world, what: str) -> str:
    s = world.session
    s.elastic_calls += 1
    return f"{s.ctx.group_name}@{world.epoch}/{what}{s.elastic_calls}"


def _dead(world) -> set[int]:
    """uids of the members this rank saw die (first hand, from the transport)."""
    return {world.ranks[r] for r in world.session.transport.dead_peers()}


def agree(world, flag: int, timeout: float | None = None) -> int:
    if not isinstance(flag, int) or isinstance(flag, bool) or not 0 <= flag < 2**62:
        raise InvalidArgument(f"flag must be an int in [0, 2**62), got {flag!r}", rank=world.rank, op="agree")
    if _ulfm(world, "agree"):
        flag, world.session.failed_ranks = _library(world, "agree", world.session.transport.agree, flag,
                                                    timeout or world.timeout)
        return flag
    m = membership(world, "agree")
    decision = m.agree(_key(world, "agree"), world.ranks, flag, _dead(world), timeout or world.timeout)
    world.session.failed_ranks = sorted(world.ranks.index(u) for u in decision["failed"])
    return decision["flag"]


def _fingerprint(ranks) -> int:
    """A flag whose AND over ranks equals each rank's own only when all passed the same
    ranks: a bit one rank has and another lacks is lost from the checksum or its complement."""
    crc = zlib.crc32(json.dumps(sorted(ranks)).encode())
    return (crc << 31) | (~crc & 0x7FFFFFFF)


def shrink(world, timeout: float | None, exclude, connect) -> "object":
    """`connect` is comm.communicator.connect, passed down by Communicator.shrink: this module
    stands below the communicator and never imports it."""
    if _ulfm(world, "shrink"):
        return _shrink_ulfm(world, timeout, exclude)
    m = membership(world, "shrink")
    timeout = timeout or world.timeout
    try:
        removed = {world.ranks[checks.root(world.session, "shrink", r, "excluded rank")] for r in exclude}
    except TypeError:
        raise InvalidArgument(f"exclude must be a list of ranks, got {exclude!r}", rank=world.rank, op="shrink") from None
    if m.uid in removed:
        raise InvalidArgument("a rank in exclude does not call shrink", rank=world.rank, op="shrink")
    seen = _dead(world)   # before the revoke below shuts this rank's monitors down
    world.revoke()        # ranks still blocked in the old communicator fail at once
    members = [u for u in world.ranks if u not in removed]
    base = _key(world, "shrink")
    for attempt in range(1, len(members) + 1):
        key = f"{base}.{attempt}"
        decision = m.agree(f"{key}/members", members, _fingerprint(removed), seen, timeout)
        if decision["flag"] != _fingerprint(removed):
            raise Mismatch("the survivors passed different exclude lists to shrink", rank=world.rank, op="shrink")
        live = [u for u in members if u not in decision["failed"]]
        if m.uid not in live:
            raise Excluded("the survivors declared this rank failed during shrink", rank=world.rank, op="shrink")
        new, ok = None, 1
        try:
            new = connect(m.store.scoped(f"{key}/c", live.index(m.uid), len(live), watch=live),
                          world.transport, world.session.ctx.group_name, ranks=tuple(live))
        except Excluded:
            raise
        except CommError as e:   # a member died during set-up: agree on it, then try again
            log.debug(world.rank, f"shrink: set-up of the new communicator failed ({e}); again")
            ok = 0
        done = m.agree(f"{key}/ok", live, ok, _dead(new) if new is not None else set(), timeout)
        if done["flag"] == 1 and not done["failed"]:
            world.session.failed_ranks = [r for r, u in enumerate(world.ranks) if u not in live and u not in removed]
            return _succeed(world, new)
        if new is not None:
            new.abort()
            new.close()
        seen |= set(done["failed"])
    raise CommError("shrink gave up: members kept failing", rank=world.rank, op="shrink")


def _shrink_ulfm(world, timeout, exclude):
    """shrink through the library (MPIX_Comm_shrink): every live rank takes part, so no rank
    can be left out on purpose."""
    if list(exclude):
        raise InvalidArgument(f"exclude is not available on transport {world.transport!r}: its library "
                              "shrinks to every live rank, and a live rank that does not call shrink "
                              "would hang the others", rank=world.rank, op="shrink")
    world.revoke()   # ranks still blocked in the old communicator fail at once
    s = world.session
    transport, kept = _library(world, "shrink", s.transport.shrink, timeout or world.timeout)
    # the new group's store keys live under this shrink's own name
    ctx = s.child_context(kept, _key(world, "shrink"), s.ctx.group_name)
    s.failed_ranks = [r for r in range(world.size) if r not in kept]
    return _succeed(world, type(world)(transport, ctx, ranks=tuple(world.ranks[r] for r in kept)))


def _succeed(old, new):
    new.epoch = old.epoch + 1
    # the store outlives the old one
    new.session.owned_store, old.session.owned_store = old.session.owned_store, None
    return new


def join_address(world) -> str:
    """Where processes that join through grow() find this communicator's survivors."""
    m = membership(world, "join_address")
    host, port = m.store.host_address()
    return f"{host}:{port}/{world.session.ctx.group_name}@{world.epoch}/grow"


def grow(world, count: int, timeout: float | None, connect):
    """`connect`: as for shrink."""
    m = membership(world, "grow")
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise InvalidArgument(f"count must be a positive int, got {count!r}", rank=world.rank, op="grow")
    if world.session.failure is not None:
        world.session.refuse("grow")
    ticket = join_address(world).split("/", 1)[1]
    if world.rank == 0:
        info = {"size": world.size, "count": count, "transport": world.transport,
                "group": world.session.ctx.group_name, "timeout": timeout or world.timeout, "epoch": world.epoch}
        m.store.set(f"{ticket}/info", json.dumps(info).encode())
    store = m.store.scoped(f"{ticket}/c", world.rank, world.size + count, watch=list(world.ranks))
    new = connect(store, world.transport, world.session.ctx.group_name)
    new.ranks = tuple(m.publish(store))
    return _succeed(world, new)


def revoke(world) -> None:
    s = world.session
    if s.foreign:
        s.refuse("revoke")
    _ulfm(world, "revoke")   # a ulfm transport that cannot revoke says why, before anything changes
    s.revoke(Revoked("this rank revoked the communicator; shrink() it to go on", rank=world.rank, op="revoke"))
    _library(world, "revoke", s.transport.revoke)
