"""`perfxlm eval perplexity` (and `eval kld`, from kld_command): argument definitions and the commands (the
CLI module only wires them in)."""

from __future__ import annotations

import argparse
import json
import os
from typing import Callable

from perfxlm.eval.inputs import read_text, tqdm_disabled
from perfxlm.eval.windows import check_ctx_size


def add_eval_parser(sub: argparse._SubParsersAction, add_engine_args: Callable, engine_kwargs: Callable) -> None:
    ev = sub.add_parser("eval", help="evaluations: perplexity and KL divergence (as llama.cpp's llama-perplexity)")
    esub = ev.add_subparsers(dest="eval_command", required=True)
    ppl = esub.add_parser(
        "perplexity", help="perplexity of a text file, computed as llama.cpp's llama-perplexity does",
        description="Tokenize FILE once, cut it into windows of --ctx-size tokens (no overlap; BOS as the "
                    "first token of each window when the model adds one), score each window on its second "
                    "half, and print the running estimate per window and llama.cpp's final line "
                    "'Final estimate: PPL = X +/- Y'.")
    add_engine_args(ppl)
    ppl.add_argument("-f", "--file", required=True, help="the text file to score (UTF-8)")
    ppl.add_argument("-c", "--ctx-size", type=int, default=512, help="tokens per window (llama.cpp's -c)")
    ppl.add_argument("--chunks", type=int, default=None, help="score only the first N windows (default: all)")
    ppl.add_argument("--batch-size", type=int, default=None,
                     help="most windows in flight at once (default: all; the engine batches them under "
                          "--max-num-batched-tokens). llama.cpp's -b counts tokens: -b 2048 -c 512 is 4 windows")
    ppl.add_argument("--score-chunk", type=int, default=None, metavar="N",
                     help="prefill each window in chunks of at most N tokens, so that later chunks (with "
                          "N <= ctx-size/2, every scored token) attend to K/V read back from the KV cache, "
                          "quantized if --kv-cache-dtype is (default: off, one pass per window)")
    ppl.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ppl.add_argument("--output-json", default=None, metavar="PATH", help="save the configuration and the result")
    ppl.add_argument("--no-progress", action="store_true", help="no progress bar")
    ppl.set_defaults(func=lambda args: cmd_perplexity(args, engine_kwargs(args)), enable_prefix_caching=False)
    from perfxlm.eval.kld_command import add_kld_parser

    add_kld_parser(esub, add_engine_args, engine_kwargs)
    from perfxlm.eval.quant_table_command import add_quant_table_parser

    add_quant_table_parser(esub, add_engine_args, engine_kwargs)


def header(llm, args: argparse.Namespace) -> dict:
    from perfxlm.ops import cpu_plan

    c = llm.llm_engine.config
    return {
        "model": c.model, "dtype": str(c.weight_dtype).replace("torch.", ""),
        "compute_dtype": str(c.torch_dtype).replace("torch.", ""), "kv_cache_dtype": c.kv_cache_dtype,
        "cpu_plan": cpu_plan.plan().describe(), "file": os.path.abspath(args.file), "ctx_size": args.ctx_size,
        "chunks": args.chunks, "batch_size": args.batch_size, "score_chunk": args.score_chunk,
        "max_num_batched_tokens": c.max_num_batched_tokens, "threads": _threads(),
    }


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def cmd_perplexity(args: argparse.Namespace, kwargs: dict) -> int:
    text = read_text(args.file)  # before the model loads: a bad file fails fast
    check_ctx_size(args.ctx_size)  # as a ctx_size no model could take
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}.")
        import torch

        torch.set_num_threads(args.threads)
    from perfxlm import LLM
    from perfxlm.eval.perplexity import perplexity

    model = kwargs.pop("model")
    llm = LLM(model, **kwargs)
    info = header(llm, args)
    for key in ("model", "dtype", "compute_dtype", "kv_cache_dtype", "cpu_plan", "file"):
        print(f"{key}: {info[key]}")
    print(f"perplexity: ctx_size={args.ctx_size}, score_chunk={args.score_chunk or 'off'}, "
          f"threads={info['threads']}", flush=True)

    def on_chunk(i: int, estimate: float) -> None:
        print(f"[{i}]{estimate:.4f},", end="", flush=True)

    result = perplexity(llm, text, args.ctx_size, n_chunks=args.chunks, batch_size=args.batch_size,
                        score_chunk=args.score_chunk, progress=not args.no_progress and not tqdm_disabled(),
                        on_chunk=on_chunk)
    print()
    print(f"scored {result.n_tokens} tokens in {result.n_chunks} windows of {result.ctx_size} "
          f"({result.text_tokens} tokens in the text, BOS {'added' if result.add_bos else 'not added'}), "
          f"{result.seconds:.1f} s")
    print(result.final_line(), flush=True)
    if args.output_json:
        with open(args.output_json, "w") as fh:
            json.dump({"config": info, "result": result.to_dict()}, fh, indent=2)
    return 0
