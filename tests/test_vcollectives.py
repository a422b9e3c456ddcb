"""v-collectives beyond the conformance suite: ranks that pass different counts fail with
Mismatch naming both ranks' counts, on every rank and whichever algorithm each chose, and the
transports without v-collectives refuse them clearly."""
from __future__ import annotations

import numpy as np
import pytest

import comm
from harness import run_ranks
from transports import base

needs_native = pytest.mark.skipif(base.unavailable_reason("native") is not None,
                                  reason=f"native: {base.unavailable_reason('native')}")


def disagree(world, rows):
    """Rank 1 thinks its block has `rows` + 1 rows; everyone else says `rows`."""
    n, r = world.size, world.rank
    counts = [rows] * n
    if r == 1:
        counts[1] += 1
    try:
        world.all_gather_v(np.zeros(sum(counts), np.float32), np.ones(counts[r], np.float32), counts)
    except comm.CommError as e:
        return type(e).__name__, str(e)
    return None


# rows 10: direct on one host; 300_000: the ring (the counts' first check is its own round);
# cma forced; tcp channels: the ring's neighbour exchange
@pytest.mark.parametrize("rows, env", [(10, {}), (300_000, {}), (300_000, {"COMM_ALGO": "cma"}),
                                       (10, {"COMM_CHANNELS": "tcp"})])
@needs_native
def test_counts_disagree_is_a_mismatch_naming_both(rows, env):
    results = run_ranks(disagree, 2, rows, env={"COMM_TIMEOUT": "20", **env}, expect_errors=True)
    for r, got in enumerate(results):
        assert got is not None, f"rank {r} accepted counts that differ"
        kind, text = got
        assert kind == "Mismatch", got
        other = 1 - r
        mine = f"[{rows}, {rows + 1}]" if r == 1 else f"[{rows}, {rows}]"
        theirs = f"[{rows}, {rows + 1}]" if other == 1 else f"[{rows}, {rows}]"
        assert f"rank {other} passed counts {theirs}, rank {r} passed {mine}" in text, text
