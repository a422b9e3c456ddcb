"""Helper of test_elastic: forks one process per line of stdin ({"address", "mode", "steps"})
that joins the survivors through comm.join(address), runs `steps` all_reduces whose values
depend on the uids, and then leaves: "kill" exits without closing (as a crash), "leave"
closes first. Prints one JSON line per process: its uid, rank, size, ranks and problems.
Forking from one process that imported comm keeps a join cheap."""
import json
import os
import sys

import numpy as np

import comm


def joiner(request, out):
    new = comm.join(request["address"])
    uid = new.ranks[new.rank]
    problems = []
    for step in range(request["steps"]):
        x = np.array([(uid + 1) * 1000.0 + step])
        new.all_reduce(x)
        want = sum((u + 1) * 1000.0 + step for u in new.ranks)
        if x[0] != want:
            problems.append((step, x[0], want))
    os.write(out, (json.dumps({"uid": uid, "rank": new.rank, "size": new.size, "ranks": new.ranks,
                               "problems": problems}) + "\n").encode())
    if request["mode"] == "leave":
        new.close()


def main():
    for line in sys.stdin:
        request = json.loads(line)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                joiner(request, w)
                code = 0
            except BaseException as e:
                os.write(w, (json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n").encode())
            finally:
                os._exit(code)
        os.close(w)
        _, status = os.waitpid(pid, 0)
        report = os.read(r, 1 << 16).decode().strip() or json.dumps({"error": f"status {status}"})
        os.close(r)
        print(report, flush=True)


if __name__ == "__main__":
    main()
