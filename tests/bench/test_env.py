"""The configuration block and the memory / machine helpers."""

from __future__ import annotations

import os

from perfxlm.bench import env as benv
from perfxlm.bench.common import sibling_path
from perfxlm.bench.latency import _run_isolated


def test_collect_and_format_env():
    import perfxlm

    e = benv.collect_env(None, command="bench x", batch_size=4)
    assert e["engine"] == "perfxlm" and e["engine_version"] == perfxlm.__version__
    assert e["cpu_model"] and e["torch_threads"] >= 1 and e["usable_cpus"] >= 1
    assert e["command"] == "bench x" and e["batch_size"] == 4
    text = benv.format_env(e)
    for key in ("engine_version", "torch_threads", "cpu_model", "batch_size"):
        assert key in text


def test_memory_and_peaks():
    assert 0 < benv.peak_rss_gib() < 1024
    current = benv.current_rss_gib()
    assert current is None or 0 < current <= benv.peak_rss_gib() + 1e-3
    assert benv.measure_memory_bandwidth_gbs(size_mib=8, repeats=1) > 0
    assert benv.measure_matmul_gflops("float32", n=64, repeats=1) > 0


def test_format_params():
    assert benv.format_params(134_515_008) == "135M"
    assert benv.format_params(1_235_814_400) == "1.2B"
    assert benv.format_params(7_000_000_000) == "7.0B"
    assert benv.format_params(336_288) == "336K"
    assert benv.format_params(0) == "?"


def test_isolated_run_uses_another_process():
    assert _run_isolated(os.getpid, {}) != os.getpid()


def test_sibling_path():
    assert sibling_path("out/r.json", ".png") == "out/r.png"
    assert sibling_path(None, ".png") is None
