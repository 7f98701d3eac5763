"""Core engine benchmark: prefill tok/s (512-token prompt), batch-1 decode tok/s (512-token prompt,
128 new tokens) and generated tok/s for 64 concurrent requests (128 in / 128 out).

    python benchmarks/bench_core.py [--model PATH] [--dtype bfloat16] [--threads 2] [--repeats 3]

Prints medians over repeats. Not a test: timings belong to benchmarks, not to the test suite.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from perfxlm import LLM, SamplingParams


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(100, vocab, (length,), generator=g).tolist()} for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-concurrent", action="store_true")
    ap.add_argument("--concurrent", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, dtype=args.dtype, load_format=args.load_format, enable_prefix_caching=False,
              kv_cache_gib=2.0)
    vocab = llm.llm_engine.config.hf_config.vocab_size
    print(f"model={llm.llm_engine.config.model} dtype={llm.llm_engine.config.torch_dtype} threads={torch.get_num_threads()}")
    llm.generate(random_prompts(2, 64, vocab, 0), SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)

    prefill, decode, concurrent = [], [], []
    for r in range(args.repeats):
        t = time.perf_counter()
        llm.generate(random_prompts(1, 512, vocab, 100 + r), SamplingParams(max_tokens=1), use_tqdm=False)
        prefill.append(512 / (time.perf_counter() - t))

        out = llm.generate(random_prompts(1, 512, vocab, 200 + r),
                           SamplingParams(max_tokens=128, ignore_eos=True), use_tqdm=False)[0]
        m = out.metrics
        decode.append(127 / (m.finished_time - m.first_token_time))

        if not args.skip_concurrent:
            t = time.perf_counter()
            outs = llm.generate(random_prompts(args.concurrent, 128, vocab, 300 + r),
                                SamplingParams(max_tokens=128, ignore_eos=True), use_tqdm=False)
            el = time.perf_counter() - t
            concurrent.append(sum(len(o.outputs[0].token_ids) for o in outs) / el)
        print(f"run {r}: prefill {prefill[-1]:.0f} tok/s, decode b1 {decode[-1]:.1f} tok/s"
              + (f", {args.concurrent} concurrent {concurrent[-1]:.0f} gen tok/s" if concurrent else ""))
    print(f"median: prefill-512 {statistics.median(prefill):.0f} tok/s | decode batch 1 "
          f"{statistics.median(decode):.1f} tok/s"
          + (f" | {args.concurrent} concurrent {statistics.median(concurrent):.0f} gen tok/s" if concurrent else ""))


if __name__ == "__main__":
    main()
