"""Rank arithmetic shared by every algorithm: rings, binomial trees, recursive doubling, chunks.

Written once here so the ring all_reduce and ring reduce_scatter (or the binomial broadcast
and reduce) cannot disagree about who talks to whom.
"""
from __future__ import annotations

# ---- ring -------------------------------------------------------------------------------------

def ring_neighbours(rank: int, size: int) -> tuple[int, int]:
    """(left, right): a ring receives from the left and sends to the right."""
    return (rank - 1) % size, (rank + 1) % size


def segment_bounds(count: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of segment `index` when `count` elements are cut into `parts` near-equal
    segments; the first count % parts segments get one more element."""
    base, extra = divmod(count, parts)
    start = index * base + min(index, extra)
    return start, start + base + (index < extra)


def chunks(count: int, chunk: int):
    """(offset, length) pieces of at most `chunk` elements covering [0, count); none if count is 0."""
    for start in range(0, count, max(1, chunk)):
        yield start, min(chunk, count - start)


# ---- binomial tree ----------------------------------------------------------------------------

def binomial_parent(rank: int, size: int, root: int) -> int | None:
    """The parent of `rank` in the binomial tree rooted at `root` (None for the root).

    In relative numbering v = rank - root, the parent clears v's lowest set bit."""
    v = (rank - root) % size
    if v == 0:
        return None
    return ((v & (v - 1)) + root) % size


def binomial_children(rank: int, size: int, root: int) -> list[int]:
    """The children of `rank`, smallest subtree first: v + 2**k for every 2**k below v's
    lowest set bit (any 2**k for the root), while inside the group."""
    v = (rank - root) % size
    children, mask = [], 1
    while mask < size and not v & mask:
        if v + mask < size:
            children.append((v + mask + root) % size)
        mask <<= 1
    return children


# ---- recursive doubling -----------------------------------------------------------------------

def rd_fold(rank: int, size: int) -> tuple[int | None, int | None]:
    """Fold a group of any size onto the largest power of two p <= size.

    The first 2*(size - p) ranks pair up: each even one hands its data to the odd one above
    it and sits out. Returns (virtual rank among the p, or None for a rank that sits out;
    the partner it exchanges the folded data with, or None)."""
    p = 1 << (size.bit_length() - 1)
    rem = size - p
    if rank < 2 * rem:
        return (rank // 2, rank - 1) if rank % 2 else (None, rank + 1)
    return rank - rem, None


def rd_real_rank(vrank: int, size: int) -> int:
    """The group rank of virtual rank `vrank` of rd_fold."""
    rem = size - (1 << (size.bit_length() - 1))
    return 2 * vrank + 1 if vrank < rem else vrank + rem


def rd_partners(vrank: int, size: int) -> list[int]:
    """The group ranks a virtual rank exchanges with, one per doubling step."""
    p = 1 << (size.bit_length() - 1)
    partners, mask = [], 1
    while mask < p:
        partners.append(rd_real_rank(vrank ^ mask, size))
        mask <<= 1
    return partners
