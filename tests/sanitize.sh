#!/usr/bin/env bash
# The engine under AddressSanitizer + UndefinedBehaviorSanitizer: builds it once more
# (-DCOMM_SANITIZE=ON, in build/asan, installed editable into the side environment
# build/asan-venv, which borrows the current environment's packages but not its engine) and
# runs the tests that drive the most engine code with real and with wrong arguments. Any
# out-of-bounds access, use after free or undefined behaviour aborts a rank, so its test fails.
#
#   tests/sanitize.sh [extra pytest arguments]     (with the project's venv active)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
VENV=build/asan-venv
purelib() { "$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv --without-pip "$VENV"
  # path lines only: every package directory of the main environment, not its editable engine
  "$PY" -c 'import sys; print("\n".join(p for p in sys.path if p and not p.startswith(sys.base_prefix)))' \
    > "$(purelib "$VENV/bin/python")/main-env.pth"
fi
# the build backend (no build isolation: the sanitizer flags go to this one build), in the
# main environment, which the side environment borrows
"$PY" -m pip install -q "scikit-build-core>=1.0" "nanobind>=2.0"
"$PY" -m pip --python "$VENV/bin/python" install -q --no-build-isolation --no-deps -e . \
  --config-settings=cmake.define.COMM_SANITIZE=ON --config-settings=build-dir=build/asan

# Python itself is not instrumented: the runtime must be loaded first, with the C++ runtime
# (whose exceptions ASan intercepts); Python's own allocations look like leaks to LeakSanitizer.
export LD_PRELOAD="$(g++ -print-file-name=libasan.so) $(g++ -print-file-name=libstdc++.so)"
# Each rank under ASan holds hundreds of MiB (shadow, quarantine): a smaller quarantine, and
# only the last few test clusters kept alive (tests/conftest.py), keep the run well inside a
# 24 GiB machine (with every cluster kept, the run peaked at 17 GiB and was once OOM-killed).
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:alloc_dealloc_mismatch=0:quarantine_size_mb=32
export TEST_CLUSTERS_KEPT=${TEST_CLUSTERS_KEPT:-3}
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
# The subset (a few minutes on 2 cores; everything runs about 5x slower under ASan): bad
# input at every layer and all_to_all on the wire (test_memory_safety, test_invalid_input),
# every native algorithm forced in turn on shared memory and TCP (test_forced_algorithm),
# the conformance suite's native all_to_all, reduce_scatter / all_gather and rooted
# collectives at 3 ranks, and the one-call path's async Works (whose ops the progress thread
# sees while their waiters run and free them); and the one-sided windows (test_window: puts,
# gets and signals over CMA, shm rings, TCP and UCX, refusals of out-of-range and hostile puts).
C=tests/test_conformance.py
V=tests/test_vcollectives.py
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
  tests/test_memory_safety.py tests/test_invalid_input.py \
  tests/test_native_algorithms.py::test_forced_algorithm \
  "$C::test_all_to_all[native-2]" "$C::test_all_to_all[native-3]" \
  "$C::test_reduce_scatter_all_gather[native-3]" "$C::test_broadcast_reduce_gather_scatter[native-3]" \
  "$V::test_lean_path_matches_the_full_path" "$V::test_all_to_all_lean_path_matches_the_full_path" \
  tests/test_window.py "$@"
