"""Serving metrics from per-request records, with vLLM's definitions and JSON names
(`benchmarks/benchmark_serving.py::calculate_metrics`). Pure functions: no clock, no I/O.

Per successful request, from the client's clock:
- TTFT  = time of the first streamed chunk with a choice - time the request was sent;
- ITL   = the gaps between consecutive such chunks (one per chunk after the first; a chunk may
          carry several tokens, so ITL is per chunk, not per token);
- E2EL  = time of the last such chunk - time the request was sent;
- TPOT  = (E2EL - TTFT) / (output tokens - 1), for requests with more than one output token.
Over the run (duration = first send to last completion):
- request_throughput = successful requests / duration;
- output_throughput = output tokens / duration; total_token_throughput = (input + output) / duration;
- request_goodput = requests meeting every SLO given (ttft, tpot, e2el in ms; a request with one
  output token counts TPOT 0) / duration.
Each of ttft, tpot, itl, e2el is summarised as mean_, median_, std_ and p{P}_ ..._ms, percentiles by
numpy's linear interpolation; an empty list counts as 0, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
DEFAULT_PERCENTILES = (90.0, 99.0)


@dataclass
class RequestRecord:
    """What the client saw of one request (vLLM's RequestFuncOutput). Times in seconds."""

    prompt_len: int = 0
    success: bool = False
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0  # E2EL
    output_tokens: int | None = None  # from the server's usage, when it sends one
    generated_text: str = ""
    error: str = ""
    start_time: float = 0.0  # when it was sent, relative to the start of the run


def record_from_chunks(
    send_time: float,
    chunk_times: Sequence[float],
    prompt_len: int = 0,
    texts: Sequence[str] | None = None,
    output_tokens: int | None = None,
    run_start: float | None = None,
) -> RequestRecord:
    """A record from the arrival times of the chunks that carried a choice (not the usage-only one)."""
    rec = RequestRecord(prompt_len=prompt_len, output_tokens=output_tokens)
    rec.start_time = send_time - run_start if run_start is not None else 0.0
    rec.generated_text = "".join(texts or ())
    if not chunk_times:
        rec.error = "Never received a valid chunk to calculate TTFT."
        return rec
    rec.success = True
    rec.ttft = chunk_times[0] - send_time
    rec.itl = [b - a for a, b in zip(chunk_times, chunk_times[1:])]
    rec.latency = chunk_times[-1] - send_time
    return rec


def parse_goodput(specs: Iterable[str] | None) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for spec in specs or ():
        for item in spec.split():
            name, sep, value = item.partition(":")
            name = name.strip().lower()
            if not sep or name not in GOODPUT_METRICS:
                raise ValueError(f"--goodput takes NAME:MS with NAME in {', '.join(GOODPUT_METRICS)}; got {item!r}.")
            try:
                ms = float(value)
            except ValueError:
                raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds.") from None
            if ms < 0:
                raise ValueError(f"--goodput {item!r}: the SLO must be >= 0 ms.")
            slos[name] = ms
    return slos


def percentile_key(p: float) -> str:
    """vLLM's spelling: 99 -> "p99", 99.9 -> "p99.9"."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def summarize(values: Sequence[float], name: str, percentiles: Sequence[float] = DEFAULT_PERCENTILES,
              scale: float = 1000.0, unit: str = "ms") -> dict[str, float]:
    """mean_/median_/std_/p{P}_{name}_{unit} of `values` times `scale` (seconds -> ms by default)."""
    arr = np.asarray(values if len(values) else [0.0], dtype=np.float64)
    out = {
        f"mean_{name}_{unit}": float(np.mean(arr)) * scale,
        f"median_{name}_{unit}": float(np.median(arr)) * scale,
        f"std_{name}_{unit}": float(np.std(arr)) * scale,
    }
    for p in percentiles:
        out[f"{percentile_key(p)}_{name}_{unit}"] = float(np.percentile(arr, p)) * scale
    return out


def output_lengths(records: Sequence[RequestRecord], count_tokens: Callable[[str], int] | None = None) -> list[int]:
    """Output tokens per request: the server's usage count, else the tokenizer's count of the text
    (which may differ slightly), else 0 for a failed request."""
    lens = []
    for rec in records:
        if not rec.success:
            lens.append(0)
        elif rec.output_tokens is not None:
            lens.append(int(rec.output_tokens))
        elif count_tokens is not None:
            lens.append(int(count_tokens(rec.generated_text)))
        else:
            raise ValueError("the server sent no usage, and no tokenizer was given to count output tokens.")
    return lens


def calculate_metrics(
    records: Sequence[RequestRecord],
    duration_s: float,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
    goodput: Mapping[str, float] | None = None,
    count_tokens: Callable[[str], int] | None = None,
    selected_metrics: Sequence[str] = METRICS,
) -> dict[str, Any]:
    """The benchmark's numbers, keyed as in vLLM's result JSON."""
    if duration_s <= 0:
        raise ValueError(f"duration must be > 0, got {duration_s}.")
    out_lens = output_lengths(records, count_tokens)
    ttfts, tpots, all_tpots, itls, e2els = [], [], [], [], []
    total_input = completed = 0
    for rec, n_out in zip(records, out_lens):
        if not rec.success:
            continue
        completed += 1
        total_input += rec.prompt_len
        tpot = 0.0
        if n_out > 1:
            tpot = (rec.latency - rec.ttft) / (n_out - 1)
            tpots.append(tpot)
        all_tpots.append(tpot)  # goodput counts a one-token request's TPOT as 0
        itls.extend(rec.itl)
        ttfts.append(rec.ttft)
        e2els.append(rec.latency)

    good = 0
    if goodput:
        per_metric = {"ttft": ttfts, "tpot": all_tpots, "e2el": e2els}
        names = [n for n in GOODPUT_METRICS if n in goodput]
        for values in zip(*(per_metric[n] for n in names)):
            if all(v * 1000.0 <= goodput[n] for n, v in zip(names, values)):
                good += 1

    total_output = sum(out_lens)
    result: dict[str, Any] = {
        "duration": duration_s,
        "completed": completed,
        "failed": len(records) - completed,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": completed / duration_s,
        "request_goodput": good / duration_s if goodput else None,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
    }
    series = {"ttft": ttfts, "tpot": tpots, "itl": itls, "e2el": e2els}
    for name in selected_metrics:
        result.update(summarize(series[name], name, percentiles))
    return result


def per_request_series(records: Sequence[RequestRecord], out_lens: Sequence[int]) -> dict[str, list[float]]:
    """Per-request TTFT / TPOT / E2EL and all ITLs in ms, for plots."""
    ok = [(r, n) for r, n in zip(records, out_lens) if r.success]
    return {
        "ttft": [r.ttft * 1000 for r, _ in ok],
        "tpot": [(r.latency - r.ttft) / (n - 1) * 1000 for r, n in ok if n > 1],
        "itl": [x * 1000 for r, _ in ok for x in r.itl],
        "e2el": [r.latency * 1000 for r, _ in ok],
    }


def offline_throughput(elapsed_s: float, num_requests: int, prompt_tokens: int, output_tokens: int) -> dict[str, Any]:
    """Offline throughput, named as in vLLM's throughput JSON plus the serving names."""
    if elapsed_s <= 0:
        raise ValueError(f"elapsed time must be > 0, got {elapsed_s}.")
    total = prompt_tokens + output_tokens
    return {
        "elapsed_time": elapsed_s,
        "num_requests": num_requests,
        "total_input_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "total_num_tokens": total,
        "requests_per_second": num_requests / elapsed_s,
        "tokens_per_second": total / elapsed_s,
        "output_tokens_per_second": output_tokens / elapsed_s,
        "request_throughput": num_requests / elapsed_s,
        "total_token_throughput": total / elapsed_s,
        "output_throughput": output_tokens / elapsed_s,
    }


def format_serving_result(result: Mapping[str, Any], percentiles: Sequence[float] = DEFAULT_PERCENTILES,
                          selected_metrics: Sequence[str] = METRICS) -> str:
    """The result block vLLM prints, with the same labels."""
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]

    def row(label: str, value: Any, fmt: str = "<10.2f") -> None:
        lines.append(f"{label:<40} {value:{fmt}}" if isinstance(value, (int, float)) else f"{label:<40} {value}")

    row("Successful requests:", result["completed"], "<10")
    if result.get("failed"):
        row("Failed requests:", result["failed"], "<10")
    if result.get("max_concurrency") is not None:
        row("Maximum request concurrency:", result["max_concurrency"], "<10")
    row("Benchmark duration (s):", result["duration"])
    row("Total input tokens:", result["total_input_tokens"], "<10")
    row("Total generated tokens:", result["total_output_tokens"], "<10")
    row("Request throughput (req/s):", result["request_throughput"])
    if result.get("request_goodput") is not None:
        row("Request goodput (req/s):", result["request_goodput"])
    row("Output token throughput (tok/s):", result["output_throughput"])
    row("Total Token throughput (tok/s):", result["total_token_throughput"])
    titles = {"ttft": ("Time to First Token", "TTFT"), "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
              "itl": ("Inter-token Latency", "ITL"), "e2el": ("End-to-end Latency", "E2EL")}
    for name in selected_metrics:
        title, short = titles[name]
        lines.append("{s:{c}^50}".format(s=title, c="-"))
        row(f"Mean {short} (ms):", result[f"mean_{name}_ms"])
        row(f"Median {short} (ms):", result[f"median_{name}_ms"])
        for p in percentiles:
            pk = percentile_key(p)
            row(f"P{pk[1:]} {short} (ms):", result[f"{pk}_{name}_ms"])
    lines.append("=" * 50)
    return "\n".join(lines)
