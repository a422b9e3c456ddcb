"""The GPU device check (tests/device/run.sh) as it behaves on a machine without a GPU: every
check is NOT RUN with its reason, the exit status says "nothing could run" (2), and a hang is
still reported with a summary by the watchdog."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_SH = os.path.join(ROOT, "tests", "device", "run.sh")


def _has_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


pytestmark = pytest.mark.skipif(_has_gpu(), reason="a GPU is present: run tests/device/run.sh itself")


def _run(*args, **env):
    return subprocess.run(["bash", RUN_SH, *args], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHON=sys.executable, **env))


@pytest.mark.slow
def test_dry_run_reports_every_check_not_run_with_its_reason():
    done = _run("--dry-run")
    out = done.stdout
    assert done.returncode == 2, out + done.stderr          # nothing could run: not a failure
    assert "dry run: nothing installed or built" in out
    assert "device check" in out and "torch" in out and "nccl4py" in out and "libnccl" in out   # header
    assert "FAIL" not in out
    not_run = [line for line in out.splitlines() if line.startswith("NOT RUN ")]
    assert len(not_run) >= 5 and all(": " in line and line.split(": ", 1)[1].strip() for line in not_run)
    assert "==== summary: 0 pass, 0 fail" in out


@pytest.mark.slow
def test_watchdog_reports_a_hang_with_stacks_and_summary():
    # a check that never ends comes first; the budget runs out in it
    done = _run("--dry-run", DEVICE_CHECK_BUDGET="5", DEVICE_CHECK_SELF_TEST="hang")
    out = done.stdout
    assert done.returncode == 1, out + done.stderr
    assert re.search(r"budget of \d+ s exhausted while running: self-test: a check that hangs", out), out
    assert "Thread" in out and "File" in out                 # faulthandler's stacks, via the section's process
    assert "==== summary" in out and "FAIL    self-test: a check that hangs" in out
    # the sections after it are reported, not lost
    assert out.count("NOT RUN ") >= 5, out
