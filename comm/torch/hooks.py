"""Compressed gradient communication for torch: DDP hooks and FSDP2 collectives over a "comm" group.

    from comm.torch import hooks
    ddp.register_comm_hook(None, hooks.bf16_hook)          # or hooks.fp8_hook; state: the group
                                                           # (None: the default group)
    fsdp_module.set_custom_reduce_scatter(hooks.CompressedReduceScatter("bf16"))
    fsdp_module.set_custom_all_gather(hooks.CompressedAllGather("bf16"))   # optional

Each routes the gradient bucket's all_reduce (or FSDP2's reduce_scatter / all_gather) through
the group's Communicator with compress= (comm.compress): bf16 or fp8 on the wire between hosts,
every partial sum in float32, the result returned in the bucket's dtype. The group must be a
"comm" process group, and its tensors on the CPU. Where comm.compress does not choose
compression (one host, small buckets: COMM_COMPRESS_MIN_BYTES) the exact all_reduce runs.

Error against torch's own hooks: torch's bf16_compress_hook casts the bucket to bfloat16 and
all-reduces in bfloat16, so every partial sum is rounded to 8 bits and the error grows with the
number of ranks (up to about (n-1) x 2^-8 of the sum of magnitudes for n ranks). bf16_hook sends
bfloat16 but sums in float32, quantizing each element at most twice: its error is at most
(2^-7 + 2^-16 + n x 2^-23) of the sum of magnitudes whatever the number of ranks (docs/compress.md's
bound); fp8_hook's is at most (2^-3 + 2^-8 + n x 2^-23) of it plus 9e-6 of the sum of the
ranks' block maxima. The average (DDP's gradient mean) is taken in float32 after the sum.

The hooks post the all_reduce asynchronously (async_op=True: on the native engine the compressed
all_reduce runs on the engine's thread) and return its future, so backward goes on meanwhile.
The FSDP2 collectives do as FSDP2 asks: with async_op=True (its all_gather on the CPU) they post
and return the Work FSDP2 waits on (the native engine runs the compressed reduce_scatter /
all_gather on its own thread); without it (its reduce_scatter) they return once done.
"""
import torch
import torch.distributed as dist

try:   # FSDP2's custom-collective interfaces (torch 2.8+; not exported by torch.distributed.fsdp)
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
except ImportError:   # older torch: the classes still work as plain callables
    AllGather = ReduceScatter = object

from ..core.errors import InvalidArgument
from ..core.types import ReduceOp
from .args import reduce_op
from .backend import ProcessGroupComm
from .work import as_torch_error


def _backend(group, op: str) -> ProcessGroupComm:
    """The "comm" backend of a process group (None: the default group)."""
    group = group if group is not None else dist.group.WORLD
    try:
        backend = group._get_backend(torch.device("cpu"))
    except RuntimeError:
        backend = None
    if not isinstance(backend, ProcessGroupComm):
        raise as_torch_error(InvalidArgument(
            f"compressed hooks need a process group of the 'comm' backend, got {type(backend).__name__}: "
            "dist.init_process_group('comm') or dist.new_group(backend='comm')", op=op))
    return backend


def communicator(group, op: str):
    """The comm.Communicator behind a "comm" process group (None: the default group)."""
    return _backend(group, op)._communicator("cpu", op)


def _all_reduce_hook(group, bucket, fmt: str) -> torch.futures.Future:
    """The bucket's mean posted asynchronously (the engine runs a compressed all_reduce on its
    own thread: backward goes on meanwhile); the future resolves to the bucket once it is done,
    completed as the backend completes its own asynchronous work."""
    tensor = bucket.buffer()
    post = lambda comm, async_op: [comm.all_reduce(tensor, ReduceOp.AVG, compress=fmt, async_op=async_op)]  # noqa: E731
    work = _backend(group, "all_reduce")._launch("all_reduce", tensor.device, post, [tensor])
    return work.get_future().then(lambda fut: fut.value()[0])


def _post(group, op: str, output: torch.Tensor, async_op: bool, call):
    """FSDP2's collective: with async_op, posted (the native engine runs it compressed on its
    own thread) and its torch Work returned, which FSDP2 waits on; else run here, None."""
    if not async_op:
        call(communicator(group, op), False)
        return None
    return _backend(group, op)._launch(op, output.device, lambda comm, a: [call(comm, a)], [output])


def bf16_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP hook: the gradient mean with bfloat16 on the wire and float32 sums. state: the group."""
    return _all_reduce_hook(state, bucket, "bf16")


def fp8_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP hook: the gradient mean with fp8 (e4m3, block scales) on the wire, float32 sums."""
    return _all_reduce_hook(state, bucket, "fp8")


class CompressedReduceScatter(ReduceScatter):
    """FSDP2's reduce_scatter (fully_shard(...).set_custom_reduce_scatter) through compress=."""

    def __init__(self, fmt: str = "bf16"):
        self.fmt = fmt

    def allocate(self, size, *, dtype, device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        if isinstance(op, dist.ReduceOp.RedOpType):   # dist.ReduceOp.SUM itself, not a ReduceOp
            op = dist.ReduceOp(op)
        rop = reduce_op(op)
        return _post(group, "reduce_scatter", output_tensor, async_op,
                     lambda c, a: c.reduce_scatter(output_tensor, input_tensor, rop, compress=self.fmt, async_op=a))


class CompressedAllGather(AllGather):
    """FSDP2's all_gather (set_custom_all_gather) through compress= (parameters quantized once)."""

    def __init__(self, fmt: str = "bf16"):
        self.fmt = fmt

    def allocate(self, size, *, dtype, device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        return _post(group, "all_gather", output_tensor, async_op,
                     lambda c, a: c.all_gather(output_tensor, input_tensor, compress=self.fmt, async_op=a))
