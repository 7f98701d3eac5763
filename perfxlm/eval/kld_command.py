"""`perfxlm eval kld`: arguments and the command (llama.cpp's `llama-perplexity --kl-divergence`).

    perfxlm eval kld --base MODEL [--base-quantization Q] [--model MODEL] [-q Q[,Q2,...]] -f TEXT [-c 512]

The base runs first and its distributions go to --base-logits FILE (kept for later runs; a temporary
file when not named); then each model under test (--model, default the base's model, once per
quantization in the -q list and per KV cache dtype in --kv-cache-dtypes) is compared with it. Without
--base, --base-logits names a file saved earlier (the text's tokens are in it; -f is then optional and
only checked to tokenize the same).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
from typing import Any, Callable

KV_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")


def add_kld_parser(esub: argparse._SubParsersAction, add_engine_args: Callable, engine_kwargs: Callable) -> None:
    kld = esub.add_parser(
        "kld", help="KL divergence of a model from a base model (llama.cpp's --kl-divergence statistics)",
        description="Score a text's perplexity windows with a base model, save its whole distribution at "
                    "every scored token, then score the same windows with each model under test and print "
                    "llama.cpp's statistics: Mean PPL(Q)/PPL(base), Mean KLD and its percentiles, Δp, "
                    "Same top p. Engine options (--dtype, --kv-cache-dtype, ...) apply to the models under "
                    "test; the base takes --base-* ones.")
    add_engine_args(kld, positional_model=False)
    kld.add_argument("--base", default=None, help="the base model (folder or .gguf); omit to reuse --base-logits")
    kld.add_argument("--base-quantization", default=None, help="the base's --quantization (default: its own)")
    kld.add_argument("--base-dtype", default=None, choices=["auto", "float32", "bfloat16"],
                     help="the base's --dtype (default: --dtype)")
    kld.add_argument("--base-kv-cache-dtype", default="auto", choices=KV_DTYPES, help="the base's KV cache")
    kld.add_argument("--base-logits", default=None, metavar="FILE",
                     help="where the base's distributions are saved (with --base) or read from (without)")
    kld.add_argument("--kv-cache-dtypes", default=None, metavar="LIST",
                     help="comma list of KV cache dtypes to compare, one run each (overrides --kv-cache-dtype)")
    kld.add_argument("-f", "--file", default=None, help="the text (UTF-8); needed with --base")
    kld.add_argument("-c", "--ctx-size", type=int, default=512, help="tokens per window (llama.cpp's -c)")
    kld.add_argument("--chunks", type=int, default=None, help="only the first N windows (default: all)")
    kld.add_argument("--batch-size", type=int, default=None, help="most windows in flight at once")
    kld.add_argument("--score-chunk", type=int, default=None, metavar="N",
                     help="prefill windows in chunks of at most N tokens, so scored tokens attend to K/V "
                          "read back from the (possibly quantized) KV cache")
    kld.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    kld.add_argument("--json", action="store_true", help="print the results as JSON instead of the report")
    kld.add_argument("--output-json", default=None, metavar="PATH", help="also save the results as JSON")
    kld.add_argument("--plot", default=None, metavar="PNG",
                     help="PNG of the KLD distribution per model (default with several: kld.png beside "
                          "--output-json, else none)")
    kld.add_argument("--no-progress", action="store_true", help="no progress bars")
    kld.set_defaults(func=lambda args: cmd_kld(args, engine_kwargs(args)), enable_prefix_caching=False)


def split_list(value: str | None) -> list[str | None]:
    """A comma list (a JSON object is one value); [None] for nothing."""
    if value is None:
        return [None]
    if value.strip().startswith("{"):
        return [value]
    items = [v.strip() for v in value.split(",") if v.strip()]
    if not items:
        raise ValueError(f"{value!r}: expected a comma-separated list.")
    return items


def candidates(args: argparse.Namespace, kwargs: dict) -> list[dict[str, Any]]:
    """One engine configuration per model under test."""
    model = kwargs.get("model") or args.base
    if model is None:
        raise ValueError("name the model under test with --model (or --base, whose model it then defaults to).")
    kv = split_list(args.kv_cache_dtypes) if args.kv_cache_dtypes else [kwargs.get("kv_cache_dtype", "auto")]
    for value in kv:
        if value not in KV_DTYPES:
            raise ValueError(f"--kv-cache-dtypes: {value!r} is not one of {', '.join(KV_DTYPES)}.")
    out = []
    for quant in split_list(kwargs.get("quantization")):
        for dtype in kv:
            out.append({**kwargs, "model": model, "quantization": quant, "kv_cache_dtype": dtype})
    return out


def _label(c: dict[str, Any], many_models: bool) -> str:
    parts = [os.path.basename(str(c["model"]).rstrip("/"))] if many_models else []
    parts.append(str(c["quantization"] or "as stored"))
    if c.get("kv_cache_dtype") not in (None, "auto"):
        parts.append(f"kv {c['kv_cache_dtype']}")
    return " / ".join(parts)


def cmd_kld(args: argparse.Namespace, kwargs: dict) -> int:
    from perfxlm.eval.inputs import read_text, tqdm_disabled

    text = read_text(args.file) if args.file else None  # before any model loads: a bad file fails fast
    if args.base is not None and text is None:
        raise ValueError("--base needs the text: -f FILE.")
    if args.base is None and args.base_logits is None:
        raise ValueError("name a base: --base MODEL (with -f TEXT), or --base-logits FILE saved by an earlier run.")
    runs = candidates(args, kwargs)
    if args.base is None:
        from perfxlm.eval.kld_base import open_base

        open_base(args.base_logits)  # as the text: a missing or foreign base file fails before a model loads
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}.")
        import torch

        torch.set_num_threads(args.threads)
    from perfxlm import LLM
    from perfxlm.eval.kld import kl_divergence, save_base_logprobs

    progress = not args.no_progress and not tqdm_disabled()
    say = (lambda *a, **k: None) if args.json else print
    temporary = None
    path = args.base_logits
    if args.base is not None:
        if path is None:
            fd, temporary = tempfile.mkstemp(suffix=".kldbase")
            os.close(fd)
            path = temporary
        base_kwargs = {**kwargs, "model": args.base, "quantization": args.base_quantization,
                       "kv_cache_dtype": args.base_kv_cache_dtype, "dtype": args.base_dtype or kwargs["dtype"]}
        model = base_kwargs.pop("model")
        say(f"base: {model} (quantization {args.base_quantization or 'as stored'}) -> {path}", flush=True)
        llm = LLM(model, **base_kwargs)
        save_base_logprobs(llm, text, path, args.ctx_size, n_chunks=args.chunks, batch_size=args.batch_size,
                           score_chunk=args.score_chunk, progress=progress)
        del llm
        gc.collect()
        text = None  # the base's tokens are the reference now; the model's tokenizer is checked below
    results = []
    try:
        many_models = len({c["model"] for c in runs}) > 1
        for c in runs:
            label = _label(c, many_models)
            run = dict(c)
            model = run.pop("model")
            say(f"\nmodel: {model} ({label})", flush=True)
            llm = LLM(model, **run)
            result = kl_divergence(llm, path, text, batch_size=args.batch_size,
                                   score_chunk=args.score_chunk, progress=progress,
                                   on_window=lambda i, line: say(line, flush=True))
            del llm
            gc.collect()
            results.append((label, result))
            say(result.summary.report(), flush=True)
    finally:
        if temporary is not None:
            os.unlink(temporary)
    payload = [{"label": label, **r.to_dict()} for label, r in results]
    if args.json:
        print(json.dumps(payload, indent=2))
    if args.output_json:
        with open(args.output_json, "w") as fh:
            json.dump(payload, fh, indent=2)
    plot = args.plot
    if plot is None and len(results) > 1 and args.output_json:
        plot = os.path.join(os.path.dirname(os.path.abspath(args.output_json)), "kld.png")
    if plot:
        from perfxlm.eval.kld_plot import plot_kld

        plot_kld({label: r.summary.kld_values for label, r in results}, plot,
                 title=f"KL divergence from the base, {results[0][1].n_windows} windows of {args.ctx_size}")
        say(f"plot: {plot}")
    return 0
