"""The C++ engine's bindings (native/src/binding/binding.cc), compiled into the module beside this file.

A folder, not the bare compiled module in comm/, so that `from comm import _native` names a
source file that imports nothing of this library: read from the source, the engine is then
the leaf it is, and the vocabulary and transports that use it stand below comm/__init__.py
instead of in a circle with it (tests/test_imports.py). Where the engine was not built, the
import fails with ImportError, which its users turn into the reason a transport is missing.
"""
from ._native import *  # noqa: F401,F403  (every name the bindings define is public)
