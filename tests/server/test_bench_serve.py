"""`perfxlm bench serve` against a real `perfxlm serve` on loopback."""

import json
import os

from perfxlm.entrypoints.cli import main

SHAREGPT = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "datasets",
                        "sharegpt_samples_1024.json")


def test_bench_serve_against_perfxlm_serve(server, tmp_path):
    out = tmp_path / "serve.json"
    png = tmp_path / "serve.png"
    args = ["bench", "serve", "--base-url", server.url, "--num-prompts", "12", "--request-rate", "8",
            "--max-concurrency", "8", "--output-json", str(out), "--output-png", str(png), "--disable-tqdm",
            "--goodput", "ttft:5000", "tpot:500", "--ignore-eos"]
    if os.path.isfile(SHAREGPT):
        args += ["--dataset", "sharegpt", SHAREGPT, "--sharegpt-output-len", "16"]
    else:
        args += ["--dataset", "random", "--input-len", "32", "--output-len", "16"]
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 12 and result["failed"] == 0
    for key in ("request_throughput", "output_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
                "mean_tpot_ms", "mean_itl_ms", "mean_e2el_ms"):
        assert result[key] > 0, key
    assert result["total_output_tokens"] == 12 * 16
    assert png.stat().st_size > 1000
    server.wait_idle()
