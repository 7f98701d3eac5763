"""`bench serve` against a fake OpenAI-compatible streaming server on loopback."""

from __future__ import annotations

import json
import math

import pytest

from perfxlm.bench.datasets import SampleRequest
from perfxlm.bench.serve import api_url, arrival_offsets, completion_payload, run_serve_benchmark
from perfxlm.entrypoints.cli import main


def requests(n: int, out_len: int = 4) -> list[SampleRequest]:
    return [SampleRequest(f"prompt number {i}", 3, out_len) for i in range(n)]


class SpaceTokenizer:
    def encode(self, text, add_special_tokens=True):
        return text.split()


def test_streamed_timings_and_payload(fake_server):
    server = fake_server(first_delay=0.05, gap=0.02)
    result, records = run_serve_benchmark(server.base_url, "fake-model", requests(3, out_len=4), ignore_eos=True)
    assert result["completed"] == 3 and result["failed"] == 0
    assert result["total_input_tokens"] == 9 and result["total_output_tokens"] == 12  # from the usage chunk
    assert len(server.requests) == 4  # the initial test request, then the 3
    body = server.requests[-1]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 4 and body["model"] == "fake-model" and body["ignore_eos"] is True
    assert body["temperature"] == 0.0
    for rec in records:
        assert rec.success and rec.generated_text == " t0 t1 t2 t3"
        assert len(rec.itl) == 3  # one per chunk after the first; the usage chunk is not a token chunk
        assert 0.05 <= rec.ttft < 0.5
        # the server sleeps 20 ms between chunks; a busy machine may deliver two together, so only
        # their sum is bounded below
        assert all(0 <= x < 2.0 for x in rec.itl) and sum(rec.itl) >= 0.035
        assert rec.latency == pytest.approx(rec.ttft + sum(rec.itl))
    assert result["mean_tpot_ms"] == pytest.approx(
        sum((r.latency - r.ttft) / 3 for r in records) / 3 * 1000)
    assert result["mean_itl_ms"] >= 10 and result["mean_ttft_ms"] >= 50
    assert result["duration"] >= max(r.latency for r in records)
    assert result["request_throughput"] == pytest.approx(3 / result["duration"])
    assert result["output_lens"] == [4, 4, 4] and len(result["itls"]) == 3 and "generated_texts" not in result


def test_request_rate_schedule(fake_server):
    server = fake_server(first_delay=0.0, gap=0.0)
    n, rate = 8, 40.0
    result, records = run_serve_benchmark(server.base_url, "m", requests(n, 2), request_rate=rate, seed=3,
                                          initial_test=False)
    offsets = arrival_offsets(n, rate, 1.0, seed=3)
    for rec, offset in zip(records, offsets):
        assert rec.start_time == pytest.approx(offset, abs=0.03)
    assert result["request_rate"] == rate and result["burstiness"] == 1.0
    assert result["duration"] >= offsets[-1]


def test_max_concurrency(fake_server):
    server = fake_server(first_delay=0.02, gap=0.005)
    result, _ = run_serve_benchmark(server.base_url, "m", requests(5), max_concurrency=1, initial_test=False)
    assert result["completed"] == 5 and server.max_in_flight == 1 and result["max_concurrency"] == 1
    server2 = fake_server(first_delay=0.05, gap=0.005)
    run_serve_benchmark(server2.base_url, "m", requests(5), initial_test=False)
    assert server2.max_in_flight > 1  # rate inf: all at once


def test_counts_tokens_without_usage(fake_server):
    server = fake_server(send_usage=False)
    result, _ = run_serve_benchmark(server.base_url, "m", requests(2, 5), tokenizer=SpaceTokenizer(),
                                    goodput={"ttft": 10_000}, save_detailed=True)
    assert result["total_output_tokens"] == 10  # " t0 t1 t2 t3 t4" counted by the tokenizer
    assert result["request_goodput"] == pytest.approx(2 / result["duration"])
    assert result["generated_texts"] == [" t0 t1 t2 t3 t4"] * 2


def test_server_errors(fake_server):
    server = fake_server(status=500)
    with pytest.raises(ValueError, match="Initial test run failed"):
        run_serve_benchmark(server.base_url, "m", requests(2))
    result, records = run_serve_benchmark(server.base_url, "m", requests(2), initial_test=False)
    assert result["completed"] == 0 and result["failed"] == 2
    assert all("HTTP 500" in r.error for r in records)


def test_url_and_payload():
    assert api_url("http://h:1") == "http://h:1/v1/completions"
    assert api_url("http://h:1/") == "http://h:1/v1/completions"
    assert api_url("http://h:1/v1") == "http://h:1/v1/completions"
    ids = SampleRequest(None, 3, 7, [1, 2, 3])
    p = completion_payload("m", ids, extra_body={"top_k": 1})
    assert p["prompt"] == [1, 2, 3] and p["max_tokens"] == 7 and p["top_k"] == 1 and "ignore_eos" not in p


def test_cli_serve_random(fake_server, smol_tokenizer_dir, tmp_path, capsys):
    server = fake_server(first_delay=0.01, gap=0.002)
    out = tmp_path / "serve.json"
    assert main(["bench", "serve", "--base-url", server.base_url, "--tokenizer", smol_tokenizer_dir,
                 "--dataset", "random", "--num-prompts", "5", "--input-len", "16", "--output-len", "3",
                 "--request-rate", "inf", "--goodput", "ttft:5000", "tpot:5000", "--disable-tqdm",
                 "--output-json", str(out)]) == 0
    text = capsys.readouterr().out
    for label in ("engine_version", "cpu_model", "base_url", "Successful requests:", "Request goodput (req/s):",
                  "Mean TTFT (ms):", "P90 TPOT (ms):", "P99 ITL (ms):", "Median E2EL (ms):"):
        assert label in text, label
    data = json.loads(out.read_text())
    assert data["config"]["model"] == "fake-model"  # asked from /v1/models
    assert data["completed"] == 5 and data["total_output_tokens"] == 15
    assert data["request_goodput"] == pytest.approx(data["request_throughput"])
    for key in ("request_throughput", "output_throughput", "total_token_throughput", "mean_ttft_ms",
                "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "mean_itl_ms", "mean_e2el_ms",
                "p99_e2el_ms"):
        assert isinstance(data[key], float), key
    assert all(isinstance(b["prompt"], str) for b in server.requests)
    assert data["input_lens"] == [16] * 5  # random text re-encoding to 16 tokens
    with open(tmp_path / "serve.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_cli_serve_sharegpt(fake_server, sharegpt_samples, smol_tokenizer, smol_tokenizer_dir, tmp_path):
    server = fake_server(first_delay=0.0, gap=0.0)
    out = tmp_path / "serve.json"
    assert main(["bench", "serve", "--base-url", server.base_url + "/v1", "--model", "fake-model",
                 "--tokenizer", smol_tokenizer_dir, "--dataset", "sharegpt", sharegpt_samples,
                 "--num-prompts", "4", "--request-rate", "50", "--burstiness", "0.5", "--max-concurrency", "2",
                 "--metric-percentiles", "50,99", "--disable-tqdm", "--output-json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["completed"] == 4 and "p50_ttft_ms" in data and "p90_ttft_ms" not in data
    assert data["burstiness"] == 0.5 and data["max_concurrency"] == 2 and data["request_rate"] == 50
    from perfxlm.bench.datasets import sample_sharegpt

    expected = sample_sharegpt(sharegpt_samples, 4, smol_tokenizer, seed=0)
    # (the server may see them out of order: two in flight at once)
    assert sorted((b["prompt"], b["max_tokens"]) for b in server.requests[1:]) == \
        sorted((r.prompt, r.expected_output_len) for r in expected)
    assert data["input_lens"] == [r.prompt_len for r in expected]
    assert not math.isnan(data["mean_e2el_ms"])


def test_cli_serve_unreachable_server(capsys):
    import socket

    with socket.socket() as s:  # a loopback port that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--disable-tqdm"]) == 2
    assert "--model" in capsys.readouterr().err
