"""The benchmark suite: `python -m bench`, nccl-tests conventions, several transports side by side.

    python -m bench --np 2 all_reduce -b 8 -e 64M -f 2 --transport native,mpi-raw,gloo
    mpirun -np 4 python -m bench all -b 8 -e 128M -f 2 --json out.json --plot out.png

Layout (each file does one thing):
    cli.py         flags (nccl-tests' -b -e -i -f -n -w -c -d -o -r -a -T, plus --transport,
                   --json, --plot, --np) and the loop over transports and benchmarks
    launch.py      who we are (mpirun / torchrun / srun / self-launch) and the control channel
    runners.py     how each library is called: one Runner interface (setup, operations,
                   teardown); this library's transports, gloo and mpi-raw
    benchmarks/    what is measured: one Benchmark per collective (a case: run, fill, check)
    measure.py     warmup, timed iterations after a barrier, the check, aggregation over ranks
    data.py        exactly predictable inputs and expected results (bit-exact #wrong)
    report.py      tables, the comparison table, JSON (schema documented there), PNG plot
    scale.py       `python -m bench.scale`: set-up at scale across simulated hosts (one rank:
                   scale_rank.py) and, with --model, the cost model of scale_model.py

Adding a benchmark (e.g. moe): one new module in bench/benchmarks/; see the docstring of
bench/benchmarks/__init__.py. Adding a library to compare against: one Runner subclass.
"""
