"""`perfxlm bench latency` and `perfxlm bench sweep`.

Latency: one batch of B requests with I random prompt tokens each (fixed seed, fresh prompts every
iteration so that no prefix is cached) and O generated tokens (ignore_eos, temperature 1, as vLLM's
benchmark_latency samples). The engine is stepped directly:
- prefill time = from submitting the batch to the step after which every request has its first
  token (one step when max_num_batched_tokens >= B * I, which the benchmark sets unless told);
- decode step time = the rest of the run divided by the number of steps in it (O - 1 for a batch
  that was prefilled together);
- generated tokens/s = B * O / end-to-end time; decode tokens/s = B / decode step time;
- peak memory = the process's peak resident set size (getrusage).
Warm-up iterations run first and are not counted; each figure is summarised over the iterations.

Sweep: the latency benchmark for each batch size, each in a fresh process by default, so that the
memory column is that batch size's peak (in one process the peak only grows); the table PPL.LLM
publishes, as Markdown, CSV, JSON and a PNG.
"""

from __future__ import annotations

import csv
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from perfxlm.bench import env as benv
from perfxlm.bench import roofline
from perfxlm.bench.common import make_llm, sibling_path, size_engine_for_batch, write_json
from perfxlm.bench.datasets import random_token_ids
from perfxlm.bench.metrics import summarize

LATENCY_PERCENTILES = (10, 25, 50, 75, 90, 99)  # vLLM's benchmark_latency
SUMMARY_PERCENTILES = (90, 99)


def measure_batch(engine: Any, prompts: Sequence[Any], params: Any, tag: str) -> dict[str, float]:
    """Run one batch to completion on an idle engine; time prefill and decode steps apart."""
    from perfxlm.sampling_params import RequestOutputKind

    if engine.has_unfinished_requests():
        raise RuntimeError("the engine must be idle to time a batch.")
    params = params.clone() if hasattr(params, "clone") else params
    params.output_kind = RequestOutputKind.DELTA  # every step reports its new tokens
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    started: set[str] = set()
    tokens = steps = prefill_steps = prefill_tokens = 0
    prefill_end = None
    t0 = time.perf_counter()
    try:
        for rid, prompt in zip(ids, prompts):
            engine.add_request(rid, prompt, params)
        now = t0
        while engine.has_unfinished_requests():
            outputs = engine.step()
            now = time.perf_counter()
            steps += 1
            for out in outputs:
                n = len(out.outputs[0].token_ids)
                if n:
                    tokens += n
                    started.add(out.request_id)
            if prefill_end is None and len(started) == len(ids):
                prefill_end, prefill_steps, prefill_tokens = now, steps, tokens
    except BaseException:
        engine.abort_request(ids)
        raise
    end = now
    if prefill_end is None:
        raise RuntimeError("the batch finished without every request producing a token.")
    decode_steps = steps - prefill_steps
    decode_s = (end - prefill_end) / decode_steps if decode_steps else math.nan
    e2e = end - t0
    return {
        "prefill_s": prefill_end - t0,
        "prefill_steps": prefill_steps,
        "decode_step_s": decode_s,
        "decode_steps": decode_steps,
        "latency_s": e2e,
        "generated_tokens": tokens,
        "throughput_tok_s": tokens / e2e,
        # tokens per second of decode time: B / step time, unless a step yields several tokens per
        # request (speculative decoding)
        "decode_tok_s": (tokens - prefill_tokens) / (end - prefill_end) if decode_steps else math.nan,
    }


def run_latency(
    llm: Any,
    batch_size: int,
    input_len: int,
    output_len: int,
    num_iters: int = 3,
    num_iters_warmup: int = 1,
    seed: int = 0,
    disable_detokenize: bool = False,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    from perfxlm import SamplingParams

    for name, value in (("batch size", batch_size), ("input length", input_len), ("output length", output_len),
                        ("--num-iters", num_iters)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}.")
    if num_iters_warmup < 0:
        raise ValueError(f"--num-iters-warmup must be >= 0, got {num_iters_warmup}.")
    engine = llm.llm_engine
    config = engine.config
    max_len = engine.resolved.max_model_len  # fitted to the KV pool
    if input_len + output_len > max_len:
        raise ValueError(f"input ({input_len}) + output ({output_len}) tokens exceed max_model_len ({max_len}).")
    vocab = int(config.hf_config.vocab_size)
    params = SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=output_len,
                            detokenize=not disable_detokenize)
    runs = []
    spec = engine.scheduler.spec_stats
    spec_before = None
    for it in range(num_iters_warmup + num_iters):
        if it == num_iters_warmup:
            spec_before = (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens)
        prompts = [{"prompt_token_ids": ids}
                   for ids in random_token_ids(batch_size, input_len, vocab, seed=seed * 7919 + it)]
        warm = it < num_iters_warmup
        result = measure_batch(engine, prompts, params, tag=f"lat{it}")
        if log is not None:
            log(f"{'warm-up' if warm else 'iteration'} {it - num_iters_warmup + 1 if not warm else it + 1}: "
                f"prefill {result['prefill_s'] * 1e3:.1f} ms, decode step {result['decode_step_s'] * 1e3:.2f} ms, "
                f"{result['throughput_tok_s']:.1f} tok/s, e2e {result['latency_s']:.3f} s")
        if not warm:
            runs.append(result)

    latencies = [r["latency_s"] for r in runs]
    out: dict[str, Any] = {
        "batch_size": batch_size,
        "input_len": input_len,
        "output_len": output_len,
        "num_iters": num_iters,
        "num_iters_warmup": num_iters_warmup,
        # vLLM's benchmark_latency names
        "avg_latency": statistics.fmean(latencies),
        "latencies": latencies,
        "percentiles": {str(p): _percentile(latencies, p) for p in LATENCY_PERCENTILES},
        "prefill_steps": runs[-1]["prefill_steps"],
    }
    out.update(summarize([r["prefill_s"] for r in runs], "prefill", SUMMARY_PERCENTILES))
    decode = [r["decode_step_s"] for r in runs if not math.isnan(r["decode_step_s"])]
    if decode:
        out.update(summarize(decode, "decode_step", SUMMARY_PERCENTILES))
        out.update(summarize([r["decode_tok_s"] for r in runs], "decode_throughput", SUMMARY_PERCENTILES,
                             scale=1.0, unit="tok_s"))
    out.update(summarize([r["throughput_tok_s"] for r in runs], "throughput", SUMMARY_PERCENTILES,
                         scale=1.0, unit="tok_s"))
    out.update(summarize(latencies, "e2e_latency", SUMMARY_PERCENTILES, scale=1.0, unit="s"))
    if config.speculative_config is not None and spec_before is not None:
        drafts, draft_tokens, accepted = (now - then for now, then in zip(
            (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens), spec_before))
        out["spec_decode"] = {"num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted,
                              "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
                              "mean_acceptance_length": 1 + accepted / drafts if drafts else 0.0}
    out["peak_memory_gib"] = benv.peak_rss_gib()
    out["iterations"] = runs
    return out


def _percentile(values: Sequence[float], p: float) -> float:
    import numpy as np

    return float(np.percentile(np.asarray(values, dtype=float), p))


def format_latency(result: dict[str, Any]) -> str:
    b, i, o = result["batch_size"], result["input_len"], result["output_len"]
    lines = [f"batch {b}, input {i} tokens, output {o} tokens, {result['num_iters']} iterations "
             f"(+{result['num_iters_warmup']} warm-up)"]
    header = f"{'':28}{'mean':>12}{'median':>12}{'p90':>12}{'p99':>12}"
    lines.append(header)

    def row(label: str, key: str, fmt: str = "{:12.2f}") -> None:
        if f"mean_{key}" not in result:
            lines.append(f"{label:28}{'-':>12}")
            return
        vals = [result[f"{s}_{key}"] for s in ("mean", "median", "p90", "p99")]
        lines.append(f"{label:28}" + "".join(fmt.format(v) for v in vals))

    row("prefill (ms)", "prefill_ms")
    row("decode step (ms)", "decode_step_ms", "{:12.3f}")
    row("generated tokens/s", "throughput_tok_s", "{:12.1f}")
    row("decode tokens/s", "decode_throughput_tok_s", "{:12.1f}")
    row("end-to-end latency (s)", "e2e_latency_s", "{:12.4f}")
    spec = result.get("spec_decode")
    if spec is not None:
        lines.append(f"{'speculative decoding':28}acceptance {spec['acceptance_rate']:.1%}, mean accepted length "
                     f"{spec['mean_acceptance_length']:.2f} ({spec['num_draft_tokens']} draft tokens)")
    lines.append(f"{'peak resident memory (GiB)':28}{result['peak_memory_gib']:12.3f}")
    lines.append(f"Avg latency: {result['avg_latency']:.4f} seconds")
    for p, v in result["percentiles"].items():
        lines.append(f"{p}% percentile latency: {v:.4f} seconds")
    return "\n".join(lines)


# ---- CLI: latency -----------------------------------------------------------------------------
def cmd_latency(args: Any, engine_kwargs: dict[str, Any]) -> int:
    benv.set_threads(args.threads)
    kwargs = size_engine_for_batch(engine_kwargs, args.batch_size, args.input_len, args.output_len)
    llm = make_llm(kwargs, skip_tokenizer_init=args.skip_tokenizer_init)
    env = benv.collect_env(llm, command="bench latency", batch_size=args.batch_size, input_len=args.input_len,
                           output_len=args.output_len, num_iters=args.num_iters,
                           num_iters_warmup=args.num_iters_warmup, seed=args.seed,
                           detokenize=not args.disable_detokenize and llm.get_tokenizer() is not None)
    compute_dtype = env.get("gemm_dtype", env.get("compute_dtype", env["dtype"]))
    peaks = benv.machine_peaks(compute_dtype) if args.machine_peaks else {}
    env.update(peaks)
    print(benv.format_env(env))
    result = run_latency(llm, args.batch_size, args.input_len, args.output_len, args.num_iters,
                         args.num_iters_warmup, args.seed, args.disable_detokenize,
                         log=None if args.quiet else print)
    print(format_latency(result))
    costs = roofline.model_costs(llm)
    if costs is not None:
        result["achieved"] = roofline.achieved(costs, result, peaks, compute_dtype)
        print(roofline.format_achieved(result["achieved"], peaks, compute_dtype))
    if args.output_json:
        write_json(args.output_json, {"config": env, **result})
        print(f"saved {args.output_json}")
    return 0


# ---- sweep ------------------------------------------------------------------------------------
SWEEP_COLUMNS = [
    ("model", "model", "{}"),
    ("model_size", "size", "{}"),
    ("dtype", "dtype", "{}"),
    ("batch_size", "batch", "{}"),
    ("input_len", "input len", "{}"),
    ("output_len", "output len", "{}"),
    ("prefill_ms", "prefill (ms)", "{:.1f}"),
    ("decode_ms", "decode (ms)", "{:.2f}"),
    ("throughput_tok_s", "throughput (tok/s)", "{:.1f}"),
    ("memory_gib", "memory (GiB)", "{:.2f}"),
]


def sweep_point(engine_kwargs: dict[str, Any], batch_size: int, input_len: int, output_len: int,
                num_iters: int, num_iters_warmup: int, seed: int, threads: int | None = None,
                disable_detokenize: bool = False, skip_tokenizer_init: bool = False) -> dict[str, Any]:
    """One row of the sweep, from a fresh engine sized for this batch."""
    benv.set_threads(threads)
    kwargs = size_engine_for_batch(engine_kwargs, batch_size, input_len, output_len)
    llm = make_llm(kwargs, skip_tokenizer_init=skip_tokenizer_init, log=None)
    summary = benv.model_summary(llm)
    result = run_latency(llm, batch_size, input_len, output_len, num_iters, num_iters_warmup, seed,
                         disable_detokenize)
    del llm
    return {"row": sweep_row(summary, result), "model_summary": summary, "detail": result}


def sweep_row(summary: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    """The table's row: medians over the iterations."""
    return {
        "model": os.path.basename(str(summary["model"]).rstrip("/")),
        "model_size": summary["model_size"],
        "dtype": summary["dtype"],
        "batch_size": result["batch_size"],
        "input_len": result["input_len"],
        "output_len": result["output_len"],
        "prefill_ms": result["median_prefill_ms"],
        "decode_ms": result.get("median_decode_step_ms", math.nan),
        "throughput_tok_s": result["median_throughput_tok_s"],
        "decode_tok_s": result.get("median_decode_throughput_tok_s", math.nan),
        "e2e_s": result["median_e2e_latency_s"],
        "memory_gib": result["peak_memory_gib"],
    }


def _run_isolated(fn: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    """fn(**kwargs) in a fresh interpreter (spawn), so its peak memory is its own."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    with ctx.Pool(1, maxtasksperchild=1) as pool:
        return pool.apply(fn, (), kwargs)


def run_sweep(engine_kwargs: dict[str, Any], batch_sizes: Sequence[int], input_len: int, output_len: int,
              num_iters: int = 3, num_iters_warmup: int = 1, seed: int = 0, threads: int | None = None,
              isolate: bool = True, disable_detokenize: bool = False, skip_tokenizer_init: bool = False,
              log: Callable[[str], None] | None = print) -> tuple[list[dict[str, Any]], dict[str, Any], list[dict]]:
    rows, details, summary = [], [], {}
    for b in batch_sizes:
        kwargs = dict(engine_kwargs=engine_kwargs, batch_size=b, input_len=input_len, output_len=output_len,
                      num_iters=num_iters, num_iters_warmup=num_iters_warmup, seed=seed, threads=threads,
                      disable_detokenize=disable_detokenize, skip_tokenizer_init=skip_tokenizer_init)
        point = _run_isolated(sweep_point, kwargs) if isolate else sweep_point(**kwargs)
        rows.append(point["row"])
        details.append(point["detail"])
        summary = point["model_summary"]
        if log is not None:
            r = point["row"]
            log(f"batch {b:>4}: prefill {r['prefill_ms']:.1f} ms, decode {r['decode_ms']:.2f} ms, "
                f"{r['throughput_tok_s']:.1f} tok/s, {r['memory_gib']:.2f} GiB")
    return rows, summary, details


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    head = "| " + " | ".join(label for _, label, _ in SWEEP_COLUMNS) + " |"
    rule = "|" + "|".join("---" if i < 3 else "---:" for i in range(len(SWEEP_COLUMNS))) + "|"
    body = []
    for r in rows:
        cells = []
        for key, _, fmt in SWEEP_COLUMNS:
            v = r.get(key)
            cells.append("-" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v))
        body.append("| " + " | ".join(cells) + " |")
    return "\n".join([head, rule, *body])


def write_csv(path: str, rows: Sequence[dict[str, Any]]) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    keys = list(rows[0].keys()) if rows else [k for k, _, _ in SWEEP_COLUMNS]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    return path


def parse_batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in str(text).replace(" ", "").split(",") if x]
    except ValueError:
        raise ValueError(f"--batch-sizes takes comma-separated integers, got {text!r}.") from None
    if not sizes or any(b < 1 for b in sizes):
        raise ValueError(f"--batch-sizes takes integers >= 1, got {text!r}.")
    return sizes


def cmd_sweep(args: Any, engine_kwargs: dict[str, Any]) -> int:
    benv.set_threads(args.threads)
    sizes = parse_batch_sizes(args.batch_sizes)
    print(f"sweep: batch sizes {sizes}, input {args.input_len}, output {args.output_len}, "
          f"{args.num_iters} iterations (+{args.num_iters_warmup} warm-up) each, "
          f"{'one process per batch size' if args.isolate else 'one process'}")
    rows, summary, details = run_sweep(
        engine_kwargs, sizes, args.input_len, args.output_len, args.num_iters, args.num_iters_warmup, args.seed,
        threads=args.threads, isolate=args.isolate, disable_detokenize=args.disable_detokenize,
        skip_tokenizer_init=args.skip_tokenizer_init,
    )
    env = benv.collect_env(None, command="bench sweep", batch_sizes=sizes, input_len=args.input_len,
                           output_len=args.output_len, num_iters=args.num_iters,
                           num_iters_warmup=args.num_iters_warmup, seed=args.seed, isolate=args.isolate)
    env.update({k: v for k, v in summary.items() if k not in ("num_kv_blocks", "max_num_seqs",
                                                                "max_num_batched_tokens")})
    if args.machine_peaks:
        env.update(benv.machine_peaks(env.get("gemm_dtype", env.get("compute_dtype", env.get("dtype", "float32")))))
    print(benv.format_env(env))
    print(markdown_table(rows))
    csv_path = args.output_csv or sibling_path(args.output_json, ".csv")
    png_path = args.output_png or sibling_path(args.output_json, ".png")
    if args.output_json:
        write_json(args.output_json, {"config": env, "rows": rows, "details": details})
        print(f"saved {args.output_json}")
    if csv_path:
        write_csv(csv_path, rows)
        print(f"saved {csv_path}")
    if png_path:
        from perfxlm.bench.plots import plot_sweep

        title = (f"{rows[0]['model']} ({rows[0]['model_size']}, {rows[0]['dtype']}), input {args.input_len}, "
                 f"output {args.output_len}; {env['cpu_model']}, torch threads: {env['torch_threads']}")
        plot_sweep(rows, png_path, title)
        print(f"saved {png_path}")
    return 0
