"""Batch-1 decode speed with and without speculative decoding, on input-grounded prompts (rewrite a code
file of this repository: "code edit" renames every `self`, "one change" renames its first function, the
instruction before the code, "one change, code first" after it; quote a passage; summarise a text) and on
open-ended chat prompts, with the greedy outputs compared token for token.

Both engines live in one process and run each prompt alternately (plain, speculative, plain, ...), so drift
on a shared machine hits both alike; per prompt kind it prints the median decode tokens/s of each, their
ratio, the acceptance rate and mean accepted length, and whether every output was identical. Passages and
chat prompts come from a ShareGPT file (`--dataset`; without one only the code prompts run).

    python benchmarks/spec_decode.py --dataset sharegpt_samples_1024.json
    python benchmarks/spec_decode.py --model m.bf16.gguf --quantization none --dtype bfloat16 \
        --speculative-config '{"model": "m.Q4_0.gguf", "num_speculative_tokens": 4}'   # its own quantized file

(A bf16 target wants --dtype bfloat16: dtype "auto" is float32 on a CPU without native bf16 arithmetic, and
a float32 target reads twice the bytes per step its bf16 file holds.)
    python benchmarks/spec_decode.py --dataset sharegpt_samples_1024.json --llama-cpp   # llama.cpp beside
    python benchmarks/spec_decode.py --dataset sharegpt_samples_1024.json --parallel 16  # 16 requests at once

With --parallel N the N prompts (every kind's, in turn) run as one batch instead, alternately with
speculation off and on: whole-batch decode tok/s of each and their ratio (speculation should switch itself
off where verifying the batch's drafts is no longer nearly free, so the ratio should not fall below 1).

With --llama-cpp (a GGUF target) llama.cpp runs the same file and the same prompt tokens through
llama-cpp-python, plain and with its own speculation of the same kind, greedy, for as many tokens as
perfxlm's plain output has, alternating with perfxlm's runs: for `ngram` its prompt lookup
(`LlamaPromptLookupDecoding`: the same number of guesses, n-grams up to the same length; it takes the
earliest match and its full number of guesses, where perfxlm takes the match reaching furthest back and
fewer guesses for a short one); for a GGUF draft `model` the same draft file, run greedily by a second
llama.cpp context for the same number of guesses (LlamaCppDraft). The rows then show llama.cpp's decode
tok/s with and without its speculation and perfxlm's speculative speed over llama.cpp's.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import re
import statistics
import sys

from perfxlm import LLM, SamplingParams
from perfxlm.bench.datasets import load_sharegpt_pairs
from perfxlm.bench.latency import measure_batch

DEFAULT_SPEC = '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# classes with many `self`s; --prompts-per-kind takes the first N (3 by default, up to 8)
_CODE_FILES = ("perfxlm/engine/request.py", "perfxlm/spec_decode/stats.py", "perfxlm/engine/detokenizer.py",
               "perfxlm/engine/handle.py", "perfxlm/spec_decode/draft_model.py", "perfxlm/engine/llm_engine.py",
               "perfxlm/engine/kv_cache_manager.py", "perfxlm/engine/scheduler.py")


def _clip(tokenizer, text: str, max_tokens: int) -> str:
    ids = tokenizer.encode(text, add_special_tokens=False)[:max_tokens]
    return tokenizer.decode(ids)


def _first_name(code: str) -> str:
    """The first function (else class, else identifier) the code names: the one change's target."""
    for pattern in (r"\bdef (\w+)", r"\bclass (\w+)", r"([A-Za-z_]\w*)"):
        found = re.search(pattern, code)
        if found:
            return found.group(1)
    return "main"


def make_prompts(tokenizer, dataset: str | None, per_kind: int, passage_tokens: int) -> dict[str, list[str]]:
    """Chat messages (one user turn each) per prompt kind."""
    kinds: dict[str, list[str]] = {"code edit": [], "one change": [], "one change, code first": []}
    for path in _CODE_FILES[:per_kind]:
        with open(os.path.join(_ROOT, path), encoding="utf-8") as f:
            code = _clip(tokenizer, f.read(), passage_tokens)
        kinds["code edit"].append("Rewrite this Python code with every `self` renamed to `this`. Output only the "
                                  f"whole code.\n\n```python\n{code}\n```")
        name = _first_name(code)
        change = f"with the function `{name}` renamed to `{name}_v2`. Output only the whole code."
        kinds["one change"].append(f"Rewrite this Python code {change}\n\n```python\n{code}\n```")
        kinds["one change, code first"].append(f"```python\n{code}\n```\n\nRewrite the code above {change}")
    if dataset is None:
        return kinds
    pairs = [(h, r) for h, r in load_sharegpt_pairs(dataset) if len(r) > 1500 and len(h) < 300]
    passages = [_clip(tokenizer, r, passage_tokens) for _, r in pairs[: 2 * per_kind]]
    kinds["quote"] = [f"Here is a passage:\n\n{p}\n\nQuote the passage's first three paragraphs exactly."
                      for p in passages[:per_kind]]
    kinds["summarise"] = [f"Summarise this text, reusing its own sentences:\n\n{p}" for p in passages[per_kind:]]
    kinds["chat"] = [h for h, _ in pairs[2 * per_kind : 3 * per_kind]]
    return kinds


class LlamaCppDraft:
    """llama.cpp's draft-model speculation through llama-cpp-python: its target `Llama` asks a
    `LlamaDraftModel` for guesses each step; this one runs a second `Llama` on the draft file greedily for
    `k` tokens after the request's tokens (llama-cpp-python keeps the draft's KV cache over the prefix it
    shares with the last call, so each call evaluates only the tokens since)."""

    def __init__(self, path: str, k: int, common: dict) -> None:
        from llama_cpp import Llama

        self.llama = Llama(**{**common, "model_path": path})
        self.k = k

    def __call__(self, input_ids, /, **kwargs):
        import numpy as np

        steps = self.llama.generate(input_ids.tolist(), temp=0.0, top_k=1, repeat_penalty=1.0, reset=True)
        guesses = list(itertools.islice(steps, self.k))
        steps.close()
        return np.asarray(guesses, dtype=np.intc)


class LlamaCppPair:
    """llama.cpp on the target's GGUF file (llama-cpp-python), plain and with its own speculation, both
    greedy; each run decodes a given number of tokens after the same prompt tokens perfxlm was given. The
    speculation is the one `spec` asks for: prompt lookup (`LlamaPromptLookupDecoding`) for `ngram`, a
    draft GGUF file (LlamaCppDraft) for `model`."""

    def __init__(self, plain: LLM, spec: dict, threads: int) -> None:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        path = plain.llm_engine.config.model
        draft = spec.get("model")
        if not str(path).endswith(".gguf") or not (spec.get("method") == "ngram" or str(draft).endswith(".gguf")):
            raise SystemExit("--llama-cpp compares llama.cpp's speculation on a GGUF target (--model FILE.gguf) with "
                             "method ngram or a GGUF draft model")
        common = {"model_path": path, "n_ctx": 4096, "n_threads": threads, "n_threads_batch": threads,
                  "verbose": False}
        k = spec.get("num_speculative_tokens", 5)
        if draft:
            guesser = LlamaCppDraft(draft, k, common)
            self.spec_name = "draft"
        else:
            guesser = LlamaPromptLookupDecoding(max_ngram_size=spec.get("prompt_lookup_max", 4), num_pred_tokens=k)
            self.spec_name = "lookup"
        self.engines = {"llama.cpp": Llama(**common), "llama.cpp spec": Llama(**common, draft_model=guesser)}

    def run(self, prompt_ids: list[int], n: int) -> dict[str, float]:
        """Decode tok/s of each (the tokens after the first over the time after it)."""
        import time

        speeds = {}
        for name, llm in self.engines.items():
            llm.reset()
            llm._ctx.kv_cache_clear()  # no prefix reuse from the last run: both sides prefill the prompt
            first, count = None, 0
            for _ in llm.generate(prompt_ids, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
                count += 1
                if first is None:
                    first = time.perf_counter()
                if count >= n:
                    break
            speeds[name] = (count - 1) / (time.perf_counter() - first) if count > 1 else 0.0
        return speeds


def make_peer(plain: LLM, args):
    """--peer NAME=PATH: the build's llama-spec-bench on the target's GGUF file (benchmarks/peer_tools.py)."""
    from peer_tools import SpecBenchPeer, parse_peer_arg

    path = str(plain.llm_engine.config.model)
    if not path.endswith(".gguf"):
        raise SystemExit("--peer times a llama.cpp-family build on a GGUF target: give --model FILE.gguf")
    name, folder = parse_peer_arg(args.peer, set())
    return SpecBenchPeer.find(name, folder, path, args.threads, json.loads(args.speculative_config),
                              args.peer_spec_type)


def run_parallel(plain: LLM, spec: LLM, tokenizer, params: SamplingParams, args) -> int:
    """N requests in one batch, speculation off and on alternately: decode tok/s of the whole batch."""
    kinds = make_prompts(tokenizer, args.dataset, max(args.prompts_per_kind, args.parallel), args.passage_tokens)
    texts = [t for group in itertools.zip_longest(*kinds.values()) for t in group if t is not None][: args.parallel]
    if len(texts) < args.parallel:
        raise SystemExit(f"--parallel {args.parallel}: only {len(texts)} prompts (give --dataset)")
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                             add_generation_prompt=True) for t in texts]
    speeds: dict[str, list[float]] = {"plain": [], "spec": []}
    for r in range(args.rounds):
        for name, llm in (("plain", plain), ("spec", spec)):
            speeds[name].append(measure_batch(llm.llm_engine, prompts, params, tag=f"par-{r}-{name}")["decode_tok_s"])
    row = {"plain_tok_s": statistics.median(speeds["plain"]), "spec_tok_s": statistics.median(speeds["spec"])}
    row["speedup"] = row["spec_tok_s"] / row["plain_tok_s"]
    print(f"{args.parallel} parallel requests: plain {row['plain_tok_s']:7.1f} tok/s  speculative "
          f"{row['spec_tok_s']:7.1f} tok/s  x{row['speedup']:.2f}", flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"speculative_config": json.loads(args.speculative_config), "parallel": args.parallel,
                       "results": row}, f, indent=2)
    return 0


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
    ap.add_argument("--parallel", type=int, default=0,
                    help="run this many prompts at once (every kind's in turn) instead of one at a time")
    ap.add_argument("--llama-cpp", action="store_true",
                    help="also time llama.cpp (llama-cpp-python) on the same GGUF file and prompts, plain and with "
                         "its prompt lookup or the same draft file")
    ap.add_argument("--peer", default=None, metavar="NAME=PATH",
                    help="also time a llama.cpp-family build's own speculative decoding (its llama-spec-bench, e.g. "
                         "ik_llama.cpp's build folder) on the same GGUF target, draft and prompts")
    ap.add_argument("--peer-spec-type", default=None,
                    help="the peer's --spec-type (default: draft:n_max=K for a draft file, ngram_simple for ngram)")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    common = dict(dtype=args.dtype, quantization=args.quantization, kv_cache_gib=0.5, enable_prefix_caching=False)
    plain = LLM(args.model, **common)
    spec = LLM(args.model, speculative_config=args.speculative_config, **common)
    tokenizer = plain.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    stats = spec.llm_engine.scheduler.spec_stats
    llama = LlamaCppPair(plain, json.loads(args.speculative_config), args.threads) if args.llama_cpp else None
    peer = make_peer(plain, args) if args.peer else None
    if args.parallel > 0:
        return run_parallel(plain, spec, tokenizer, params, args)
    report = {}
    for kind, texts in make_prompts(tokenizer, args.dataset, args.prompts_per_kind, args.passage_tokens).items():
        speeds: dict[str, list[float]] = collections.defaultdict(list)
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
                outs = {name: llm.generate(prompt, params, use_tqdm=False)[0]
                        for name, llm in (("plain", plain), ("spec", spec))}
                if llama is not None:
                    for name, tok_s in llama.run(outs["plain"].prompt_token_ids,
                                                 len(outs["plain"].outputs[0].token_ids)).items():
                        speeds[name].append(tok_s)
                if peer is not None:
                    for name, result in peer.run(text, len(outs["plain"].outputs[0].token_ids)).items():
                        speeds[f"peer {name}"].append(result["decode_tps"])
                        speeds["peer acceptance"].append(result["acceptance_rate"])
            same &= outs["plain"].outputs[0].token_ids == outs["spec"].outputs[0].token_ids
        drafts, draft_tokens, accepted = (a - b for a, b in zip(
            (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens), before))
        row = {"plain_tok_s": statistics.median(speeds["plain"]), "spec_tok_s": statistics.median(speeds["spec"]),
               "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
               "mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0, "identical": same}
        row["speedup"] = row["spec_tok_s"] / row["plain_tok_s"]
        line = ""
        if llama is not None:
            row["llama_cpp_tok_s"] = statistics.median(speeds["llama.cpp"])
            kind_of = llama.spec_name
            row[f"llama_cpp_{kind_of}_tok_s"] = spec_tok_s = statistics.median(speeds["llama.cpp spec"])
            line = (f"  | llama.cpp {row['llama_cpp_tok_s']:7.1f}, with its {kind_of} {spec_tok_s:7.1f} tok/s "
                    f"(x{spec_tok_s / row['llama_cpp_tok_s']:.2f}); perfxlm speculative / llama.cpp {kind_of} "
                    f"x{row['spec_tok_s'] / spec_tok_s:.2f}")
        if peer is not None:
            row["peer_tok_s"] = statistics.median(speeds["peer plain"])
            row["peer_spec_tok_s"] = statistics.median(speeds["peer spec"])
            row["peer_acceptance_rate"] = statistics.median(speeds["peer acceptance"])
            line += (f"  | {peer.peer} {row['peer_tok_s']:7.1f}, with its {peer.spec_type.split(':')[0]} "
                     f"{row['peer_spec_tok_s']:7.1f} tok/s (x{row['peer_spec_tok_s'] / row['peer_tok_s']:.2f}, acceptance "
                     f"{row['peer_acceptance_rate']:.0%}); perfxlm speculative / {peer.peer} speculative "
                     f"x{row['spec_tok_s'] / row['peer_spec_tok_s']:.2f}")
        report[kind] = row
        print(f"{kind:12} plain {row['plain_tok_s']:7.1f} tok/s  speculative {row['spec_tok_s']:7.1f} tok/s  "
              f"x{row['speedup']:.2f}  acceptance {row['acceptance_rate']:.0%}  mean accepted length "
              f"{row['mean_acceptance_length']:.2f}  outputs identical: {same}{line}", flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"speculative_config": json.loads(args.speculative_config), "results": report}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
