"""Memory safety: no argument, however wrong, makes the library write outside a buffer, read
memory that is not there, or leave part of an output silently unwritten.

Outputs are views of larger arrays whose tail rows hold a canary: a write past the end shows
as a changed canary. Three layers are checked: the Communicator (clear InvalidArgument), the
native engine when the Communicator is bypassed (it checks every count against the buffer
sizes it is handed), and the wire (ranks that disagree on all_to_all splits both get Mismatch,
and the receiver never takes more bytes than its slot holds). And on every transport, an
operation keeps its buffers while it runs even when the caller drops its handle and array."""
from __future__ import annotations

import gc
import time
import weakref

import numpy as np
import pytest

import comm
from comm.core.buffers import as_buffer
from comm.core.ops import OpDesc, OpKind
from comm.core.types import DType, ReduceOp
from harness import ENGINE_CHANNELS, assert_no_problems, engine_param, engine_setup, transport_params
from transports import base

pytestmark = pytest.mark.skipif(base.unavailable_reason("native") is not None,
                                reason=f"native: {base.unavailable_reason('native')}")

CANARY = -7.0


def canaried(rows: int, width: int, extra: int = 2):
    """(the whole array, a view of its first `rows` rows); every value starts as CANARY."""
    full = np.full((rows + extra, width), CANARY, np.float32)
    return full, full[:rows]


# ---- item 1: the block a rank sends itself ----------------------------------------------------

def _rows(q: int, p: int) -> int:
    return (q + p) % 3 + 1  # rows rank q sends rank p: uneven, agreed by every rank


def self_block_refused(world) -> list[str]:
    """Rank 0 sends itself one row fewer than it expects (the row would stay unwritten), the
    last rank one row more (it used to be copied past the end of `out`). Both must be refused
    locally, leaving `out` untouched; the same call with agreeing splits then works."""
    n, r, width, problems = world.size, world.rank, 3, []
    in_splits = [_rows(r, p) for p in range(n)]
    out_splits = [_rows(q, r) for q in range(n)]
    full, out = canaried(sum(out_splits), width)
    if r in (0, n - 1):
        bad = list(in_splits)
        bad[r] += -1 if r == 0 else 1
        x = np.ones((sum(bad), width), np.float32)
        try:
            world.all_to_all(out, x, out_splits, bad)
            problems.append(f"rank {r}: in_splits[{r}] != out_splits[{r}] was accepted")
        except comm.InvalidArgument as e:
            if f"in_splits[{r}]" not in str(e) or not str(e).startswith(f"[rank {r}] all_to_all: "):
                problems.append(f"rank {r}: unclear message: {e}")
        if not (full == CANARY).all():
            problems.append(f"rank {r}: the refused all_to_all wrote into its output")
    x = np.concatenate([np.full((in_splits[p], width), 100 * r + p, np.float32) for p in range(n)])
    world.all_to_all(out, x, out_splits, in_splits)
    want = np.concatenate([np.full((out_splits[q], width), 100 * q + r, np.float32) for q in range(n)])
    if not (out == want).all():
        problems.append(f"rank {r}: wrong all_to_all result after the refused call")
    if not (full[len(out):] == CANARY).all():
        problems.append(f"rank {r}: all_to_all wrote past the end of its output")
    return problems


@pytest.mark.parametrize("n", [2, 3])
def test_all_to_all_self_block_refused(cluster, n):
    assert_no_problems(cluster(n).run(self_block_refused))


# ---- item 1: ranks that disagree on the splits ------------------------------------------------

def splits_disagree(world, delta: int, width: int):
    """Rank 0 sends rank 1 `1 + delta` rows; rank 1 expects one. Every other pair agrees.
    Returns (error class or None, seconds to the error, canary intact, rows right)."""
    n, r = world.size, world.rank
    in_splits, out_splits = [1] * n, [1] * n
    if r == 0:
        in_splits[1] += delta
    x = np.full((sum(in_splits), width), r + 1, np.float32)
    full, out = canaried(n, width)
    start = time.perf_counter()
    try:
        world.all_to_all(out, x, out_splits, in_splits)
        err = None
    except comm.CommError as e:
        err = type(e).__name__, str(e)
    seconds = time.perf_counter() - start
    # rows from every agreeing pair hold the sender's value; the disagreeing one is untouched
    rows_right = all((out[q] == q + 1).all() or (r, q) in ((1, 0), (0, 1)) for q in range(n))
    return err, seconds, bool((full[n:] == CANARY).all()), rows_right


@pytest.mark.parametrize("n,channels,delta,width", [
    (2, "auto", 1, 3),              # the receiver must refuse a longer message
    (2, "tcp", -1, 3),              # ... and a shorter one (a row would stay unwritten)
    (3, "auto", 2, 1 << 16),        # 768 KiB against 256 KiB: larger than a shm ring
    (3, "tcp", -1, 1 << 17),        # 0 bytes against 512 KiB: striped over the sockets
    (2, "tcp", 2, 1 << 15),         # 384 KiB (striped) against 128 KiB (one socket)
    engine_param(2, "ucx", 1, 3, channels="ucx"),        # inline in the header's message
    engine_param(3, "ucx", 2, 1 << 16, channels="ucx"),  # a separate payload message, drained
    engine_param(2, "ucx", -1, 1 << 15, channels="ucx"), # 0 bytes against 128 KiB
])
def test_all_to_all_splits_disagree(cluster, n, channels, delta, width):
    transport, env = engine_setup(channels)
    c = cluster(n, transport, env=env)
    try:
        results = c.run(splits_disagree, delta, width)
    finally:
        c.kill()  # the communicators failed: never reuse them
    for r, (err, seconds, canary_ok, rows_right) in enumerate(results):
        assert canary_ok, f"rank {r}: wrote past the end of its output"
        assert rows_right, f"rank {r}: a block of an agreeing pair is wrong"
        if r in (0, 1):
            assert err is not None and err[0] == "Mismatch", f"rank {r}: {err}"
            assert "all_to_all splits disagree" in err[1], err[1]
            assert seconds < 20, f"rank {r}: Mismatch after {seconds:.1f} s (timeout is 60)"
        else:
            assert err is None, f"rank {r}, not in the disagreeing pair: {err}"


# ---- item 2: the engine checks sizes itself ---------------------------------------------------

def engine_refuses(world) -> list[str]:
    """Operations whose counts exceed the buffers they carry, posted straight to the native
    transport (the Communicator's checks bypassed): each must raise InvalidArgument and
    touch no byte; the communicator then still works."""
    n, r, transport, problems = world.size, world.rank, world.session.transport, []
    arrays = []

    def buf(count: int):
        full = np.full(count + 8, CANARY, np.float32)
        arrays.append(full)
        return as_buffer(full[:count], op="test", writable=True)

    f32 = DType.FLOAT32
    c = 16
    other = (r + 1) % n
    cases = {
        "all_reduce count beyond input": OpDesc(OpKind.ALL_REDUCE, buf(c), buf(c + 1), f32, c + 1),
        "all_reduce output too small": OpDesc(OpKind.ALL_REDUCE, buf(c), buf(c - 1), f32, c),
        "all_reduce null input": OpDesc(OpKind.ALL_REDUCE, None, buf(c), f32, c),
        "all_reduce count overflows": OpDesc(OpKind.ALL_REDUCE, buf(c), buf(c), f32, 2**62),
        "all_reduce BAND on float32": OpDesc(OpKind.ALL_REDUCE, buf(c), buf(c), f32, c, ReduceOp.BAND),
        "all_reduce AVG on int32": OpDesc(OpKind.ALL_REDUCE, buf(c), buf(c), DType.INT32, c, ReduceOp.AVG),
        "reduce_scatter input too small": OpDesc(OpKind.REDUCE_SCATTER, buf(n * c - 1), buf(c), f32, c),
        "all_gather output too small": OpDesc(OpKind.ALL_GATHER, buf(c), buf(n * c - 1), f32, c),
        "broadcast root too large": OpDesc(OpKind.BROADCAST, None, buf(c), f32, c, root=n),
        "broadcast root negative": OpDesc(OpKind.BROADCAST, None, buf(c), f32, c, root=-1),
        "broadcast count beyond buffer": OpDesc(OpKind.BROADCAST, None, buf(c), f32, c + 1),
        "reduce root without output": OpDesc(OpKind.REDUCE, buf(c), None, f32, c, root=r),
        "gather root output too small": OpDesc(OpKind.GATHER, buf(c), buf(n * c - 1), f32, c, root=r),
        "scatter root input too small": OpDesc(OpKind.SCATTER, buf(n * c - 1), buf(c), f32, c, root=r),
        "all_to_all input splits too big": OpDesc(OpKind.ALL_TO_ALL, buf(n * c), buf(n * c + 1), f32,
                                                  send_counts=(c + 1,) * n, recv_counts=(c + 1,) * n),
        "all_to_all output splits too big": OpDesc(OpKind.ALL_TO_ALL, buf(n * c + 1), buf(n * c), f32,
                                                   send_counts=(c + 1,) * n, recv_counts=(c + 1,) * n),
        "all_to_all splits for another size": OpDesc(OpKind.ALL_TO_ALL, buf(n * c), buf(n * c), f32,
                                                     send_counts=(1,) * (n + 1), recv_counts=(1,) * (n + 1)),
        "all_to_all self block differs": OpDesc(OpKind.ALL_TO_ALL, buf(n * c), buf(n * c), f32,
                                                send_counts=(2,) * n, recv_counts=(1,) * n),
        "all_to_all splits overflow": OpDesc(OpKind.ALL_TO_ALL, buf(c), buf(c), f32,
                                             send_counts=(2**62,) * n, recv_counts=(2**62,) * n),
        "send to a rank out of range": OpDesc(OpKind.SEND, buf(c), None, f32, c, peer=n),
        "send to itself": OpDesc(OpKind.SEND, buf(c), None, f32, c, peer=r),
        "send with a negative tag": OpDesc(OpKind.SEND, buf(c), None, f32, c, peer=other, tag=-1),
        "send count beyond buffer": OpDesc(OpKind.SEND, buf(c), None, f32, c + 1, peer=other),
        "recv count beyond buffer": OpDesc(OpKind.RECV, None, buf(c), f32, c + 1, peer=other),
    }
    for name, desc in cases.items():
        try:
            transport.post(desc, True)
            problems.append(f"rank {r}: {name}: accepted")
        except comm.InvalidArgument:
            pass
        except Exception as e:  # any other outcome is the bug this test is for
            problems.append(f"rank {r}: {name}: {type(e).__name__}: {e}")
    # codes out of range, through the binding itself
    b = buf(c)
    for kind, dtype, op in [(99, 2, 0), (-1, 2, 0), (0, 10, 0), (0, 2, 9), (0, -3, 0)]:
        try:
            transport._engine.post(OpDesc(kind, b, b, dtype, c, op), True)
            problems.append(f"rank {r}: codes {(kind, dtype, op)}: accepted")
        except Exception as e:
            if "unknown" not in str(e):
                problems.append(f"rank {r}: codes {(kind, dtype, op)}: {type(e).__name__}: {e}")
    for full in arrays:
        if not (full == CANARY).all():
            problems.append(f"rank {r}: a refused operation wrote into a buffer")
            break
    x = np.full(8, r + 1.0, np.float32)
    world.all_reduce(x)  # nothing of the refused operations reached the wire
    if not (x == n * (n + 1) / 2).all():
        problems.append(f"rank {r}: all_reduce after the refused operations gave {x[0]}")
    return problems


@pytest.mark.parametrize("channels", [engine_param(c, channels=c) for c in ENGINE_CHANNELS])
def test_engine_checks_sizes_itself(cluster, channels):
    transport, env = engine_setup(channels)
    assert_no_problems(cluster(2, transport, env=env).run(engine_refuses))


# ---- item 3: tensors without (enough) memory --------------------------------------------------

def _tensors_without_memory():
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.ones(1000)
    freed = torch.ones(1000)
    freed.untyped_storage().resize_(0)   # how FSDP frees a sharded parameter's full tensor
    short = torch.ones(1000)
    short.untyped_storage().resize_(64)  # 16 of its 1000 floats
    tail = torch.ones(1000)[10:]         # a view at an offset ...
    tail.untyped_storage().resize_(3000)  # ... of a storage that then shrank under it
    return {"FakeTensor": fake, "storage resized to 0": freed, "storage smaller than the tensor": short,
            "view past a shrunk storage": tail, "meta": torch.empty(1000, device="meta"),
            "sparse": torch.eye(4).to_sparse(), "sparse csr": torch.eye(4).to_sparse_csr(),
            "negation view": torch.ones(4)._neg_view()}


def tensors_refused(world) -> list[str]:
    import torch
    r, problems = world.rank, []
    calls = {"all_reduce": lambda t: world.all_reduce(t),
             "broadcast": lambda t: world.broadcast(t, root=0),
             "all_gather": lambda t: world.all_gather(t, torch.ones(t.numel() // world.size)),
             "all_to_all": lambda t: world.all_to_all(t, torch.ones(t.numel()))}
    for name, tensor in _tensors_without_memory().items():
        for op, call in calls.items():
            if op == "all_gather" and tensor.numel() % world.size:
                continue
            try:
                call(tensor)
                problems.append(f"rank {r}: {op} on a {name} tensor was accepted")
            except comm.InvalidArgument as e:
                if not str(e).startswith(f"[rank {r}] {op}: "):
                    problems.append(f"rank {r}: unclear message for {name}: {e}")
    x = torch.full((4,), float(r + 1))
    world.all_reduce(x)
    if x[0].item() != world.size * (world.size + 1) / 2:
        problems.append(f"rank {r}: all_reduce after the refused tensors gave {x[0].item()}")
    return problems


def test_tensors_without_memory_refused(cluster):
    pytest.importorskip("torch")
    assert_no_problems(cluster(2).run(tensors_refused))


# ---- item 4: splits are integers --------------------------------------------------------------

def splits_types(world) -> list[str]:
    n, r, problems = world.size, world.rank, []
    x, out = np.ones((2 * n, 3), np.float32), np.zeros((2 * n, 3), np.float32)
    for bad in ([1.9] * n, [np.float32(2.0)] * n, [True] * n, ["2"] * n, [2.0] * n):
        try:
            world.all_to_all(out, x, bad, [2] * n)
            problems.append(f"rank {r}: out_splits {bad} accepted")
        except comm.InvalidArgument as e:
            if "must be integers" not in str(e):
                problems.append(f"rank {r}: unclear message: {e}")
    world.all_to_all(out, x, [np.int64(2)] * n, np.array([2] * n, np.int32))  # numpy integers are fine
    if not (out == 1).all():
        problems.append(f"rank {r}: all_to_all with numpy integer splits gave a wrong result")
    return problems


def test_splits_must_be_integers(cluster):
    assert_no_problems(cluster(2).run(splits_types))


# ---- a dropped handle ---------------------------------------------------------------------------

# Calls after the end by which the dropped buffer must be released: the communicator looks at
# dropped operations again after 1, 2, 4, ... posts while none has ended.
CALLS_AFTER = 8


def dropped_handle(world, how: str) -> list[str]:
    """Rank 0 starts an all_reduce (async_op=True, or a persistent handle's start()) and drops
    the handle and the array at once; rank 1 joins 0.5 s later. Meanwhile rank 0 allocates
    arrays of the same size, which the allocator would place in the freed block: none may be
    written. Once the operation has ended, a few calls later the dropped array is let go."""
    n, problems = 1 << 14, []
    if world.rank == 1:
        time.sleep(0.5)
        x = np.full(n, 2.0, np.float32)
        world.all_reduce(x)
        if not (x == 3.0).all():
            problems.append(f"rank 1: all_reduce gave {x[:4]}, not 3.0")
        for _ in range(CALLS_AFTER):
            world.barrier()
        return problems
    x = np.ones(n, np.float32)
    gone = weakref.ref(x)
    if how == "async":
        world.all_reduce(x, async_op=True)
    else:
        h = world.all_reduce_init(x)
        h.start()
        del h
    del x
    gc.collect()
    victims = [np.zeros(n, np.float32) for _ in range(64)]
    if gone() is None:
        problems.append(f"{how}: the array was freed while its operation ran")
    time.sleep(1.0)  # rank 1 has joined: the dropped all_reduce has ended (on MPI, which
    for _ in range(CALLS_AFTER):  # progresses only inside its calls, in the first barrier)
        world.barrier()
    written = sum(int((v != 0).any()) for v in victims)
    if written:
        problems.append(f"{how}: {written} arrays allocated after the drop were written")
    if gone() is not None:
        problems.append(f"{how}: the array is still held after its operation ended")
    return problems


@pytest.mark.parametrize("how", ["async", "persistent"])
def test_dropped_handle_keeps_buffers(cluster, transport, how):
    name, launcher = transport
    assert_no_problems(cluster(2, name, launcher).run(dropped_handle, how))


@pytest.fixture(params=transport_params())
def transport(request):
    return request.param
