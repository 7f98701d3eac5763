"""Structured outputs cost: per-token mask fill of the grammar engine on the model's tokenizer, and the
decode throughput of a batch where half the rows are guided against the same batch unguided.

    python benchmarks/bench_structured_outputs.py [--model PATH] [--batch 16] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import time

from perfxlm import LLM, SamplingParams
from perfxlm.sampling_params import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city", "zip"]}}, "required": ["name", "age", "tags", "address"]}
TEXT = json.dumps({"name": "Alice Smith", "age": 42, "tags": ["a", "bb", "some longer tag text"],
                   "address": {"city": "Paris", "zip": "75001"}})


def mask_cost(llm: LLM) -> dict:
    import xgrammar as xgr

    tok = llm.get_tokenizer()
    backend_vocab = int(llm.llm_engine.config.hf_config.vocab_size)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=backend_vocab)
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    ids = tok.encode(TEXT, add_special_tokens=False)
    out = {}
    for name, grammar in (("json_schema", compiler.compile_json_schema(json.dumps(SCHEMA))),
                          ("json_object", compiler.compile_json_schema('{"type": "object"}'))):
        matcher = xgr.GrammarMatcher(grammar)
        bitmask = xgr.allocate_token_bitmask(1, backend_vocab)
        times = []
        for t in ids:
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            times.append(time.perf_counter() - start)
            assert matcher.accept_token(t)
        out[name] = {"mean_us": 1e6 * sum(times) / len(times), "max_us": 1e6 * max(times)}
    return out


def throughput(llm: LLM, batch: int, tokens: int, guided_fraction: float) -> tuple[float, float]:
    """(tokens per wall second, tokens per CPU second of this process: steady under other load)."""
    regex = StructuredOutputsParams(regex=r"[A-Za-z ,.]+")  # never ends by itself: every row runs `tokens` steps
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=tokens, ignore_eos=True,
                             structured_outputs=regex if i < batch * guided_fraction else None)
              for i in range(batch)]
    prompts = [f"Write a short story about the number {i}." for i in range(batch)]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm up (the grammar engine's vocabulary too)
    start, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return n / elapsed, n / cpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    llm = LLM(args.model, kv_cache_gib=0.5, enable_prefix_caching=False)
    print(json.dumps({"mask_fill_per_token": mask_cost(llm)}, indent=1))
    plain, half = [], []
    for _ in range(args.repeats):  # interleaved, best of each: other load on the machine hits both alike
        plain.append(throughput(llm, args.batch, args.tokens, 0.0))
        half.append(throughput(llm, args.batch, args.tokens, 0.5))
    for k, unit in ((0, "tok/s"), (1, "tok per CPU-s")):
        p, h = max(x[k] for x in plain), max(x[k] for x in half)
        print(f"batch {args.batch} x {args.tokens} tokens, best of {args.repeats}: unguided {p:.1f} {unit}, "
              f"50 % guided {h:.1f} {unit} ({h / p:.1%}); runs: {[round(x[k]) for x in plain]} / "
              f"{[round(x[k]) for x in half]}")


if __name__ == "__main__":
    main()
