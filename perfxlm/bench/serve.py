"""`perfxlm bench serve`: an OpenAI-API client that benchmarks any OpenAI-compatible server
(perfxlm, vLLM, llama.cpp's llama-server, ...) through streaming `/v1/completions`, the way vLLM's
benchmark_serving does:

- requests are sent on a schedule: all at once (--request-rate inf), or with gamma-distributed gaps
  of mean 1/rate and shape --burstiness (1 = a Poisson process; < 1 burstier, > 1 more regular),
  drawn from a fixed seed; --max-concurrency caps the requests in flight (the others wait);
- each request streams (`"stream": true`, usage asked for with `stream_options.include_usage`), and
  every chunk that carries a choice is timestamped on arrival: TTFT, ITL and E2EL come from those
  timestamps, output tokens from the server's usage (else the tokenizer's count of the text);
- one request is sent first, alone, to check the server answers (not counted);
- metrics (see perfxlm.bench.metrics), a JSON with configuration and results, and a PNG of the
  latency CDFs.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
import traceback
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from perfxlm.bench import env as benv
from perfxlm.bench.common import sibling_path, write_json
from perfxlm.bench.datasets import SampleRequest, check_dataset_path, load_requests, parse_dataset_arg
from perfxlm.bench.metrics import (
    METRICS,
    RequestRecord,
    calculate_metrics,
    format_serving_result,
    output_lengths,
    parse_goodput,
    per_request_series,
    record_from_chunks,
)

REQUEST_TIMEOUT_S = 6 * 60 * 60  # as vLLM: a slow server is measured, not cut off


# ---- arrivals ---------------------------------------------------------------------------------
def arrival_intervals(num: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """`num` gaps between consecutive sends: gamma(shape=burstiness, scale=1/(rate*burstiness)), mean
    1/rate; exponential (Poisson arrivals) for burstiness 1; zeros for an infinite rate."""
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}.")
    if not request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {request_rate}.")
    if math.isinf(request_rate):
        return np.zeros(num)
    theta = 1.0 / (request_rate * burstiness)
    return np.random.default_rng(seed).gamma(shape=burstiness, scale=theta, size=num)


def arrival_offsets(num: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """When each request is sent, in seconds from the start: the first at 0, then after each gap."""
    gaps = arrival_intervals(max(num - 1, 0), request_rate, burstiness, seed)
    return np.concatenate([[0.0], np.cumsum(gaps)])[:num]


async def dispatch(items: Sequence[Any], offsets: Sequence[float],
                   launch: Callable[[Any], Awaitable[Any]]) -> list[Any]:
    """Start launch(item) at start + offset for each item (absolute times: no drift), gather the results."""
    loop_start = time.perf_counter()
    tasks = []
    for item, offset in zip(items, offsets):
        delay = loop_start + float(offset) - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(launch(item)))
    return list(await asyncio.gather(*tasks))


# ---- one request --------------------------------------------------------------------------------
def api_url(base_url: str, endpoint: str = "/v1/completions") -> str:
    base = base_url.rstrip("/")
    if base.endswith("/v1") and endpoint.startswith("/v1/"):
        base = base[: -len("/v1")]
    return base + endpoint


def completion_payload(model: str, request: SampleRequest, ignore_eos: bool = False,
                       extra_body: dict[str, Any] | None = None) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": model,
        "prompt": request.prompt if request.prompt is not None else request.prompt_token_ids,
        "temperature": 0.0,
        "max_tokens": request.expected_output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        payload["ignore_eos"] = True
    if extra_body:
        payload.update(extra_body)
    return payload


def _headers() -> dict[str, str]:
    key = os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


async def stream_completion(session: Any, url: str, payload: dict[str, Any], prompt_len: int,
                            run_start: float | None = None) -> RequestRecord:
    """POST one streaming completion; timestamp each chunk that carries a choice."""
    chunk_times: list[float] = []
    texts: list[str] = []
    output_tokens = None
    send = time.perf_counter()
    try:
        async with session.post(url, json=payload, headers=_headers()) as response:
            if response.status != 200:
                body = (await response.text())[:500]
                rec = RequestRecord(prompt_len=prompt_len, error=f"HTTP {response.status} {response.reason}: {body}")
                rec.start_time = send - run_start if run_start is not None else 0.0
                return rec
            async for raw in response.content:
                line = raw.strip()
                if not line or line.startswith(b":"):
                    continue  # SSE keep-alive / comment
                if line.startswith(b"data:"):
                    line = line[5:].strip()
                if line == b"[DONE]":
                    break
                data = json.loads(line)
                if data.get("error"):
                    raise RuntimeError(f"server error in stream: {data['error']}")
                choices = data.get("choices")
                if choices:
                    chunk_times.append(time.perf_counter())
                    texts.append(choices[0].get("text") or "")
                usage = data.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    output_tokens = int(usage["completion_tokens"])
    except Exception:  # noqa: BLE001 - a failed request is a result, not a crash
        rec = RequestRecord(prompt_len=prompt_len, error=traceback.format_exc(limit=3))
        rec.start_time = send - run_start if run_start is not None else 0.0
        return rec
    return record_from_chunks(send, chunk_times, prompt_len, texts, output_tokens, run_start)


# ---- the benchmark ----------------------------------------------------------------------------------
async def _benchmark(
    url: str, model: str, requests: Sequence[SampleRequest], request_rate: float, burstiness: float,
    max_concurrency: int | None, seed: int, ignore_eos: bool, extra_body: dict[str, Any] | None,
    disable_tqdm: bool, initial_test: bool, log: Callable[[str], None] | None,
) -> tuple[list[RequestRecord], float]:
    import aiohttp
    from tqdm import tqdm

    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0, force_close=False)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector, trust_env=True) as session:
        if initial_test:
            first = requests[0]
            probe = SampleRequest(first.prompt, first.prompt_len, min(first.expected_output_len, 16),
                                  first.prompt_token_ids)
            if log is not None:
                log("Starting initial single prompt test run...")
            rec = await stream_completion(session, url, completion_payload(model, probe, ignore_eos, extra_body),
                                          probe.prompt_len)
            if not rec.success:
                raise ValueError(f"Initial test run failed - check the server and the arguments. Error: {rec.error}")
            if log is not None:
                log("Initial test run completed. Starting main benchmark run...")

        bar = tqdm(total=len(requests), disable=disable_tqdm, dynamic_ncols=True)
        semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        run_start = time.perf_counter()

        async def launch(request: SampleRequest) -> RequestRecord:
            payload = completion_payload(model, request, ignore_eos, extra_body)
            if semaphore is None:
                rec = await stream_completion(session, url, payload, request.prompt_len, run_start)
            else:
                async with semaphore:
                    rec = await stream_completion(session, url, payload, request.prompt_len, run_start)
            bar.update(1)
            return rec

        offsets = arrival_offsets(len(requests), request_rate, burstiness, seed)
        records = await dispatch(requests, offsets, launch)
        duration = time.perf_counter() - run_start
        bar.close()
    return records, duration


def run_serve_benchmark(
    base_url: str,
    model: str,
    requests: Sequence[SampleRequest],
    *,
    endpoint: str = "/v1/completions",
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    seed: int = 0,
    goodput: dict[str, float] | None = None,
    percentiles: Sequence[float] = (90.0, 99.0),
    selected_metrics: Sequence[str] = METRICS,
    ignore_eos: bool = False,
    tokenizer: Any = None,
    extra_body: dict[str, Any] | None = None,
    disable_tqdm: bool = True,
    initial_test: bool = True,
    save_detailed: bool = False,
    log: Callable[[str], None] | None = None,
) -> tuple[dict[str, Any], list[RequestRecord]]:
    """Run the benchmark; returns vLLM's result dict (with per-request lists) and the records."""
    if not requests:
        raise ValueError("no request to send.")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {max_concurrency}.")
    arrival_intervals(0, request_rate, burstiness)  # validates both
    url = api_url(base_url, endpoint)
    spec_before = spec_decode_counters(base_url)
    records, duration = asyncio.run(_benchmark(
        url, model, requests, request_rate, burstiness, max_concurrency, seed, ignore_eos, extra_body,
        disable_tqdm, initial_test, log,
    ))
    count = None
    if tokenizer is not None:
        def count(text: str) -> int:
            return len(tokenizer.encode(text, add_special_tokens=False))
    result = calculate_metrics(records, duration, percentiles, goodput, count, selected_metrics)
    out_lens = output_lengths(records, count)
    result.update({
        "request_rate": request_rate if not math.isinf(request_rate) else "inf",
        "burstiness": burstiness,
        "max_concurrency": max_concurrency,
        "input_lens": [r.prompt_len for r in records],
        "output_lens": out_lens,
        "ttfts": [r.ttft for r in records],
        "itls": [r.itl for r in records],
        "e2els": [r.latency for r in records],
        "start_times": [r.start_time for r in records],
        "errors": [r.error for r in records],
    })
    spec = spec_decode_delta(spec_before, spec_decode_counters(base_url))
    if spec is not None:
        result["spec_decode"] = spec
        if log is not None:
            log(f"speculative decoding: acceptance {spec['acceptance_rate']:.1%}, mean accepted length "
                f"{spec['mean_acceptance_length']:.2f} ({spec['num_draft_tokens']} draft tokens)")
    if save_detailed:
        result["generated_texts"] = [r.generated_text for r in records]
    return result, records


_SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def spec_decode_counters(base_url: str) -> dict[str, float] | None:
    """The server's speculative-decoding counters from /metrics (perfxlm's or vLLM's names); None when it
    has none or /metrics does not answer."""
    import urllib.request

    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=5) as resp:
            text = resp.read().decode("utf-8", "replace")
    except Exception:
        return None
    return parse_spec_decode_counters(text)


def parse_spec_decode_counters(text: str) -> dict[str, float] | None:
    found: dict[str, float] = {}
    for line in text.splitlines():
        for prefix in ("perfxlm:spec_decode_", "vllm:spec_decode_"):
            for name in _SPEC_COUNTERS:
                if line.startswith(f"{prefix}{name}_total ") or line.startswith(f"{prefix}{name}_total{{"):
                    found[name] = found.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return found or None


def spec_decode_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, Any] | None:
    if not after:
        return None
    d = {name: int(after.get(name, 0) - (before or {}).get(name, 0)) for name in _SPEC_COUNTERS}
    if not d["num_draft_tokens"]:
        return None
    d["acceptance_rate"] = d["num_accepted_tokens"] / d["num_draft_tokens"]
    d["mean_acceptance_length"] = 1 + d["num_accepted_tokens"] / d["num_drafts"] if d["num_drafts"] else 1.0
    return d


# ---- tokenizer and model name -----------------------------------------------------------------------------
def resolve_tokenizer(tokenizer: str | None, model: str | None, log: Callable[[str], None] | None = print) -> Any:
    """--tokenizer PATH, else the model name if it is a local path, else the embedded default model's."""
    from perfxlm.tokenizer import get_tokenizer

    if tokenizer:
        return get_tokenizer(os.path.expanduser(tokenizer))
    if model and os.path.exists(os.path.expanduser(model)):
        path = os.path.expanduser(model)
        return get_tokenizer(path)
    from perfxlm.config import default_model_path

    path = default_model_path()  # raises ValueError with the install hint when absent
    if log is not None:
        log(f"note: no --tokenizer given: counting tokens with the default model's tokenizer ({os.path.basename(path)}).")
    return get_tokenizer(path)


def fetch_model_name(base_url: str, timeout_s: float = 10.0) -> str:
    """The first model the server lists at /v1/models."""
    import aiohttp

    async def get() -> str:
        url = api_url(base_url, "/v1/models")
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
            async with session.get(url, headers=_headers()) as response:
                response.raise_for_status()
                data = await response.json()
        models = data.get("data") or []
        if not models:
            raise ValueError(f"{url} lists no model: pass --model NAME.")
        return str(models[0]["id"])

    try:
        return asyncio.run(get())
    except (OSError, asyncio.TimeoutError, aiohttp.ClientError) as exc:
        raise ValueError(f"could not reach {base_url} to ask its model name ({exc}): pass --model NAME.") from exc


# ---- CLI ---------------------------------------------------------------------------------------------
def cmd_serve(args: Any) -> int:
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    goodput = parse_goodput(args.goodput)
    percentiles = [float(p) for p in str(args.metric_percentiles).split(",") if p.strip()]
    selected = [m.strip() for m in str(args.percentile_metrics).split(",") if m.strip()]
    bad = [m for m in selected if m not in METRICS]
    if bad:
        raise ValueError(f"--percentile-metrics takes {', '.join(METRICS)}; got {', '.join(bad)}.")
    extra_body = json.loads(args.extra_body) if args.extra_body else None
    name, path = parse_dataset_arg(args.dataset, args.dataset_path)
    check_dataset_path(name, path)
    model = args.model or fetch_model_name(base_url)
    tokenizer = resolve_tokenizer(args.tokenizer, args.model)
    requests = load_requests(
        name, path, args.num_prompts, tokenizer=tokenizer, input_len=args.input_len, output_len=args.output_len,
        seed=args.seed, range_ratio=args.random_range_ratio, sharegpt_output_len=args.sharegpt_output_len,
    )
    env = benv.collect_env(
        None, command="bench serve", base_url=base_url, endpoint=args.endpoint, model=model,
        tokenizer=getattr(tokenizer, "name_or_path", None) or args.tokenizer, dataset=name, dataset_path=path,
        num_prompts=len(requests), input_len=args.input_len if name == "random" else None,
        output_len=args.output_len if name == "random" else args.sharegpt_output_len,
        request_rate=args.request_rate, burstiness=args.burstiness, max_concurrency=args.max_concurrency,
        ignore_eos=args.ignore_eos, goodput=goodput or None, seed=args.seed,
    )
    env["note"] = "engine_version, torch and CPU fields describe the client's machine; the server's engine is its own"
    print(benv.format_env(env))
    print(f"Traffic request rate: {args.request_rate}\nBurstiness factor: {args.burstiness} "
          f"({'Poisson process' if args.burstiness == 1.0 else 'gamma distribution'})\n"
          f"Maximum request concurrency: {args.max_concurrency}")
    result, records = run_serve_benchmark(
        base_url, model, requests, endpoint=args.endpoint, request_rate=args.request_rate,
        burstiness=args.burstiness, max_concurrency=args.max_concurrency, seed=args.seed, goodput=goodput or None,
        percentiles=percentiles, selected_metrics=selected, ignore_eos=args.ignore_eos, tokenizer=tokenizer,
        extra_body=extra_body, disable_tqdm=args.disable_tqdm, initial_test=not args.skip_initial_test,
        save_detailed=args.save_detailed, log=print,
    )
    print(format_serving_result(result, percentiles, selected))
    if result["failed"]:
        first = next(e for e in result["errors"] if e)
        print(f"{result['failed']} requests failed; the first error:\n{first}")
    png_path = args.output_png or sibling_path(args.output_json, ".png")
    if args.output_json:
        write_json(args.output_json, {"config": env, **result})
        print(f"saved {args.output_json}")
    if png_path:
        from perfxlm.bench.plots import plot_latency_cdfs

        rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}"
        title = f"{model} at {base_url}: {len(requests)} {name} prompts, request rate {rate}"
        plot_latency_cdfs(per_request_series(records, result["output_lens"]), png_path, title)
        print(f"saved {png_path}")
    return 0 if result["completed"] else 1
