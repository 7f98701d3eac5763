"""benchmarks/attention_kernels.py runs end to end on tiny shapes: every kernel, every cache dtype."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "attention_kernels.py"


def _load():
    spec = importlib.util.spec_from_file_location("attention_kernels_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_kernel_and_dtype_is_timed(tmp_path, capsys):
    out = tmp_path / "att.json"
    result = _load().main(["--dtypes", "auto,int8,fp8,fp8_e5m2", "--context", "37", "--new", "5", "--batch", "2",
                           "--heads", "6", "--kv-heads", "2", "--head-dim", "24", "--block-size", "4",
                           "--iters", "2", "--rounds", "1", "--torch", "--output-json", str(out)])  # fmt: skip
    assert {"decode-torch", "prefill-tiled", "prefill-gathered"} <= set(result)
    for per in result.values():
        assert set(per) == {"auto", "int8", "fp8", "fp8_e5m2"} and all(ms > 0 for ms in per.values())
    assert json.loads(out.read_text())["ms"] == result
    assert "| prefill-tiled |" in capsys.readouterr().out


def test_an_unknown_dtype_fails_before_timing():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        _load().main(["--dtypes", "int4", "--iters", "1", "--rounds", "1"])
