"""Hugging Face transformers on the same workloads as bench_core.py, for same-machine ratios.

    python benchmarks/bench_hf_reference.py [--dtype float32] [--threads 2] [--batch 16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, GgufConfig

from perfxlm.config import default_model_path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=getattr(torch, args.dtype),
        quantization_config=GgufConfig(gguf_file=os.path.basename(path), dequantize=True)).eval()
    g = torch.Generator().manual_seed(0)
    prefill, decode, batch = [], [], []
    with torch.inference_mode():
        for _ in range(args.repeats):
            ids = torch.randint(100, 49000, (1, 512), generator=g)
            t = time.perf_counter()
            model(ids)
            prefill.append(512 / (time.perf_counter() - t))
            t = time.perf_counter()
            model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
            t1 = time.perf_counter() - t
            t = time.perf_counter()
            model.generate(ids, max_new_tokens=128, min_new_tokens=128, do_sample=False)
            decode.append(127 / (time.perf_counter() - t - t1))
            ids = torch.randint(100, 49000, (args.batch, 128), generator=g)
            t = time.perf_counter()
            model.generate(ids, max_new_tokens=128, min_new_tokens=128, do_sample=False)
            batch.append(args.batch * 128 / (time.perf_counter() - t))
            print(f"prefill {prefill[-1]:.0f} tok/s, decode b1 {decode[-1]:.1f} tok/s, "
                  f"batch {args.batch} {batch[-1]:.0f} gen tok/s", flush=True)
    print(f"median: prefill-512 {statistics.median(prefill):.0f} | decode b1 {statistics.median(decode):.1f} | "
          f"batch {args.batch} {statistics.median(batch):.0f} gen tok/s ({args.dtype})")


if __name__ == "__main__":
    main()
