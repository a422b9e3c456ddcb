"""Imports flow one way, down the folders: the folders are the layers, and this test reads
them from the tree, not from a list of modules. From the ground up:

    comm/_native/    the engine's compiled module (imports none of ours)
    comm/core/       the vocabulary: errors, types, ops, buffers, config, log, gpu
    comm/bootstrap/  rendezvous, the store and its host, gathers, agreement, auth, limits, topology
    transports/      one module or folder per transport
    comm/            the API: the communicator and the features built on it, comm/torch/
    bench/           the benchmark suite

A module may import its own layer and those below it. Read from the source with `ast`,
nothing imported. Every import statement counts, at module level or inside a function: a lazy
import hides a circle, it does not remove it. Relative imports are resolved; `from pkg import
name` is an import of the module pkg.name when that is a module, else of pkg itself (its
__init__.py, which for `comm` imports everything).
"""
from __future__ import annotations

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("comm", "transports", "bench")
# The layers, bottom first: a module belongs to the deepest of these folders that holds it.
LAYERS = ("comm/_native", "comm/core", "comm/bootstrap", "transports", "comm", "bench")


def extensions(root: str) -> set[str]:
    """Compiled modules the build installs into our packages ("comm._native")."""
    with open(os.path.join(root, "native", "CMakeLists.txt")) as f:
        text = f.read()
    return {f"{dest.strip('/').replace('/', '.')}.{target}"
            for target, dest in re.findall(r"install\(TARGETS\s+(\w+)\s+LIBRARY\s+DESTINATION\s+(\S+?)\)", text)}


def modules(root: str) -> dict[str, str | None]:
    """Module name -> source file (None for a compiled module)."""
    found: dict[str, str | None] = {}
    for pkg in PACKAGES:
        for d, _, files in os.walk(os.path.join(root, pkg)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(d, f)
                    name = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                    found[name.removesuffix(".__init__")] = path
    for name in extensions(root) if os.path.exists(os.path.join(root, "native")) else ():
        found[name] = None
    return found


def imports(root: str) -> dict[str, dict[str, int]]:
    """Module -> {module it imports: line of the first such import}."""
    mods = modules(root)
    graph: dict[str, dict[str, int]] = {}
    for name, path in mods.items():
        graph[name] = {}
        if path is None:
            continue
        is_pkg = path.endswith("__init__.py")
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = name.split(".") if is_pkg else name.split(".")[:-1]
                    parts = parts[:len(parts) - (node.level - 1)]
                    base = ".".join(parts + ([base] if base else []))
                subs = [f"{base}.{a.name}" for a in node.names]
                targets = [t for t in subs if t in mods] + ([base] if any(t not in mods for t in subs) else [])
            else:
                continue
            for t in targets:
                while t and t not in mods:   # numpy.x -> nothing of ours; comm.x.y -> comm.x
                    t = t.rpartition(".")[0]
                if t and t != name:
                    graph[name].setdefault(t, node.lineno)
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(graph[w])))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def layer(module: str, compiled: set[str]) -> str:
    """The folder (of LAYERS) a module lives in; a compiled module's is its package's."""
    path = module.replace(".", "/")
    return max((f for f in LAYERS if path == f or path.startswith(f + "/")), key=len)


def _file(module: str, root: str) -> str:
    path = modules(root).get(module)
    return os.path.relpath(path, root) if path else module


def cycle_report(root: str) -> list[str]:
    graph = imports(root)
    lines = []
    for component in cycles(graph):
        lines.append(f"{len(component)} files import each other: "
                     + ", ".join(_file(m, root) for m in component))
        lines += [f"  {_file(m, root)}:{line} imports {t}" for m in component
                  for t, line in sorted(graph[m].items()) if t in component]
    return lines


def layer_report(root: str) -> list[str]:
    graph = imports(root)
    compiled = {m for m, path in modules(root).items() if path is None}
    return [f"{_file(m, root)}:{line}: {m} ({layer(m, compiled)}) imports {t} ({layer(t, compiled)}), "
            "a layer above it"
            for m, targets in sorted(graph.items()) for t, line in sorted(targets.items())
            if LAYERS.index(layer(t, compiled)) > LAYERS.index(layer(m, compiled))]


def test_no_import_cycle():
    report = cycle_report(ROOT)
    assert not report, "import cycles (lazy imports count):\n" + "\n".join(report)


def test_imports_flow_down_the_layers():
    assert all(os.path.isdir(os.path.join(ROOT, f)) for f in LAYERS), "a layer's folder is missing"
    report = layer_report(ROOT)
    assert not report, "\n".join(report)


def test_the_engine_module_is_known():
    # the CMake install rule is how the compiled module is found: a changed rule must not
    # silently turn the imports of it into imports of a package's __init__.py
    assert extensions(ROOT) == {"comm._native._native"}
    assert set(imports(ROOT)["comm._native"]) == {"comm._native._native"}


def _tree(tmp_path, files: dict[str, str]) -> str:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(tmp_path)


def test_a_lazy_circle_and_an_upward_import_are_found(tmp_path):
    """The checks themselves: a circle closed inside a function, through `from . import`, and
    a transport that asks the communicator, lazily, are both reported with file and line."""
    root = _tree(tmp_path, {
        "comm/__init__.py": "from .communicator import Communicator\n",
        "comm/core/config.py": "from .errors import InvalidArgument\n\ndef pick():\n    from transports import base\n",
        "comm/core/errors.py": "",
        "comm/communicator.py": "from .core import config\n",
        "transports/__init__.py": "",
        "transports/base.py": "from comm.core import config\n\ndef get():\n    from comm.communicator import connect\n",
        "bench/__init__.py": "import comm\nimport transports.base\n",
    })
    report = cycle_report(root)
    assert report[0] == "3 files import each other: comm/communicator.py, comm/core/config.py, transports/base.py"
    assert "  comm/core/config.py:4 imports transports.base" in report
    layers = layer_report(root)
    assert "comm/core/config.py:4: comm.core.config (comm/core) imports transports.base (transports), a layer above it" in layers
    assert any(line.startswith("transports/base.py:4: transports.base (transports) imports comm.communicator")
               for line in layers)
    assert not any(line.startswith("bench/") for line in layers)


def test_from_package_import_name_is_the_package(tmp_path):
    """`from comm import CommError` needs comm/__init__.py (which imports the communicator);
    `from comm.core import errors` only the module."""
    root = _tree(tmp_path, {
        "comm/__init__.py": "from .core.errors import CommError\nfrom .communicator import Communicator\n",
        "comm/core/errors.py": "",
        "comm/communicator.py": "from transports import base\n",
        "transports/__init__.py": "",
        "transports/base.py": "from comm.core import errors\n",
        "transports/mpi/__init__.py": "from comm import CommError\nfrom comm.core import errors\n",
    })
    graph = imports(root)
    assert graph["transports.base"] == {"comm.core.errors": 1}
    assert graph["transports.mpi"] == {"comm": 1, "comm.core.errors": 2}
    assert cycle_report(root) == []
    assert layer_report(root) == ["transports/mpi/__init__.py:1: transports.mpi (transports) imports comm (comm), a layer above it"]
