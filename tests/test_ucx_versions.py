"""The ucx transport on every UCX from the engine's floor up, whatever UCX it was built with.

Other wheels than this environment's libucx are installed into a folder of their own (pip
install --target, once per test session; skipped, saying why, where the download fails) and
put first on the ranks' PYTHONPATH: `import libucx` then loads that UCX, as it does in an
environment where another package (ucxx-cu12) chose the libucx version. A library older than
the floor, or of another major version, must be refused with a TransportUnavailable that names
the floor; no wheel that old exists, so a library that is nothing but ucp_get_version stands in
for it, found the way a system UCX is (RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY and the loader's
search path)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from harness import HERE, ROOT, run_ranks

from transports import base

pytestmark = pytest.mark.skipif(base.unavailable_reason("ucx") is not None,
                                reason=f"ucx: {base.unavailable_reason('ucx')}")

with open(os.path.join(ROOT, "pyproject.toml")) as f:
    PYPROJECT = f.read()
# The floor as pyproject.toml pins it for the [ucx] extra: "1.14".
FLOOR = re.search(r'^ucx = \["libucx-cu12>=(\d+\.\d+),<\d+"\]', PYPROJECT, re.M).group(1)
# The floor itself, and what ucxx-cu12 0.52 (ucx-py's successor) pins: installing it beside
# comm[ucx] moves libucx back to 1.21.
VERSIONS = [FLOOR, "1.21"]


@pytest.fixture(scope="session")
def ucx_wheels(tmp_path_factory):
    """version -> a folder holding that libucx-cu12 wheel, downloaded on first use."""
    folders: dict[str, str] = {}

    def get(version: str) -> str:
        if version not in folders:
            target = str(tmp_path_factory.mktemp(f"libucx-{version}"))
            done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile",
                                   "--disable-pip-version-check", "--target", target, f"libucx-cu12=={version}.*"],
                                  capture_output=True, text=True, timeout=600, check=False)
            if done.returncode != 0:
                pytest.skip(f"libucx-cu12=={version}.* cannot be installed here: {done.stderr.strip()[-500:]}")
            folders[version] = target
        return folders[version]

    return get


def _python_path(folder: str) -> str:
    return os.pathsep.join([folder, HERE, ROOT])


def collectives_and_messages(world, version):
    """all_reduce (inline and large payloads), all_to_all, send/recv and a window on the UCX of `version`."""
    from comm import _native
    from transports.ucx import UCXTransport
    problems, r, n = [], world.rank, world.size
    library = _native.net_library("ucx", UCXTransport.net_options())
    if not re.match(rf"UCX {re.escape(version)}\.\d+ \(.*\): supported", library):
        problems.append(f"rank {r}: the engine loaded {library}, not UCX {version}")
    for count in (100, 1 << 18):  # in the header's message; past the inline size (read or rendezvous)
        x = np.arange(count, dtype=np.float32) * (r + 1)
        world.all_reduce(x)
        if not (x == np.arange(count, dtype=np.float32) * n * (n + 1) / 2).all():
            problems.append(f"rank {r}: all_reduce of {count} wrong")
    block = 3000
    mine = np.concatenate([np.full(block, 100 * r + dst, np.int32) for dst in range(n)])
    got = np.zeros_like(mine)
    world.all_to_all(got, mine)
    if not (got == np.concatenate([np.full(block, 100 * src + r, np.int32) for src in range(n)])).all():
        problems.append(f"rank {r}: all_to_all wrong")
    peer = 1 - r
    for count in (64, 1 << 17):
        out = np.arange(count, dtype=np.float64) + r
        into = np.zeros(count)
        w = world.isend(out, peer, tag=7)
        world.recv(into, peer, tag=7)
        w.wait()
        if not (into == np.arange(count, dtype=np.float64) + peer).all():
            problems.append(f"rank {r}: recv of {count} from {peer} wrong")
    # a window over this UCX's RMA (COMM_WINDOW_RMA=1: rkeys, ucp_put_nbx / ucp_get_nbx)
    pool = np.zeros(1 << 16, np.uint8)
    with world.window(pool) as win:
        if win._tw.paths[peer] != "rma":
            problems.append(f"rank {r}: window reaches rank {peer} by {win._tw.paths[peer]}, not rma")
        win.put(peer, np.full(1 << 16, r + 1, np.uint8), signal=0)
        win.flush(peer)   # the get below reads what this put wrote
        win.wait_signal(0, 1, timeout=20)
        back = np.zeros(1 << 16, np.uint8)
        win.get(peer, back)
        win.flush()
        if not ((pool == peer + 1).all() and (back == r + 1).all()):
            problems.append(f"rank {r}: window put / get wrong")
    return problems


@pytest.mark.parametrize("version", VERSIONS)
def test_jobs_on_an_older_ucx(ucx_wheels, version):
    folder = ucx_wheels(version)
    env = {"PYTHONPATH": _python_path(folder)}
    env["COMM_WINDOW_RMA"] = "1"   # the window below over this UCX's RMA (rkeys, ucp_put_nbx / ucp_get_nbx)
    assert run_ranks(collectives_and_messages, 2, version, transport="ucx", env=env, timeout=120) == [[], []]


def test_doctor_names_the_ucx_and_its_range(ucx_wheels):
    folder = ucx_wheels(FLOOR)
    out = _run([sys.executable, "-m", "comm.doctor"], {"PYTHONPATH": _python_path(folder)})
    line = f"  libucp: UCX {FLOOR}."
    assert line in out, out
    assert re.search(rf"libucp: UCX {re.escape(FLOOR)}\.\d+ \({re.escape(folder)}/libucx/lib/libucp\.so[.0-9]*\): "
                     rf"supported \(the engine runs on UCX {re.escape(FLOOR)} or a newer 1\.x\)", out), out


STUB = "void ucp_get_version(unsigned* major, unsigned* minor, unsigned* release) { *major = %d; *minor = %d; *release = 7; }\n"


def _stub(folder, major: int, minor: int) -> str:
    """A folder with a libucp that says it is UCX major.minor.7, under the names UCX's loaders
    look for (the libucx wheel's system lookup: libucp.so; the engine's: libucp.so.0)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler (cc) to build a library that reports another UCX version")
    src = folder / "stub.c"
    src.write_text(STUB % (major, minor))
    lib = folder / "libucp.so.0"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True, timeout=60)
    shutil.copy(lib, folder / "libucp.so")  # a copy, not a link: the engine's own load is libucp.so.0
    return str(folder)


INIT = """
import comm
try:
    comm.init(rank=0, world_size=1, master_addr="127.0.0.1", master_port=comm.bootstrap.rendezvous.free_port(), transport="ucx")
except comm.TransportUnavailable as e:
    print("unavailable:", e)
"""


def _run(argv, env) -> str:
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, **env})
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.parametrize("kind", ["older than the floor", "another major version"])
def test_unsupported_ucx_is_refused_naming_the_floor(tmp_path, kind):
    major, minor = map(int, FLOOR.split("."))
    version = (major, minor - 1) if kind == "older than the floor" else (major + 1, 0)
    folder = _stub(tmp_path, *version)
    env = {"RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY": "true",
           "LD_LIBRARY_PATH": os.pathsep.join([folder, os.environ.get("LD_LIBRARY_PATH", "")])}
    found = f"UCX {version[0]}.{version[1]}.7 ({folder}/libucp.so.0)"
    why = (f"{found} is not supported: the engine runs on UCX {FLOOR} or a newer 1.x "
           f"(pip install 'libucx-cu12>={FLOOR},<{major + 1}')")
    out = _run([sys.executable, "-c", INIT], env)
    assert f"unavailable: [rank 0] init: transport 'ucx' cannot run here: {why}" in out, out
    assert f"  libucp: {why}" in _run([sys.executable, "-m", "comm.doctor"], env)


def test_the_floor_is_declared_alike():
    """The engine's floor (ucx_library.h), the [ucx] extra and the build requirement say one version."""
    from comm import _native
    from transports.ucx import UCXTransport
    library = _native.net_library("ucx", UCXTransport.net_options())
    assert f"the engine runs on UCX {FLOOR} or a newer 1.x" in library, library
    requires = re.search(r"^requires = \[(.*?)\]", PYPROJECT, re.M | re.S).group(1)
    assert f'"libucx-cu12>={FLOOR},<2;' in requires, requires
