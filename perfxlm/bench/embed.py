"""`perfxlm bench embed`: embedding throughput of a model on the pooling runner, every text submitted at once.

Texts: the first human turn of each ShareGPT conversation (`--dataset sharegpt PATH`), or random token ids
of `--input-len` (`--dataset random`); each cut to `--max-tokens` as the tokenizer truncates.
texts/s = texts / elapsed; tokens/s = input tokens (after truncation) / elapsed.
"""

from __future__ import annotations

import random
import time
from typing import Any

from perfxlm.bench import env as benv
from perfxlm.bench.common import write_json
from perfxlm.bench.datasets import check_dataset_path, load_sharegpt_pairs, parse_dataset_arg


def embed_inputs(name: str, path: str | None, num: int, vocab_size: int, input_len: int, seed: int) -> list[Any]:
    if name == "sharegpt":
        texts = [p for p, _ in load_sharegpt_pairs(path) if p.strip()]  # type: ignore[arg-type]
        if not texts:
            raise ValueError(f"{path}: no ShareGPT conversation with a first turn.")
        return [texts[i % len(texts)] for i in range(num)]
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(vocab_size) for _ in range(input_len)]} for _ in range(num)]


def run_embed(llm: Any, inputs: list[Any], max_tokens: int | None, use_tqdm: bool = True) -> dict[str, Any]:
    from perfxlm import PoolingParams

    if not inputs:
        raise ValueError("no input to embed.")
    params = PoolingParams(truncate_prompt_tokens=max_tokens)
    start = time.perf_counter()
    outputs = llm.embed(inputs, pooling_params=params, use_tqdm=use_tqdm)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return {"num_texts": len(outputs), "total_input_tokens": tokens, "elapsed_time": elapsed,
            "texts_per_second": len(outputs) / elapsed, "tokens_per_second": tokens / elapsed,
            "peak_memory_gib": benv.peak_rss_gib()}


def format_embed(result: dict[str, Any]) -> str:
    return (f"Embedding throughput: {result['texts_per_second']:.2f} texts/s, "
            f"{result['tokens_per_second']:.2f} tokens/s\n"
            f"Texts: {result['num_texts']}, input tokens: {result['total_input_tokens']}, "
            f"elapsed (s): {result['elapsed_time']:.3f}, peak resident memory (GiB): {result['peak_memory_gib']:.3f}")


def cmd_embed(args: Any, engine_kwargs: dict[str, Any]) -> int:
    from perfxlm import LLM, PoolingParams

    benv.set_threads(args.threads)
    name, path = parse_dataset_arg(args.dataset, args.dataset_path)
    check_dataset_path(name, path)
    kwargs = dict(engine_kwargs)
    if kwargs.get("runner", "auto") == "auto":
        kwargs["runner"] = "pooling"  # a causal LM benchmarks as a last-token embedder
    llm = LLM(kwargs.pop("model", None), skip_tokenizer_init=args.skip_tokenizer_init, **kwargs)
    engine = llm.llm_engine
    if name == "sharegpt" and engine.tokenizer is None:
        raise ValueError("--dataset sharegpt tokenizes text: this model has no tokenizer (pass --tokenizer PATH).")
    window = engine.max_model_len
    max_tokens = min(args.max_tokens, window) if args.max_tokens else window
    inputs = embed_inputs(name, path, args.num_prompts, int(engine.config.hf_config.vocab_size),
                          min(args.input_len, max_tokens), args.seed)
    pc = engine.pooler_config
    config = {"command": "bench embed", "model": engine.config.model, "dataset": name, "dataset_path": path,
              "num_prompts": len(inputs), "max_tokens": max_tokens, "pooling_type": pc.pooling_type,
              "dtype": str(engine.config.torch_dtype), "threads": args.threads,
              "max_num_batched_tokens": engine.config.max_num_batched_tokens}
    print(", ".join(f"{k}={v}" for k, v in config.items()))
    warm_up = PoolingParams(truncate_prompt_tokens=max_tokens)
    llm.embed(inputs[:4], pooling_params=warm_up, use_tqdm=False)  # first-call costs (allocator, threads) off the clock
    result = run_embed(llm, inputs, max_tokens, use_tqdm=not args.disable_tqdm)
    print(format_embed(result))
    if args.output_json:
        write_json(args.output_json, {"config": config, **result})
        print(f"saved {args.output_json}")
    return 0
