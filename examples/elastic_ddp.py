"""Data-parallel training that keeps going when a rank dies (comm's shrink and grow).

    python examples/elastic_ddp.py --np 4 --steps 60 --kill-rank 2 --kill-step 20

Each rank trains one copy of a small model on its share of every global batch and averages the
gradients with all_reduce. When a rank dies (here --kill-rank SIGKILLs itself at --kill-step),
the survivors get an error, shrink the communicator, re-divide the data among themselves, and
go on from the state of the new rank 0 (broadcast, so every survivor resumes from the same step
and parameters). Then a replacement process joins (grow): rank 0 starts it with the address to
join, and it receives the model and the optimizer's state by broadcast from rank 0.

--np N starts N local ranks itself; under a launcher (torchrun, mpirun) each process is a rank.
--out DIR: each rank writes its final parameters and losses to DIR/rank<uid>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys

import numpy as np
import torch

import comm

FEATURES, SAMPLES, BATCH = 16, 4096, 256


def data():
    """The same synthetic regression problem on every rank."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    w = torch.randn(FEATURES, 1, generator=g)
    return x, x @ w + 0.1 * torch.randn(SAMPLES, 1, generator=g)


class Trainer:
    def __init__(self):
        torch.manual_seed(1)
        self.model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        for p in self.model.parameters():   # momentum buffers exist from the start: one state layout
            self.opt.state[p]["momentum_buffer"] = torch.zeros_like(p)
        self.step = 0
        self.x, self.y = data()

    def state(self) -> list[torch.Tensor]:
        """Everything a replacement needs, as tensors to broadcast in place."""
        params = list(self.model.parameters())
        return [p.data for p in params] + [self.opt.state[p]["momentum_buffer"] for p in params]

    def sync_from_rank0(self, c) -> None:
        """Every rank takes rank 0's step, parameters and momentum: survivors that were a step
        apart when the failure came, and newcomers, resume from one state."""
        step = torch.tensor([self.step], dtype=torch.int64)
        c.broadcast(step, root=0)
        self.step = int(step)
        for t in self.state():
            c.broadcast(t, root=0)

    def train_step(self, c) -> float:
        """One step on this rank's share of the global batch; the gradients are averaged."""
        start = (self.step * BATCH) % SAMPLES
        rows = torch.arange(start, start + BATCH) % SAMPLES
        mine = rows[c.rank::c.size]   # the data re-divides when the group changes
        loss = torch.nn.functional.mse_loss(self.model(self.x[mine]), self.y[mine], reduction="sum")
        self.opt.zero_grad()
        loss.backward()
        params = list(self.model.parameters())
        flat = torch.cat([p.grad.reshape(-1) for p in params] + [loss.detach().reshape(1)])
        c.all_reduce(flat)   # sums over ranks; divided by the global batch below
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p) / BATCH)
            offset += p.numel()
        self.opt.step()
        self.step += 1
        return float(flat[-1]) / BATCH


def _argv(args) -> list[str]:
    """The command line of one rank (or a replacement) with the same settings."""
    argv = [sys.executable, os.path.abspath(__file__), "--steps", str(args.steps), "--kill-rank",
            str(args.kill_rank), "--kill-step", str(args.kill_step)]
    return argv + (["--out", args.out] if args.out else []) + ([] if args.replace else ["--no-replace"])


def replace(c, args) -> "comm.Communicator":
    """Grow by one: rank 0 starts the replacement with the address to join."""
    if c.rank == 0:
        subprocess.Popen(_argv(args) + ["--join", c.join_address()])
    return c.grow(1)


def train(c, args, trainer: Trainer) -> None:
    losses = []
    while trainer.step < args.steps:
        if c.ranks[c.rank] == args.kill_rank and trainer.step == args.kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            losses.append((trainer.step, trainer.train_step(c)))
        except comm.CommError as e:
            print(f"[uid {c.ranks[c.rank]}] step {trainer.step}: {type(e).__name__}; shrinking", flush=True)
            c = c.shrink()
            trainer.sync_from_rank0(c)
            if args.replace:
                c = replace(c, args)
                trainer.sync_from_rank0(c)
    uid = c.ranks[c.rank]
    if args.out:
        params = [p.detach().numpy().tolist() for p in trainer.model.parameters()]
        with open(os.path.join(args.out, f"rank{uid}.json"), "w") as f:
            json.dump({"uid": uid, "rank": c.rank, "size": c.size, "params": params, "losses": losses}, f)
    print(f"[uid {uid}] done at step {trainer.step}, rank {c.rank} of {c.size}, "
          f"loss {losses[-1][1] if losses else float('nan'):.4f}", flush=True)
    c.close()


def launch(args) -> int:
    """--np N: start N local ranks (torchrun's variables) and wait for them."""
    import secrets
    from comm.bootstrap import rendezvous
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(rendezvous.free_port()),
               WORLD_SIZE=str(args.np), COMM_SECRET=os.environ.get("COMM_SECRET") or secrets.token_hex(16))
    procs = [subprocess.Popen(_argv(args), env=dict(env, RANK=str(r))) for r in range(args.np)]
    codes = [p.wait() for p in procs]
    # the rank killed on purpose ends with SIGKILL; every other must succeed
    return 0 if all(code == 0 or code == -signal.SIGKILL for code in codes) else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--np", type=int, default=0)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--kill-rank", type=int, default=-1)
    ap.add_argument("--kill-step", type=int, default=-1)
    ap.add_argument("--no-replace", dest="replace", action="store_false")
    ap.add_argument("--join", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.np:
        return launch(args)
    trainer = Trainer()
    if args.join:   # a replacement: the survivors' state comes by broadcast
        c = comm.join(args.join)
        trainer.sync_from_rank0(c)
    else:
        c = comm.init()
    train(c, args, trainer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
