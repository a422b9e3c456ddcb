"""What this machine offers the library: `python -m comm.doctor`.

Transports (importable, or why not), the engine's nets and UCX's own view of transports and
devices, RDMA ports (through the engine's verbs net), GPUs and NCCL, and the limits shared memory runs
into. COMM_DEBUG=1 prints the same report at init. Every probe is local and read-only; a
probe that fails reports why instead of raising.
"""
from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys

from .core.errors import CommError

# Probes that run a program may not hold up init (COMM_DEBUG) for long.
_PROGRAM_TIMEOUT_S = 10


def _transports() -> list[str]:
    from transports import base
    return [f"{name}: {base.unavailable_reason(name) or 'available'}" for name in base.names()]


def _engine() -> list[str]:
    try:
        from comm import _native
    except ImportError as e:
        return [f"not built ({e}); run `pip install .`"]
    lines = [f"reduction kernels: {_native.kernel_isa()}"]
    from transports import base
    for transport in base.names():
        cls = _engine_transport(transport)
        if cls is None or cls.net is None:
            continue
        why = cls.available()
        if why:
            lines.append(f"net {cls.net}: unavailable: {why}")
            continue
        lines.append(f"net {cls.net} ({', '.join(f'{k}={v}' for k, v in cls.net_options().items())}):")
        try:
            listing = _native.net_describe(cls.net, cls.net_options())
        except CommError as e:   # the engine raises comm.core.errors classes
            listing = f"cannot be opened: {e.cause}"
        lines += ["  " + line for line in listing.splitlines() if line.strip("# ")]
    return lines


def _engine_transport(name: str):
    """The transport class `name` when it runs on the native engine, else None."""
    from transports import base
    from transports.native import NativeTransport
    try:
        cls = base.get(name)
    except Exception:  # noqa: BLE001  (an unimportable transport is listed by _transports)
        return None
    return cls if issubclass(cls, NativeTransport) else None


def _ucx() -> list[str]:
    try:
        import libucx
    except ImportError as e:
        return [f"libucx is not installed ({e}); pip install libucx-cu12"]
    lines = [f"libucx {libucx.__version__}", _libucp(),
             f"UCX_TLS={os.environ.get('UCX_TLS', '(unset: UCX chooses)')}"]
    ucx_info = os.path.join(os.path.dirname(libucx.__file__), "bin", "ucx_info")
    if not os.access(ucx_info, os.X_OK):
        return lines + ["ucx_info is not in the wheel: no device listing"]
    lib = os.path.join(os.path.dirname(libucx.__file__), "lib")  # the wheel's binary has no rpath
    out = _program([ucx_info, "-d"], {"LD_LIBRARY_PATH": lib})
    if out is None:
        return lines + ["ucx_info -d failed"]
    devices: dict[str, list[str]] = {}
    transport = None
    for line in out.splitlines():
        key, _, value = line.strip("# \t").partition(":")
        if key.strip() == "Transport":
            transport = value.strip()
        elif key.strip() == "Device" and transport:
            devices.setdefault(transport, []).append(value.strip())
    lines += [f"transport {t}: {', '.join(d)}" for t, d in devices.items()] or ["ucx_info lists no transport"]
    return lines


def _libucp() -> str:
    """The libucp the ucx transport loads: its version and file, and whether it is within the
    range the engine runs on (the engine says, from what it loaded)."""
    cls = _engine_transport("ucx")
    if cls is None:
        return "libucp: the ucx transport cannot be imported (see transports)"
    from transports.native import _native
    options = cls.net_options()
    if _native is None or not options.get("library"):
        return f"libucp: {cls.available()}"
    return f"libucp: {_native.net_library('ucx', options)}"


def _rdma() -> list[str]:
    """RDMA ports as the engine's verbs net sees them (libibverbs, loaded by the engine), or why
    it cannot look: built without rdma-core's headers, no library, no device, no active port."""
    from transports.native import _native
    from transports.verbs import VerbsTransport
    if _native is None:
        return ["the native engine is not built"]
    options = VerbsTransport.net_options()
    why = _native.net_unavailable("verbs", options)
    if why:
        return [why]
    return [line for line in _native.net_describe("verbs", options).splitlines() if line]


def _gpus() -> list[str]:
    lines = []
    smi = shutil.which("nvidia-smi")
    out = _program([smi, "--query-gpu=index,name,driver_version,memory.total", "--format=csv,noheader"]) if smi else None
    if out is None:
        lines.append("nvidia-smi: " + ("failed" if smi else "not found (no NVIDIA driver)"))
    else:
        lines += [f"GPU {line.strip()}" for line in out.splitlines() if line.strip()] or ["no GPU"]
    from transports import base
    lines.append(f"NCCL (transport nccl): {base.unavailable_reason('nccl') or 'available'}")
    return lines


def _shared_memory() -> list[str]:
    lines = [f"cores: {os.cpu_count()} (this process may use {len(os.sched_getaffinity(0))})"]
    try:
        st = os.statvfs("/dev/shm")
        lines.append(f"/dev/shm: {st.f_blocks * st.f_frsize >> 20} MiB, {st.f_bavail * st.f_frsize >> 20} MiB free "
                     "(UCX's and MPI's shared-memory transports; the engine's own segments are memfd)")
    except OSError as e:
        lines.append(f"/dev/shm: {e}")
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    show = lambda v: "unlimited" if v == resource.RLIM_INFINITY else f"{v >> 10} KiB"  # noqa: E731
    lines.append(f"locked memory (ulimit -l): {show(soft)} (hard {show(hard)}); RDMA registration pins memory")
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            scope = f.read().strip()
        note = ("process_vm_readv between a job's ranks is allowed" if scope == "0" else
                "process_vm_readv between sibling ranks is refused: no single-copy (cma) path")
        lines.append(f"Yama ptrace_scope {scope}: {note}")
    except OSError:
        lines.append("Yama ptrace_scope: not present (process_vm_readv follows the same-user rule)")
    return lines


def _program(argv: list[str], env: dict | None = None) -> str | None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=_PROGRAM_TIMEOUT_S, check=False,
                              env={**os.environ, **env} if env else None)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


SECTIONS = {"transports": _transports, "native engine": _engine, "UCX": _ucx,
            "RDMA devices": _rdma, "GPUs": _gpus, "shared memory and limits": _shared_memory}


def report() -> list[str]:
    """The report, one line each: a section title, then its lines indented."""
    lines = [f"comm doctor: Python {sys.version.split()[0]} on {os.uname().sysname} {os.uname().release}"]
    for title, probe in SECTIONS.items():
        lines.append(f"{title}:")
        try:
            lines += ["  " + line for line in probe()]
        except Exception as e:  # noqa: BLE001  (a probe's failure is part of the report)
            lines.append(f"  probe failed: {type(e).__name__}: {e}")
    return lines


def main() -> int:
    print("\n".join(report()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
