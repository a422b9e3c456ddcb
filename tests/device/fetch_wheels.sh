#!/usr/bin/env bash
# Download, on a machine with network, the wheels tests/device/run.sh installs on the GPU machine
# (which has none): CPython 3.12, manylinux x86-64. The machine's image already has torch (CUDA 13),
# NCCL for CUDA 13, cuda-bindings and numpy; these are what it lacks. Everything lands in
# tests/device/wheels/ (git-ignored), carried to the machine with the working tree.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
mkdir -p wheels
get() { "$PY" -m pip download --quiet --no-deps --only-binary=:all: --platform manylinux_2_28_x86_64 \
            --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            --python-version 3.12 --implementation cp --dest wheels "$@"; }
# nccl4py without its extras: the image has the NCCL library and cuda-bindings; only its
# low-level bindings are used (not cutlass-dsl, which the cu13 extra would pull).
get "nccl4py>=0.5,<0.7" "cuda-core~=1.0" "cuda-pathfinder>=1.5.4,<2" packaging
# building the engine with --no-build-isolation: the build backend and its tools
get "scikit-build-core>=0.10" "nanobind>=2.0" pathspec cmake ninja
ls -la wheels
du -sh wheels
