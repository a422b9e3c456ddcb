"""RDMA verbs transport (pyverbs): RC queue pairs, RDMA WRITE WITH IMMEDIATE, GPUDirect RDMA.

    wire.py       address records, immediates, clear-to-send records, write requests (pure)
    credits.py    credit-based flow control (pure)
    regcache.py   memory-registration cache (pure)
    device.py     pyverbs loading, port discovery, host / CUDA memory registration
    engine.py     queue pairs, completions, the rendezvous protocol: comm.algorithms.P2P
    transport.py  the Transport: send/recv direct, collectives from comm.algorithms
"""
from .transport import VerbsTransport

__all__ = ["VerbsTransport"]
