"""`perfxlm` command line: generate (more subcommands join as they are built)."""

from __future__ import annotations

import argparse
import sys


def add_engine_args(parser: argparse.ArgumentParser, positional_model: bool = True) -> None:
    model_help = "Hugging Face model folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)"
    if positional_model:
        parser.add_argument("model", nargs="?", default=None, help=model_help)
        parser.add_argument("--model", dest="model_opt", default=None, help="same as the positional MODEL")
    else:
        parser.add_argument("--model", dest="model_opt", default=None, help=model_help)
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder, if not the model's")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="weights and activations dtype; auto = bfloat16 where the CPU has native bf16")
    parser.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "gguf", "dummy"],
                        help="dummy = random weights of the right shapes (benchmarks)")
    parser.add_argument("--max-model-len", type=int, default=None, help="context length (prompt + output)")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="most requests in one batch")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="most tokens in one step")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    parser.add_argument("--kv-cache-gib", type=float, default=None, help="KV cache size in GiB")
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="exact number of KV cache blocks")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="reuse the KV cache of shared prompt prefixes")
    parser.add_argument("--seed", type=int, default=0, help="random seed")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        model=args.model_opt or getattr(args, "model", None),
        tokenizer=args.tokenizer,
        dtype=args.dtype,
        load_format=args.load_format,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        kv_cache_gib=args.kv_cache_gib,
        num_kv_blocks=args.num_kv_blocks,
        enable_prefix_caching=args.enable_prefix_caching,
        seed=args.seed,
    )


def _generate(args: argparse.Namespace) -> int:
    from perfxlm import LLM, SamplingParams

    kwargs = engine_kwargs(args)
    model = kwargs.pop("model")
    llm = LLM(model, **kwargs)
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens,
        seed=args.sampling_seed,
    )
    if args.chat:
        outputs = llm.chat([{"role": "user", "content": p} for p in args.prompt][:1], params, use_tqdm=False)
    else:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    for out in outputs:
        if len(outputs) > 1 or args.chat:
            print(f"### {out.prompt!r}" if not args.chat else f"### {args.prompt[0]!r}")
        print((out.prompt or "") + out.outputs[0].text if args.echo else out.outputs[0].text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="perfxlm", description="perfxlm: a vLLM-compatible LLM engine for CPUs")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one or more prompts and print the result")
    gen.add_argument("prompt", nargs="+", help="prompt text (several prompts are batched)")
    add_engine_args(gen, positional_model=False)
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--chat", action="store_true", help="wrap the (first) prompt in the model's chat template")
    gen.add_argument("--echo", action="store_true", help="print the prompt before the completion")
    gen.set_defaults(func=_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
