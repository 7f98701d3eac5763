"""Decode speed of pre-quantized AWQ and GPTQ checkpoints against the engine's own quantization="int4" on
the same random-weight model, in one run: batch-1 decode tokens/s after a prompt, and 16 parallel
requests' generated tokens/s, each engine in turn, rounds alternating; medians.

The checkpoints are written with the layouts the test suite writes (tests/quant/packed_checkpoints.py:
AutoAWQ's GEMM packing with zero points, AutoGPTQ's v1 packing, symmetric and act-order), group 128 as
most Hub checkpoints are (64 for the 135M shape, whose 576 wide inputs 128 does not divide). int4 is measured twice: its defaults (group 32, mixed 4/8-bit down
projections) and group 128 without mixed precision, the same bytes per weight as the checkpoints.
The checkpoints store the embedding and LM head in float, as real ones do; the engine quantizes them at
load by default as int4 does (PERFXLM_PACKED_LM_HEAD / quantization's lm_head). `--float-heads` adds
each checkpoint with them kept float (vLLM's way) and int4 with `lm_head: false`.

    python benchmarks/prequant_speed.py                  # SmolLM2-135M's shapes, 30 layers
    python benchmarks/prequant_speed.py --shape 1b --rounds 3
    python benchmarks/prequant_speed.py --float-heads --parallel 0
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.quant.packed_checkpoints import awq_parts, gptq_parts, input_key, write_packed  # noqa: E402

from perfxlm import LLM, SamplingParams  # noqa: E402

SHAPES = {  # hidden, intermediate, layers, heads, KV heads, vocab
    "135m": (576, 1536, 30, 9, 3, 49152),
    "1b": (2048, 8192, 16, 32, 8, 128256),
}
GROUPS = {"135m": 64, "1b": 128}


def build(root: str, shape: str, group: int, float_heads: bool = False) -> dict[str, tuple[str, dict]]:
    """{name: (folder, extra LLM arguments)} for the float checkpoint and each packed one."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, inter, layers, heads, kv, vocab = SHAPES[shape]
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, tie_word_embeddings=True,
                      max_position_embeddings=4096, initializer_range=0.05)

    def model():
        torch.manual_seed(0)
        return LlamaForCausalLM(cfg).eval()

    folders: dict[str, tuple[str, dict]] = {}
    base = os.path.join(root, "float")
    model().to(torch.bfloat16).save_pretrained(base)
    folders["int4"] = (base, {"quantization": "int4"})
    folders[f"int4 g{group}"] = (base, {"quantization": {"method": "int4", "group_size": group,
                                                          "mixed_precision": False}})
    awq = os.path.join(root, "awq")
    write_packed(awq, model(), lambda name, w: awq_parts(w, group),
                 {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"})
    folders["awq"] = (awq, {})
    gptq = os.path.join(root, "gptq")
    write_packed(gptq, model(), lambda name, w: gptq_parts(w, 4, group, sym=True),
                 {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": True, "desc_act": False})
    folders["gptq"] = (gptq, {})
    orders: dict[str, torch.Tensor] = {}  # one permutation per input, as GPTQ's act-order gives

    def act_order(name, w):
        order = orders.setdefault(input_key(name), torch.randperm(w.shape[1], generator=torch.Generator().manual_seed(len(orders))))
        return gptq_parts(w, 4, group, sym=True, order=order)

    act = os.path.join(root, "gptq_act")
    write_packed(act, model(), act_order,
                 {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": True, "desc_act": True})
    folders["gptq act-order"] = (act, {})
    if float_heads:
        folders["int4 float head"] = (base, {"quantization": {"method": "int4", "lm_head": False}})
        for name, method in (("awq", "awq"), ("gptq", "gptq"), ("gptq act-order", "gptq")):
            folders[f"{name} float head"] = (folders[name][0], {"quantization": {"method": method, "lm_head": False}})
    return folders


def decode_tok_s(llm: LLM, prompt: list[int], out_len: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    m = out.metrics
    return (len(out.outputs[0].token_ids) - 1) / (m.last_token_time - m.first_token_time)


def parallel_tok_s(llm: LLM, prompts: list[list[int]], out_len: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=tuple(SHAPES), default="135m")
    ap.add_argument("--group", type=int, default=None, help="default: 64 for 135m, 128 for 1b")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--parallel", type=int, default=16, help="0: batch-1 decode only")
    ap.add_argument("--float-heads", action="store_true",
                    help="also each engine with its embedding and LM head kept float")
    ap.add_argument("--only", default=None, help="comma-separated engine names (int4, 'int4 g128', awq, gptq, ...)")
    args = ap.parse_args()
    args.group = args.group or GROUPS[args.shape]
    with tempfile.TemporaryDirectory() as tmp:
        folders = build(tmp, args.shape, args.group, args.float_heads)
        if args.only:
            keep = {n.strip() for n in args.only.split(",")}
            folders = {k: v for k, v in folders.items() if k in keep or k == "int4"}
        blocks = (args.parallel or 1) * (args.prompt_len + args.output_len) // 16 + 64  # five engines' KV pools
        engines = {name: LLM(path, skip_tokenizer_init=True, enable_prefix_caching=False, num_kv_blocks=blocks, **extra)
                   for name, (path, extra) in folders.items()}
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(10, 1000, (args.prompt_len,), generator=g).tolist()
        prompts = [torch.randint(10, 1000, (args.prompt_len,), generator=g).tolist() for _ in range(args.parallel)]
        for llm in engines.values():  # warm-up
            decode_tok_s(llm, prompt[:8], 4)
        dec = {n: [] for n in engines}
        par = {n: [] for n in engines}
        for r in range(args.rounds):
            for name, llm in engines.items():
                dec[name].append(decode_tok_s(llm, prompt, args.output_len))
                if args.parallel:
                    par[name].append(parallel_tok_s(llm, prompts, args.output_len))
            print(f"round {r + 1}: " + ", ".join(f"{n} {dec[n][-1]:.1f}" for n in engines), flush=True)
    ref_d = statistics.median(dec["int4"])
    print(f"\n{args.shape}-shaped random Llama, group {args.group}, {torch.get_num_threads()} threads, medians of "
          f"{args.rounds} alternating rounds; batch-1 decode after {args.prompt_len} tokens"
          + (f", {args.parallel} parallel {args.prompt_len}/{args.output_len}" if args.parallel else ""))
    for name in engines:
        d = statistics.median(dec[name])
        line = f"  {name:>25}: decode {d:7.1f} tok/s {d / ref_d:5.2f}x int4"
        if args.parallel:
            p, ref_p = statistics.median(par[name]), statistics.median(par["int4"])
            line += f"; parallel {p:7.1f} tok/s {p / ref_p:5.2f}x"
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
