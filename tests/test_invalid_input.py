"""Bad input is refused on the caller's rank with InvalidArgument (naming rank, op and cause)
before anything is sent, and the communicator stays usable afterwards."""
from __future__ import annotations

import socket

import numpy as np
import pytest

import comm
from reference import HAVE_TORCH
from transports import base

pytestmark = pytest.mark.skipif(base.unavailable_reason("native") is not None,
                                reason=f"native: {base.unavailable_reason('native')}")


class FakeCudaArray:
    """An array that claims to live on a GPU: the native transport must refuse it unread."""

    __cuda_array_interface__ = {"data": (0xDEAD0000, False), "shape": (4,), "typestr": "<f4",
                                "strides": None, "version": 3}


def _cases(world):
    """name -> (op name in the message, a call that must raise InvalidArgument)."""
    n, r = world.size, world.rank
    f32 = np.ones(8, np.float32)
    ro = np.ones(8, np.float32)
    ro.flags.writeable = False
    big, other = np.ones(16 * n, np.float32), (r + 1) % n
    return {
        "non_contiguous_numpy": ("all_reduce", lambda: world.all_reduce(np.ones((4, 4))[:, 1])),
        "non_contiguous_torch": ("all_reduce", lambda: world.all_reduce(_torch().ones(4, 4).t())),
        "read_only_output": ("all_reduce", lambda: world.all_reduce(ro)),
        "unsupported_dtype": ("all_reduce", lambda: world.all_reduce(np.ones(4, np.complex64))),
        "not_an_array": ("all_reduce", lambda: world.all_reduce([1.0, 2.0])),
        "band_on_float": ("all_reduce", lambda: world.all_reduce(f32, op=comm.BAND)),
        "avg_on_int": ("all_reduce", lambda: world.all_reduce(np.ones(4, np.int32), op=comm.AVG)),
        "premul_without_factor": ("all_reduce", lambda: world.all_reduce(f32, op=comm.PREMUL_SUM)),
        "unknown_op": ("all_reduce", lambda: world.all_reduce(f32, op=42)),
        "all_reduce_out_size": ("all_reduce", lambda: world.all_reduce(f32, out=np.ones(7, np.float32))),
        "mixed_dtypes": ("all_reduce", lambda: world.all_reduce(f32, out=np.ones(8, np.float64))),
        "reduce_scatter_sizes": ("reduce_scatter", lambda: world.reduce_scatter(np.ones(3, np.float32), np.ones(3 * n + 1, np.float32))),
        "all_gather_sizes": ("all_gather", lambda: world.all_gather(np.ones(8 * n + 1, np.float32), f32)),
        "split_sum_wrong": ("all_to_all", lambda: world.all_to_all(np.ones(n, np.float32), np.ones(n, np.float32),
                                                                   [1] * n, [2] + [1] * (n - 1))),
        "split_length_wrong": ("all_to_all", lambda: world.all_to_all(np.ones(n, np.float32), np.ones(n, np.float32),
                                                                      [1] * (n + 1), [1] * n)),
        "split_negative": ("all_to_all", lambda: world.all_to_all(np.ones(n, np.float32), np.ones(n, np.float32),
                                                                  [1] * n, [-1, 2] + [1] * (n - 2))),
        "rows_not_divisible": ("all_to_all", lambda: world.all_to_all(np.ones(n + 1, np.float32), np.ones(n + 1, np.float32))),
        "v_counts_length": ("all_gather_v", lambda: world.all_gather_v(f32, f32[:1], [1] * (n + 1))),
        "v_counts_negative": ("reduce_scatter_v", lambda: world.reduce_scatter_v(
            f32[:1], np.ones(n, np.float32), [-1, 2] + [1] * (n - 2))),
        "v_counts_not_int": ("all_gather_v", lambda: world.all_gather_v(f32, f32[:1], [1.0] * n)),
        "v_input_rows": ("all_gather_v", lambda: world.all_gather_v(np.ones(n + 1, np.float32), f32[:2], [1] * n)),
        "v_output_rows": ("reduce_scatter_v", lambda: world.reduce_scatter_v(f32[:2], np.ones(n, np.float32), [1] * n)),
        "root_too_large": ("broadcast", lambda: world.broadcast(f32, root=n)),
        "root_negative": ("reduce", lambda: world.reduce(f32, root=-1)),
        "root_not_int": ("gather", lambda: world.gather(None, f32, root=0.5)),
        "scatter_root_without_input": ("scatter", lambda: world.scatter(f32, None, root=r)),
        "peer_out_of_range": ("send", lambda: world.send(f32, n + 3)),
        "send_to_self": ("send", lambda: world.send(f32, r)),
        "recv_from_self": ("recv", lambda: world.recv(f32, r)),
        "negative_tag": ("send", lambda: world.send(f32, (r + 1) % n, tag=-1)),
        "cuda_buffer_on_cpu_transport": ("all_reduce", lambda: world.all_reduce(FakeCudaArray())),
        # input and output sharing memory other than in the call's in-place layout: a peer
        # would read what this rank overwrites (all_to_all has no in-place layout at all)
        "all_to_all_in_place": ("all_to_all", lambda: world.all_to_all(big, big)),
        "all_to_all_overlap": ("all_to_all", lambda: world.all_to_all(big[n:3 * n], big[:2 * n], [2] * n, [2] * n)),
        "all_reduce_overlap": ("all_reduce", lambda: world.all_reduce(big[:8], out=big[1:9])),
        "all_gather_other_block": ("all_gather", lambda: world.all_gather(big[:4 * n], big[other * 4:other * 4 + 4])),
        "reduce_scatter_other_block": ("reduce_scatter", lambda: world.reduce_scatter(
            big[other * 4:other * 4 + 4], big[:4 * n])),
        "all_gather_v_other_block": ("all_gather_v", lambda: world.all_gather_v(
            big[:4 * n], big[other * 4:other * 4 + 4], [4] * n)),
        "reduce_scatter_v_other_block": ("reduce_scatter_v", lambda: world.reduce_scatter_v(
            big[other * 4:other * 4 + 4], big[:4 * n], [4] * n)),
    }


def _torch():
    import torch
    return torch


def check_invalid(world, name):
    op, call = _cases(world)[name]
    try:
        call()
    except comm.InvalidArgument as e:
        got = (type(e).__name__, e.rank, e.op, str(e))
    else:
        got = None
    # still usable: a real collective right after the refused call
    x = np.full(16, float(world.rank), np.float32)
    world.all_reduce(x)
    usable = bool((x == sum(range(world.size))).all())
    return got, op, usable


CASES = ["non_contiguous_numpy", "non_contiguous_torch", "read_only_output", "unsupported_dtype",
         "not_an_array", "band_on_float", "avg_on_int", "premul_without_factor", "unknown_op",
         "all_reduce_out_size", "mixed_dtypes", "reduce_scatter_sizes", "all_gather_sizes",
         "split_sum_wrong", "split_length_wrong", "split_negative", "rows_not_divisible",
         "v_counts_length", "v_counts_negative", "v_counts_not_int", "v_input_rows", "v_output_rows",
         "root_too_large", "root_negative", "root_not_int", "scatter_root_without_input",
         "peer_out_of_range", "send_to_self", "recv_from_self", "negative_tag",
         "cuda_buffer_on_cpu_transport", "all_to_all_in_place", "all_to_all_overlap", "all_reduce_overlap",
         "all_gather_other_block", "reduce_scatter_other_block", "all_gather_v_other_block",
         "reduce_scatter_v_other_block"]


@pytest.mark.parametrize("name", [pytest.param(c, marks=pytest.mark.skipif(
    "torch" in c and not HAVE_TORCH, reason="torch is not installed")) for c in CASES])
def test_refused_before_sending(cluster, name):
    for rank, (got, op, usable) in enumerate(cluster(2).run(check_invalid, name)):
        assert got is not None, f"rank {rank}: {name} was accepted"
        kind, err_rank, err_op, text = got
        assert kind == "InvalidArgument" and err_rank == rank and err_op == op, got
        assert text.startswith(f"[rank {rank}] {op}: "), text
        assert usable, f"rank {rank}: communicator unusable after {name}"


def in_place_layouts(world):
    """The in-place layouts that the overlap check lets through, each exact (blocking and
    async, so through the lean path and the full one; 2-D rows take the full path)."""
    n, r = world.size, world.rank
    got = {}
    for shape in ((), (2,)):
        width = shape[0] if shape else 1
        out = np.zeros((4 * n,) + shape, np.float32)
        out[4 * r:4 * r + 4] = r + 1
        world.all_gather(out, out[4 * r:4 * r + 4])
        got["all_gather", shape] = out.reshape(-1).tolist() == [q + 1.0 for q in range(n) for _ in range(4 * width)]
        x = np.arange(4 * n * width, dtype=np.float32).reshape((4 * n,) + shape)
        world.reduce_scatter(x[4 * r:4 * r + 4], x, async_op=True).wait()
        want = n * np.arange(4 * n * width, dtype=np.float32).reshape((4 * n,) + shape)[4 * r:4 * r + 4]
        got["reduce_scatter", shape] = bool((x[4 * r:4 * r + 4] == want).all())
        counts = [q + 1 for q in range(n)]
        start = sum(counts[:r])
        out = np.zeros((sum(counts),) + shape, np.float32)
        out[start:start + counts[r]] = r + 1
        world.all_gather_v(out, out[start:start + counts[r]], counts)
        got["all_gather_v", shape] = out.reshape(-1).tolist() == [q + 1.0 for q in range(n) for _ in range(counts[q] * width)]
        x = np.ones((sum(counts),) + shape, np.float32)
        world.reduce_scatter_v(x[start:start + counts[r]], x, counts)
        got["reduce_scatter_v", shape] = bool((x[start:start + counts[r]] == n).all())
        y = np.full((8,) + shape, r + 1.0, np.float32)
        world.all_reduce(y, out=y)
        got["all_reduce", shape] = bool((y == n * (n + 1) / 2).all())
    return got


def rooted_overlaps(world):
    """One rank, so the root's own checks decide: gather and scatter accept the root's block
    in place and refuse any other overlap, naming the layout."""
    big = np.arange(16, dtype=np.float32)
    got = []
    for op, call in (("gather", lambda: world.gather(big[:8], big[1:9])),
                     ("scatter", lambda: world.scatter(big[1:9], big[:8])),
                     ("reduce", lambda: world.reduce(big[:8], out=big[2:10]))):
        try:
            call()
            got.append((op, None))
        except comm.InvalidArgument as e:
            got.append((op, str(e)))
    world.gather(big[:8], big[:8])
    world.scatter(big[:8], big[:8])
    return got, big[:8].tolist() == list(range(8))


def test_rooted_overlaps_are_refused(cluster):
    (got, in_place_ok), = cluster(1).run(rooted_overlaps)
    for op, text in got:
        assert text and text.startswith(f"[rank 0] {op}: input and output overlap"), (op, text)
    assert in_place_ok


def test_in_place_layouts_are_accepted(cluster):
    for rank, got in enumerate(cluster(3).run(in_place_layouts)):
        assert all(got.values()), (rank, got)


def use_after_close(world):
    sub = world.split(0)
    sub.close()
    try:
        sub.all_reduce(np.ones(4))
    except comm.Closed as e:
        return str(e)
    return None


def test_use_after_close(cluster):
    for rank, text in enumerate(cluster(2).run(use_after_close)):
        assert text and text.startswith(f"[rank {rank}] all_reduce: ") and "closed" in text


def test_wrong_world_size_in_env(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(comm.InvalidArgument, match="rank 3 is not in a world of size 2"):
        comm.init()
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(comm.InvalidArgument, match="WORLD_SIZE='two' is not an integer"):
        comm.init()


def test_port_in_use():
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        with pytest.raises(comm.InvalidArgument, match="port in use"):
            comm.init(rank=0, world_size=2, master_addr="127.0.0.1", master_port=port, timeout=5)


def test_bad_init_arguments():
    with pytest.raises(comm.InvalidArgument, match="timeout must be positive"):
        comm.init(timeout=0)
    with pytest.raises(comm.TransportUnavailable, match="unknown transport 'carrier-pigeon'"):
        comm.init(transport="carrier-pigeon")


def zero_size_ops(world):
    n = world.size
    e = np.zeros(0, np.float32)
    world.all_reduce(e)
    world.reduce_scatter(e, np.zeros(0, np.float32))
    world.all_gather(np.zeros(0, np.float32), e)
    world.broadcast(e, root=n - 1)
    world.all_to_all(np.zeros((0, 3), np.float32), np.zeros((0, 3), np.float32), [0] * n, [0] * n)
    x = np.ones(3, np.float32)
    world.all_reduce(x)
    return float(x[0])


def test_zero_size_edge_cases(cluster):
    assert cluster(3).run(zero_size_ops) == [3.0, 3.0, 3.0]


def test_single_process_world():
    with comm.init(transport="native") as world:
        assert (world.rank, world.size) == (0, 1)
        x = np.arange(5, dtype=np.float64)
        world.all_reduce(x)
        assert (x == np.arange(5)).all()
