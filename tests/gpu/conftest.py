"""The GPU kernels' tests run on a CUDA device where torch sees one, and in Triton's interpreter on CPU
tensors everywhere else (the same kernels, executed op by op), so every machine checks them."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # must be set before the first @triton.jit runs (the decorator picks the interpreter at definition
    # time); tests/conftest.py sets it for the whole run, this keeps `pytest tests/gpu/...` alone right too
    os.environ.setdefault("TRITON_INTERPRET", "1")

if importlib.util.find_spec("triton") is None:
    collect_ignore_glob = ["test_*.py"]
    print("tests/gpu skipped: triton is not installed (pip install triton)")

DEVICE = "cuda" if HAS_CUDA else "cpu"


@pytest.fixture
def device() -> str:
    return DEVICE
