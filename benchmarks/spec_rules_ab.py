"""Prompt lookup's guess rules against each other and plain decoding, by CPU time, in one process: a
plain engine and one speculative engine per `PERFXLM_NGRAM_DRAFTS` rule run each of benchmarks/
spec_decode.py's prompts in turn (plain, rule 1, rule 2, ... per round), one thread, and each decode step
is charged the thread's CPU time (robust on a shared machine where wall time is not). Per prompt it prints
the median decode tokens per CPU-second of each engine and whether every output equals plain decoding;
per prompt kind, each rule's speed-up over plain decoding (median over prompts, and each prompt's).

    python benchmarks/spec_rules_ab.py --dataset sharegpt_samples_1024.json --rules half,match
    python benchmarks/spec_rules_ab.py --rules match --row-tiles 4,0   # the row-group GEMVs' tile caps

With --row-tiles each rule's engine runs once per cap of the row-group GEMVs' tile (set_row_tile; 0: the
build's own), named rule/tN: the same guesses, the verification rows tiled differently.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from spec_decode import DEFAULT_SPEC, make_prompts

from perfxlm import LLM, SamplingParams


def make_engine(rule: str | None, spec: str) -> tuple[LLM, list[float]]:
    """An engine (speculative under `rule`, plain for None) whose steps record their CPU time."""
    if rule:
        os.environ["PERFXLM_NGRAM_DRAFTS"] = rule  # read when the proposer is built
    kwargs = {"speculative_config": json.loads(spec)} if rule else {}
    llm = LLM(None, kv_cache_gib=0.5, enable_prefix_caching=False, **kwargs)
    core, records = llm.llm_engine.core, []
    step = core.step

    def timed_step():
        t = time.thread_time()
        result = step()
        records.append(time.thread_time() - t)
        return result

    core.step = timed_step
    return llm, records


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default=None)
    ap.add_argument("--rules", default="half,match")
    ap.add_argument("--speculative-config", default=DEFAULT_SPEC)
    ap.add_argument("--prompts-per-kind", type=int, default=3)
    ap.add_argument("--passage-tokens", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--row-tiles", default=None, help="row tile caps to compare per rule (e.g. 4,0)")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)  # thread CPU time covers the step's whole work only with one thread
    rules = args.rules.split(",")
    engines = {"plain": make_engine(None, args.speculative_config)}
    engines.update({rule: make_engine(rule, args.speculative_config) for rule in rules})
    tile_of: dict[str, int] = {}
    if args.row_tiles:
        from perfxlm.ops import native

        ops = native.kernels()
        caps = [int(t) for t in args.row_tiles.split(",")]
        for rule in rules:
            for cap in caps:
                engines[f"{rule}/t{cap}"] = engines[rule]
                tile_of[f"{rule}/t{cap}"] = cap
            del engines[rule]
        rules = [name for name in engines if name != "plain"]
    tokenizer = engines["plain"][0].get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    kinds = make_prompts(tokenizer, args.dataset, args.prompts_per_kind, args.passage_tokens)
    speeds: dict[tuple[str, int, str], list[float]] = {}
    for kind, texts in kinds.items():
        for i, text in enumerate(texts):
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                   add_generation_prompt=True)
            outputs = {}
            for _ in range(args.rounds):
                for name, (llm, records) in engines.items():
                    if tile_of:
                        ops.set_row_tile(tile_of.get(name, 0))
                    records.clear()
                    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
                    # the first step prefills the prompt: decode is the steps after it
                    speeds.setdefault((kind, i, name), []).append((len(out.token_ids) - 1) / sum(records[1:]))
                    outputs[name] = list(out.token_ids)
            same = all(o == outputs["plain"] for o in outputs.values())
            cells = " ".join(f"{n} {statistics.median(speeds[(kind, i, n)]):6.1f}" for n in engines)
            print(f"{kind:10} {i}  {cells}  identical={same}", flush=True)
    print("speed-up over plain decoding (decode tokens per CPU-second), median over prompts [each prompt]")
    for kind, texts in kinds.items():
        for rule in rules:
            ratios = [statistics.median(speeds[(kind, i, rule)]) / statistics.median(speeds[(kind, i, "plain")])
                      for i in range(len(texts))]
            print(f"{kind:10} {rule:7} x{statistics.median(ratios):.2f} [{' '.join(f'{r:.2f}' for r in ratios)}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
