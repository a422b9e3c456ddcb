"""Rank processes for the torch backend's tests: `ranks` runs a function on n persistent
processes, `process_group` gives it a fresh default "comm" group."""
import contextlib
import datetime

import pytest
from harness import Cluster, free_port


@pytest.fixture(scope="module")
def ranks():
    """ranks(n, fn, *args): fn(rank, size, port, *args) on n persistent processes, results in
    rank order (port: a fresh one for this call's default group)."""
    clusters: dict[int, Cluster] = {}

    def run(n, fn, *args, timeout=120):
        c = clusters.get(n)
        if c is None or c.broken:
            if c is not None:
                c.close()
            c = clusters[n] = Cluster(n, init=False)
        try:
            return c.run(fn, free_port(), *args, timeout=timeout)
        except BaseException:
            c.kill()  # a rank's reply may still be unread: never reuse these processes
            raise

    yield run
    for c in clusters.values():
        c.close()


@contextlib.contextmanager
def process_group(rank, size, port, timeout=30):
    import torch.distributed as dist

    import comm.torch  # noqa: F401  registers "comm"

    dist.init_process_group("comm", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout))
    try:
        yield dist
    finally:
        dist.destroy_process_group()
