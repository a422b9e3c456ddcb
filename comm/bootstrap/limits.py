"""The file-descriptor budget (RLIMIT_NOFILE), checked before a process needs the descriptors:
a job too large for `ulimit -n` fails at once, with the number it needs, rather than midway
through set-up with EMFILE on one rank while the others wait out the timeout."""
from __future__ import annotations

import os
import resource

from ..core.errors import CommError

# Descriptors a process keeps beside what is counted (interpreter, libraries, store client,
# listeners, event descriptors): the headroom each check leaves.
MARGIN = 64


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 0


def reserve(more: int, what: str, *, rank: int, op: str, hint: str = "") -> None:
    """`more` descriptors beyond those open now (and MARGIN) must fit under RLIMIT_NOFILE. The
    soft limit is raised to the hard one when that suffices; otherwise a CommError names
    `ulimit -n` and the number needed. what: what they are for, in words."""
    open_now = open_descriptors()
    needed = open_now + more + MARGIN
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or needed <= soft:
        return
    if hard == resource.RLIM_INFINITY or needed <= hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        return
    raise CommError(f"this rank needs about {needed} file descriptors ({what}, {open_now} open already, "
                    f"{MARGIN} spare) but `ulimit -n` allows {soft} and its hard limit {hard}: raise it "
                    f"(ulimit -n {needed} or more{hint})", rank=rank, op=op)


def available_memory() -> int | None:
    """Bytes this host can still give (MemAvailable, plus free huge pages, which it does not
    count); None where /proc/meminfo is not there to say."""
    try:
        with open("/proc/meminfo") as f:
            fields = {k: v.split() for k, v in (line.split(":", 1) for line in f if ":" in line)}
        kib = int(fields["MemAvailable"][0])
        huge = int(fields.get("HugePages_Free", ["0"])[0]) * int(fields.get("Hugepagesize", ["0"])[0])
    except (OSError, KeyError, ValueError, IndexError):
        return None
    return (kib + huge) * 1024
