"""One rank of a test_lifetime.py scenario: a plain script, as users write them, so a rank can
end every way a real one does (uncaught exception, sys.exit, return, os._exit, a signal) and
can fork. Usage: lifetime_rank.py SCENARIO, with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
and COMM_TIMEOUT set. Results are JSON lines on stdout (a forked child's are marked so)."""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import numpy as np

import comm

RANK = int(os.environ["RANK"])


def report(**fields) -> None:
    print(json.dumps(dict(fields, rank=RANK, pid=os.getpid())), flush=True)


def error_fields(e: BaseException) -> dict:
    return {"error": type(e).__name__, "text": str(e), "peer": getattr(e, "peer", None),
            "at": time.time()}


def exit_kinds(world) -> None:
    """The victim (VICTIM) ends by KIND once everyone is past a barrier; the others wait for it
    in an all_reduce and report the error they get and when."""
    victim, kind = int(os.environ["VICTIM"]), os.environ["KIND"]
    world.barrier()
    if RANK != victim:
        try:
            world.all_reduce(np.ones(4, np.float32))
            report(error=None)
        except comm.CommError as e:
            report(**error_fields(e))
        time.sleep(3)  # stay until every survivor has noticed: our exit would be news too
        return
    time.sleep(0.3)  # the survivors are inside their all_reduce by now
    report(died_at=time.time())
    if kind == "exception":
        raise RuntimeError("an ordinary bug")
    if kind == "sys_exit":
        sys.exit(3)
    if kind == "os_exit":
        os._exit(0)
    if kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    assert kind == "return"


def _in_child(world, work, lean) -> None:
    """Every use of the parent's communicator is refused in a forked child."""
    x = np.full(4, 1000, np.float32)
    uses = {"all_reduce": lambda: world.all_reduce(x), "barrier": world.barrier,
            "send": lambda: world.send(x, 1), "split": lambda: world.split(0),
            "abort": world.abort, "wait": work.wait, "lean_wait": lean.wait,
            "all_reduce_async": lambda: world.all_reduce(x, async_op=True)}
    for name, use in uses.items():
        try:
            use()
            report(child=True, use=name, error=None)
        except comm.CommError as e:
            report(child=True, use=name, **error_fields(e))
    world.close()
    sys.exit(0)  # a normal exit: garbage collection of the inherited engine must not hang


def fork(world) -> None:
    """Rank 0 forks; the child tries the parent's communicator, then exits. The parent then
    works with rank 1 as before; finally it forks a long-lived child and dies (SIGKILL)."""
    x = np.full(4, RANK + 1, np.float32)
    if RANK == 0:
        work = world.barrier(async_op=True)  # in flight across the fork (rank 1 joins later)
        y = np.full(4, 5, np.float32)
        lean = world.all_reduce(y, async_op=True)  # the engine's native Work, in flight too
        pid = os.fork()
        if pid == 0:
            _in_child(world, work, lean)
        start = time.monotonic()
        while os.waitpid(pid, os.WNOHANG) == (0, 0) and time.monotonic() - start < 20:
            time.sleep(0.01)
        report(child_exited_after=time.monotonic() - start)
        world.send(np.zeros(1, np.float32), 1)  # the child is done: rank 1 may go on
        work.wait()
        lean.wait()
    else:
        world.recv(np.zeros(1, np.float32), 0)
        world.barrier()
        world.all_reduce(np.full(4, 5, np.float32))
    world.all_reduce(x)
    report(result=x.tolist())
    world.barrier()
    if RANK == 0:
        if os.fork() == 0:
            # holds every inherited descriptor of the communicator while the parent is gone;
            # not the output pipes, which the test reads to their end
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            time.sleep(20)
            os._exit(0)
        report(died_at=time.time())
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        world.all_reduce(x)
        report(error=None)
    except comm.CommError as e:
        report(**error_fields(e))


def threads(world) -> None:
    """Two threads run 300 same-signature all_reduces each on one communicator (one-shot, or
    with MODE=persistent each thread's own persistent handle); rank 1 starts late. Thread t's
    input is t + 1 on every rank, so any other sum means the threads' calls were mixed up."""
    results = {}
    start = threading.Barrier(2)
    persistent = os.environ.get("MODE") == "persistent"
    # every rank past init (its last read of the store) before rank 0's abort can end its
    # process, and the store it hosts, while rank 1 is still between a set and a get
    world.barrier()

    def loop(t: int) -> None:
        good = bad = 0
        error = None
        x = np.empty(4, np.float32)
        run = world.all_reduce_init(x) if persistent else lambda: world.all_reduce(x)
        start.wait()
        if world.rank == 1:
            # rank 0's first call then waits for rank 1 while rank 0's other thread arrives: the
            # overlap happens for sure, however the threads are scheduled on a loaded machine
            time.sleep(0.5)
        for _ in range(300):
            x[:] = t + 1
            try:
                run()
            except comm.CommError as e:
                error = (type(e).__name__, str(e))
                break
            if np.all(x == (t + 1) * world.size):
                good += 1
            else:
                bad += 1
        results[t] = {"good": good, "bad": bad, "error": error}

    ts = [threading.Thread(target=loop, args=(t,)) for t in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    report(threads=results)


def sigint(world) -> None:
    """Rank 0 blocks in MODE (a collective, Work.wait, recv, or wait_signal on a window) that
    rank 1 never joins; rank 1 blocks in a receive rank 0 never sends. The test sends rank 0
    SIGINT."""
    # Python turns SIGINT into KeyboardInterrupt only when SIGINT was not ignored at start-up,
    # and children inherit an ignored SIGINT (nohup, `... &`, some CI runners): this rank
    # asks for the handler it is testing.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    mode = os.environ["MODE"]
    x = np.ones(4, np.float32)
    # wait_signal: a window open on both ranks; rank 0 then waits on a signal no one sends
    # (over TCP or shm without CMA its thread drives the engine meanwhile, as a recv does)
    w = world.window(np.zeros(64, np.uint8), signals=2) if mode == "wait_signal" else None
    world.barrier()
    if RANK == 1:
        try:
            world.recv(x, 0, tag=7)
            report(error=None)
        except comm.CommError as e:
            report(**error_fields(e))
        return
    report(ready=True)
    try:
        if mode == "all_reduce":
            world.all_reduce(x)
        elif mode == "wait":
            world.all_reduce(x, async_op=True).wait()
        elif mode == "wait_signal":
            w.wait_signal(1, 1)
        else:
            world.recv(x, 1)
        report(interrupted=None)
    except KeyboardInterrupt:
        report(interrupted=time.time())
    if mode == "wait_signal":  # the communicator stays usable: its streams must be intact
        try:
            world.send(x, 1, tag=7)
            report(after="sent")
        except comm.CommError as e:
            report(after=type(e).__name__)
        return
    try:
        world.all_reduce(x)
    except comm.CommError as e:
        report(after=type(e).__name__)


def init_killed() -> None:
    """The victim (VICTIM) is killed right after creating its shared-memory segment, before any
    peer mapped it; the others report how their init ended and how long it took."""
    if RANK == int(os.environ["VICTIM"]):
        from transports.native import NativeTransport

        def create_and_die(engine, store, local):
            engine.shm_create()
            os.kill(os.getpid(), signal.SIGKILL)

        NativeTransport._share_memory = staticmethod(create_and_die)
    start = time.monotonic()
    try:
        comm.init()
        report(error=None)
    except comm.CommError as e:
        report(seconds=time.monotonic() - start, **error_fields(e))


def main() -> None:
    if sys.argv[1] == "init_killed":
        init_killed()
        return
    world = comm.init()
    globals()[sys.argv[1]](world)
    # No close(): a script that returns from its main leaves that to interpreter exit.


if __name__ == "__main__":
    main()
