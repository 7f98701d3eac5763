"""How far bf16 and int8 LoRA storage (lora_dtype) move a model's output from float32 adapters, which
equal peft's (tests/lora/test_lora_vs_peft.py): each prompt's greedy continuation under float32 adapters
is scored teacher-forced (prompt_logprobs) under each storage, so every position compares the same
context. Reported: the largest and mean change of a token's log-probability, how often the top token
differs, and the adapter's own effect (the same figures for no adapter at all) to put them in scale.

    python benchmarks/lora_numerics.py                          # the embedded SmolLM2 GGUF, rank 16
    python benchmarks/lora_numerics.py --model DIR --rank 64 --std 0.05
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lora_throughput import write_adapter  # noqa: E402  (the same random PEFT folders)

from perfxlm import LLM, LoRARequest, SamplingParams  # noqa: E402
from perfxlm.config import default_model_path  # noqa: E402


def scored(llm: LLM, sequences: list[list[int]], starts: list[int], lora) -> list[list[tuple[float, int]]]:
    """(log-probability of each continuation token, the top token there) per sequence."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0)
    outs = llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False, lora_request=lora)
    rows = []
    for seq, start, out in zip(sequences, starts, outs):
        row = []
        for pos in range(start, len(seq)):
            entry = out.prompt_logprobs[pos]
            top = max(entry.items(), key=lambda kv: kv[1].logprob)[0]
            row.append((entry[seq[pos]].logprob, top))
        rows.append(row)
    return rows


def compare(ref, got) -> tuple[float, float, float]:
    """(max |d logprob|, mean |d logprob|, share of positions whose top token differs)."""
    diffs, flips, n = [], 0, 0
    for r_row, g_row in zip(ref, got):
        for (r_lp, r_top), (g_lp, g_top) in zip(r_row, g_row):
            diffs.append(abs(r_lp - g_lp))
            flips += r_top != g_top
            n += 1
    return max(diffs), sum(diffs) / len(diffs), flips / n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2 GGUF")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--std", type=float, default=0.02, help="the random A's and B's standard deviation")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    args = ap.parse_args()
    model = args.model or default_model_path()

    def engine(lora_dtype: str) -> LLM:  # one at a time: three float32 copies of a model need not fit
        return LLM(model, dtype="float32", enable_lora=True, max_lora_rank=args.rank, lora_dtype=lora_dtype,
                   enable_prefix_caching=False, num_kv_blocks=args.prompts * (args.input_len + args.output_len) // 16 + 64)

    llm = engine("float32")
    cfg = llm.llm_engine.config.hf_config
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, cfg.vocab_size - 100, (args.input_len,), generator=g).tolist()
               for _ in range(args.prompts)]
    with tempfile.TemporaryDirectory() as tmp:
        path = write_adapter(os.path.join(tmp, "a"), cfg, args.rank, seed=1, std=args.std)
        lora = LoRARequest("a", 1, path)
        greedy = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False, lora_request=lora)
        sequences = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
        starts = [len(p) for p in prompts]
        ref = scored(llm, sequences, starts, lora)
        rows = {"no adapter": scored(llm, sequences, starts, None)}
        del llm
        for d in ("bfloat16", "int8"):
            llm = engine(d)
            rows[d] = scored(llm, sequences, starts, lora)
            del llm
    print(f"model {model} (float32 activations), one adapter of rank {args.rank} on every projection "
          f"(A, B ~ N(0, {args.std}^2), alpha 2r), {args.prompts} prompts x {args.output_len} greedy tokens of "
          "the float32 adapter, scored teacher-forced; against float32 adapters (= peft):")
    for name, got in rows.items():
        mx, mean, flips = compare(ref, got)
        print(f"  {name:>10}: |d logprob| max {mx:.4f}, mean {mean:.5f}; top token differs at {flips:.2%} of positions")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
