"""The UCX transport: the native engine, with UCX carrying the data (native/src/channels/ucx/ucx.cc).

Every algorithm, persistent handle, the lean path, send/recv and the failure handling are the
engine's (transports/native/__init__.py); what is UCX's is only where its library comes from. The
engine loads libucp at run time from the libucx wheel (pip install libucx-cu12), which
ucxx-cu12 also installs, holding it at an older release: any UCX from the engine's floor to
the newest 1.x runs (native/src/channels/ucx/ucx_library.h), another is refused naming that range. UCX
then picks its own transports (shared memory on one host, TCP, InfiniBand / RoCE where
present; UCX_TLS chooses). On one host, large payloads are read by the receiver straight
from the sender's buffer (native/src/channels/README.md), in place of UCX's own CMA.
"""
from __future__ import annotations

import os
import sys

from comm.core import config

from .base import register
from .native import NativeTransport, _native


def _find_libucp() -> tuple[str | None, str | None]:
    """(path of the libucp the libucx wheel loaded, None) or (None, why not)."""
    try:
        import libucx
        loaded = libucx.load_library()   # libucs, libucs_signal, libuct, libucp, in that order
    except (ImportError, OSError) as e:
        why = f"the libucx wheel cannot be loaded ({e}); pip install libucx-cu12"
        if "mpi4py.MPI" in sys.modules:  # Open MPI's wheel bundles an older UCX under the same sonames
            why += ("; mpi4py.MPI was imported first with Open MPI's own UCX: import it "
                    "through transports.mpi.load_mpi()")
        return None, why
    ucp = loaded[-1] if loaded else None
    if ucp is None or not os.path.isabs(getattr(ucp, "_name", "") or ""):
        # a system UCX (RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY): the loader resolves its soname
        return "libucp.so.0", None
    return ucp._name, None


_LIBUCP, _IMPORT_ERROR = _find_libucp()


class UCXTransport(NativeTransport):
    name = "ucx"
    net = "ucx"

    @classmethod
    def net_options(cls) -> dict[str, str]:
        # endpoints: per remote peer, each its own connection; large payloads are striped
        # over them as over the TCP channel's sockets. rma: windows over UCX RMA (rkeys)
        # instead of p2p messages (native/src/windows/window_ucx.cc)
        return {"library": _LIBUCP, "endpoints": str(max(1, int(config.get("COMM_SOCKETS_PER_PEER")))),
                "rma": "1" if config.get("COMM_WINDOW_RMA") else "0"}

    @classmethod
    def available(cls) -> str | None:
        why = super().available() or _IMPORT_ERROR
        if why is None:
            why = _native.net_unavailable("ucx", cls.net_options()) or None
        return why


register(UCXTransport)
