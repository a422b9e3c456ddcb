"""The pyverbs side that is not messaging: loading pyverbs, finding a port, registering memory
(host memory, and CUDA memory for GPUDirect RDMA), and the few CUDA calls verbs needs.

pyverbs ships with rdma-core: on Debian/Ubuntu `apt-get install python3-pyverbs rdma-core`.
That package installs into the system Python's /usr/lib/python3/dist-packages, which a virtual
environment does not see; when pyverbs is not importable otherwise, that folder is appended to
sys.path just for the import below and removed again (appended, so it never shadows the
environment's own packages; pyverbs' extension modules must match this Python's version).
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from comm.errors import CommError, TransportUnavailable

DEBIAN_DIST_PACKAGES = "/usr/lib/python3/dist-packages"


def _import_pyverbs():
    import pyverbs.addr
    import pyverbs.cq
    import pyverbs.device
    import pyverbs.enums
    import pyverbs.mr
    import pyverbs.pd
    import pyverbs.pyverbs_error
    import pyverbs.qp
    import pyverbs.wr
    return pyverbs


def load_pyverbs():
    """(pyverbs module, None), or (None, why it cannot be imported)."""
    try:
        return _import_pyverbs(), None
    except ImportError:
        pass
    if not os.path.isdir(os.path.join(DEBIAN_DIST_PACKAGES, "pyverbs")):
        return None, "pyverbs is not installed (apt-get install python3-pyverbs rdma-core)"
    sys.path.append(DEBIAN_DIST_PACKAGES)
    try:
        return _import_pyverbs(), None
    except ImportError as e:
        return None, f"pyverbs from python3-pyverbs does not import into this Python ({e})"
    finally:
        sys.path.remove(DEBIAN_DIST_PACKAGES)


pv, PYVERBS_ERROR = load_pyverbs()
# pyverbs' enums, or None: modules that use them import fine without pyverbs and are only
# entered once available() has said the transport can run.
E = pv.enums if pv is not None else None


@dataclass(frozen=True)
class Port:
    device: str
    port: int
    lid: int
    mtu: int            # ibv_mtu code of the active MTU
    link_layer: int
    gid_index: int
    gid_text: str       # pyverbs' textual GID


def _device_names() -> list[str]:
    try:
        devices = pv.device.get_device_list()
    except pv.pyverbs_error.PyverbsRDMAError:
        return []    # no kernel RDMA support at all: the same answer as an empty list
    return [d.name.decode() if isinstance(d.name, bytes) else d.name for d in devices]


# ibv_query_gid_type reports the sysfs enum (ibv_gid_type_sysfs in infiniband/driver.h):
# IB/RoCE v1 = 0, RoCE v2 = 1. Not verbs.h's ibv_gid_type, where RoCE v2 is 2.
GID_TYPE_SYSFS_ROCE_V2 = 1


def choose_gid(entries, ethernet: bool, wanted: int) -> int:
    """The GID index to use, from the port's table as (index, gid text, sysfs type) entries
    (type None where it cannot be read): the configured index when given; on Ethernet (RoCE)
    the first non-zero RoCE v2 GID, which routers can forward; else index 0."""
    if wanted >= 0:
        return wanted
    if ethernet:
        for index, gid, gid_type in entries:
            if int(gid.replace(":", ""), 16) and gid_type == GID_TYPE_SYSFS_ROCE_V2:
                return index
    return 0


def _gid_table(ctx, port: int, length: int):
    """(index, gid, sysfs type) of every populated entry of the port's GID table."""
    for index in range(length):
        try:
            yield index, ctx.query_gid(port, index).gid, ctx.query_gid_type(port, index)
        except pv.pyverbs_error.PyverbsError:
            continue   # unpopulated table entry


def _pick_gid(ctx, port: int, attr, wanted: int) -> tuple[int, str]:
    ethernet = attr.link_layer == E.IBV_LINK_LAYER_ETHERNET
    entries = _gid_table(ctx, port, attr.gid_tbl_len) if ethernet and wanted < 0 else ()
    index = choose_gid(entries, ethernet, wanted)
    return index, ctx.query_gid(port, index).gid


def find_port(wanted: str | None, gid_index: int) -> Port:
    """The first ACTIVE port (of device `wanted`, "name" or "name:port", when given)."""
    if pv is None:
        raise TransportUnavailable(PYVERBS_ERROR)
    names = _device_names()
    if not names:
        raise TransportUnavailable("no RDMA device (the kernel lists no InfiniBand/RoCE device)")
    want_dev, _, want_port = (wanted or "").partition(":")
    seen = []
    for name in names:
        if want_dev and name != want_dev:
            continue
        with pv.device.Context(name=name) as ctx:
            for port in range(1, ctx.query_device().phys_port_cnt + 1):
                if want_port and int(want_port) != port:
                    continue
                attr = ctx.query_port(port)
                seen.append(f"{name}:{port}")
                if attr.state == E.IBV_PORT_ACTIVE:
                    index, gid = _pick_gid(ctx, port, attr, gid_index)
                    return Port(name, port, attr.lid, attr.active_mtu, attr.link_layer, index, gid)
    if not seen:
        raise TransportUnavailable(f"no RDMA device matches COMM_VERBS_DEVICE={wanted!r}; "
                                   f"devices here: {', '.join(names)}")
    raise TransportUnavailable(f"no active RDMA port (checked {', '.join(seen)}); is the link up?")


# ---- CUDA (optional: only for GPU buffers) -----------------------------------------------------
try:
    from cuda.bindings import driver as _cu
    from cuda.bindings import runtime as _cudart
except ImportError:
    _cu = _cudart = None


def _check(result, what: str):
    err, *rest = result
    if int(err) != 0:
        raise CommError(f"{what} failed: CUDA error {err!r}")
    return rest[0] if len(rest) == 1 else rest


def cuda_bind(device: int) -> None:
    """Make `device`'s primary context current on this thread (the progress thread is not the
    thread torch initialised CUDA on, and driver calls need a current context)."""
    if _cudart is None:
        raise CommError("CUDA buffers on the verbs transport need cuda-bindings (pip install cuda-bindings)")
    _check(_cudart.cudaSetDevice(device), "cudaSetDevice")


def cuda_sync() -> None:
    """Wait for all GPU work: verbs cannot order itself after a CUDA stream, so the NIC must not
    read a buffer a kernel may still be writing, nor hand one back before the data is there."""
    _check(_cudart.cudaDeviceSynchronize(), "cudaDeviceSynchronize")


def cuda_allocation(ptr: int) -> tuple[int, int]:
    """(base, end) of the cudaMalloc allocation holding ptr: registered whole, so every tensor
    a caching allocator carves out of it reuses one registration."""
    base, size = _check(_cu.cuMemGetAddressRange(ptr), "cuMemGetAddressRange")
    return int(base), int(base) + int(size)


def cuda_flush_rdma_writes() -> None:
    """Make NIC writes that completed visible to later GPU work (GPUDirect RDMA ordering)."""
    _check(_cu.cuFlushGPUDirectRDMAWrites(
        _cu.CUflushGPUDirectRDMAWritesTarget.CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX,
        _cu.CUflushGPUDirectRDMAWritesScope.CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER),
        "cuFlushGPUDirectRDMAWrites")


def _dmabuf_fd(start: int, length: int) -> int | None:
    """A dma-buf file descriptor for GPU memory [start, start+length), or None when the driver
    or range does not allow it (page alignment is required)."""
    page = os.sysconf("SC_PAGE_SIZE")
    if start % page or _cu is None:
        return None
    err, fd = _cu.cuMemGetHandleForAddressRange(
        start, -(-length // page) * page,
        _cu.CUmemRangeHandleType.CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0)
    return int(fd) if int(err) == 0 else None


def register(pd, start: int, length: int, device: str) -> tuple[object, int, int, int]:
    """Register [start, start+length) for local and remote writes: (mr, lkey, rkey, iova_start).

    GPU memory (GPUDirect RDMA): a dma-buf MR when the CUDA driver exports one (upstream kernel
    path, no extra module). pyverbs registers dma-buf MRs with iova = offset in the dma-buf, so
    work requests address it as start - (dma-buf base) = 0 here. Otherwise plain ibv_reg_mr on
    the device pointer, which works when the nvidia-peermem module is loaded."""
    access = E.IBV_ACCESS_LOCAL_WRITE | E.IBV_ACCESS_REMOTE_WRITE
    if device == "cuda":
        fd = _dmabuf_fd(start, length)
        if fd is not None:
            try:
                mr = pv.mr.DmaBufMR(pd, length, access, dmabuf=fd, offset=0)
                return mr, mr.lkey, mr.rkey, 0
            except pv.pyverbs_error.PyverbsRDMAError:
                pass   # NIC or kernel without dma-buf support: try peer memory
            finally:
                os.close(fd)   # the MR holds its own reference to the dma-buf
    try:
        mr = pv.mr.MR(pd, length, access, address=start)
    except pv.pyverbs_error.PyverbsRDMAError as e:
        hint = " (GPU memory needs dma-buf support or the nvidia-peermem module)" if device == "cuda" else ""
        raise CommError(f"cannot register {length} bytes of {device} memory with the NIC: {e}{hint}") from None
    return mr, mr.lkey, mr.rkey, start
