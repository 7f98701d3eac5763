"""What a verification step costs per row: the model's forward pass, the LM head and the whole step, by the
number of decode rows the step ran (1: a plain decode; k + 1: a verification of k guesses), over greedy
speculative generations of the code-edit prompts of benchmarks/spec_decode.py.

Speculation pays only if a row is cheap next to a step: a step of k + 1 rows that yields L tokens on
average beats plain decoding by L / (cost(k + 1) / cost(1)). Each step's parts are timed by the thread's
CPU time (--clock cpu, the default: robust on a shared machine, one thread) or by wall time (--clock wall,
for quiet figures at --threads N); per row count it prints the median of each and its ratio to one row.

    python benchmarks/verify_rows.py                        # CPU time, one thread
    python benchmarks/verify_rows.py --clock wall --threads 2
    python benchmarks/verify_rows.py --row-tiles 4,0        # row-group tile caps alternated per prompt

--row-tiles runs each prompt once per cap of the row-group GEMVs' tile (set_row_tile; 0: the build's own)
and prints the table per cap: the same guesses, the verification rows tiled differently.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time

from spec_decode import DEFAULT_SPEC, make_prompts

from perfxlm import LLM, SamplingParams

_PARTS = ("step", "forward", "logits")


def instrument(llm: LLM, clock) -> dict[int, list[dict[str, float]]]:
    """Wrap the engine's step, the runner's forward and the model's LM head; return the records by rows."""
    core = llm.llm_engine.core
    records: dict[int, list[dict[str, float]]] = collections.defaultdict(list)
    current: dict[str, float] = {}

    def timed(obj, name: str, part: str) -> None:
        inner = getattr(obj, name)

        def wrapper(*args, **kwargs):
            t = clock()
            result = inner(*args, **kwargs)
            current[part] = current.get(part, 0.0) + clock() - t
            if part == "forward":
                current["rows"] = args[1].numel()  # _forward(order, input_ids, ...)
            return result

        setattr(obj, name, wrapper)

    timed(core.runner, "_forward", "forward")
    timed(core.runner.model, "compute_logits", "logits")
    step = core.step

    def timed_step():
        current.clear()
        t = clock()
        result = step()
        current["step"] = clock() - t
        if "rows" in current:
            records[int(current["rows"])].append(dict(current))
        return result

    core.step = timed_step
    return records


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="target model (default: the embedded SmolLM2 GGUF)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default=None, help="e.g. none: a GGUF target dequantized (its own quantized "
                                                         "file as the draft model)")
    ap.add_argument("--speculative-config", default=DEFAULT_SPEC)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--row-tiles", default="0", help="row tile caps to alternate (e.g. 4,0)")
    args = ap.parse_args()
    if args.clock == "cpu" and args.threads != 1:
        raise SystemExit("--clock cpu reads the calling thread's CPU time: it needs --threads 1 (or --clock wall)")
    import torch

    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization, speculative_config=args.speculative_config,
              kv_cache_gib=0.5, enable_prefix_caching=False)
    records = instrument(llm, clock)
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    from perfxlm.ops import native

    ops = native.kernels()
    caps = [int(t) for t in args.row_tiles.split(",")]
    by_cap: dict[int, dict[int, list[dict[str, float]]]] = {c: collections.defaultdict(list) for c in caps}
    for _ in range(args.rounds):
        for text in make_prompts(tokenizer, None, 3, 300)["code edit"]:
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                   add_generation_prompt=True)
            for cap in caps:
                if ops is not None and hasattr(ops, "set_row_tile"):
                    ops.set_row_tile(cap)
                records.clear()
                llm.generate(prompt, params, use_tqdm=False)
                for r, recs in records.items():
                    by_cap[cap][r].extend(recs)
    if ops is not None and hasattr(ops, "set_row_tile"):
        ops.set_row_tile(0)
    out = {}
    for cap in caps:
        recs_by_rows = by_cap[cap]
        decode_rows = sorted(r for r in recs_by_rows if r <= 16 and len(recs_by_rows[r]) >= 3)
        if 1 not in decode_rows:
            raise SystemExit("no plain decode steps were timed: raise --max-tokens")
        median = {r: {p: statistics.median(rec.get(p, 0.0) for rec in recs_by_rows[r]) * 1e3 for p in _PARTS}
                  for r in decode_rows}
        if len(caps) > 1:
            print(f"row tile cap {cap if cap else 'of the build'}")
        for r in decode_rows:
            parts = "  ".join(f"{p} {median[r][p]:6.2f} ms (x{median[r][p] / median[1][p]:.2f})" for p in _PARTS)
            print(f"{r:2} rows  steps {len(recs_by_rows[r]):4}  {parts}", flush=True)
        out[cap] = median
    if args.output_json:
        with open(args.output_json, "w") as f:
            ms = out[caps[0]] if len(caps) == 1 else {str(c): m for c, m in out.items()}
            json.dump({"clock": args.clock, "threads": args.threads, "ms": ms}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
