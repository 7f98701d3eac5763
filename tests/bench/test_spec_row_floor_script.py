"""benchmarks/spec_row_floor.py: the instruction each tier's plan multiplies with is one dot_throughput.py
times, and the script prints a floor on this CPU from the roofline's multiply-adds (the default model's
counted here); benchmarks/spec_replay.py --row-slope charges steps by that share."""

from __future__ import annotations

import importlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def floor():
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("spec_row_floor")
    finally:
        sys.path.remove(str(BENCH))


def _resolved(isa, quantized=True, weight_dtype=torch.bfloat16, dot_width=512, bf16_dots=True, kv="bfloat16"):
    return SimpleNamespace(isa=isa, quantized_source="gguf" if quantized else None,
                           quant_activations="int8_native" if quantized else None, weight_dtype=weight_dtype,
                           cpu_plan=SimpleNamespace(dot_width=dot_width, bf16_dots=bf16_dots),
                           kv_cache_spec=SimpleNamespace(name=kv))


@pytest.mark.parametrize("isa", ["avx2", "avx_vnni", "avx512", "avx512_vnni", "avx512_bf16", "amx"])
def test_every_tier_names_an_instruction_the_table_times(floor, isa):
    from dot_throughput import KERNELS

    picks = {floor.linear_instruction(_resolved(isa)), floor.linear_instruction(_resolved(isa, dot_width=256)),
             floor.linear_instruction(_resolved(isa, quantized=False)),
             floor.linear_instruction(_resolved(isa, quantized=False, weight_dtype=torch.float32)),
             floor.attention_instruction(_resolved(isa)), floor.attention_instruction(_resolved(isa, kv="int8"))}
    assert picks <= set(KERNELS) and picks <= set(floor.MACS_PER_STEP)
    # only a tier with the instruction uses it
    assert ("vdpbf16ps zmm (AVX512-BF16)" in picks) == (isa in ("avx512_bf16", "amx"))
    assert any("zmm" in p for p in picks) == (isa.startswith("avx512") or isa == "amx")
    int8 = floor.linear_instruction(_resolved(isa))
    assert ("vpdpbusd" in int8) == (isa in ("avx_vnni", "avx512_vnni", "avx512_bf16", "amx"))


@pytest.mark.skipif(not (shutil.which("gcc") or shutil.which("cc")), reason="no C compiler on this machine")
def test_the_script_prints_a_floor(default_model):
    out = subprocess.run([sys.executable, str(BENCH / "spec_row_floor.py"), "--context", "24", "--steps", "4",
                          "--rounds", "1", "--iters", "20000", "--threads", "1"],
                         check=True, capture_output=True, text=True, cwd=BENCH).stdout
    share = re.search(r"costs at least ([\d.]+) ms = ([\d.]+)% of a step", out)
    assert share and float(share.group(1)) > 0 and float(share.group(2)) > 0, out
    assert re.search(r"--row-slope 0\.\d{3}", out), out
    # SmolLM2-135M: 30 layers of 576 x (576 + 2 x 192 + 576 + 3 x 1536) and a 49152-row head; 9 heads of 64
    assert "134.5 M multiply-adds" in out and f"{30 * 9 * 64 * 2 * 24 / 1e6:.1f} M multiply-adds" in out, out


def test_replay_charges_each_row_the_slope(tmp_path):
    prompt = list(range(100, 160))
    output = prompt[10:40]  # copied from the prompt: lookup guesses it after the first tokens
    outputs = tmp_path / "plain.json"
    outputs.write_text(json.dumps({"copy": [[prompt, output]]}))

    def speedup(slope: str) -> float:
        out = subprocess.run([sys.executable, str(BENCH / "spec_replay.py"), "--outputs", str(outputs),
                              "--rules", "oracle", "--row-slope", slope], check=True, capture_output=True,
                             text=True, cwd=BENCH).stdout
        return float(re.search(r"oracle: x([\d.]+)", out).group(1))

    free = speedup("0")
    assert free > 4  # rows free: every step takes the guesses and the token after them (up to 6)
    assert speedup("0.1") < free and speedup("1") <= 1.0  # a row costing a step: no speed-up at all
