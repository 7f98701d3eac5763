"""The achieved-vs-peak arithmetic of `perfxlm bench latency --machine-peaks`, by hand."""

import pytest

from perfxlm.bench.roofline import achieved, format_achieved


def test_achieved_fractions_by_hand():
    costs = {
        "weight_bytes_per_step": 1.0e9,  # 1 GB of weights
        "matmul_params_per_token": 1.0e8,
        "lm_head_params": 1.0e7,
        "kv_bytes_per_token": 1000.0,
        "attn_flops_per_pair": 10.0,
    }
    result = {"batch_size": 2, "input_len": 100, "output_len": 50,
              "median_decode_step_ms": 100.0, "median_prefill_ms": 2000.0}
    peaks = {"read_bandwidth_gbs": 20.0, "matmul_gflops_float32": 100.0}
    a = achieved(costs, result, peaks, "float32")
    # decode: 1e9 + 2 sequences x (100 + 25) mean context x 1000 B = 1.00025e9 B in 0.1 s
    assert a["decode_bytes_per_step"] == pytest.approx(1.00025e9)
    assert a["decode_achieved_gbs"] == pytest.approx(10.0025)
    assert a["decode_bandwidth_fraction"] == pytest.approx(10.0025 / 20)
    # prefill: 2 x 1e8 x 200 tokens + 2 x 1e7 x 2 rows + 10 x 2 x 100 x 101 / 2 pairs = 4.00402e10 FLOP in 2 s
    assert a["prefill_flops"] == pytest.approx(4.0e10 + 4.0e7 + 101000)
    assert a["prefill_achieved_gflops"] == pytest.approx(a["prefill_flops"] / 2 / 1e9)
    assert a["prefill_gemm_fraction"] == pytest.approx(a["prefill_achieved_gflops"] / 100)
    text = format_achieved(a, peaks, "float32")
    assert "GB/s read bandwidth (50 %)" in text and "float32 GEMM (20 %)" in text


def test_without_peaks_reports_rates_only():
    costs = {"weight_bytes_per_step": 1e6, "matmul_params_per_token": 1e5, "lm_head_params": 0.0,
             "kv_bytes_per_token": 0.0, "attn_flops_per_pair": 0.0}
    result = {"batch_size": 1, "input_len": 10, "output_len": 1, "median_decode_step_ms": float("nan"),
              "median_prefill_ms": 1.0}
    a = achieved(costs, result, {}, "float32")
    assert "decode_achieved_gbs" not in a and "prefill_gemm_fraction" not in a
    assert a["prefill_achieved_gflops"] == pytest.approx(2e6 / 1e-3 / 1e9)
