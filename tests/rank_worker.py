"""One rank of a test cluster (see harness.py). Started by the harness or by mpirun."""
import os
import socket
import sys
import traceback

from harness import _recv, _send


def _rank() -> int:
    for key in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        if key in os.environ:
            return int(os.environ[key])
    raise RuntimeError("no rank in the environment")


def main() -> None:
    rank = _rank()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(os.environ["COMM_TEST_CONTROL"])
    _send(sock, rank)
    world = None
    try:
        if os.environ["COMM_TEST_INIT"] == "1":
            import comm
            world = comm.init(transport=os.environ["COMM_TEST_TRANSPORT"])
        _send(sock, (True, None))
    except BaseException:
        _send(sock, (False, traceback.format_exc()))
        return
    size = int(os.environ.get("WORLD_SIZE") or os.environ.get("OMPI_COMM_WORLD_SIZE") or 1)
    while True:
        try:
            job = _recv(sock)
        except ConnectionError:
            break
        if job is None:
            break
        fn, args = job
        try:
            result = fn(world, *args) if world is not None else fn(rank, size, *args)
            _send(sock, (True, result))
        except BaseException as e:
            try:
                _send(sock, (False, (e, traceback.format_exc())))
            except Exception:  # the exception itself would not pickle
                _send(sock, (False, (None, traceback.format_exc())))
    if world is not None:
        world.close()
    sock.close()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown: transports' daemon threads may still hold the GIL


if __name__ == "__main__":
    main()
