"""What prompt lookup can win on benchmarks/spec_decode.py's prompts, without timing anything twice: the
plain engine's greedy outputs are replayed through the n-gram rules (greedy verification accepts a guess
exactly where it equals the output), and each step is charged what a step of that many rows costs
(benchmarks/verify_rows.py's ratios to one row). Per prompt kind it prints the modelled speed-up over plain
decoding and the acceptance of each rule, and of an oracle that guesses exactly the tokens that will be
accepted (the bound for prompt lookup at that row cost).

    python benchmarks/spec_replay.py --dataset sharegpt_samples_1024.json
    python benchmarks/spec_replay.py --dataset sharegpt_samples_1024.json --row-costs 1,1.13,1.31,1.61,1.94,2.38

The default row costs are verify_rows.py's on a 2-vCPU Zen 4 after the row-group GEMVs took a step's rows
in tiles of 4 (loaded, one thread, CPU time per step: 2 to 6 rows cost 1.06x, 1.21x, 1.39x, 1.82x, 1.87x one
row; a fifth row starts a second tile); past the list's end each row adds the last step's increment.
Rules: "budget" (the most recent occurrence within the per-request budget), "half" (the match reaching
furthest back, a guess per two matched tokens), "match" (the same, a guess per matched token: the
engine's default), "reanchorN" ("match" re-anchored across one edit up to N tokens back:
PERFXLM_NGRAM_REANCHOR=N), "oracle" (the most recent occurrence cut where it will be rejected); pick them
with --rules. --outputs FILE keeps the plain outputs (written on the first run, read after), so rules can
be compared without running the model again; --verbose prints each step's accepted / proposed guesses.

    python benchmarks/spec_replay.py --dataset sharegpt_samples_1024.json --outputs plain.json \
        --rules match,reanchor3,oracle --verbose
    python benchmarks/spec_replay.py --dataset sharegpt_samples_1024.json --outputs plain.json --row-slope 0.064

--row-slope S charges a step of r rows 1 + S (r - 1) instead: at the least a row can cost on this CPU
(benchmarks/spec_row_floor.py), the speed-up no kernel work can raise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import numpy as np
from spec_decode import make_prompts

from perfxlm import LLM, SamplingParams
from perfxlm.spec_decode.draft_budget import DraftBudget
from perfxlm.spec_decode.ngram import REANCHOR_AFTER, propose_by_match, propose_ngram

DEFAULT_COSTS = "1,1.06,1.21,1.39,1.82,1.87"


def replay(prompt: list[int], output: list[int], rule: str, k: int, lookup: tuple[int, int],
           cost, trace: list | None = None) -> tuple[float, int, int]:
    """(modelled speed-up, draft tokens, accepted ones) of one request's decode under `rule`; `trace`
    gets each step's (guesses, accepted ones)."""
    tokens, pos, spent, drafted, accepted = [*prompt, output[0]], 1, 0.0, 0, 0
    budget = DraftBudget()
    while pos < len(output):
        room = min(budget.take(k) if rule == "budget" else k, len(output) - pos - 1)
        arr = np.asarray(tokens, dtype=np.int64)
        if room < 1:
            drafts = []
        elif rule == "budget":
            drafts = propose_ngram(arr, *lookup, room)
        elif rule.startswith("reanchor"):  # "reanchorN": match, re-anchored across an edit N tokens back
            drafts = propose_by_match(arr, *lookup, room, 1, int(rule[8:] or REANCHOR_AFTER))
        else:
            drafts = propose_by_match(arr, *lookup, room, 2 if rule == "half" else 1)
        if rule == "oracle":  # the most recent match's continuation, cut where it will be rejected
            drafts = propose_ngram(arr, *lookup, room)
            n = next((j for j, t in enumerate(drafts) if output[pos + j] != t), len(drafts))
            drafts = drafts[:n]
        good = next((j for j, t in enumerate(drafts) if output[pos + j] != t), len(drafts))
        if drafts:
            budget.observe(len(drafts), good)
            drafted, accepted = drafted + len(drafts), accepted + good
        spent += cost(1 + len(drafts))
        if trace is not None:
            trace.append((len(drafts), good))
        step = min(good + 1, len(output) - pos)
        tokens.extend(output[pos : pos + step])
        pos += step
    return (len(output) - 1) / spent if spent else 1.0, drafted, accepted


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dataset", default=None)
    ap.add_argument("--prompts-per-kind", type=int, default=3)
    ap.add_argument("--passage-tokens", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-speculative-tokens", type=int, default=5)
    ap.add_argument("--lookup", default="2,4", help="prompt_lookup_min,prompt_lookup_max")
    ap.add_argument("--row-costs", default=DEFAULT_COSTS, help="a step's cost by rows (1, 2, ...) over one row's")
    ap.add_argument("--row-slope", type=float, default=None,
                    help="instead of --row-costs, each row past the first adds this share of a one-row step "
                         "(benchmarks/spec_row_floor.py prints this CPU's least)")
    ap.add_argument("--rules", default="budget,half,match,reanchor,oracle")
    ap.add_argument("--outputs", default=None, help="JSON cache of the plain outputs (written if absent)")
    ap.add_argument("--verbose", action="store_true", help="per prompt, each rule's accepted lengths by step")
    args = ap.parse_args()
    costs = [float(c) for c in args.row_costs.split(",")]
    if args.row_slope is not None:
        costs = [1 + args.row_slope * r for r in range(args.num_speculative_tokens + 1)]
    step_up = costs[-1] - costs[-2] if len(costs) > 1 else 0.0

    def cost(rows: int) -> float:
        return costs[rows - 1] if rows <= len(costs) else costs[-1] + step_up * (rows - len(costs))

    lookup = tuple(int(v) for v in args.lookup.split(","))
    if args.outputs and os.path.exists(args.outputs):
        with open(args.outputs) as f:
            all_runs = {kind: [tuple(r) for r in runs] for kind, runs in json.load(f).items()}
    else:
        all_runs = plain_outputs(args)
        if args.outputs:
            with open(args.outputs, "w") as f:
                json.dump(all_runs, f)
    for kind, runs in all_runs.items():
        line = f"{kind:12}"
        for rule in args.rules.split(","):
            traces = [[] for _ in runs]
            results = [replay(p, o, rule, args.num_speculative_tokens, lookup, cost, t)
                       for (p, o), t in zip(runs, traces) if len(o) > 1]
            if args.verbose:
                for i, t in enumerate(traces):
                    print(f"{kind} {i} {rule}: " + " ".join(f"{a}/{d}" if d else "-" for d, a in t))
            drafted, accepted = sum(r[1] for r in results), sum(r[2] for r in results)
            speedups = [r[0] for r in results]
            line += (f"  {rule}: x{statistics.median(speedups):.2f} median [{' '.join(f'{s:.2f}' for s in speedups)}]"
                     f" acceptance {accepted / drafted if drafted else 0:.0%}")
        print(line, flush=True)
    return 0


def plain_outputs(args) -> dict[str, list[tuple[list[int], list[int]]]]:
    """(prompt ids, greedy output ids) of each prompt, by kind (one thread: nothing here is timed)."""
    import torch

    torch.set_num_threads(1)
    llm = LLM(args.model, kv_cache_gib=0.5, enable_prefix_caching=False)
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    all_runs = {}
    for kind, texts in make_prompts(tokenizer, args.dataset, args.prompts_per_kind, args.passage_tokens).items():
        runs = []
        for text in texts:
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                   add_generation_prompt=True)
            out = llm.generate(prompt, params, use_tqdm=False)[0]  # one at a time, as spec_decode.py runs them
            runs.append((list(out.prompt_token_ids), list(out.outputs[0].token_ids)))
        all_runs[kind] = runs
    return all_runs


if __name__ == "__main__":
    sys.exit(main())
