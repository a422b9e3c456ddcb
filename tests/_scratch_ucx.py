import numpy as np, time, sys
def f(world, mode):
    r, n = world.rank, world.size
    sub = world.split(r % 2, key=-r)
    x = np.full(5000, float(r))
    y = np.full(7000, float(r))
    if mode == "seq":
        sub.all_reduce(x); world.all_reduce(y)
    elif mode == "world-async":
        world.all_reduce(y, async_op=True).wait()
    elif mode == "sub-async":
        sub.all_reduce(x, async_op=True).wait(); world.all_reduce(y)
    else:
        w = sub.all_reduce(x, async_op=True); wy = world.all_reduce(y, async_op=True); w.wait(); wy.wait()
    return float(y[0])
