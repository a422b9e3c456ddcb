"""Shared fixtures: persistent rank clusters, reused across tests and rebuilt after a failure."""
import os

import pytest

from harness import Cluster, leftover_dirs
from reference import HAVE_TORCH


def pytest_collection_modifyitems(config, items):
    """`pytest tests` runs the quick suite: tests marked slow (long real-process runs, soaks,
    many simulated hosts) run with `-m slow` (or any -m that selects them), or when named."""
    if config.option.markexpr or any("::" in a for a in config.args):
        return
    slow = [i for i in items if i.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [i for i in items if not i.get_closest_marker("slow")]


def pytest_sessionfinish(session, exitstatus):
    """Every Cluster removes its control directory once its ranks have started (harness.py):
    one left over means a path around that, and a full run would leave dozens in /tmp."""
    if leftover_dirs():
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    left = leftover_dirs()
    if left:
        terminalreporter.section("test cluster directories left behind", red=True)
        terminalreporter.write_line(f"{len(left)}, e.g. {left[:3]}: the run fails (tests/conftest.py)")


def pytest_report_header():
    if not HAVE_TORCH:
        return "torch is not installed: bfloat16 cases run as float16, torch tests are skipped"
    return None


@pytest.fixture(scope="session")
def cluster():
    """get(n, transport, launcher, env): a live cluster of that kind, reused. At most
    TEST_CLUSTERS_KEPT of them stay alive (default: all), the least recently used closed first:
    tests/sanitize.sh keeps few, as each of its ranks holds hundreds of MiB under ASan."""
    kept = int(os.environ.get("TEST_CLUSTERS_KEPT", "0")) or None
    clusters: dict = {}   # in order of last use

    def get(n: int, transport: str = "native", launcher: str = "spawn", env: dict | None = None):
        key = (n, transport, launcher, tuple(sorted((env or {}).items())))
        c = clusters.pop(key, None)
        if c is None or c.broken:
            if c is not None:
                c.close()
            while kept is not None and len(clusters) >= kept:
                clusters.pop(next(iter(clusters))).close()
            c = Cluster(n, transport, launcher=launcher, env=env)
        clusters[key] = c
        return c

    yield get
    for c in clusters.values():
        c.close()
