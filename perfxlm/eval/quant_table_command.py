"""`perfxlm eval quant-table MODEL -f TEXT`: arguments and the command (perfxlm/eval/quant_table.py)."""

from __future__ import annotations

import argparse
import json
import os
from typing import Callable


def add_quant_table_parser(esub: argparse._SubParsersAction, add_engine_args: Callable,
                           engine_kwargs: Callable) -> None:  # fmt: skip
    qt = esub.add_parser(
        "quant-table", help="every weight format for a model side by side: bits/weight, size, Δppl, KLD, speed",
        description="Score a text with the model unquantized (float32, the base), then with each weight format "
                    "(default: none, int8, w8a8, int4, nf4 for a float checkpoint; as stored and dequantized for "
                    "a quantized GGUF), and tabulate bits per weight, resident weight size, perplexity, its "
                    "change, mean and 99th-percentile KL divergence from the base, same top token, and batch-1 "
                    "decode tokens/s, as Markdown (and JSON, PNG).")
    add_engine_args(qt)
    qt.add_argument("-f", "--file", required=True, help="the text (UTF-8)")
    qt.add_argument("-c", "--ctx-size", type=int, default=512, help="tokens per window")
    qt.add_argument("--chunks", type=int, default=None, help="only the first N windows (default: all)")
    qt.add_argument("--formats", default=None, metavar="LIST",
                    help="comma list of --quantization values (a JSON object counts as one; default: see above)")
    qt.add_argument("--decode-tokens", type=int, default=64,
                    help="tokens decoded per timed request for the speed column (0: no speed column)")
    qt.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    qt.add_argument("--output-json", default=None, metavar="PATH", help="save the rows as JSON")
    qt.add_argument("--markdown", default=None, metavar="PATH", help="save the table as Markdown")
    qt.add_argument("--plot", default=None, metavar="PNG", help="PNG: KLD against bits per weight, and speed")
    qt.add_argument("--no-progress", action="store_true", help="no progress bars")
    qt.set_defaults(func=lambda args: cmd_quant_table(args, engine_kwargs(args)), enable_prefix_caching=False)


def cmd_quant_table(args: argparse.Namespace, kwargs: dict) -> int:
    from perfxlm.eval.inputs import read_text, tqdm_disabled
    from perfxlm.eval.kld_command import split_list
    from perfxlm.eval.quant_table import (check_formats, default_formats, markdown, plot_quant_table,
                                          run_quant_table, temporary_base_path, to_dicts)  # fmt: skip

    text = read_text(args.file)
    if kwargs.get("quantization") is not None:
        raise ValueError("quant-table runs every format itself: name them with --formats, not --quantization.")
    if kwargs.get("model") is None:
        from perfxlm.config import default_model_path

        kwargs["model"] = default_model_path()
    formats = split_list(args.formats) if args.formats else list(default_formats(kwargs["model"], args.load_format))
    check_formats(formats)
    if args.decode_tokens < 0:
        raise ValueError(f"--decode-tokens must be >= 0, got {args.decode_tokens}.")
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}.")
        import torch

        torch.set_num_threads(args.threads)
    base = temporary_base_path()
    try:
        rows = run_quant_table(kwargs, text, formats, base, args.ctx_size, args.chunks, args.decode_tokens,
                               progress=not args.no_progress and not tqdm_disabled(),
                               log=lambda line: print(line, flush=True))  # fmt: skip
    finally:
        os.unlink(base)
    table = markdown(rows)
    print()
    print(table)
    if args.markdown:
        with open(args.markdown, "w") as fh:
            fh.write(table + "\n")
    if args.output_json:
        with open(args.output_json, "w") as fh:
            json.dump(to_dicts(rows), fh, indent=2)
    if args.plot:
        plot_quant_table(rows, args.plot, title=f"{os.path.basename(str(kwargs['model']).rstrip('/'))}: weight "
                                                f"formats, {args.file and os.path.basename(args.file)}")
        print(f"plot: {args.plot}")
    return 0
