"""`decode`: the all_reduce of LLM decoding with tensor parallelism (hidden x batch per layer
per token: 4 KiB to 256 KiB of bfloat16 for 7B-70B models), a latency regime.

`python -m bench --np 2 decode` is a preset (bench/cli.py): bfloat16, -b 4K -e 256K -f 2,
-n 2000 -w 200, transports native,mpi-raw,gloo, unless those flags are given. A runner without bfloat16
reductions (MPI) runs float32 of the same bytes instead, so every size compares equal
message sizes; its #wrong is checked against the float32 result.
"""
from __future__ import annotations

from comm.core.types import DType

from . import Params, register
from .collectives import AllReduce


@register
class Decode(AllReduce):
    name = "decode"

    @staticmethod
    def _as_run(runner, p: Params, in_place: bool) -> Params:
        """p itself, or its float32 stand-in (same bytes) where the runner lacks p.dtype."""
        if p.dtype is not DType.BFLOAT16 or runner.supports("all_reduce", p.dtype, p.op, in_place) is None:
            return p
        return Params(p.count // 2, DType.FLOAT32, p.op, p.root, p.rank, p.size)

    def unsupported(self, runner, p, in_place):
        q = self._as_run(runner, p, in_place)
        return runner.supports("all_reduce", q.dtype, q.op, in_place)

    def case(self, runner, p, in_place):
        return super().case(runner, self._as_run(runner, p, in_place), in_place)
