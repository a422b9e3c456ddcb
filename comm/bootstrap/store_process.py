"""The store's host in a process of its own, for jobs of many ranks: the host keeps a
connection (and a thread) for every rank for the job's life, which in rank 0's own process
would make its descriptors grow with the job where every other rank's grow with the hosts
(as torchrun's agent, not a worker, hosts torch's store). Small jobs keep the host in rank 0's
process: a child costs an interpreter's start-up, about 0.1 s of CPU.

The child serves until its stdin, a pipe whose only writer is rank 0, reaches its end: when
rank 0 closes the store, or when rank 0's process ends in any way at all (killed included),
so it never outlives the job, as the host in rank 0's process never did."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys

from .store_host import LINGER, StoreServer

OWN_PROCESS_FROM = 32   # ranks


class HostProcess:
    """Serves `listener` (bound and listening) in a child process; this process's copy of the
    listener is closed. Takes StoreServer's arguments."""

    def __init__(self, listener: socket.socket, secret: bytes | None, timeout: float, *,
                 size: int, agree: dict[str, str], where: str):
        if not sys.executable:
            raise OSError("sys.executable is empty: no interpreter to start")
        fd = listener.fileno()
        conf = {"fd": fd, "secret": secret.hex() if secret is not None else None, "timeout": timeout,
                "size": size, "agree": agree, "where": where}
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # where comm imports from
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
        self._proc = subprocess.Popen([sys.executable, "-c", "from comm.bootstrap.store_process import serve; serve()"],
                                      stdin=subprocess.PIPE, pass_fds=(fd,), env=env)
        listener.close()
        try:   # the secret travels through the pipe, never the command line or the environment
            self._proc.stdin.write(json.dumps(conf).encode() + b"\n")
            self._proc.stdin.flush()
        except OSError:
            pass   # the child died at start: the ranks find no store and say so

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._proc.stdin.close()
        try:   # it may linger to tell late ranks of a disagreement (StoreServer.close)
            self._proc.wait(timeout=LINGER + 5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def serve() -> None:
    """The child's main: serve until stdin ends."""
    # Ctrl-C reaches the whole process group: rank 0 decides when the job ends, not the child.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    line = sys.stdin.buffer.readline()
    if not line:
        return
    conf = json.loads(line)
    secret = bytes.fromhex(conf["secret"]) if conf["secret"] is not None else None
    server = StoreServer(socket.socket(fileno=conf["fd"]), secret, conf["timeout"], size=conf["size"],
                         agree=conf["agree"], where=conf["where"])
    while sys.stdin.buffer.read(4096):
        pass
    server.close()
