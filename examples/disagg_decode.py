"""Disaggregated decode: prefill ranks compute each request's KV cache and put it, block by block,
into a decode rank's paged KV pool with one-sided puts (comm.window); decode ranks wait on a
signal per request, rebuild the cache from their pool and generate.

    python examples/disagg_decode.py --np 2                    # rank 0 prefill, rank 1 decode
    python examples/disagg_decode.py --np 4 --prefill 1        # 1 prefill rank, 3 decode ranks
    python examples/disagg_decode.py --np 2 --hosts 2 --link-rate 2gbit   # simulated hosts (root)
    python examples/disagg_decode.py --np 2 --mpirun           # under mpirun, transport mpi
    torchrun --nproc-per-node 2 examples/disagg_decode.py      # any launcher: each process a rank

The model is Hugging Face's LlamaForCausalLM, unchanged, with a small LlamaConfig and random
weights from a fixed seed (the same on every rank). Prefill runs the prompt, takes the first
token from its logits, and puts the KV cache (past_key_values, every layer's keys and values)
into blocks of --block-tokens tokens of the decode rank's pool: a window over a torch tensor
[blocks, layers, 2, kv_heads, block_tokens, head_dim]. Each prefill rank owns a share of every
decode rank's pool and a ring of header slots in it; it picks free blocks in a shuffled order
(a paged pool's block table is not contiguous), puts the blocks, then the header (request id,
prompt length, first token, block table, the time of its first put) with signal p (its rank),
so the header and every block land before decode sees the signal. Decode waits for signal p to
reach the count of requests it expects from p, rebuilds a transformers DynamicCache from the
blocks, hands the blocks and slot back to p with a put of no bytes carrying signal
(its index among the decode ranks) on p's window (flow control), and generates greedily.

Every decode rank also generates each of its requests whole in one process (model.generate,
greedy) and compares the tokens: the run prints one line per request and exits 1 on any
difference. `block wait` is how long decode waited for a request's blocks after prefill started
putting them (zero when they were there before decode asked), beside the time the payload
needs on a link of --link-rate (TCP/IP headers take ~4% more). Prefill's and decode's clocks
are compared, so the wait is measured on one machine only (simulated hosts share its clock).
"""
from __future__ import annotations

import argparse
import collections
import inspect
import os
import subprocess
import sys
import time

import numpy as np
import torch

import comm

HEADER = 7   # int64s before the block table: rid, prompt_len, first token, blocks, t_put_ns, bytes, magic
MAGIC = 0x4B56


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--np", type=int, default=0, help="start this many ranks (spread over --hosts)")
    ap.add_argument("--hosts", type=int, default=0, help="spread --np ranks over this many simulated hosts (root)")
    ap.add_argument("--link-rate", default=None, help="with --hosts: each host's link, e.g. 2gbit")
    ap.add_argument("--mpirun", action="store_true", help="start the --np ranks with mpirun, transport mpi")
    ap.add_argument("--prefill", type=int, default=0, help="prefill ranks (default: half, at least 1)")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=16, help="tokens to generate per request")
    ap.add_argument("--prompt", default="64,256", help="min,max prompt length in tokens")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--block-tokens", type=int, default=16, help="tokens per KV block")
    ap.add_argument("--pool-blocks", type=int, default=0, help="blocks per decode rank (default: 2 requests' worth per prefill rank)")
    ap.add_argument("--slots", type=int, default=2, help="requests each prefill rank may have in flight per decode rank")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--verify", type=int, default=1, help="1: compare with one-process generation (default)")
    return ap.parse_args(argv)


def build_model(args):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=1024, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, max_position_embeddings=4096)
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(cfg).eval(), cfg


def requests(args, vocab: int) -> list[torch.Tensor]:
    lo, hi = (int(x) for x in args.prompt.split(","))
    g = torch.Generator().manual_seed(args.seed + 1)
    lengths = torch.randint(lo, hi + 1, (args.requests,), generator=g)
    return [torch.randint(0, vocab, (int(n),), generator=g) for n in lengths]


class Layout:
    """Where things live in a decode rank's window (a flat byte tensor): the pool of KV blocks,
    then the header slots of every prefill rank."""

    def __init__(self, args, cfg, prefill: int, max_blocks: int):
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.block_shape = (cfg.num_hidden_layers, 2, cfg.num_key_value_heads, args.block_tokens, head_dim)
        self.block_bytes = int(np.prod(self.block_shape)) * 4          # float32
        self.T, self.max_blocks, self.slots = args.block_tokens, max_blocks, args.slots
        self.blocks = args.pool_blocks or 2 * max_blocks * prefill
        self.share = self.blocks // prefill                             # blocks owned by each prefill rank
        if self.share < max_blocks:
            raise SystemExit(f"--pool-blocks {self.blocks}: each of {prefill} prefill ranks needs {max_blocks}")
        self.header_ints = HEADER + max_blocks
        self.header_base = self.blocks * self.block_bytes
        self.nbytes = self.header_base + prefill * self.slots * self.header_ints * 8

    def header_at(self, p: int, slot: int) -> int:
        return self.header_base + (p * self.slots + slot) * self.header_ints * 8

    def views(self, mem: torch.Tensor):
        pool = mem[:self.header_base].view(torch.float32).view(self.blocks, *self.block_shape)
        return pool, mem[self.header_base:].view(torch.int64)


def step(model, ids: torch.Tensor, cache=None):
    """(logits, cache) of one forward pass; transformers renamed past_key_values to cache (5.x)."""
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        out = model(ids, use_cache=True, **({kw: cache} if cache is not None else {}))
    return out.logits, getattr(out, "cache", None) or out.past_key_values


def kv_of(cache, layer: int):
    """(keys, values) [batch, kv_heads, seq, head_dim] of one layer of a transformers cache."""
    if hasattr(cache, "layers"):
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]   # transformers 4.x


def to_blocks(cache, lay: Layout, n_layers: int, length: int) -> torch.Tensor:
    """The cache as [blocks, layers, 2, kv_heads, T, head_dim] (the last block zero-padded)."""
    nb = -(-length // lay.T)
    out = torch.zeros(nb, *lay.block_shape)
    for layer in range(n_layers):
        for i, t in enumerate(kv_of(cache, layer)):
            kvh, _, hd = t.shape[1:]
            padded = torch.zeros(kvh, nb * lay.T, hd)
            padded[:, :length] = t[0]
            out[:, layer, i] = padded.view(kvh, nb, lay.T, hd).transpose(0, 1)
    return out


def from_blocks(pool: torch.Tensor, table: list[int], n_layers: int, length: int):
    """A DynamicCache holding the first `length` tokens stored in pool blocks `table`."""
    from transformers import DynamicCache
    cache = DynamicCache()
    blocks = pool[table]                                   # a copy: the blocks can go back now
    for layer in range(n_layers):
        kv = []
        for i in range(2):
            b = blocks[:, layer, i]                        # [nb, kv_heads, T, head_dim]
            kvh, hd = b.shape[1], b.shape[3]
            kv.append(b.transpose(0, 1).reshape(kvh, -1, hd)[:, :length].unsqueeze(0).contiguous())
        cache.update(kv[0], kv[1], layer)
    return cache


def assignments(n_req: int, prefill: int, decode: int) -> list[tuple[int, int]]:
    """(prefill rank, decode rank) of each request."""
    return [(rid % prefill, prefill + rid % decode) for rid in range(n_req)]


def run_prefill(c, w, args, model, cfg, prompts, lay: Layout, plan) -> None:
    p = c.rank
    g = torch.Generator().manual_seed(args.seed + 100 + p)
    free: dict[int, collections.deque] = {}       # decode rank -> free blocks of p's share there
    inflight: dict[int, collections.deque] = collections.defaultdict(collections.deque)  # d -> (j, blocks)
    sent = collections.Counter()
    for rid, (src, d) in enumerate(plan):
        if src != p:
            continue
        prompt = prompts[rid]
        nb = -(-len(prompt) // lay.T)
        if d not in free:
            free[d] = collections.deque((p * lay.share + torch.randperm(lay.share, generator=g)).tolist())
        q = inflight[d]
        # flow control: a header slot and enough blocks, or wait for d to hand the oldest back
        while q and (len(q) >= lay.slots or len(free[d]) < nb):
            j, blocks = q.popleft()
            w.wait_signal(d - args.prefill, j + 1)
            w.flush(d)                  # its sources are no longer needed either
            free[d].extend(blocks)
        logits, cache = step(model, prompt[None])
        first = int(logits[0, -1].argmax())
        staged = to_blocks(cache, lay, cfg.num_hidden_layers, len(prompt))
        table = [free[d].popleft() for _ in range(nb)]
        j = sent[d]
        t_put = time.monotonic_ns()
        for i, blk in enumerate(table):
            w.put(d, staged[i], blk * lay.block_bytes)
        head = torch.zeros(lay.header_ints, dtype=torch.int64)
        head[:HEADER] = torch.tensor([rid, len(prompt), first, nb, t_put, nb * lay.block_bytes, MAGIC])
        head[HEADER:HEADER + nb] = torch.tensor(table)
        w.put(d, head, lay.header_at(p, j % lay.slots), signal=p)   # after every block: data first
        q.append((j, table))
        sent[d] += 1
    w.flush()


def run_decode(c, w, args, model, cfg, prompts, lay: Layout, plan, mem) -> np.ndarray:
    """Serve this rank's requests; returns rows of [rid, prompt_len, bytes, block_wait_s, ok]."""
    pool, headers = lay.views(mem)
    d = c.rank
    got = collections.Counter()
    rows = []
    for rid, (p, dst) in enumerate(plan):
        if dst != d:
            continue
        j = got[p]
        t_ask = time.monotonic_ns()
        w.wait_signal(p, j + 1)
        t_seen = time.monotonic_ns()
        at = (lay.header_at(p, j % lay.slots) - lay.header_base) // 8
        head = headers[at:at + lay.header_ints].clone()
        hrid, length, first, nb, t_put, nbytes, magic = head[:HEADER].tolist()
        if magic != MAGIC or hrid != rid or length != len(prompts[rid]):
            raise RuntimeError(f"rank {d}: header of request {rid} from rank {p} is {head[:HEADER].tolist()}")
        table = head[HEADER:HEADER + nb].tolist()
        cache = from_blocks(pool, table, cfg.num_hidden_layers, length)
        w.put(p, torch.empty(0), 0, signal=d - args.prefill)   # blocks and slot go back to p
        got[p] += 1
        tokens = [first]
        for _ in range(args.new_tokens - 1):
            logits, cache = step(model, torch.tensor([[tokens[-1]]]), cache)
            tokens.append(int(logits[0, -1].argmax()))
        ok = 1.0
        if args.verify:
            with torch.no_grad():
                whole = model.generate(prompts[rid][None], attention_mask=torch.ones(1, length, dtype=torch.long),
                                       max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
            ok = float(whole[0, length:].tolist() == tokens)
        wait = max(0, t_seen - max(t_put, t_ask)) / 1e9
        rows.append([rid, length, nbytes + lay.header_ints * 8, wait, ok])
    w.flush()
    return np.array(rows, np.float64).reshape(-1, 5)


def serve(args) -> int:
    torch.set_num_threads(1)
    c = comm.init()
    if c.size < 2:
        raise SystemExit("needs at least 2 ranks: prefill and decode")
    args.prefill = args.prefill or max(1, c.size // 2)
    if not 1 <= args.prefill < c.size:
        raise SystemExit(f"--prefill {args.prefill}: needs 1 to {c.size - 1} of {c.size} ranks")
    model, cfg = build_model(args)
    prompts = requests(args, cfg.vocab_size)
    plan = assignments(args.requests, args.prefill, c.size - args.prefill)
    max_blocks = -(-max(len(x) for x in prompts) // args.block_tokens)
    lay = Layout(args, cfg, args.prefill, max_blocks)
    decoding = c.rank >= args.prefill
    mem = torch.zeros(lay.nbytes if decoding else 0, dtype=torch.uint8)
    start = time.perf_counter()
    with c.window(mem, signals=max(args.prefill, c.size - args.prefill)) as w:
        if decoding:
            mine = run_decode(c, w, args, model, cfg, prompts, lay, plan, mem)
        else:
            run_prefill(c, w, args, model, cfg, prompts, lay, plan)
            mine = np.zeros((0, 5))
    elapsed = time.perf_counter() - start
    table = np.zeros((args.requests, 5))
    for row in mine:
        table[int(row[0])] = row
    c.all_reduce(table)                                   # every decode rank's rows, to everyone
    if c.rank == 0:
        report(args, c, table, plan, elapsed)
    bad = int(args.requests - table[:, 4].sum()) if args.verify else 0
    c.close()
    return 1 if bad else 0


def report(args, c, table, plan, elapsed) -> None:
    rate = None
    if args.link_rate:
        from bench.cluster import rate_bits
        rate = rate_bits(args.link_rate) / 8
    print(f"# disaggregated decode: {args.prefill} prefill + {c.size - args.prefill} decode ranks, "
          f"transport {c.transport}, {args.requests} requests, {args.new_tokens} new tokens each, "
          f"{elapsed:.2f} s")
    print(f"{'request':>7} {'prefill':>7} {'decode':>6} {'prompt':>6} {'KV bytes':>9} {'block wait':>10} "
          f"{'link needs':>10} {'tokens':>9}")
    for rid, row in enumerate(table):
        p, d = plan[rid]
        need = f"{row[2] / rate * 1e3:8.2f}ms" if rate else f"{'-':>10}"
        same = ("identical" if row[4] else "DIFFERENT") if args.verify else "unchecked"
        print(f"{rid:7d} {p:7d} {d:6d} {int(row[1]):6d} {int(row[2]):9d} {row[3] * 1e3:8.2f}ms {need} {same:>9}")
    if args.verify:
        n_ok = int(table[:, 4].sum())
        print(f"# tokens identical to one-process generation: {n_ok} of {args.requests}")
    if rate:
        worst = max(table[:, 3] / (table[:, 2] / rate))
        print(f"# longest block wait / link time of its bytes: {worst:.2f}")


def launch(args, argv) -> int:
    """--np: start the ranks (on simulated hosts with --hosts), wait for them, return the status."""
    import secrets

    from bench.launch import _mpirun_command, _run_ranks, find_mpirun
    from comm.bootstrap import rendezvous
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMP_NUM_THREADS="1", COMM_SECRET=os.environ.get("COMM_SECRET") or secrets.token_hex(16),
               PYTHONPATH=os.pathsep.join(x for x in (root, os.environ.get("PYTHONPATH")) if x))
    child = [sys.executable, os.path.abspath(__file__)] + [a for a in argv if a != "--mpirun"]
    if args.hosts:
        from bench.cluster import NetnsCluster, unavailable
        if unavailable():
            raise SystemExit(f"--hosts: {unavailable()}")
        with NetnsCluster(args.hosts, args.link_rate) as cluster:
            return _run_ranks(lambda: cluster.launch(child, args.np // args.hosts, env,
                                                     master_port=rendezvous.DEFAULT_PORT))
    if args.mpirun:
        mpirun = find_mpirun()
        if mpirun is None:
            raise SystemExit("--mpirun: no mpirun found")
        env["COMM_TRANSPORT"] = "mpi"
        return _run_ranks(lambda: [subprocess.Popen(_mpirun_command(mpirun, args.np) + child, env=env,
                                                    start_new_session=True)])
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(rendezvous.free_port()), WORLD_SIZE=str(args.np))
    return _run_ranks(lambda: [subprocess.Popen(child, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                                                start_new_session=True) for r in range(args.np)])


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    if args.np and not any(k in os.environ for k in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")):
        return launch(args, argv)
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
