"""Ranks on two hosts (network namespaces joined by veth): the cross-host TCP path carries the
data, alone and mixed with shared memory inside each host."""
from __future__ import annotations

import numpy as np
import pytest

from harness import assert_no_problems, run_ranks
from netns import ADDRS, TwoHosts, unavailable
from reference import dtypes
from test_conformance import check_all_reduce, check_all_to_all, check_p2p, check_rooted
from comm.types import DType
from transports import base

_why = unavailable() or base.unavailable_reason("native")
pytestmark = pytest.mark.skipif(_why is not None, reason=str(_why))


@pytest.fixture
def hosts():
    h = TwoHosts()
    yield h
    h.close()


def cross_host_suite(world):
    problems = check_all_reduce(world, dtypes(DType.FLOAT32, DType.BFLOAT16, DType.INT32), [0, 1, 1001, 300_001])
    problems += check_rooted(world, [DType.FLOAT32], [1, 100_003])
    problems += check_all_to_all(world, [DType.FLOAT32], 4)
    problems += check_p2p(world)
    x = np.full(4 << 20, float(world.rank), np.float32)   # 16 MiB
    world.all_reduce(x)
    if not (x == sum(range(world.size))).all():
        problems.append(f"rank {world.rank}: 16 MiB all_reduce wrong")
    return problems


@pytest.mark.parametrize("per_host", [1, 2])
def test_two_hosts(hosts, per_host):
    """per_host=1: pure TCP between namespaces; 2: shm inside each host, TCP across."""
    n = 2 * per_host
    netns = [hosts.ns[r // per_host] for r in range(n)]
    before = hosts.tx_bytes(0) + hosts.tx_bytes(1)
    results = run_ranks(cross_host_suite, n, netns=netns, timeout=300,
                        env={"MASTER_ADDR": ADDRS[0], "COMM_TIMEOUT": "60"})
    assert_no_problems(results)
    moved = hosts.tx_bytes(0) + hosts.tx_bytes(1) - before
    assert moved > 16 << 20, f"only {moved} bytes crossed the veth link: the cross-host path was not used"
