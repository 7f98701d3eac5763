"""benchmarks/make_dummy_gguf.py as a module: the GGUF writers tests use to lay out a transformers model
as llama.cpp's converter does (benchmarks/ is no package)."""

from __future__ import annotations

import functools
import importlib.util
import os

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@functools.cache
def converter():
    spec = importlib.util.spec_from_file_location("make_dummy_gguf", os.path.join(_ROOT, "benchmarks", "make_dummy_gguf.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
