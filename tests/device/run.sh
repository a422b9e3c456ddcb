#!/usr/bin/env bash
# The device check, for a GPU machine without network (a few minutes in all):
#   tests/device/run.sh            install what the image lacks from tests/device/wheels/
#                                  (see fetch_wheels.sh), build the engine, run run.py
#   tests/device/run.sh --dry-run  no install, no build: run.py with this Python as it is
#                                  (on a machine without a GPU every check is NOT RUN)
# Exit status: run.py's (0 all ran checks passed, 1 a failure, 2 nothing could run), or 3
# when the install or the build failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
WHEELS=tests/device/wheels
step() { echo "== $*"; }

if [ "${1:-}" = "--dry-run" ]; then
    step "dry run: nothing installed or built; $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
else
    missing=()
    # distribution:module; cmake and ninja also count when the image has the program
    for pair in nccl4py:nccl.bindings.nccl cuda-core:cuda.core cuda-pathfinder:cuda.pathfinder \
                packaging:packaging scikit-build-core:scikit_build_core nanobind:nanobind \
                pathspec:pathspec cmake:cmake ninja:ninja; do
        dist=${pair%%:*} module=${pair#*:}
        if [ "$dist" = cmake ] || [ "$dist" = ninja ]; then
            command -v "$dist" >/dev/null && continue
        fi
        "$PY" -c "import $module" 2>/dev/null || missing+=("$dist")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        step "installing from $WHEELS: ${missing[*]}"
        "$PY" -m pip install --quiet --no-index --no-deps --find-links "$WHEELS" "${missing[@]}" \
            || { echo "FAIL install (run tests/device/fetch_wheels.sh where there is network)"; exit 3; }
    fi
    step "building the engine"
    t0=$SECONDS
    CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) timeout 240 "$PY" -m pip install --quiet --no-index \
        --no-build-isolation --no-deps -e . || { echo "FAIL build"; exit 3; }
    step "built in $((SECONDS - t0)) s"
fi
# run.py prints its summary itself when its budget runs out; the outer timeout is a last resort.
timeout -k 5 "$(( ${DEVICE_CHECK_BUDGET:-200} + 20 ))" "$PY" tests/device/run.py
