"""The least a verification row of speculative decoding can cost on this CPU, as a share of a plain decode
step: the row's multiply-adds (every linear layer's, the LM head's, and attention's over the context) at
the throughput of the dot-product instruction the engine's kernels use for them (benchmarks/
dot_throughput.py's measurement, on every thread), over the time a plain decode step of the same model
takes here. Speculation on a CPU is sold as "verifying a few guesses costs what one token costs"; that
holds where the cores' arithmetic far outruns the memory's bandwidth. On a CPU with few cores it does
not, and no kernel can make a row cheaper than this.

    python benchmarks/spec_row_floor.py                                  # the default model, 2 threads
    python benchmarks/spec_row_floor.py --model m.bf16.gguf --quantization none --dtype bfloat16

It prints the row's multiply-adds, the instructions and their rates, the floor in ms and as a share of the
step, and the row costs to model prompt lookup at that floor with benchmarks/spec_replay.py
(`--row-slope SHARE`): the best speed-up any kernel could give those prompts on this CPU. The measured
per-row costs to compare it with come from benchmarks/verify_rows.py.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from dot_throughput import measure

from perfxlm import LLM, SamplingParams
from perfxlm.bench.latency import measure_batch
from perfxlm.bench.roofline import model_costs

# dot_throughput.py's kernels: name -> multiply-adds per step
MACS_PER_STEP = {
    "vpdpbusd zmm (AVX512-VNNI)": 64,
    "vpdpbusd ymm (AVX512-VNNI/VL)": 32,
    "vpmaddubsw+vpmaddwd+vpaddd ymm (AVX2 int8 dot)": 32,
    "vdpbf16ps zmm (AVX512-BF16)": 32,
    "vfmadd231ps zmm (AVX-512F)": 16,
    "vfmadd231ps ymm (FMA)": 8,
}
_AVX512 = ("avx512", "avx512_vnni", "avx512_bf16", "amx")
_VNNI512 = ("avx512_vnni", "avx512_bf16", "amx")
_BF16 = ("avx512_bf16", "amx")
_AVX2_INT8 = "vpmaddubsw+vpmaddwd+vpaddd ymm (AVX2 int8 dot)"


def _fma(isa: str) -> str:
    return "vfmadd231ps zmm (AVX-512F)" if isa in _AVX512 else "vfmadd231ps ymm (FMA)"


def linear_instruction(resolved) -> str:
    """The instruction a decode row's linear products take under the engine's plan for this model. The
    avx512 tier's int8 dot (the same three instructions on zmm) is counted as AVX2's, which the table has;
    the amx tier's as AVX-512's (its tiles, not in the table, would lower the floor further)."""
    plan, isa = resolved.cpu_plan, resolved.isa
    if resolved.quantized_source is not None and str(resolved.quant_activations).startswith("int8"):
        if isa in _VNNI512:
            return "vpdpbusd zmm (AVX512-VNNI)" if plan.dot_width == 512 else "vpdpbusd ymm (AVX512-VNNI/VL)"
        return "vpdpbusd ymm (AVX512-VNNI/VL)" if isa == "avx_vnni" else _AVX2_INT8
    if "bfloat16" in str(resolved.weight_dtype) and plan.bf16_dots and isa in _BF16:
        return "vdpbf16ps zmm (AVX512-BF16)"
    return _fma(isa)


def attention_instruction(resolved) -> str:
    """The instruction decode attention's products take (a bf16 cache's pairs where the CPU has them)."""
    if resolved.kv_cache_spec.name == "bfloat16" and resolved.isa in _BF16:
        return "vdpbf16ps zmm (AVX512-BF16)"
    return _fma(resolved.isa)


def row_macs(llm: LLM) -> tuple[float, float]:
    """(multiply-adds of one token's linear products and LM head, attention's per context token), from the
    roofline's count of the model (perfxlm/bench/roofline.py: a mixture of experts counts every expert,
    so its floor comes out high)."""
    costs = model_costs(llm)
    if costs is None:
        raise SystemExit("the engine's model is not reachable from this process (a multi-process executor)")
    return costs["matmul_params_per_token"] + costs["lm_head_params"], costs["attn_flops_per_pair"] / 2


def plain_step_ms(llm: LLM, context: int, steps: int, rounds: int) -> float:
    """Median over `rounds` of a batch-1 greedy decode's ms per step after a `context`-token prompt."""
    vocab = llm.get_tokenizer().vocab_size
    prompt = {"prompt_token_ids": [(7 * i + 100) % (vocab - 200) + 100 for i in range(context)]}
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    return statistics.median(1e3 / measure_batch(llm.llm_engine, [prompt], params, tag=f"floor-{r}")["decode_tok_s"]
                             for r in range(rounds))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2 GGUF")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=650, help="prompt tokens before the timed decode")
    ap.add_argument("--steps", type=int, default=64, help="decode steps timed per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20_000_000, help="dot_throughput.py's loop iterations")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    rates = measure(args.iters)  # first, while nothing else runs
    llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization, kv_cache_gib=0.5,
              enable_prefix_caching=False)
    resolved = llm.llm_engine.config.resolved
    if resolved.isa == "scalar":
        raise SystemExit("the scalar tier's products are plain loops, not in dot_throughput.py's table; "
                         "force a vector tier with PERFXLM_ISA")
    linear, per_token = row_macs(llm)
    step = plain_step_ms(llm, args.context, args.steps, args.rounds)
    floor = 0.0
    for what, macs, name in (("linear products", linear, linear_instruction(resolved)),
                             (f"attention over {args.context} tokens", per_token * args.context,
                              attention_instruction(resolved))):
        if name not in rates:
            raise SystemExit(f"{name}: this CPU lacks it, but the plan ({resolved.isa}) uses it")
        ms = macs / (MACS_PER_STEP[name] / rates[name] * 1e9 * args.threads) * 1e3  # steps per ns x macs per step
        floor += ms
        print(f"{what:28} {macs / 1e6:8.1f} M multiply-adds  {name}: {rates[name]:.3f} ns per step, "
              f"{MACS_PER_STEP[name]} each -> {ms:.3f} ms on {args.threads} threads")
    share = floor / step
    if resolved.isa == "amx":
        print("(amx: counted at AVX-512's instructions; its tiles take a step's rows faster, so the floor is lower)")
    print(f"plain decode step ({resolved.isa}, {args.threads} threads, {args.context}-token context): {step:.2f} ms")
    print(f"a verification row costs at least {floor:.3f} ms = {share:.1%} of a step; model prompt lookup there with")
    print(f"    python benchmarks/spec_replay.py --row-slope {share:.3f} --dataset ... --outputs ...")
    return 0


if __name__ == "__main__":
    sys.exit(main())
