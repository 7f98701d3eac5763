"""One mixture-of-experts layer's routed experts: the native one-call kernel (`ops/fused_moe.py`) against
the torch loop over experts (`grouped_experts_torch`), same inputs, same run, rounds interleaved so drift
on a shared machine hits both alike; medians reported, and their ratio.

Defaults: Qwen3-30B-A3B's expert shapes (hidden 2048, 768 per expert, 8 of 128 experts per token) with
fewer experts so the stacks fit a small machine (routing stays uniform over those there are).

    python benchmarks/moe_experts.py                           # bf16 stacks, 1 / 16 / 128 tokens
    python benchmarks/moe_experts.py --weights int4 --experts 64 --tokens 1,4 --output-json moe.json
    python benchmarks/moe_experts.py --weights int4 --int8-blocks --tokens 1,16,512  # llama.cpp's Q8 products
    python benchmarks/moe_experts.py --weights mxfp4 --gpt-oss --experts 32 --top-k 4 --hidden 2880 --inter 2880

    python benchmarks/moe_experts.py --weights int4 --int8-blocks --layouts --experts 64 --tokens 1,16
        # the native kernel on plain stacks against the same stacks in row groups (CodeLayout.ROWS8)

--layouts: Q8_0 / Q4_0-form stacks (centred codes, a float16 scale per 32), the native kernel on the plain
layout against row groups, rounds alternating; per-call wall time and the process's CPU time (both
threads) reported.
--gpt-oss: biased experts with the clamped SwiGLU over interleaved gate/up rows. The same script run with
another checkout on the path (PYTHONPATH) times that checkout's kernel on the same inputs: alternate the
two for an A/B of a kernel change.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from perfxlm.model.layers.activation import ClampedSwiGLU, SiluAndMul
from perfxlm.model.layers.moe import grouped_experts, grouped_experts_torch
from perfxlm.ops import native
from perfxlm.quant.quantizers import quantize_symmetric_int4, quantize_symmetric_int8
from perfxlm.quant.weight import ActivationMode


def stacks(args: argparse.Namespace):
    g = torch.Generator().manual_seed(0)
    e, h, i = args.experts, args.hidden, args.inter
    if args.weights == "mxfp4":  # random E2M1 codes, exponents about 0.02's (quantizing this many floats is slow)
        from perfxlm.quant import mxfp4

        def packed(n: int, k: int):
            blocks = torch.randint(0, 256, (e, n, k // 32, 16), dtype=torch.uint8, generator=g)
            exponents = torch.randint(119, 122, (e, n, k // 32), dtype=torch.uint8, generator=g)
            return mxfp4.from_checkpoint(blocks, exponents, "w")

        return packed(2 * i, h), packed(h, i)
    gate_up = torch.randn(e, 2 * i, h, generator=g) * 0.02
    down = torch.randn(e, h, i, generator=g) * 0.02
    if args.weights == "bf16":
        return gate_up.bfloat16(), down.bfloat16()
    if args.weights == "int8":  # --layouts: Q8_0's form (centred codes, float16 scales), which row groups take
        q8 = dict(centred=True, half=True) if args.layouts else {}
        return quantize_symmetric_int8(gate_up, 32, **q8), quantize_symmetric_int8(down, 32, **q8)
    if args.weights == "int4":
        return quantize_symmetric_int4(gate_up, 32), quantize_symmetric_int4(down, 32)
    return gate_up, down


def timed(fn, repeats: int, clock=time.perf_counter) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times)


def compare_layouts(args: argparse.Namespace, gate_up, down, act, biases) -> list[dict]:
    """The native kernel on the plain stacks and on the same stacks in row groups, rounds alternating."""
    layouts = {"plain": (gate_up, down), "rows8": (gate_up.in_row_groups(), down.in_row_groups())}
    results = []
    for n in (int(t) for t in args.tokens.split(",")):
        g = torch.Generator().manual_seed(n)
        x = torch.randn(n, args.hidden, generator=g)
        weights, ids = torch.softmax(torch.randn(n, args.experts, generator=g), -1).topk(args.top_k, dim=-1)
        wall: dict[str, list[float]] = {k: [] for k in layouts}
        cpu: dict[str, list[float]] = {k: [] for k in layouts}
        for _ in range(args.rounds):
            for name, (gu, dn) in layouts.items():
                call = lambda gu=gu, dn=dn: grouped_experts(x, weights, ids, gu, dn, act, *biases)  # noqa: E731
                wall[name].append(timed(call, args.repeats))
                cpu[name].append(timed(call, args.repeats, time.process_time))
        w = {k: statistics.median(v) * 1e3 for k, v in wall.items()}
        c = {k: statistics.median(v) * 1e3 for k, v in cpu.items()}
        active = int(torch.unique(ids).numel())
        results.append({"tokens": n, "active_experts": active, "plain_ms": w["plain"], "rows8_ms": w["rows8"],
                        "plain_cpu_ms": c["plain"], "rows8_cpu_ms": c["rows8"], "speedup": w["plain"] / w["rows8"],
                        "cpu_speedup": c["plain"] / c["rows8"]})  # fmt: skip
        print(f"{n:4d} tokens ({active:3d} experts active): plain {w['plain']:8.3f} ms ({c['plain']:8.3f} cpu)  "
              f"row groups {w['rows8']:8.3f} ms ({c['rows8']:8.3f} cpu)  x{w['plain'] / w['rows8']:.2f} "
              f"(cpu x{c['plain'] / c['rows8']:.2f})", flush=True)  # fmt: skip
    return results


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", choices=["float32", "bf16", "int8", "int4", "mxfp4"], default="bf16")
    ap.add_argument("--int8-blocks", action="store_true", help="quantized stacks under int8 activation blocks")
    ap.add_argument("--gpt-oss", action="store_true", help="biased experts, clamped SwiGLU (interleaved gate/up)")
    ap.add_argument("--layouts", action="store_true", help="native kernel: plain stacks against row groups "
                    "(int8 / int4 weights with --int8-blocks)")
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--tokens", default="1,16,128", help="batch sizes (tokens per step), comma-separated")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args(argv)
    if native.kernels() is None:
        sys.exit("the native kernels are not built on this machine: nothing to compare")
    torch.set_num_threads(args.threads)
    gate_up, down = stacks(args)
    if args.int8_blocks and args.weights in ("int8", "int4", "mxfp4"):
        gate_up.activations = down.activations = ActivationMode.INT8_NATIVE
    act, biases = SiluAndMul(), (None, None)
    if args.gpt_oss:
        act = ClampedSwiGLU(1.702, 7.0)
        biases = (torch.randn(args.experts, 2 * args.inter) * 0.01, torch.randn(args.experts, args.hidden) * 0.01)
    if args.layouts and not (args.int8_blocks and args.weights in ("int8", "int4")):
        sys.exit("--layouts compares row groups: int8 or int4 weights under --int8-blocks")
    results = []
    with torch.inference_mode():
        if args.layouts:
            results = compare_layouts(args, gate_up, down, act, biases)
        for n in () if args.layouts else (int(t) for t in args.tokens.split(",")):
            g = torch.Generator().manual_seed(n)
            x = torch.randn(n, args.hidden, generator=g)
            weights, ids = torch.softmax(torch.randn(n, args.experts, generator=g), -1).topk(args.top_k, dim=-1)
            # said, not asserted: an older checkout's kernel may round otherwise and is still worth timing
            same = torch.equal(grouped_experts(x, weights, ids, gate_up, down, act, *biases),
                               grouped_experts_torch(x, weights, ids, gate_up, down, act, *biases))  # fmt: skip
            rounds = {"native": [], "torch": []}
            for _ in range(args.rounds):
                rounds["native"].append(
                    timed(lambda: grouped_experts(x, weights, ids, gate_up, down, act, *biases), args.repeats))
                rounds["torch"].append(
                    timed(lambda: grouped_experts_torch(x, weights, ids, gate_up, down, act, *biases), args.repeats))
            nat, tor = statistics.median(rounds["native"]), statistics.median(rounds["torch"])
            active = int(torch.unique(ids).numel())
            results.append({"tokens": n, "active_experts": active, "native_ms": nat * 1e3, "torch_ms": tor * 1e3,
                            "speedup": tor / nat, "same_bits": same})  # fmt: skip
            print(f"{n:4d} tokens ({active:3d} experts active): native {nat * 1e3:8.3f} ms  torch loop "
                  f"{tor * 1e3:8.3f} ms  x{tor / nat:.2f}  {'same bits' if same else 'BITS DIFFER'}", flush=True)  # fmt: skip
    report = {"layouts": args.layouts, "weights": args.weights, "int8_blocks": args.int8_blocks, "gpt_oss": args.gpt_oss, "experts": args.experts, "top_k": args.top_k, "hidden": args.hidden,
              "inter": args.inter, "threads": args.threads, "results": results}  # fmt: skip
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
