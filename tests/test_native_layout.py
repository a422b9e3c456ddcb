"""The engine's folders (native/src/<part>/) and what each may include, read from the
`#include` lines (direct includes; nothing is compiled). The parts include each other's
headers both ways where the communicator holds what it runs (core/comm.h holds the channels,
core/engine.h the algorithms), so these are the rules that do hold, and that keep the parts
apart where it matters:

    core's vocabulary  core/common.h, op.h, topology.h: include nothing above them
    kernels/           the loops: kernels/ and the vocabulary only (no communicator)
    channels/          move bytes, know no collective: nothing of algorithms/, of core/ only
                       the vocabulary
    binding/           the only part that knows Python (nanobind, Python.h); nothing includes it

native/src/<part>/README.md says the same in words."""
from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "native", "src")
VOCABULARY = {"core/common.h", "core/op.h", "core/topology.h"}
INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)


def includes(src: str) -> dict[str, list[tuple[str, str]]]:
    """Source file (its path under src) -> its includes, as (kind, path): kind '"' or '<'."""
    found = {}
    for folder, _, files in os.walk(src):
        for name in files:
            if name.endswith((".h", ".cc", ".inc")):
                path = os.path.join(folder, name)
                with open(path) as f:
                    found[os.path.relpath(path, src)] = INCLUDE.findall(f.read())
    return found


def violations(src: str = SRC) -> list[str]:
    bad = []
    for source, incs in includes(src).items():
        part = source.split("/")[0]
        for kind, inc in incs:
            ours = kind == '"'
            if not ours:
                if (inc.startswith("nanobind/") or inc == "Python.h") and part != "binding":
                    bad.append(f"{source}: <{inc}> (only binding/ knows Python)")
                continue
            if inc.startswith("binding/") and part != "binding":
                bad.append(f'{source}: "{inc}" (nothing includes the binding)')
            if source in VOCABULARY and inc not in VOCABULARY:
                bad.append(f'{source}: "{inc}" (core\'s vocabulary includes nothing above it)')
            if part == "kernels" and not (inc.startswith("kernels/") or inc in VOCABULARY):
                bad.append(f'{source}: "{inc}" (kernels include kernels/ and core\'s vocabulary only)')
            if part == "channels" and (inc.startswith("algorithms/")
                                       or (inc.startswith("core/") and inc not in VOCABULARY)):
                bad.append(f'{source}: "{inc}" (channels know no collective and no communicator)')
    return bad


def test_every_part_is_a_folder():
    loose = [n for n in os.listdir(SRC) if os.path.isfile(os.path.join(SRC, n)) and n != "CMakeLists.txt"]
    assert loose == [], f"files directly in native/src (each belongs in a part's folder): {loose}"


def test_includes_keep_the_parts_apart():
    assert violations() == []


def test_an_upward_include_is_caught(tmp_path):
    """The check reads what it should: a channel that includes an algorithm, and Python, is named."""
    (tmp_path / "channels").mkdir()
    (tmp_path / "channels" / "x.cc").write_text('#include "algorithms/algorithms.h"\n#include <nanobind/nanobind.h>\n')
    bad = violations(str(tmp_path))
    assert len(bad) == 2 and all(b.startswith("channels/x.cc") for b in bad), bad
