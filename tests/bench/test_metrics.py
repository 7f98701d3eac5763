"""Serving metric arithmetic against hand-computed values (vLLM's definitions)."""

from __future__ import annotations

import pytest

from perfxlm.bench.metrics import (
    RequestRecord,
    calculate_metrics,
    format_serving_result,
    offline_throughput,
    parse_goodput,
    percentile_key,
    record_from_chunks,
    summarize,
)


def fake_run():
    """Three requests, sent at 100.0 and 100.1 s (and one that failed), run of 1 s.

    A: chunks at 100.20, 100.25, 100.35, 100.40; usage says 5 tokens (a chunk carried two).
       TTFT 200 ms, ITLs 50/100/50 ms, E2EL 400 ms, TPOT (400-200)/(5-1) = 50 ms.
    B: chunks at 100.60, 100.70; 2 tokens. TTFT 500 ms, ITL 100 ms, E2EL 600 ms, TPOT 100 ms.
    C: no chunk (failed)."""
    a = record_from_chunks(100.0, [100.20, 100.25, 100.35, 100.40], prompt_len=10,
                           texts=["a", "b", "", "c"], output_tokens=5, run_start=100.0)
    b = record_from_chunks(100.1, [100.60, 100.70], prompt_len=20, texts=["x", "y"], output_tokens=2, run_start=100.0)
    c = record_from_chunks(100.2, [], prompt_len=30, run_start=100.0)
    return [a, b, c]


def test_record_from_chunks():
    a, b, c = fake_run()
    assert a.success and a.ttft == pytest.approx(0.2) and a.latency == pytest.approx(0.4)
    assert a.itl == pytest.approx([0.05, 0.10, 0.05])
    assert a.generated_text == "abc" and a.start_time == 0.0
    assert b.itl == pytest.approx([0.1]) and b.start_time == pytest.approx(0.1)
    assert not c.success and "TTFT" in c.error


def test_calculate_metrics_hand_computed():
    m = calculate_metrics(fake_run(), duration_s=1.0, percentiles=(90, 99))
    assert m["completed"] == 2 and m["failed"] == 1
    assert m["total_input_tokens"] == 30  # the failed request's prompt does not count
    assert m["total_output_tokens"] == 7
    assert m["request_throughput"] == pytest.approx(2.0)
    assert m["output_throughput"] == pytest.approx(7.0)
    assert m["total_token_throughput"] == pytest.approx(37.0)
    assert m["request_goodput"] is None
    # TTFT: 200, 500 ms
    assert m["mean_ttft_ms"] == pytest.approx(350)
    assert m["median_ttft_ms"] == pytest.approx(350)
    assert m["std_ttft_ms"] == pytest.approx(150)
    assert m["p90_ttft_ms"] == pytest.approx(200 + 0.90 * 300)
    assert m["p99_ttft_ms"] == pytest.approx(200 + 0.99 * 300)
    # TPOT: 50, 100 ms
    assert m["mean_tpot_ms"] == pytest.approx(75)
    assert m["median_tpot_ms"] == pytest.approx(75)
    assert m["p99_tpot_ms"] == pytest.approx(50 + 0.99 * 50)
    # ITL: every gap of every request: 50, 100, 50, 100 ms
    assert m["mean_itl_ms"] == pytest.approx(75)
    assert m["median_itl_ms"] == pytest.approx(75)
    assert m["p90_itl_ms"] == pytest.approx(100)
    assert m["std_itl_ms"] == pytest.approx(25)
    # E2EL: 400, 600 ms
    assert m["mean_e2el_ms"] == pytest.approx(500)
    assert m["p90_e2el_ms"] == pytest.approx(580)
    assert m["p99_e2el_ms"] == pytest.approx(598)


def test_duration_scales_throughputs():
    m = calculate_metrics(fake_run(), duration_s=4.0)
    assert m["request_throughput"] == pytest.approx(0.5)
    assert m["output_throughput"] == pytest.approx(7 / 4)
    assert m["mean_ttft_ms"] == pytest.approx(350)  # latencies do not depend on the duration


@pytest.mark.parametrize("slos, good", [
    ({"ttft": 300}, 1),              # A (200) meets it, B (500) does not
    ({"ttft": 500}, 2),              # equal to the SLO counts as met
    ({"tpot": 60}, 1),
    ({"ttft": 600, "tpot": 90}, 1),  # B fails on TPOT (100)
    ({"e2el": 700}, 2),
    ({"e2el": 100}, 0),
])
def test_goodput(slos, good):
    m = calculate_metrics(fake_run(), duration_s=2.0, goodput=slos)
    assert m["request_goodput"] == pytest.approx(good / 2.0)


def test_one_token_request_tpot():
    """A one-token request has no TPOT (left out of the TPOT stats) but counts TPOT 0 for goodput."""
    one = record_from_chunks(0.0, [0.3], prompt_len=4, output_tokens=1)
    two = record_from_chunks(0.0, [0.1, 0.3], prompt_len=4, output_tokens=2)
    m = calculate_metrics([one, two], 1.0, goodput={"tpot": 1})
    assert m["mean_tpot_ms"] == pytest.approx(200)  # only `two`
    assert m["request_goodput"] == pytest.approx(1.0)  # `one` meets it with TPOT 0, `two` does not
    assert m["mean_itl_ms"] == pytest.approx(200)


def test_output_tokens_from_tokenizer_when_no_usage():
    rec = record_from_chunks(0.0, [0.1, 0.2, 0.4], prompt_len=3, texts=["one two", " three", " four"])
    m = calculate_metrics([rec], 1.0, count_tokens=lambda text: len(text.split()))
    assert m["total_output_tokens"] == 4
    assert m["mean_tpot_ms"] == pytest.approx((400 - 100) / 3)
    with pytest.raises(ValueError, match="usage"):
        calculate_metrics([rec], 1.0)


def test_empty_lists_count_as_zero():
    m = calculate_metrics([RequestRecord(prompt_len=5, error="boom")], 1.0)
    assert m["completed"] == 0 and m["failed"] == 1 and m["total_input_tokens"] == 0
    assert m["mean_ttft_ms"] == 0 and m["p99_itl_ms"] == 0


def test_names_and_formats():
    assert percentile_key(99) == "p99" and percentile_key(99.9) == "p99.9" and percentile_key(50.0) == "p50"
    s = summarize([1.0, 2.0, 3.0], "x", (50,), scale=1.0, unit="s")
    assert s == {"mean_x_s": 2.0, "median_x_s": 2.0, "std_x_s": pytest.approx((2 / 3) ** 0.5), "p50_x_s": 2.0}
    m = calculate_metrics(fake_run(), 1.0, percentiles=(50, 99.9), goodput={"ttft": 300})
    assert "p50_ttft_ms" in m and "p99.9_e2el_ms" in m
    text = format_serving_result(m, (50, 99.9))
    for label in ("Successful requests:", "Request throughput (req/s):", "Request goodput (req/s):",
                  "Output token throughput (tok/s):", "Mean TTFT (ms):", "P99.9 E2EL (ms):", "Median ITL (ms):"):
        assert label in text


def test_parse_goodput():
    assert parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 500.0, "tpot": 50.0}
    assert parse_goodput(["e2el:1.5"]) == {"e2el": 1.5}
    assert parse_goodput(None) == {}
    for bad in (["ttft"], ["itl:5"], ["ttft:abc"], ["ttft:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_offline_throughput():
    r = offline_throughput(2.0, num_requests=10, prompt_tokens=1000, output_tokens=500)
    assert r["requests_per_second"] == 5.0 and r["request_throughput"] == 5.0
    assert r["tokens_per_second"] == 750.0 and r["total_token_throughput"] == 750.0
    assert r["output_tokens_per_second"] == 250.0 and r["output_throughput"] == 250.0
    assert r["total_num_tokens"] == 1500
    with pytest.raises(ValueError):
        offline_throughput(0.0, 1, 1, 1)
