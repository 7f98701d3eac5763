"""Data parallel against tensor parallel on this machine: output tokens/s of one batch of random prompts
(every request submitted at once, greedy, ignore_eos) for one process (with T threads), N tensor-parallel
ranks and N replicas. Every engine is built first, then the runs go round-robin over them, so that other
load on the machine falls on every configuration alike; the median of the rounds is printed with the
spread, so a busy machine shows as a wide range.

    python benchmarks/bench_parallel.py --model path/to/config_dir --load-format dummy \
        --configs one:1,one:2,tp:2,dp:2 --batch-sizes 1,16
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (a folder with config.json for --load-format dummy)")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default=None, help="as LLM(quantization=...); 'none' dequantizes a GGUF file")
    ap.add_argument("--configs", default="one:1,one:2,tp:2,dp:2",
                    help="one:T (one process, T threads), tp:N (N ranks), dp:N (N replicas); comma-separated")
    ap.add_argument("--batch-sizes", default="1,16", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--input-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds (one untimed round first)")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()

    import torch

    from perfxlm import LLM, SamplingParams

    configs = [(c.split(":")[0], int(c.split(":")[1])) for c in args.configs.split(",")]
    engines, threads = {}, torch.get_num_threads()
    for kind, n in configs:
        kw = {"tp": {"tensor_parallel_size": n}, "dp": {"data_parallel_size": n}}.get(kind, {})
        t0 = time.perf_counter()
        engines[(kind, n)] = LLM(args.model, load_format=args.load_format, dtype=args.dtype,
                                 quantization=args.quantization, skip_tokenizer_init=True, enable_prefix_caching=False,
                                 max_model_len=args.input_len + args.output_len + 16, kv_cache_gib=0.5, **kw)
        print(f"{kind}:{n} loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    rng = random.Random(0)
    vocab = int(next(iter(engines.values())).llm_engine.config.hf_config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True, detokenize=False)
    rates: dict = {}
    print(f"load average before: {os.getloadavg()}", flush=True)
    try:
        for batch in args.batch_sizes:
            prompts = [{"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(args.input_len)]}
                       for _ in range(batch)]
            for r in range(args.rounds + 1):
                for (kind, n), llm in engines.items():
                    torch.set_num_threads(n if kind == "one" else threads)
                    t = time.perf_counter()
                    llm.generate(prompts, params, use_tqdm=False)
                    if r:
                        rates.setdefault((kind, n, batch), []).append(batch * args.output_len / (time.perf_counter() - t))
        print(f"load average after: {os.getloadavg()}", flush=True)
    finally:
        torch.set_num_threads(threads)
        for llm in engines.values():
            llm.llm_engine.shutdown()
    rows = [{"config": f"{k}:{n}", "batch": b, "median_tok_s": round(statistics.median(v), 2),
             "min_tok_s": round(min(v), 2), "max_tok_s": round(max(v), 2), "rounds": len(v)}
            for (k, n, b), v in rates.items()]
    print("| config | batch | median tok/s | min-max |\n|---|---:|---:|---:|")
    for row in rows:
        print(f"| {row['config']} | {row['batch']} | {row['median_tok_s']:.1f} | {row['min_tok_s']:.1f}-{row['max_tok_s']:.1f} |")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
