"""`python -m bench.compress_ddp`: a small Hugging Face Llama under DDP across simulated hosts,
the exact gradient all_reduce against comm.torch.hooks' compressed hooks.

    python -m bench.compress_ddp --hosts 2 --link-rate 1gbit --steps 50

One rank per host (network namespaces, root only), the default group on the "comm" backend.
The same model (random init, fixed seed), the same batches (a learnable token pattern), trained
once per hook in turn: the default all_reduce ("exact"), then --hooks (bf16, fp8). Prints the
median step time of each (the slowest rank's), its ratio to the exact run, and the largest
relative difference of the loss from the exact run's over the steps. Needs transformers.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from . import cluster
from .launch import _child_env, _run_ranks


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m bench.compress_ddp", description=__doc__.split("\n")[0])
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--link-rate", default="1gbit")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--hooks", default="bf16")
    p.add_argument("--vocab", type=int, default=16000)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tokens", type=int, default=16, help="tokens per rank per step")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if "RANK" in os.environ:
        return rank_main(args)
    why = cluster.unavailable()
    if why:
        print(f"bench.compress_ddp: {why}", file=sys.stderr)
        return 2
    child = [sys.executable, "-m", "bench.compress_ddp"] + argv
    with cluster.NetnsCluster(args.hosts, args.link_rate) as c:
        return _run_ranks(lambda: c.launch(child, 1, dict(_child_env(), OMP_NUM_THREADS="1")))


def train(args, hook, rank: int):
    """Losses and step times (seconds, the slowest rank's) of args.steps DDP steps."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 2,
                         num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=8,
                         max_position_embeddings=max(64, args.tokens))
    model = DDP(LlamaForCausalLM(config))
    if hook is not None:
        model.register_comm_hook(None, hook)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(100 + rank)
    losses, times = [], []
    for _ in range(args.steps):
        start = torch.randint(0, args.vocab, (1, 1), generator=g)
        ids = (start + torch.arange(args.tokens)) % args.vocab   # next token = this one + 1
        dist.barrier()
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        losses.append(loss.item())
        times.append(float(took))
    return losses, times


def rank_main(args) -> int:
    import torch
    import torch.distributed as dist
    import comm.torch  # noqa: F401  (registers "comm")
    from comm.torch import hooks

    torch.set_num_threads(1)
    dist.init_process_group("comm")
    rank = dist.get_rank()
    runs = {"exact": train(args, None, rank)}
    for name in [h for h in args.hooks.split(",") if h]:
        runs[name] = train(args, {"bf16": hooks.bf16_hook, "fp8": hooks.fp8_hook}[name], rank)
    if rank == 0:
        params = sum(p.numel() for p in __import__("transformers").LlamaForCausalLM(
            __import__("transformers").LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                                                   intermediate_size=args.hidden * 2, num_hidden_layers=args.layers,
                                                   num_attention_heads=8, num_key_value_heads=8)).parameters())
        exact_losses, exact_times = runs["exact"]
        base = statistics.median(exact_times[5:])   # past the measuring calls of COMM_COMPRESS=auto
        print(f"# Llama DDP: {params / 1e6:.1f}M parameters, {args.hosts} hosts x 1 rank, links {args.link_rate}, "
              f"{args.steps} steps (median step time of steps 6..{args.steps})")
        print(f"{'hook':>6} {'step (s)':>9} {'x exact':>8} {'max |loss - exact| / exact':>27} {'first loss':>10} {'last loss':>10}")
        rows = []
        for name, (losses, times) in runs.items():
            step = statistics.median(times[5:])
            diff = max(abs(a - b) / abs(b) for a, b in zip(losses, exact_losses))
            rows.append({"hook": name, "step_s": step, "ratio": step / base, "max_rel_loss_diff": diff,
                         "losses": losses})
            print(f"{name:>6} {step:>9.3f} {step / base:>8.2f} {diff:>27.4f} {losses[0]:>10.4f} {losses[-1]:>10.4f}")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(rows, fh, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
