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


def test_verification_rows_read_one_table_each_a_token_further(tmp_path):
    module = _load()
    args = module.argparse.Namespace(model_dtype="bfloat16", heads=6, kv_heads=2, head_dim=24, block_size=4,
                                     context=37, new=0, batch=2, rows=3)
    s = module.Setup("auto", args)
    assert s.query.shape[0] == 6 and s.tables.shape[0] == 6
    assert all(s.tables[i].equal(s.tables[i - i % 3]) for i in range(6))  # a sequence's rows share its table
    assert s.lens.tolist() == [35, 36, 37, 35, 36, 37]
    result = module.main(["--dtypes", "auto,int8", "--context", "37", "--new", "0", "--batch", "2", "--rows", "3",
                          "--heads", "6", "--kv-heads", "2", "--head-dim", "24", "--block-size", "4",
                          "--iters", "2", "--rounds", "1", "--torch"])  # fmt: skip
    assert all(ms > 0 for per in result.values() for ms in per.values())
    with pytest.raises(ValueError, match="--rows 40"):
        module.main(["--context", "37", "--rows", "40", "--iters", "1", "--rounds", "1"])
