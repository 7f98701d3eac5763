"""Batch-1 decode speed with and without speculative decoding, on input-grounded prompts (rewrite a code
file of this repository with one change; quote a passage; summarise a text) and on open-ended chat
prompts, with the greedy outputs compared token for token.

Both engines live in one process and run each prompt alternately (plain, speculative, plain, ...), so drift
on a shared machine hits both alike; per prompt kind it prints the median decode tokens/s of each, their
ratio, the acceptance rate and mean accepted length, and whether every output was identical. Passages and
chat prompts come from a ShareGPT file (`--dataset`; without one only the code prompts run).

    python benchmarks/spec_decode.py --dataset sharegpt_samples_1024.json
    python benchmarks/spec_decode.py --model m.gguf --quantization none \
        --speculative-config '{"model": "m.gguf", "num_speculative_tokens": 4}'   # its own quantized file
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from perfxlm import LLM, SamplingParams
from perfxlm.bench.datasets import load_sharegpt_pairs
from perfxlm.bench.latency import measure_batch

DEFAULT_SPEC = '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CODE_FILES = ("perfxlm/engine/request.py", "perfxlm/spec_decode/stats.py", "perfxlm/engine/detokenizer.py")


def _clip(tokenizer, text: str, max_tokens: int) -> str:
    ids = tokenizer.encode(text, add_special_tokens=False)[:max_tokens]
    return tokenizer.decode(ids)


def make_prompts(tokenizer, dataset: str | None, per_kind: int, passage_tokens: int) -> dict[str, list[str]]:
    """Chat messages (one user turn each) per prompt kind."""
    kinds: dict[str, list[str]] = {"code edit": []}
    for path in _CODE_FILES[:per_kind]:
        with open(os.path.join(_ROOT, path), encoding="utf-8") as f:
            code = _clip(tokenizer, f.read(), passage_tokens)
        kinds["code edit"].append("Rewrite this Python code with every `self` renamed to `this`. Output only the "
                                  f"whole code.\n\n```python\n{code}\n```")
    if dataset is None:
        return kinds
    pairs = [(h, r) for h, r in load_sharegpt_pairs(dataset) if len(r) > 1500 and len(h) < 300]
    passages = [_clip(tokenizer, r, passage_tokens) for _, r in pairs[: 2 * per_kind]]
    kinds["quote"] = [f"Here is a passage:\n\n{p}\n\nQuote the passage's first three paragraphs exactly."
                      for p in passages[:per_kind]]
    kinds["summarise"] = [f"Summarise this text, reusing its own sentences:\n\n{p}" for p in passages[per_kind:]]
    kinds["chat"] = [h for h, _ in pairs[2 * per_kind : 3 * per_kind]]
    return kinds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="target model (default: the embedded SmolLM2 GGUF)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default=None,
                    help="the target's weights, e.g. none: a GGUF file dequantized, so that its own quantized "
                         "file can be the draft (--speculative-config '{\"model\": FILE, ...}')")
    ap.add_argument("--speculative-config", default=DEFAULT_SPEC)
    ap.add_argument("--dataset", default=None, help="a ShareGPT JSON file for the passage and chat prompts")
    ap.add_argument("--prompts-per-kind", type=int, default=3)
    ap.add_argument("--passage-tokens", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3, help="alternating runs of each prompt per engine")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    common = dict(dtype=args.dtype, quantization=args.quantization, kv_cache_gib=0.5, enable_prefix_caching=False)
    plain = LLM(args.model, **common)
    spec = LLM(args.model, speculative_config=args.speculative_config, **common)
    tokenizer = plain.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    stats = spec.llm_engine.scheduler.spec_stats
    report = {}
    for kind, texts in make_prompts(tokenizer, args.dataset, args.prompts_per_kind, args.passage_tokens).items():
        speeds: dict[str, list[float]] = {"plain": [], "spec": []}
        same = True
        before = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
        for p, text in enumerate(texts):
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                   add_generation_prompt=True)
            outs = {}
            for r in range(args.rounds):
                for name, llm in (("plain", plain), ("spec", spec)):
                    result = measure_batch(llm.llm_engine, [prompt], params, tag=f"{kind}-{p}-{r}-{name}")
                    speeds[name].append(result["decode_tok_s"])
                outs = {name: llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
                        for name, llm in (("plain", plain), ("spec", spec))}
            same &= outs["plain"] == outs["spec"]
        drafts, draft_tokens, accepted = (a - b for a, b in zip(
            (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens), before))
        row = {"plain_tok_s": statistics.median(speeds["plain"]), "spec_tok_s": statistics.median(speeds["spec"]),
               "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
               "mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0, "identical": same}
        row["speedup"] = row["spec_tok_s"] / row["plain_tok_s"]
        report[kind] = row
        print(f"{kind:12} plain {row['plain_tok_s']:7.1f} tok/s  speculative {row['spec_tok_s']:7.1f} tok/s  "
              f"x{row['speedup']:.2f}  acceptance {row['acceptance_rate']:.0%}  mean accepted length "
              f"{row['mean_acceptance_length']:.2f}  outputs identical: {same}", flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"speculative_config": json.loads(args.speculative_config), "results": report}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
