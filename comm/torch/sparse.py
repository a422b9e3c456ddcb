"""Sparse (COO) all_reduce for the torch backend, as gloo does it.

nn.Embedding(sparse=True) under DDP hands the backend COO gradients whose non-zero rows differ
per rank, so there is no common dense layout to reduce. Like gloo: coalesce the local tensor,
all-gather every rank's non-zero count, all-gather the indices and values (padded to the
largest count), add the ranks' tensors in rank order, coalesce, and write the sum back into the
input tensor. Only SUM is defined (as with gloo).
"""
from __future__ import annotations

import torch

from ..core.errors import CommError, InvalidArgument
from .work import DoneWork, as_torch_error


def sparse_all_reduce(pg, t: torch.Tensor, opts) -> DoneWork:
    """Runs on the caller's thread (the all-gathers depend on each other's results) and returns
    a completed Work, whether or not torch asked for an asynchronous one."""
    op = "all_reduce"
    if getattr(opts.reduceOp, "op", opts.reduceOp).name != "SUM":
        raise as_torch_error(InvalidArgument("sparse tensors are only reduced with SUM", rank=pg.rank(), op=op))
    if t.device.type != "cpu":
        raise as_torch_error(InvalidArgument("sparse tensors must be on the CPU", rank=pg.rank(), op=op))
    comm, n = pg._communicator("cpu", op), pg.size()
    x = t.coalesce()
    indices, values = x.indices(), x.values()
    try:
        counts = torch.empty(n, dtype=torch.int64)
        comm.all_gather(counts, torch.tensor([values.shape[0]], dtype=torch.int64))
        most = int(counts.max())
        padded_indices = indices.new_zeros(indices.shape[0], most)
        padded_indices[:, :indices.shape[1]] = indices
        padded_values = values.new_zeros((most,) + tuple(values.shape[1:]))
        padded_values[:values.shape[0]] = values
        all_indices = indices.new_empty((n,) + tuple(padded_indices.shape))
        all_values = values.new_empty((n,) + tuple(padded_values.shape))
        comm.all_gather(all_indices, padded_indices.contiguous())
        comm.all_gather(all_values, padded_values.contiguous())
    except CommError as e:
        raise as_torch_error(e) from None
    total = None
    for r in range(n):
        k = int(counts[r])
        part = torch.sparse_coo_tensor(all_indices[r][:, :k], all_values[r][:k], x.shape)
        total = part if total is None else total + part
    t.copy_(total.coalesce())
    return DoneWork(pg, op, [t])
