"""Going on after a failure (comm.elastic): revoke, agree, shrink, grow and join, on real
processes killed with SIGKILL or stopped with SIGSTOP."""
from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import comm
from bench.cluster import NetnsCluster
from bench.cluster import unavailable as netns_unavailable
from harness import HERE, ROOT, Cluster, engine_param, engine_setup, free_port



# ---- on the ranks --------------------------------------------------------------------------
_STATE: dict = {}   # per rank process: the current communicator across calls


def _current(world):
    return _STATE.get("comm", world)


def uid_sum_loop(world, steps, pause, stop_after=None, marker=None):
    """all_reduce values that depend on uid and step; on a failure shrink, agree on the step
    to redo (the lowest any survivor finished) and go on. Every result is checked against the
    sum over the live ranks. After stop_after seconds on any rank all stop at the same step.
    marker: a path prefix; each shrink creates {marker}.{uid}.{shrinks so far}. Returns (uids at the end, shrinks, problems)."""
    c, step, shrinks, problems = _current(world), 0, [], []
    start = time.monotonic()
    while step < steps:
        uid = c.ranks[c.rank]
        late = stop_after is not None and time.monotonic() - start > stop_after
        x = np.array([(uid + 1) * 1000.0 + step, -step, float(late)])
        try:
            c.all_reduce(x)
        except comm.CommError as e:
            t = time.monotonic()
            try:
                new = c.shrink()
            except comm.CommError as again:
                return "shrink failed", type(e).__name__, type(again).__name__, str(again)
            s = np.array([step], dtype=np.int64)
            new.all_reduce(s, op=comm.MIN)
            shrinks.append((type(e).__name__, new.ranks, time.monotonic() - t))
            if marker:
                open(f"{marker}.{uid}.{len(shrinks)}", "w").close()
            if c is not world:
                c.close()
            c, step = new, int(s[0])
            _STATE["comm"] = c
            continue
        want = [sum((u + 1) * 1000.0 + step for u in c.ranks), -step * c.size]
        if x[:2].tolist() != want:
            problems.append((step, c.ranks, x.tolist(), want))
        if x[2] > 0:
            break
        step += 1
        time.sleep(pause)
    return c.ranks, shrinks, problems


def _forget(world):
    _STATE.clear()


def _wait_for(path, timeout=30):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.mark.parametrize("where", [engine_param("auto", channels="auto"),
                                   engine_param("tcp", channels="tcp", slow=True),
                                   engine_param("ucx", channels="ucx", slow=True),
                                   pytest.param("2 hosts", marks=[pytest.mark.slow, pytest.mark.skipif(
                                       netns_unavailable() is not None, reason=str(netns_unavailable()))])])
def test_shrink_after_kills_incl_store_host(tmp_path, where):
    """4 ranks; rank 2 is killed, then (once they shrank) rank 0, which hosts the store: the
    survivors shrink twice (the second time moving the store to rank 1) and every sum stays
    exact. On shared memory, TCP, UCX, and across two simulated hosts (ranks 0, 1 | 2, 3: the
    first victim's host keeps one rank, the second victim is the store's host)."""
    hosts = NetnsCluster(2) if where == "2 hosts" else None
    try:
        if hosts is None:
            transport, env = engine_setup(where)
            c = Cluster(4, transport, env={**env, "COMM_TIMEOUT": "20"})
        else:
            c = Cluster(4, netns=[hosts.ns[h] for h in (0, 0, 1, 1)],
                        env={"MASTER_ADDR": hosts.addr(0), "COMM_TIMEOUT": "20"})
        _kill_twice_and_check(c, tmp_path)
    finally:
        if hosts is not None:
            hosts.close()


def _kill_twice_and_check(c, tmp_path):
    marker = str(tmp_path / "shrunk")
    try:
        pids = c.pids()
        c.submit(uid_sum_loop, 10**6, 0.01, 4.0, marker)
        time.sleep(0.6)
        os.kill(pids[2], signal.SIGKILL)
        _wait_for(f"{marker}.0.1")
        os.kill(pids[0], signal.SIGKILL)
        out = c.collect([1, 3], 60)
    finally:
        c.kill()
        c.close()
    for r, (ok, value, _) in out.items():
        assert ok, value[1]
        ranks, shrinks, problems = value
        assert ranks == (1, 3), value
        assert [s[1] for s in shrinks] == [(0, 1, 3), (1, 3)], shrinks
        assert problems == []


def _die_when_connecting(world, victim):
    """Arms rank `victim` to SIGKILL itself in shrink, once the survivors agreed it is live
    and it starts connecting the new communicator."""
    if world.rank == victim:
        import comm.communicator

        def die(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)
        comm.communicator.connect = die


def test_rank_dies_during_shrink():
    c = Cluster(4, env={"COMM_TIMEOUT": "20"})
    try:
        pids = c.pids()
        c.run(_die_when_connecting, 1)
        c.submit(uid_sum_loop, 80, 0.01)
        time.sleep(0.5)
        os.kill(pids[3], signal.SIGKILL)
        out = c.collect([0, 2], 60)
    finally:
        c.kill()
        c.close()
    for r, (ok, value, _) in out.items():
        assert ok, value[1]
        ranks, shrinks, problems = value
        assert ranks == (0, 2) and problems == [], value
        assert [s[1] for s in shrinks] == [(0, 2)], shrinks


@pytest.mark.slow
def test_stopped_rank_is_excluded_and_gets_an_error_on_resume():
    """Rank 3 is SIGSTOPped: the survivors time out, shrink without it (declared failed at
    the timeout) and go on; resumed, rank 3 fails with Excluded and the survivors' sums stay
    exact while it runs again."""
    c = Cluster(4, env={"COMM_TIMEOUT": "1.5"})
    try:
        pids = c.pids()
        c.submit(uid_sum_loop, 10**6, 0.01, 7.0)
        time.sleep(0.5)
        os.kill(pids[3], signal.SIGSTOP)
        time.sleep(4.5)   # the survivors' all_reduce times out (1.5 s), then shrink's agreement (1.5 s)
        os.kill(pids[3], signal.SIGCONT)
        out = c.collect([0, 1, 2, 3], 30)
    finally:
        c.kill()
        c.close()
    for r in (0, 1, 2):
        ok, value, _ = out[r]
        assert ok, value[1]
        ranks, shrinks, problems = value
        assert ranks == (0, 1, 2) and problems == [], value
        # the first to time out revokes: the others may learn it that way
        assert [(s[0] in ("CommTimeout", "Revoked"), s[1]) for s in shrinks] == [(True, (0, 1, 2))], shrinks
    ok, value, _ = out[3]
    assert ok and value[0] == "shrink failed" and value[2] == "Excluded", value


def revoke_while_blocked(world):
    """Rank 1 revokes; ranks 0, 2, 3 are blocked in receives that do not involve it."""
    world.barrier()  # all start together: a rank started late would be blocked for less
    if world.rank == 1:
        time.sleep(0.3)
        world.revoke()
        world.revoke()   # idempotent
        blocked = None
    else:
        t = time.monotonic()
        try:
            world.recv(np.zeros(1), {0: 2, 2: 3, 3: 0}[world.rank])
            blocked = ("returned", 0)
        except comm.CommError as e:
            blocked = (type(e).__name__, time.monotonic() - t)
    try:
        world.barrier()
        later = "no error"
    except comm.CommError as e:
        later = type(e).__name__
    new = world.shrink()
    x = np.array([float(world.rank)])
    new.all_reduce(x)
    new.close()
    return blocked, later, new.size, new.rank, x[0], world.failed_ranks()


def test_revoke_wakes_every_rank_and_shrink_keeps_all():
    c = Cluster(4)
    try:
        out = c.run(revoke_while_blocked)
    finally:
        c.close()
    for r, (blocked, later, size, rank, total, failed) in enumerate(out):
        if r != 1:
            assert blocked[0] == "Revoked" and 0.2 < blocked[1] < 3, blocked
        assert later == "Revoked"
        assert (size, rank, total, failed) == (4, r, 6.0, [])


@pytest.mark.slow
def test_agree_with_a_rank_killed_mid_call():
    """100 agreements of 4 processes, each with a random one SIGKILLed at a random moment
    (rank 0, the store's host, among them): every survivor returns the same decision, the AND
    of the flags of the ranks it counts live, and only the victim may be counted failed."""
    # two helpers of 50 rounds side by side: a round mostly waits on its sockets and forks
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, HERE]))
    helpers = [subprocess.Popen([sys.executable, os.path.join(HERE, "elastic_agree.py"), "50"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=dict(env, SEED=str(seed))) for seed in (1, 2)]
    rounds = []
    for helper in helpers:
        out, err = helper.communicate(timeout=180)
        assert helper.returncode == 0, err[-3000:]
        rounds += [json.loads(line) for line in out.splitlines()]
    assert len(rounds) == 100
    host_killed = 0
    for rnd in rounds:
        victim, flags, decisions = rnd["victim"], rnd["flags"], rnd["decisions"]
        host_killed += victim == 0
        assert {r for r in range(4) if r != victim} <= set(map(int, decisions)), rnd
        first = next(iter(decisions.values()))
        assert all(d == first for d in decisions.values()), rnd
        assert set(first["failed"]) <= {victim}, rnd
        want = -1
        for r, f in enumerate(flags):
            if r not in first["failed"]:
                want &= f
        assert first["flag"] == want, rnd
    assert host_killed > 5   # the store's host died in a fair share of the rounds


def _resources():
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    with open("/proc/self/maps") as f:
        memfds = sum("memfd:" in line for line in f)
    return {"fds": len(os.listdir("/proc/self/fd")), "threads": len(os.listdir("/proc/self/task")),
            "memfds": memfds, "rss_kb": rss}


def join_address(world):
    return _current(world).join_address()


def grow_round(world, mode, steps):
    """grow by one (a joiner), check `steps` sums over the 4, then drop the joiner again: it
    crashed ("kill", shrink finds it gone) or left ("leave", shrink excludes it)."""
    c = _current(world)
    new = c.grow(1)
    problems = []
    if (new.size, new.rank, new.ranks[:3]) != (4, c.rank, c.ranks):
        problems.append(("grown", new.size, new.rank, new.ranks))
    uid = new.ranks[new.rank]
    for step in range(steps):
        x = np.array([(uid + 1) * 1000.0 + step])
        new.all_reduce(x)
        want = sum((u + 1) * 1000.0 + step for u in new.ranks)
        if x[0] != want:
            problems.append((step, x[0], want))
    shrunk = new.shrink() if mode == "kill" else new.shrink(exclude=[3])
    if shrunk.ranks != c.ranks:
        problems.append(("shrunk", shrunk.ranks))
    for old in (c, new):
        if old is not world:
            old.close()
    _STATE["comm"] = shrunk
    return problems, _resources()


@pytest.mark.slow
def test_grow_and_shrink_loop_without_leaks(monkeypatch):
    """3 ranks grow to 4 (a joiner), all_reduce, and shrink back, 22 times (alternately the
    joiner crashes and leaves); over the last 20, fds, threads, shared memory and memory stay
    flat. A stranger without the job's secret cannot take the joiner's place."""
    secret = "elastic-secret"
    c = Cluster(3, env={"COMM_TIMEOUT": "20", "COMM_SECRET": secret})
    joiners = subprocess.Popen([sys.executable, os.path.join(HERE, "elastic_joiner.py")],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                               env=dict(os.environ, COMM_SECRET=secret, COMM_TIMEOUT="20",
                                        PYTHONPATH=os.pathsep.join([ROOT, HERE])))
    try:
        c.run(_forget)
        usage = []
        for i in range(22):
            addresses = c.run(join_address)
            assert len(set(addresses)) == 1, addresses
            if i == 0:
                for wrong in (None, "not-the-secret"):
                    if wrong is None:
                        monkeypatch.delenv("COMM_SECRET", raising=False)
                    else:
                        monkeypatch.setenv("COMM_SECRET", wrong)
                    with pytest.raises(comm.CommError, match="refused"):
                        comm.join(addresses[0], timeout=5)
            mode = "kill" if i % 2 else "leave"
            joiners.stdin.write(json.dumps({"address": addresses[0], "mode": mode, "steps": 3}) + "\n")
            joiners.stdin.flush()
            results = c.run(grow_round, mode, 3)
            report = json.loads(joiners.stdout.readline())
            assert "error" not in report, report
            assert (report["rank"], report["size"], report["problems"]) == (3, 4, []), report
            assert report["ranks"][:3] == [0, 1, 2] and report["uid"] >= 3, report
            for problems, _ in results:
                assert problems == [], problems
            usage.append([r for _, r in results])
    finally:
        joiners.stdin.close()
        joiners.wait(timeout=30)
        c.close()
    first, last = usage[1], usage[-1]   # the first crash makes one lasting descriptor
    for before, after in zip(first, last):
        assert after["fds"] == before["fds"], (first, last)
        assert after["threads"] == before["threads"], (first, last)
        assert after["memfds"] == before["memfds"], (first, last)
        # the host keeps every round's bootstrap keys: about 10 KiB a round
        assert after["rss_kb"] - before["rss_kb"] < 2 << 10, (first, last)


@pytest.mark.slow
def test_elastic_ddp_example(tmp_path):
    """examples/elastic_ddp.py on 4 ranks, rank 2 SIGKILLed at step 20: the survivors shrink and
    a replacement joins; all four finish with identical parameters and the loss keeps falling."""
    pytest.importorskip("torch")
    run = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "elastic_ddp.py"), "--np", "4",
                          "--steps", "40", "--kill-rank", "2", "--kill-step", "20", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, COMM_TIMEOUT="60", PYTHONPATH=ROOT))
    assert run.returncode == 0, run.stderr[-3000:]
    _wait_for(str(tmp_path / "rank4.json"), 120)   # the replacement is not the launcher's child
    time.sleep(0.5)
    results = {}
    for uid in (0, 1, 3, 4):
        with open(tmp_path / f"rank{uid}.json") as f:
            results[uid] = json.load(f)
    assert not (tmp_path / "rank2.json").exists()
    assert sorted((r["rank"], r["size"]) for r in results.values()) == [(0, 4), (1, 4), (2, 4), (3, 4)]
    params = [r["params"] for r in results.values()]
    assert all(p == params[0] for p in params), "the ranks' parameters differ"
    losses = dict(results[0]["losses"])
    assert sorted(losses) == list(range(40))   # every step ran once on the survivors, 20 included
    before, after = np.mean([losses[s] for s in range(15, 20)]), np.mean([losses[s] for s in range(35, 40)])
    assert after < before < losses[0], losses
    assert results[4]["losses"][0][0] == 20 and results[4]["losses"] == results[0]["losses"][20:]


def _torch_group_after_kill(world, victim):
    """Rank `victim` dies; the survivors shrink: (the shrunk communicator, its torch group)."""
    world.barrier()   # torch imported everywhere (seconds on a loaded machine) before the clock of shrink runs
    if world.rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    # PeerFailure, or Revoked where the other survivor already began its shrink (which revokes)
    with pytest.raises((comm.PeerFailure, comm.Revoked)):
        world.all_reduce(np.ones(1))
    new = world.shrink()
    return new, comm.torch_group(new)


def _survivors_of(fn, victim=1):
    """fn(world, victim) on 3 ranks; the survivors' results, each checked to have succeeded."""
    pytest.importorskip("torch")
    c = Cluster(3, env={"COMM_TIMEOUT": "60"})   # torch's import alone can take seconds under load
    try:
        c.submit(fn, victim)
        out = c.collect([r for r in range(3) if r != victim], 120)
    finally:
        c.kill()
        c.close()
    for ok, value, _ in out.values():
        assert ok, value[1]
    return [value for _, value, _ in out.values()]


def ddp_after_shrink(world, victim):
    """Rank `victim` dies; the survivors shrink and train one DDP step on torch_group(shrunk)."""
    import torch
    new, pg = _torch_group_after_kill(world, victim)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=pg)
    ddp(torch.full((2, 4), float(new.rank + 1))).sum().backward()
    grads = [p.grad.tolist() for p in model.parameters()]
    pg.shutdown()
    return new.ranks, grads


def test_ddp_on_the_torch_group_of_a_shrunk_communicator():
    for value in _survivors_of(ddp_after_shrink):
        ranks, (weight, bias) = value
        # the input is 2 rows of (rank + 1): DDP averages 2 * 1 and 2 * 2 over the two survivors
        assert ranks == (0, 2) and weight == [[3.0] * 4] and bias == [2.0], value


def fsdp2_after_shrink(world, victim):
    """Rank `victim` dies; the survivors shrink and train FSDP2 (fully_shard over a device mesh
    of torch_group(shrunk)) for three steps."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    new, pg = _torch_group_after_kill(world, victim)
    mesh = DeviceMesh.from_group(pg, "cpu")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        model(torch.full((2, 4), float(new.rank + 1 + step))).sum().backward()
        opt.step()
        opt.zero_grad()
    full = [p.full_tensor().tolist() for p in model.parameters()]
    assert torch.distributed.get_world_size() == 2   # the shrunk group became torch's default
    torch.distributed.destroy_process_group()        # and torch's own teardown closes it
    assert new.session.closed
    return new.ranks, full


def fsdp2_reference(steps: int = 3):
    """The same training on one process, with the survivors' inputs averaged as FSDP2 does."""
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        loss = sum(model(torch.full((2, 4), float(r + 1 + step))).sum() for r in range(2)) / 2
        loss.backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().tolist() for p in model.parameters()]


@pytest.mark.slow
def test_fsdp2_on_the_torch_group_of_a_shrunk_communicator():
    results = _survivors_of(fsdp2_after_shrink)
    want = fsdp2_reference()
    for value in results:
        ranks, params = value
        assert ranks == (0, 2), value
        for got, expected in zip(params, want):
            np.testing.assert_allclose(np.array(got), np.array(expected), rtol=1e-5, atol=1e-6)
