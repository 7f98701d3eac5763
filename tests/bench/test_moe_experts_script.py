"""benchmarks/moe_experts.py runs end to end on tiny shapes and reports both paths and their ratio."""

import importlib.util
import json
from pathlib import Path

import pytest

from perfxlm.ops import native

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "moe_experts.py"


@pytest.mark.parametrize(
    "weights", [["bf16"], ["int4"], ["int4", "--int8-blocks"], ["mxfp4", "--gpt-oss"], ["float32", "--gpt-oss"]]
)
def test_both_paths_are_timed(tmp_path, weights):
    if native.kernels() is None:
        pytest.skip("native kernels unavailable on this machine")
    spec = importlib.util.spec_from_file_location("moe_experts_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "moe.json"
    report = module.main(["--weights", *weights, "--experts", "5", "--top-k", "2", "--hidden", "64", "--inter", "96",
                          "--tokens", "1,7", "--rounds", "1", "--repeats", "2", "--threads", "1",
                          "--output-json", str(out)])  # fmt: skip
    assert [r["tokens"] for r in report["results"]] == [1, 7]
    assert all(r["native_ms"] > 0 and r["torch_ms"] > 0 and r["speedup"] > 0 for r in report["results"])
    assert all(r["same_bits"] for r in report["results"])  # the kernel's promise, on the benchmark's own inputs
    assert json.loads(out.read_text()) == report


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_the_layouts_are_timed(tmp_path, weights):
    """--layouts: the kernel on plain stacks against the same stacks in row groups."""
    if native.kernels() is None:
        pytest.skip("native kernels unavailable on this machine")
    spec = importlib.util.spec_from_file_location("moe_experts_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    report = module.main(["--weights", weights, "--int8-blocks", "--layouts", "--experts", "5", "--top-k", "2",
                          "--hidden", "64", "--inter", "96", "--tokens", "1,7", "--rounds", "1", "--repeats", "2",
                          "--threads", "1"])  # fmt: skip
    assert report["layouts"] and [r["tokens"] for r in report["results"]] == [1, 7]
    assert all(r["plain_ms"] > 0 and r["rows8_ms"] > 0 and r["cpu_speedup"] > 0 for r in report["results"])
