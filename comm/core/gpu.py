"""CUDA runtime calls, and the per-rank GPU records by which ranks agree who drives which GPU.

The vocabulary both CUDA paths share: the nccl transport (transports/nccl.py) and the staged
path above the transports (comm.staging), and buffers.py for the caller's stream. CUDA calls
go through cuda-bindings (`cuda.bindings.runtime`), which works on any CUDA pointer (torch,
CuPy, DLPack): no torch import here.
"""
from __future__ import annotations

import sys

from .errors import CommError

try:  # optional: comes with the nccl extra (and with torch's CUDA builds' stacks)
    from cuda.bindings import runtime as _cudart
except ImportError:
    _cudart = None

NO_BINDINGS = "CUDA buffers need cuda-bindings here (pip install cuda-bindings, or the nccl extra)"


# ---- CUDA runtime calls -----------------------------------------------------------------------
def cuda_check(result, what: str):
    """The value of a cuda-bindings call's (error, value...) tuple, or CommError naming the error."""
    err, *rest = result
    if err != _cudart.cudaError_t.cudaSuccess:
        raise CommError(f"{what} failed: {_cudart.cudaGetErrorName(err)[1].decode()}")
    return rest[0] if len(rest) == 1 else (rest or None)


def current_stream(device: int) -> int:
    """The caller's current stream: torch's when torch has initialised CUDA, else the legacy
    default stream (0). torch is never imported here."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return torch.cuda.current_stream(device).cuda_stream
    return 0


def pci_bus_id(device: int) -> str:
    """The PCI bus id of CUDA device `device` ("0000:3b:00.0"): the same GPU has the same id in
    every process, whatever CUDA_VISIBLE_DEVICES numbers it there."""
    raw = cuda_check(_cudart.cudaDeviceGetPCIBusId(32, device), "cudaDeviceGetPCIBusId")
    return raw.split(b"\0", 1)[0].decode().lower()


# ---- agreement: who has which GPU ---------------------------------------------------------------
def encode_record(bus_id: str | None, reason: str | None, extra: bytes = b"") -> bytes:
    """One rank's entry: its GPU's bus id (and `extra`), or why it has none."""
    if bus_id is None:
        return b"-" + (reason or "no GPU").encode()
    return b"+" + bus_id.encode() + b"|" + extra


def decode_record(raw: bytes) -> tuple[str | None, str | None, bytes]:
    """(bus id, reason, extra) of an encode_record entry."""
    if raw[:1] == b"+":
        bus, _, extra = raw[1:].partition(b"|")
        return bus.decode(), None, extra
    return None, raw[1:].decode(errors="replace"), b""


def gpu_problem(records: list[tuple[str | None, str | None, bytes]]) -> str | None:
    """Why the ranks cannot each drive a GPU of their own (None when they can): the ranks that
    have no usable GPU with their reasons, else the ranks that share one (by PCI bus id)."""
    failed = [f"rank {r}: {reason}" for r, (bus, reason, _) in enumerate(records) if bus is None]
    if failed:
        return "; ".join(failed)
    owners: dict[str, list[int]] = {}
    for r, (bus, _, _) in enumerate(records):
        owners.setdefault(bus, []).append(r)
    shared = [f"ranks {', '.join(map(str, rs))} share GPU {bus}" for bus, rs in owners.items() if len(rs) > 1]
    if shared:
        return "; ".join(shared) + " (NCCL needs one GPU per rank; give each process its own, e.g. " \
                                   "torch.cuda.set_device(local_rank) or CUDA_VISIBLE_DEVICES)"
    return None


_noticed: set[str] = set()


def notice_once(text: str) -> None:
    """Print `text` to stderr the first time this process sees it."""
    if text not in _noticed:
        _noticed.add(text)
        print(f"comm: {text}", file=sys.stderr, flush=True)
