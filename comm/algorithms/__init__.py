"""Collectives over point-to-point messaging, for transports without collectives of their own
(UCX, RDMA verbs). One file per algorithm; rank arithmetic in topology.py, reduction kernels
in reduce.py, the point-to-point interface in p2p.py, the choice of algorithm in dispatch.py.
"""
from .dispatch import run
from .p2p import P2P, USER_TAG_LIMIT, collective_tag

__all__ = ["P2P", "USER_TAG_LIMIT", "collective_tag", "run"]
