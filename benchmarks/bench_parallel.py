"""Data parallel against tensor parallel on this machine: output tokens/s of one batch of random prompts
(every request submitted at once) for one process, N tensor-parallel ranks and N replicas, the median of
several runs with the spread, so that a busy machine shows as a wide range.

    python benchmarks/bench_parallel.py --model path/to/config_dir --load-format dummy --batch-sizes 1,8
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time


def _one(kind: str, n: int, args: argparse.Namespace) -> dict:
    from perfxlm import LLM, SamplingParams

    kw = {"tp": {"tensor_parallel_size": n}, "dp": {"data_parallel_size": n}}.get(kind, {})
    t0 = time.perf_counter()
    llm = LLM(args.model, load_format=args.load_format, dtype=args.dtype, quantization=args.quantization,
              skip_tokenizer_init=True,
              enable_prefix_caching=False, max_model_len=args.input_len + args.output_len + 16, kv_cache_gib=0.5,
              **kw)  # fmt: skip
    load_s = time.perf_counter() - t0
    rng = random.Random(0)
    vocab = int(llm.llm_engine.config.hf_config.vocab_size)
    rows = []
    try:
        for batch in args.batch_sizes:
            prompts = [{"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(args.input_len)]}
                       for _ in range(batch)]
            params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True, detokenize=False)
            rates = []
            for i in range(args.warmup + args.repeats):
                t = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                if i >= args.warmup:
                    rates.append(batch * args.output_len / (time.perf_counter() - t))
            rows.append({"config": f"{kind}{n}", "batch": batch, "median_tok_s": statistics.median(rates),
                         "min_tok_s": min(rates), "max_tok_s": max(rates), "runs": len(rates)})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        llm.llm_engine.shutdown()
    return {"load_s": load_s, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (a folder with config.json for --load-format dummy)")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default=None, help="as LLM(quantization=...); 'none' dequantizes a GGUF file")
    ap.add_argument("--configs", default="one1,tp2,dp2", help="one1 (one process), tpN, dpN; comma-separated")
    ap.add_argument("--batch-sizes", default="1,8", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--input-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(f"load average before: {os.getloadavg()}", flush=True)
    for c in args.configs.split(","):
        out = _one(c[:-1] if c[-1].isdigit() else c, int(c[-1]) if c[-1].isdigit() else 1, args)
        print(f"{c}: loaded in {out['load_s']:.1f} s", flush=True)
    print(f"load average after: {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
