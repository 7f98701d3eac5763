"""`perfxlm eval quant-table`: every weight format side by side."""

from __future__ import annotations

import json

import pytest

from perfxlm.eval.quant_table import FLOAT_FORMATS, GGUF_FORMATS, default_formats, markdown, weight_footprint
from tests.cli_cases import run_cli_cases
from tests.conftest import default_model_or_skip


@pytest.mark.parametrize("quantization, bits", [(None, 32), ("int8", 8), ("int4", 4)])
def test_footprint_counts_each_weight_once(tiny_llama, quantization, bits):
    from perfxlm import LLM

    llm = LLM(tiny_llama, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=32, quantization=quantization)
    model = llm.llm_engine.core.model
    count, size = weight_footprint(model)
    # 3 layers of q, k, v, o, gate, up, down plus the embedding, which the head shares
    hidden, inter, kv = 96, 192, 2 * 16
    per_layer = hidden * (hidden + 2 * kv) + hidden * hidden + 3 * hidden * inter
    assert count == 3 * per_layer + 1000 * hidden
    # the embedding: float32, or 8-bit codes with a float32 scale and min per 64 under every format
    table = 1000 * hidden * (4 if quantization is None else 1 + 8 / 64)
    linears = size - table
    assert 3 * per_layer * bits / 8 <= linears <= 3 * per_layer * bits / 8 * 1.5  # codes, then scales


def test_default_formats_follow_the_file(tiny_llama):
    assert default_formats(tiny_llama, "auto") == FLOAT_FORMATS
    model = default_model_or_skip()  # a Q4_1 GGUF
    assert default_formats(model, "auto") == GGUF_FORMATS


def test_cli_tabulates_the_formats(tmp_path):
    model = default_model_or_skip()
    text = tmp_path / "text.txt"
    text.write_text("The river runs past the old mill and under the stone bridge into the town. " * 40)
    out = tmp_path / "table.json"
    # the table and a refusal in one process (tests/cli_cases.py), each with its own exit status and
    # output: a second process spent ~3 s of CPU importing torch and the engine to refuse a format
    r, bad = run_cli_cases(
        ["eval", "quant-table", model, "-f", str(text), "-c", "128", "--chunks", "2", "--decode-tokens", "4",
         "--threads", "2", "--output-json", str(out), "--plot", str(tmp_path / "table.png"),
         "--markdown", str(tmp_path / "table.md")],
        ["eval", "quant-table", model, "-f", str(text), "--formats", "int3"],
        timeout=1200)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [row["quantization"] for row in rows] == list(GGUF_FORMATS)
    stored, dequantized = rows
    assert 4.5 < stored["bits_per_weight"] < 9 and dequantized["bits_per_weight"] >= 15.9
    assert stored["weights_mib"] < dequantized["weights_mib"]
    for row in rows:
        assert 0 <= row["kld_mean"] < 0.05 and row["decode_tok_s"] > 0 and row["ppl"] > 1
    assert "| format | bits/weight |" in r.stdout and (tmp_path / "table.png").stat().st_size > 10_000
    assert (tmp_path / "table.md").read_text().startswith("| format |")
    assert bad.returncode == 2 and "int3" in bad.stderr


def test_markdown_row():
    from perfxlm.eval.quant_table import QuantRow

    row = QuantRow("int4", "int4", 4.56, 80.0, 10.5, 3.2, 0.0123, 0.0004, 0.09, 91.5, float("nan"))
    table = markdown([row])
    assert table.splitlines()[-1] == "| int4 | 4.56 | 80.0 | 10.5000 | +3.20 % | 0.01230 ± 0.00040 | 0.0900 | 91.50 % |  |"
