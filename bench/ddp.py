"""DDP step time of a small MLP: the torch backend "comm" against gloo, in one run.

    python -m bench.ddp --np 2 --steps 50            # prints the table, ratio = comm / gloo
    python -m bench.ddp --np 4 --json ddp.json

Every rank joins one default group on "comm" and a gloo group over the same ranks, then trains
the same model under DistributedDataParallel on each, in alternating rounds (so a busy machine
slows both alike). A step is forward, backward (DDP all-reduces the gradient buckets while
backward runs) and an SGD update; the time of a round is the slowest rank's, and the median
round is reported. `measure()` is what a bench driver calls; it launches the ranks itself.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import time


def _model(width: int, depth: int):
    import torch

    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))


def _round(pg, width: int, depth: int, steps: int, warmup: int) -> float:
    """Seconds per step of DDP on `pg`, the slowest rank's."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    ddp = DDP(_model(width, depth), process_group=pg)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x, y = torch.randn(32, width), torch.randint(0, 10, (32,))
    for i in range(warmup + steps):
        if i == warmup:
            dist.barrier(group=pg)
            start = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    elapsed = torch.tensor([(time.perf_counter() - start) / steps], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=pg)
    return elapsed.item()


def _rank_main(args) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    import comm.torch  # noqa: F401  registers "comm"

    torch.set_num_threads(1)   # ranks share the cores: one compute thread each, like gloo's tests
    dist.init_process_group("comm", timeout=datetime.timedelta(seconds=120))
    groups = {"gloo": dist.new_group(backend="gloo"), "comm": dist.group.WORLD}
    times: dict[str, list[float]] = {name: [] for name in groups}
    for _ in range(args.rounds):
        for name, pg in groups.items():
            times[name].append(_round(pg, args.width, args.depth, args.steps, args.warmup))
    if dist.get_rank() == 0:
        print(json.dumps({name: statistics.median(t) for name, t in times.items()}), flush=True)
    dist.destroy_process_group()


def measure(n: int = 2, steps: int = 50, warmup: int = 5, rounds: int = 3, width: int = 256,
            depth: int = 4, timeout: float = 600) -> dict:
    """Launch n ranks on this host; returns seconds per step for "gloo" and "comm", and the
    ratio comm / gloo."""
    from comm.bootstrap.rendezvous import free_port
    port = free_port()
    argv = [sys.executable, "-m", "bench.ddp", "--rank-worker", "--steps", str(steps), "--warmup", str(warmup),
            "--rounds", str(rounds), "--width", str(width), "--depth", str(depth)]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(n),
               PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    env.setdefault("COMM_SECRET", secrets.token_hex(16))   # a job of our own, as python -m bench --np
    procs = [subprocess.Popen(argv, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL, text=True)
             for r in range(n)]
    try:
        out, _ = procs[0].communicate(timeout=timeout)
        for p in procs[1:]:
            p.wait(timeout=60)
    finally:
        for p in procs:
            p.kill()
    if any(p.returncode for p in procs):
        raise RuntimeError(f"a DDP benchmark rank failed (exit codes {[p.returncode for p in procs]})")
    result = json.loads(out.strip().splitlines()[-1])
    result.update(ratio=result["comm"] / result["gloo"], ranks=n, steps=steps, width=width, depth=depth)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ddp", description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=2, help="ranks to launch (default 2)")
    parser.add_argument("--steps", type=int, default=50, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per backend; median reported")
    parser.add_argument("--width", type=int, default=256, help="MLP width")
    parser.add_argument("--depth", type=int, default=4, help="hidden layers")
    parser.add_argument("--json", help="also write the result here")
    parser.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_worker:
        _rank_main(args)
        return 0
    r = measure(args.np, args.steps, args.warmup, args.rounds, args.width, args.depth)
    print(f"DDP step, MLP {args.depth}x{args.width}, {args.np} ranks: gloo {r['gloo'] * 1e3:.2f} ms, "
          f"comm {r['comm'] * 1e3:.2f} ms, comm/gloo = {r['ratio']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
