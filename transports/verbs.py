"""The verbs transport: the native engine, with RDMA verbs carrying the data (native/src/channels/verbs/verbs.cc).

Every algorithm, persistent handle, the lean path, send/recv and the failure handling are the
engine's (transports/native/__init__.py); what is verbs' is only which port to use. Each peer and stream
is one RC queue pair whose stream travels in credit-controlled slots written by RDMA WRITE WITH
IMMEDIATE. The engine is built with the net where rdma-core's headers were present
(libibverbs-dev) and loads libibverbs.so.1 at run time (libibverbs1 rdma-core); discovery
(net_unavailable) says which of these, or a device or an active port, is missing here.
"""
from __future__ import annotations

from comm.core import config

from .base import register
from .native import NativeTransport, _native


class VerbsTransport(NativeTransport):
    name = "verbs"
    net = "verbs"

    @classmethod
    def net_options(cls) -> dict[str, str]:
        return {"device": config.get("COMM_VERBS_DEVICE") or "",
                "gid_index": str(config.get("COMM_VERBS_GID_INDEX")),
                "hop_limit": str(config.get("COMM_VERBS_HOP_LIMIT")),
                # rma: windows over RDMA WRITE / READ instead of p2p messages (window_verbs.cc)
                "rma": "1" if config.get("COMM_WINDOW_RMA") else "0"}

    def _bootstrap(self, ctx):
        engine = super()._bootstrap(ctx)
        # A write into a queue pair that is not yet ready to receive is dropped and retried
        # for half a second at most: no rank writes until every rank has connected its own.
        ctx.store.barrier(f"{self.name}/connected")
        return engine

    @classmethod
    def available(cls) -> str | None:
        why = super().available()
        if why is None:
            why = _native.net_unavailable("verbs", cls.net_options()) or None
        return why


register(VerbsTransport)
