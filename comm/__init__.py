"""comm: one collectives API for distributed ML over many transports.

    import comm
    world = comm.init()            # torchrun / mpirun / Slurm environment, or explicit arguments
    world.all_reduce(x)            # numpy, torch, any DLPack array; in place
"""
from __future__ import annotations

import datetime
import json
import os

from .core import config, log
from .bootstrap import rendezvous
from .core.buffers import Buffer
from .communicator import Communicator, connect, transport_class
from .p2p import P2POp
from .bootstrap.store import Store
from .elastic import Membership
from .core.errors import (Aborted, Closed, CommError, CommTimeout, Excluded, InvalidArgument, Mismatch,
                          PeerFailure, Revoked, TransportUnavailable, from_os_error)
from .core.types import DType, PremulSum, ReduceOp, premul_sum
from .window import Window
from .work import Work

# What tells this library apart from Jupyter's package of the same import name (see
# comm_collectives_autoload, the torch entry point, and python -m bench).
DISTRIBUTION = "comm-collectives"

SUM = ReduceOp.SUM
PRODUCT = ReduceOp.PRODUCT
MIN = ReduceOp.MIN
MAX = ReduceOp.MAX
AVG = ReduceOp.AVG
BAND = ReduceOp.BAND
BOR = ReduceOp.BOR
BXOR = ReduceOp.BXOR
PREMUL_SUM = ReduceOp.PREMUL_SUM

__all__ = ["init", "join", "torch_group", "Communicator", "Work", "Window", "P2POp", "ReduceOp", "DType", "Buffer", "premul_sum", "PremulSum",
           "CommError", "InvalidArgument", "CommTimeout", "PeerFailure", "Aborted", "Closed",
           "Mismatch", "Revoked", "Excluded", "TransportUnavailable",
           "SUM", "PRODUCT", "MIN", "MAX", "AVG", "BAND", "BOR", "BXOR", "PREMUL_SUM"]


def torch_group(communicator: Communicator, name: str | None = None):
    """A torch.distributed process group over `communicator` (comm.torch.backend.torch_group)."""
    from .torch.backend import torch_group as make
    return make(communicator, name)


def _seconds(timeout) -> float:
    if timeout is None:
        return config.get("COMM_TIMEOUT")
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    return float(timeout)


def _placement(rank, world_size, master_addr, master_port) -> rendezvous.Placement:
    """The launcher's placement with the explicit arguments laid over it, checked."""
    place = rendezvous.detect()
    if rank is not None:
        place.rank = rank
    if world_size is not None:
        place.size = world_size
    place.master_addr = master_addr or place.master_addr
    place.master_port = master_port or place.master_port
    if place.rank is None and place.size is None:
        place.rank, place.size = 0, 1
    if place.size is None:
        raise InvalidArgument(f"rank is {place.rank} but the world size is unknown: set WORLD_SIZE (as torchrun "
                              "does) or pass world_size=", rank=place.rank, op="init")
    if place.rank is None:
        raise InvalidArgument(f"the world size is {place.size} but this process's rank is unknown: set RANK "
                              "(as torchrun does) or pass rank=", op="init")
    if not (isinstance(place.size, int) and place.size >= 1 and 0 <= place.rank < place.size):
        raise InvalidArgument(f"rank {place.rank} is not in a world of size {place.size}; check "
                              "RANK/WORLD_SIZE (or the launcher's variables)", rank=place.rank, op="init")
    return place


def init(rank: int | None = None, world_size: int | None = None, master_addr: str | None = None,
         master_port: int | None = None, transport: str = "auto", timeout=None) -> Communicator:
    """Join the job and return the world communicator.

    Rank, world size and the rendezvous address come from the arguments, else from the
    launcher's environment (torchrun, mpirun, Slurm). A process started by none of them and
    given no arguments is a world of one. transport: "auto" (COMM_TRANSPORT, default native),
    "native", "mpi", "ucx", "nccl" or "verbs". timeout: seconds or timedelta for every
    operation (default COMM_TIMEOUT).

    Ranks that disagree on the world size, the transport or whether COMM_SECRET is set fail
    at once with an error naming the disagreement. While ranks are missing, rank 0 reports
    every COMM_REPORT_INTERVAL seconds which ones, and where the others came from.
    """
    try:
        return _init(rank, world_size, master_addr, master_port, transport, timeout)
    except CommError:
        raise
    except OSError as e:   # no descriptors, no memory, no route: a CommError like the rest
        raise from_os_error(e, rank=rank, op="init") from None


def _init(rank, world_size, master_addr, master_port, transport, timeout) -> Communicator:
    try:
        config.check_environment()
    except InvalidArgument as e:
        raise e.locate(rank, "init") from None
    seconds = _seconds(timeout)
    if not seconds > 0:
        raise InvalidArgument(f"timeout must be positive, got {timeout!r}", op="init")
    place = _placement(rank, world_size, master_addr, master_port)
    if place.launcher in ("openmpi", "hydra") and (place.master_addr is None or place.master_port is None):
        from transports.mpi import share_address_through_mpi   # lazily: only this path needs MPI
        place = share_address_through_mpi(place)
    if place.size == 1:
        place.master_addr = place.master_addr or "127.0.0.1"
        place.master_port = place.master_port if place.master_port is not None else 0
    addr = place.master_addr or "127.0.0.1"
    port = place.master_port if place.master_port is not None else rendezvous.DEFAULT_PORT

    name = config.get("COMM_TRANSPORT") if transport == "auto" else transport
    transport_class(name, place.rank)   # fail before any port is bound or dialled
    secret = config.get("COMM_SECRET")
    if place.size == 1 and port == 0:
        port = rendezvous.free_port()
    log.debug(place.rank, f"init: rank {place.rank} of {place.size} (launcher {place.launcher}), "
                          f"transport {name}, rendezvous {addr}:{port}, timeout {seconds:g} s")
    if log.enabled():   # what this machine offers, as `python -m comm.doctor` prints it
        from . import doctor
        for line in doctor.report():
            log.debug(place.rank, line)
    # torchrun's agent already serves a torch TCPStore on MASTER_PORT: join it as a client, unless
    # the caller named the rendezvous itself (then it is ours to host, wherever torchrun's is)
    if (os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and master_addr is None
            and master_port is None):
        from .torch.store import TorchStore
        log.debug(place.rank, "init: joining torchrun's agent store")
        store = TorchStore.connect(addr, port, place.rank, place.size, seconds)
    else:
        store = Store.host_or_connect(addr, port, rank=place.rank, size=place.size, timeout=seconds,
                                      secret=secret.encode() if secret else None,
                                      agree={"transport": name})
    try:
        scoped = store.scoped("world")
        # shrink and grow need the store to outlive its host: every rank a standby listener
        membership = Membership(store, place.rank, rendezvous.bind_address(), seconds) \
            if isinstance(store, Store) else None
        world = connect(scoped, name, "world", owned_store=store)
    except BaseException:
        store.close()
        raise
    try:
        if membership is not None:
            membership.publish(scoped)
        return world
    except BaseException:
        world.close()   # and the store it owns
        raise


def join(address: str, timeout: float | None = None) -> Communicator:
    """The newcomer's side of Communicator.grow(): join the survivors that published `address`
    (their join_address()). timeout: seconds for the set-up (default COMM_TIMEOUT); after it
    the communicator takes the survivors' timeout unless one was given here."""
    try:
        where, ticket = address.split("/", 1)
        host, port = where.rsplit(":", 1)
        port = int(port)
    except ValueError:
        raise InvalidArgument(f"join address {address!r} is not HOST:PORT/TICKET (from join_address())",
                              op="join") from None
    secret = config.get("COMM_SECRET")
    wait = timeout or config.get("COMM_TIMEOUT")
    store = Store(host, port, rank=-1, size=0, timeout=wait, secret=secret.encode() if secret else None,
                  hello={"join": True})
    try:
        uid = store.rank = int(store.joined)
        m = Membership(store, uid, rendezvous.bind_address(), wait)
        info = json.loads(store.get(f"{ticket}/info"))
        index = store.add(f"{ticket}/joiners", 1) - 1
        if index >= info["count"]:
            raise InvalidArgument(f"the survivors grow by {info['count']} processes, and that many have "
                                  "joined already", rank=uid, op="join")
        m.timeout = store.timeout = float(info["timeout"]) if timeout is None else wait
        size = info["size"] + info["count"]
        view = store.scoped(f"{ticket}/c", info["size"] + index, size)
        new = connect(view, info["transport"], info["group"], owned_store=store)
    except BaseException:
        store.close()
        raise
    new.ranks = tuple(m.publish(view))
    new.epoch = info["epoch"] + 1
    return new
