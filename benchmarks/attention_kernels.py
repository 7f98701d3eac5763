"""The attention kernels alone, per KV cache dtype: decode over a paged cache and prefill over cached
context, on a cache filled with random values (every page touched, scales of real magnitudes).

- decode: the native `paged_decode_attention` (one query token per sequence, `--batch` sequences of
  `--context` tokens; with `--rows N`, N query rows per sequence reading its one block table, the last
  seeing `--context` tokens and each before it one fewer: a verification step's rows of N - 1 guesses),
  and with `--torch` the plain-torch path beside it; `--decode-products` times it
  with float32 and with bf16 products over a bf16 cache (PERFXLM_DECODE_ATTENTION=float32 | bf16: the
  latter where the build has AVX512-BF16, else it runs float32 too).
- prefill: `--new` tokens of one sequence after `--context` cached ones, the tiled path
  (`ops/prefill_tiles.py`) against the gathered reference (one dequantized copy of the sequence).

Rounds are interleaved over the dtypes so drift on a shared machine hits each alike; medians of the
rounds' medians are reported. Defaults: Llama-3.2-1B's attention shapes (32 heads, 8 KV heads of 64).

    python benchmarks/attention_kernels.py                      # decode and prefill, 4k context
    python benchmarks/attention_kernels.py --dtypes auto,fp8 --context 16384 --output-json att.json
    python benchmarks/attention_kernels.py --dtypes auto --new 0 --decode-products --rows 6 \
        --heads 9 --kv-heads 3 --context 650       # the default model's verification rows
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from perfxlm.ops import native
from perfxlm.ops.attention import (
    paged_decode_attention,
    paged_decode_attention_torch,
    prefill_attention,
    prefill_attention_reference,
    write_kv_cache,
)
from perfxlm.ops.kv_quant import KV_CACHE_DTYPES, KVCacheSpec


class Setup:
    """One cache dtype's filled cache and the inputs of each kernel."""

    def __init__(self, kv: str, args: argparse.Namespace):
        model_dtype = torch.bfloat16 if args.model_dtype == "bfloat16" else torch.float32
        self.spec = KVCacheSpec.resolve(kv, model_dtype)
        h, kvh, d, bs = args.heads, args.kv_heads, args.head_dim, args.block_size
        per_seq = -(-(args.context + args.new) // bs)
        num_blocks = per_seq * max(args.batch, 1)
        self.cache = self.spec.allocate(num_blocks, bs, kvh, d)
        g = torch.Generator().manual_seed(0)
        tokens = num_blocks * bs
        for start in range(0, tokens, 4096):  # written in pieces: the float K/V of a long cache is large
            n = min(4096, tokens - start)
            k, v = torch.randn(n, kvh, d, generator=g), torch.randn(n, kvh, d, generator=g)
            slots = torch.arange(start, start + n)
            write_kv_cache(k.to(model_dtype), v.to(model_dtype), self.cache.key, self.cache.value, slots,
                           self.cache.key_scale, self.cache.value_scale)  # fmt: skip
        order = torch.randperm(num_blocks, generator=g)  # scattered blocks, as a busy pool's
        rows = args.rows
        if not 1 <= rows <= args.context:
            raise ValueError(f"--rows {rows}: expected 1..--context ({args.context}) query rows per sequence")
        # each sequence's rows read its one table, the last at the whole context (a verification step)
        self.tables = order.view(max(args.batch, 1), per_seq).repeat_interleave(rows, dim=0)
        self.lens = (args.context - rows + 1 + torch.arange(rows)).repeat(max(args.batch, 1))
        self.scale = d**-0.5
        self.query = torch.randn(args.batch * rows, h, d, generator=g)
        self.new_q = torch.randn(args.new, h, d, generator=g).to(model_dtype)
        self.new_k = torch.randn(args.new, kvh, d, generator=g).to(model_dtype)
        self.new_v = torch.randn(args.new, kvh, d, generator=g).to(model_dtype)
        self.context = args.context
        self.scales = {"key_scale": self.cache.key_scale, "value_scale": self.cache.value_scale}

    def decode(self, fn) -> None:
        fn(self.query, self.cache.key, self.cache.value, self.tables, self.lens, self.scale, None, **self.scales)

    def prefill(self, fn) -> None:
        fn(self.new_q, self.new_k, self.new_v, self.cache.key, self.cache.value, self.tables[0], self.context,
           self.scale, bf16_model=self.cache.bf16_model, **self.scales)  # fmt: skip


def with_decode_products(mode: str):
    """The native decode under PERFXLM_DECODE_ATTENTION=mode (read at each call)."""

    def call(s: Setup) -> None:
        previous = os.environ.get("PERFXLM_DECODE_ATTENTION")
        os.environ["PERFXLM_DECODE_ATTENTION"] = mode
        try:
            s.decode(paged_decode_attention)
        finally:
            if previous is None:
                del os.environ["PERFXLM_DECODE_ATTENTION"]
            else:
                os.environ["PERFXLM_DECODE_ATTENTION"] = previous

    return call


def kernels(args: argparse.Namespace) -> dict:
    out = {}
    if args.batch > 0:
        if native.kernels() is not None:
            out["decode"] = lambda s: s.decode(paged_decode_attention)
            if args.decode_products:
                out["decode-float32-products"] = with_decode_products("float32")
                out["decode-bf16-products"] = with_decode_products("bf16")
        if args.torch or native.kernels() is None:
            out["decode-torch"] = lambda s: s.decode(paged_decode_attention_torch)
    if args.new > 0 and args.context > 0:
        out["prefill-tiled"] = lambda s: s.prefill(prefill_attention)
        out["prefill-gathered"] = lambda s: s.prefill(prefill_attention_reference)
    return out


def median_ms(call, iters: int) -> float:
    call()  # warm-up: thread pools, first-touch of buffers
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", default="auto,int8,fp8", help=f"comma-separated, of {', '.join(KV_CACHE_DTYPES)}")
    ap.add_argument("--model-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="what `auto` stores, and the prefill compute dtype")  # fmt: skip
    ap.add_argument("--context", type=int, default=4096, help="cached tokens per sequence")
    ap.add_argument("--batch", type=int, default=1, help="decode sequences (0: no decode)")
    ap.add_argument("--rows", type=int, default=1, help="decode query rows per sequence (a verification step's)")
    ap.add_argument("--new", type=int, default=512, help="prefill tokens after the context (0: no prefill)")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=50, help="calls per kernel per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--torch", action="store_true", help="also time the plain-torch decode path")
    ap.add_argument("--decode-products", action="store_true",
                    help="also time the native decode with float32 and with bf16 products (bf16 caches)")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    setups = {kv: Setup(kv, args) for kv in dtypes}  # ValueError for an unknown dtype, before any timing
    names = kernels(args)
    runs: dict[str, dict[str, list[float]]] = {k: {kv: [] for kv in dtypes} for k in names}
    for r in range(args.rounds):
        order = dtypes if r % 2 == 0 else dtypes[::-1]
        for name, fn in names.items():
            for kv in order:
                ms = median_ms(lambda: fn(setups[kv]), args.iters)
                runs[name][kv].append(ms)
                print(f"round {r + 1} {name} {kv}: {ms:.3f} ms", file=sys.stderr)
    result = {name: {kv: statistics.median(v) for kv, v in per.items()} for name, per in runs.items()}
    shape = (f"{args.heads} heads, {args.kv_heads} KV heads of {args.head_dim}, blocks of {args.block_size}, "
             f"context {args.context}, decode batch {args.batch} x {args.rows} rows, prefill {args.new} new tokens, "
             f"{args.threads} threads")  # fmt: skip
    print(f"\n{shape}\n\n| kernel, ms per call | " + " | ".join(dtypes) + " |")
    print("|---|" + "---:|" * len(dtypes))
    for name, per in result.items():
        first = per[dtypes[0]]
        cells = [f"{per[kv]:.3f} ({per[kv] / first:.2f}x)" for kv in dtypes]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print(f"\nmedians of {args.rounds} rounds of {args.iters} calls; ratios against {dtypes[0]} (lower is faster)")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"shape": shape, "ms": result, "rounds": runs}, f, indent=2)
    return result


if __name__ == "__main__":
    main()
