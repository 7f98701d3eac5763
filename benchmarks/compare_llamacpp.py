"""perfxlm against llama.cpp on the same GGUF weights, in one process, in alternation; prints the ratios.

Absolute figures from another machine say little (CPU kinds differ), so both engines run here, on the
same weights, the same random token ids and the same thread count, alternating which goes first:

    pip install -e ".[llamacpp]"     # builds llama.cpp from source; CMAKE_ARGS="-DGGML_NATIVE=ON"
    python benchmarks/compare_llamacpp.py --llamacpp-ftype bf16 --threads 2 --rounds 3 --output-json cmp.json

Rows (llama.cpp's own tools measure the same things):
  prefill  512-token prompt, batch 1, prompt tok/s               (llama-bench -p 512)
  decode   batch 1 after a 512-token prompt, tok/s over 128 new tokens
                                                   (llama-batched-bench -npp 512 -ntg 128 -npl 1)
  pN       N sequences of 128 prompt tokens / 128 new, N x 128 / total time incl. prefill
                                                   (llama-batched-bench -npp 128 -ntg 128 -npl N)
--isa avx2 | avx512_vnni | avx512 runs both engines built for that tier only (benchmarks/isa_tiers.py: perfxlm's
kernels and plan, torch's kernels, a llama.cpp built for the tier in its own folder), a proxy on this
machine for a CPU of that tier; --isa native (the default) builds both for this CPU. The header names it.
Decoding is greedy and ignores EOS on both sides. llama.cpp runs through llama-cpp-python's low-level
API: one context with a sequence id per request, so the parallel rows are real batched decoding.
--peer NAME=PATH (repeatable) adds a build of a llama.cpp-family engine, e.g. ik_llama.cpp, timed with its
own llama-bench / llama-batched-bench on llama.cpp's file, in the same alternation (benchmarks/peer_tools.py);
a build with run-time repacking is run plain and with -rtr, and the better of the two is reported.
Not a test: timings belong to benchmarks, not to the test suite.
"""

from __future__ import annotations

import argparse
import ast
import ctypes
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import isa_tiers  # noqa: E402  (before torch: a forced tier is set up in a fresh process)
import peer_tools  # noqa: E402

TIER = isa_tiers.reexec_for_tier(sys.argv)

import numpy as np  # noqa: E402
import torch  # noqa: E402

try:
    import llama_cpp  # noqa: E402
except ImportError as exc:  # an optional extra: say how to get it
    raise SystemExit('llama-cpp-python is missing: pip install -e ".[llamacpp]" '
                     '(CMAKE_ARGS="-DGGML_NATIVE=ON" builds it for this CPU)') from exc
from perfxlm import LLM, SamplingParams  # noqa: E402
from perfxlm.config import default_model_path  # noqa: E402
from perfxlm.ops import cpu_plan  # noqa: E402

CPU_FLAGS = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "avx512_fp16")
FTYPES = {"bf16": "LLAMA_FTYPE_MOSTLY_BF16", "f16": "LLAMA_FTYPE_MOSTLY_F16",
          "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q6_k": "LLAMA_FTYPE_MOSTLY_Q6_K",
          "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}
CACHE_DIR = Path.home() / ".cache" / "perfxlm" / "compare"


def cpu_info() -> tuple[str, list[str]]:
    name, flags = "unknown", set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key.strip() == "model name" and name == "unknown":
                name = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    return name, [f for f in CPU_FLAGS if f in flags]


# ---- llama.cpp ---------------------------------------------------------------------------------------

# llama.cpp logs every load and context creation to stderr; keep errors only (4 = GGML_LOG_LEVEL_ERROR).
# The callback object must outlive every call into the library, hence module level.
@llama_cpp.llama_log_callback
def _llama_log(level, text, _user):
    if level == 4:
        print(text.decode(errors="replace"), end="", flush=True)


def requantize(src: str, ftype: str, threads: int, out: Path | None = None) -> str:
    """Convert the GGUF once (e.g. Q4_1 -> BF16, lossless) into `out` (default: the cache folder), as
    llama-quantize does."""
    if ftype == "same":
        return src
    llama_cpp.llama_log_set(_llama_log, None)  # the conversion logs one line per tensor
    out = out or CACHE_DIR / f"{Path(src).stem}.{ftype}.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, FTYPES[ftype])
        params.allow_requantize = True  # the input is already quantized
        params.nthread = threads
        tmp = out.with_suffix(".tmp")  # a killed conversion must not leave a file that looks finished
        if llama_cpp.llama_model_quantize(src.encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
            raise RuntimeError(f"llama_model_quantize({src} -> {ftype}) failed")
        tmp.rename(out)
    return str(out)


# llama.cpp moves quantized weights into "extra" buffer types (AMX, repacked AVX layouts) by default, as
# llama-bench does. On some AMX CPUs its AMX int8 matmul crashes the process (seen: Q4_0/Q4_1/Q8_0 on a
# Xeon with amx_int8), and a segfault cannot be caught, so `auto` tries one decode in a child process first.
_PROBE = """
import sys, llama_cpp
quiet = llama_cpp.llama_log_callback(lambda *a: None)
llama_cpp.llama_log_set(quiet, None)
llama_cpp.llama_backend_init()
m = llama_cpp.llama_model_load_from_file(sys.argv[1].encode(), llama_cpp.llama_model_default_params())
p = llama_cpp.llama_context_default_params()
p.n_threads = p.n_threads_batch = int(sys.argv[2])
ctx = llama_cpp.llama_init_from_model(m, p)
for n in (16, 1):  # a prompt-sized and a decode-sized matmul take different kernels
    toks = (llama_cpp.llama_token * n)(*[100] * n)
    assert llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(toks, n)) == 0
"""


def extra_buffers_work(path: str, threads: int) -> bool:
    probe = subprocess.run([sys.executable, "-c", _PROBE, path, str(threads)], capture_output=True)
    return probe.returncode == 0


def _clear_memory(ctx) -> None:
    # The KV-cache API was renamed across llama.cpp versions; use whichever this build exports.
    if hasattr(llama_cpp, "llama_memory_clear"):
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
    elif hasattr(llama_cpp, "llama_kv_self_clear"):
        llama_cpp.llama_kv_self_clear(ctx)
    else:
        llama_cpp.llama_kv_cache_clear(ctx)


class InProcessEngine:
    """An engine driven in this process on the comparison's own token ids (peers run their tools)."""

    def measure(self, row: str, spec: tuple[int, int, int], prompts: list[list[int]]) -> dict:
        t = self.run(prompts, spec[2])
        del t["tokens"]
        return t


class LlamaCppEngine(InProcessEngine):
    name = "llama.cpp"

    def __init__(self, path: str, threads: int, extra_buffers: bool):
        llama_cpp.llama_log_set(_llama_log, None)
        llama_cpp.llama_backend_init()
        self.path, self.threads = path, threads
        mp = llama_cpp.llama_model_default_params()
        mp.use_extra_bufts = extra_buffers
        self.model = llama_cpp.llama_model_load_from_file(path.encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        desc = ctypes.create_string_buffer(256)
        llama_cpp.llama_model_desc(self.model, desc, len(desc))
        self.desc = desc.value.decode() + ("" if extra_buffers else ", extra buffer types (AMX/repack) off")
        self.contexts: dict[tuple[int, int], object] = {}  # one per (n_ctx, n_seq), reused across rounds
        self.n_batch = 2048  # llama-bench / llama-batched-bench defaults (n_ubatch 512)
        self.batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)

    def special_ids(self) -> set[int]:
        v = self.vocab
        return {t for t in range(self.n_vocab)
                if llama_cpp.llama_vocab_is_control(v, t) or llama_cpp.llama_vocab_is_eog(v, t)}

    def _context(self, n_ctx: int, n_seq: int):
        # Without a unified KV cache each sequence gets n_ctx / n_seq_max cells, so n_ctx covers them all.
        key = (-(-n_ctx // 256) * 256, n_seq)
        if key not in self.contexts:
            p = llama_cpp.llama_context_default_params()
            p.n_ctx, p.n_seq_max = key
            p.n_batch, p.n_ubatch = self.n_batch, 512
            p.n_threads = p.n_threads_batch = self.threads
            ctx = llama_cpp.llama_init_from_model(self.model, p)
            if not ctx:
                raise RuntimeError(f"llama.cpp could not create a context n_ctx={key[0]} n_seq_max={n_seq}")
            self.contexts[key] = ctx
        return self.contexts[key]

    def _decode(self, ctx, tokens, pos, seqs, outputs) -> np.ndarray:
        """Decode (token, pos, seq) triples in chunks of n_batch; greedy next token of each output row."""
        b, picks = self.batch, []
        for start in range(0, len(tokens), self.n_batch):
            end = min(start + self.n_batch, len(tokens))
            n = end - start
            np.ctypeslib.as_array(b.token, (n,))[:] = tokens[start:end]
            np.ctypeslib.as_array(b.pos, (n,))[:] = pos[start:end]
            np.ctypeslib.as_array(b.n_seq_id, (n,))[:] = 1
            np.ctypeslib.as_array(b.logits, (n,))[:] = outputs[start:end]
            for i in range(n):
                b.seq_id[i][0] = int(seqs[start + i])
            b.n_tokens = n
            if llama_cpp.llama_decode(ctx, b) != 0:
                raise RuntimeError("llama_decode failed (KV cache full?)")
            n_out = int(outputs[start:end].sum())
            if n_out:
                # Output rows are contiguous in batch order: one argmax over (n_out, vocab), no per-row calls.
                logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits(ctx), (n_out, self.n_vocab))
                picks.append(logits.argmax(axis=1))
        return np.concatenate(picks)

    def run(self, prompts: list[list[int]], n_new: int, seq_len: int = 0) -> dict:
        """Greedy generation of n_new tokens per prompt, all sequences batched together as in
        llama-batched-bench. Returns seconds: total, and decode (first to last new token).
        seq_len sizes the KV cache, so that a short warm-up creates the context the timed runs use."""
        B, P = len(prompts), len(prompts[0])
        ctx = self._context(B * max(seq_len, P + n_new), B)
        _clear_memory(ctx)  # a reused context must start empty, as llama-bench does between repetitions
        tokens = np.asarray(prompts, dtype=np.int32).reshape(-1)
        pos = np.tile(np.arange(P, dtype=np.int32), B)
        seqs = np.repeat(np.arange(B, dtype=np.int32), P)
        outputs = np.zeros(B * P, dtype=np.int8)
        outputs[P - 1::P] = 1  # logits for the last prompt token of each sequence only
        t0 = time.perf_counter()
        new = [self._decode(ctx, tokens, pos, seqs, outputs)]  # prefill gives the first new token
        t1 = time.perf_counter()
        ones, seq_ids = np.ones(B, dtype=np.int8), np.arange(B, dtype=np.int32)
        for step in range(n_new - 1):
            new.append(self._decode(ctx, new[-1].astype(np.int32), np.full(B, P + step, dtype=np.int32),
                                    seq_ids, ones))
        t2 = time.perf_counter()
        return {"total": t2 - t0, "decode": t2 - t1, "tokens": np.stack(new, axis=1).tolist()}

    def close(self) -> None:
        for ctx in self.contexts.values():
            llama_cpp.llama_free(ctx)
        self.contexts.clear()
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_model_free(self.model)


# ---- perfxlm -----------------------------------------------------------------------------------------

def _weight_formats(llm) -> str:
    """What the linear weights are stored as: dtypes, and quantized forms as bits/group/activations."""
    from collections import Counter

    from perfxlm.quant import QuantizedWeight

    model = llm.llm_engine.core.model if hasattr(llm.llm_engine.core, "model") else None
    if model is None:
        return str(llm.llm_engine.config.weight_dtype)
    kinds: Counter = Counter()
    for module in model.modules():
        w = getattr(module, "weight", None)
        if isinstance(w, QuantizedWeight):
            kinds[f"{w.bits}-bit g{w.group}{' NF4' if w.levels is not None else ''} act={w.act}"] += 1
        elif isinstance(w, torch.Tensor) and w.dim() >= 2:
            kinds[str(w.dtype).replace("torch.", "")] += 1
    return ", ".join(f"{k} x{n}" for k, n in kinds.most_common())


class PerfxlmEngine(InProcessEngine):
    name = "perfxlm"

    def __init__(self, path: str, dtype: str, extra: dict):
        kwargs = {"enable_prefix_caching": False, **extra}  # prefix caching would skip repeated prompts
        self.llm = LLM(path, dtype=dtype, **kwargs)
        cfg = self.llm.llm_engine.config
        self.desc = f"dtype={dtype} -> activations {cfg.torch_dtype}, weights {_weight_formats(self.llm)}" + (
            f"; {extra}" if extra else "")
        self.n_vocab = cfg.hf_config.vocab_size

    def special_ids(self) -> set[int]:
        return set(getattr(self.llm.get_tokenizer(), "all_special_ids", []) or [])

    def run(self, prompts: list[list[int]], n_new: int, seq_len: int = 0) -> dict:
        params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=n_new)
        t0 = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        total = time.perf_counter() - t0
        # The engine stamps each request's first and last token: decode is measured directly.
        m = [o.metrics for o in outs]
        decode = max(x.finished_time for x in m) - min(x.first_token_time for x in m)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        assert all(len(t) == n_new for t in tokens), "ignore_eos did not hold"
        return {"total": total, "decode": decode, "tokens": tokens}

    def close(self) -> None:
        del self.llm


# ---- rows --------------------------------------------------------------------------------------------

def row_specs(args) -> dict[str, tuple[int, int, int]]:
    """name -> (batch, prompt tokens, new tokens); pN is N parallel sequences."""
    specs = {}
    for r in (r.strip() for r in args.rows.split(",") if r.strip()):
        if r in ("prefill", "decode"):
            specs[r] = (1, args.prompt_tokens, 1 if r == "prefill" else args.decode_tokens + 1)
        elif r[:1] == "p" and r[1:].isdigit():
            specs[r] = (int(r[1:]), args.parallel_prompt, args.parallel_new)
        else:
            raise SystemExit(f"unknown row {r!r}: use prefill, decode or pN (N parallel sequences)")
    return specs


def throughput(row: str, spec: tuple[int, int, int], t: dict) -> float:
    B, P, N = spec
    if row == "prefill":
        return P / t["total"]  # includes the first token's sampling, as a user sees it
    if row == "decode":
        return (N - 1) / t["decode"]  # N - 1 decode steps after the prefill's token
    return B * N / t["total"]  # parallel rows: end to end, prefill included


def describe(row: str, spec) -> str:
    B, P, N = spec
    return {"prefill": f"prefill {P} tokens, batch 1, tok/s",
            "decode": f"decode batch 1 after {P} tokens, tok/s over {N - 1}"}.get(
        row, f"{B} parallel, {P} in / {N} out, generated tok/s end to end")


def make_prompts(allowed: np.ndarray, B: int, P: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.choice(allowed, size=(B, P)).tolist()


# ---- main --------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default=None, help="weights for both engines (default: the embedded model)")
    ap.add_argument("--llamacpp-gguf", default=None, help="another file of the same weights for llama.cpp")
    ap.add_argument("--llamacpp-ftype", default="same", choices=["same", *FTYPES],
                    help="convert the llama.cpp weights once (cached in ~/.cache/perfxlm/compare/)")
    ap.add_argument("--llamacpp-repack", default="auto", choices=["auto", "on", "off"],
                    help="llama.cpp's AMX / repacked weight buffers (llama-bench --repack); auto: on unless "
                         "a trial decode in a child process crashes")
    ap.add_argument("--perfxlm-dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    ap.add_argument("--perfxlm-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="extra LLM(...) keyword, repeatable; VALUE is a Python literal or a string")
    ap.add_argument("--isa", default="native", choices=["native", *isa_tiers.TIERS],
                    help="build both engines for this instruction-set tier only (see benchmarks/isa_tiers.py)")
    ap.add_argument("--peer", action="append", default=[], metavar="NAME=PATH",
                    help="also time a llama.cpp-family build (e.g. ik_llama.cpp=~/.cache/perfxlm/peers/"
                         "ik_llama.cpp/build): PATH holds llama-bench and llama-batched-bench (or has "
                         "them in bin/); it runs llama.cpp's file with the same threads; repeatable. With "
                         "--isa avx2 or avx512 a peer is refused unless its CMakeCache.txt shows it was "
                         "built for that tier (GGML_NATIVE=OFF and the tier's GGML options, as isa_tiers.py "
                         "lists them)")
    ap.add_argument("--peer-repack", default="both", choices=["both", "on", "off"],
                    help="peers with run-time repacking (ik_llama.cpp's -rtr): run both ways and report the "
                         "better (both), or only with / without it")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rows", default="prefill,decode,p16,p64", help="pN: N parallel sequences")
    ap.add_argument("--prompt-tokens", type=int, default=512, help="prompt of the prefill and decode rows")
    ap.add_argument("--decode-tokens", type=int, default=128, help="decode steps timed in the decode row")
    ap.add_argument("--parallel-prompt", type=int, default=128, help="prompt tokens per sequence in pN rows")
    ap.add_argument("--parallel-new", type=int, default=128, help="generated tokens per sequence in pN rows")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-json", default=None, help="save config + raw times; a PNG of the ratios beside")
    return ap.parse_args(argv)


def parse_perfxlm_args(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--perfxlm-arg {item!r}: expected KEY=VALUE")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value  # a bare string such as a path
    return out


def parse_peers(items: list[str]) -> list[tuple[str, Path]]:
    taken: set[str] = {"perfxlm", "llama.cpp"}
    peers = []
    for item in items:
        name, path = peer_tools.parse_peer_arg(item, taken)
        taken.add(name)
        peers.append((name, path))
    return peers


def check_peer_tier(name: str, folder: Path, tier: str) -> dict[str, str]:
    """The peer build's GGML options; under a forced tier, refuse a build for another one: its figures
    would compare a tier-limited perfxlm with a peer using the whole CPU."""
    tools = peer_tools.find_tools(name, folder)
    options = peer_tools.build_options(tools["llama-bench"].parent)
    if tier != "native":
        wrong = peer_tools.tier_mismatches(options, isa_tiers.TIERS[tier][3])
        if wrong:
            raise SystemExit(f"--peer {name}={folder} is not built for the {tier} tier (--isa {tier}): "
                             + "; ".join(wrong) + f". Build one with cmake -DCMAKE_BUILD_TYPE=Release "
                             f"{isa_tiers.TIERS[tier][3]} and pass its folder")
    return options


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    peers = parse_peers(args.peer)
    peer_options = {name: check_peer_tier(name, path, TIER) for name, path in peers}
    torch.set_num_threads(args.threads)
    gguf = args.gguf or default_model_path()
    llama_path = requantize(args.llamacpp_gguf or gguf, args.llamacpp_ftype, args.threads)
    specs = row_specs(args)

    perfx = PerfxlmEngine(gguf, args.perfxlm_dtype, parse_perfxlm_args(args.perfxlm_arg))
    repack = {"on": True, "off": False}.get(args.llamacpp_repack)
    if repack is None:
        repack = extra_buffers_work(llama_path, args.threads)
        if not repack:
            print("llama.cpp crashed with its extra buffer types (AMX/repack) on these weights: now without")
    llama = LlamaCppEngine(llama_path, args.threads, repack)
    local = [perfx, llama]
    peer_columns = {name: peer_tools.peer_engines(name, path, llama_path, args.threads, args.peer_repack)
                    for name, path in peers}
    engines = local + [e for cols in peer_columns.values() for e in cols]

    # Random ids both vocabularies know, minus control/special tokens (which may change model behaviour).
    n_vocab = min(perfx.n_vocab, llama.n_vocab)
    allowed = np.setdiff1d(np.arange(n_vocab), sorted(perfx.special_ids() | llama.special_ids()))

    cpu, flags = cpu_info()
    config = {
        "cpu": cpu, "cpu_flags": flags, "tier": isa_tiers.describe(TIER), "cpu_plan": cpu_plan.plan().describe(),
        "torch": torch.__version__, "llama_cpp_python": llama_cpp.__version__,
        "threads": args.threads, "rounds": args.rounds, "rows": {r: list(s) for r, s in specs.items()},
        "perfxlm": {"gguf": gguf, "dtype": args.perfxlm_dtype, "desc": perfx.desc},
        "llamacpp": {"gguf": llama_path, "ftype": args.llamacpp_ftype, "desc": llama.desc,
                     "extra_buffer_types": repack,
                     "system_info": llama_cpp.llama_print_system_info().decode().strip()},
        "peers": {name: {"path": str(path), "gguf": llama_path,
                         "columns": [e.name for e in peer_columns[name]], "build_options": peer_options[name]}
                  for name, path in peers},
    }
    print(f"\nCPU: {cpu}\nflags: {' '.join(flags) or '(none of ' + ', '.join(CPU_FLAGS) + ')'}")
    print(f"tier: {config['tier']}\nperfxlm CPU plan: {config['cpu_plan']}")
    print(f"torch {torch.__version__}, llama-cpp-python {llama_cpp.__version__}, threads {args.threads}")
    print(f"perfxlm:   {gguf}\n           {perfx.desc}")
    print(f"llama.cpp: {llama_path}\n           {llama.desc}\n           {config['llamacpp']['system_info']}")
    for e in engines[len(local):]:
        print(f"{e.name}: {llama_path}\n           {e.desc}")

    # Warm-up: every row shape once per engine (kernel selection, llama.cpp graph and KV allocation).
    # Peers' tools warm up inside every run.
    warm = {}
    for eng in local:
        for row, (B, P, N) in specs.items():
            warm[eng.name, row] = eng.run(make_prompts(allowed, B, P, args.seed), min(N, 4), P + N)["tokens"]
    # Both engines should compute the same greedy tokens (up to rounding when the dtypes differ):
    # a mismatch everywhere means one side is misconfigured and its speed means nothing.
    pairs = [(a, b) for r in specs
             for x, y in zip(warm["perfxlm", r], warm["llama.cpp", r]) for a, b in zip(x, y)]
    config["warmup_greedy_agreement"] = sum(a == b for a, b in pairs) / len(pairs)
    print(f"warm-up greedy tokens identical in both engines: {sum(a == b for a, b in pairs)}/{len(pairs)}")

    raw: dict[str, dict[str, list]] = {r: {e.name: [] for e in engines} for r in specs}
    for rnd in range(args.rounds):
        for i, (row, spec) in enumerate(specs.items()):
            prompts = make_prompts(allowed, spec[0], spec[1], args.seed + 1000 * (rnd + 1) + i)
            # Alternate which engine goes first so that drift (heat, other load) hits both alike.
            order = engines if (rnd + i) % 2 == 0 else engines[::-1]
            for eng in order:
                time.sleep(0.2)  # let the other engine's spinning worker threads go idle
                t = eng.measure(row, spec, prompts)
                raw[row][eng.name].append({**t, "tok_s": throughput(row, spec, t)})
            line = ", ".join(f"{e.name} {raw[row][e.name][-1]['tok_s']:.1f}" for e in engines)
            print(f"round {rnd + 1} {row}: {line} tok/s", flush=True)

    summary = {}
    for row, spec in specs.items():
        s = {}
        for e in engines:
            v = [x["tok_s"] for x in raw[row][e.name]]
            s[e.name] = {"median": statistics.median(v), "min": min(v), "max": max(v)}
        s["ratio"] = s["perfxlm"]["median"] / s["llama.cpp"]["median"]
        # Each peer's better column (plain or -rtr), named, and perfxlm's ratio to it.
        s["peers"] = {}
        for name, cols in peer_columns.items():
            best = max(cols, key=lambda e: s[e.name]["median"])
            s["peers"][name] = {"best": best.name, "repack": best.repack, "median": s[best.name]["median"],
                                "ratio": s["perfxlm"]["median"] / s[best.name]["median"]}
        summary[row] = s
    for name, cols in peer_columns.items():
        config["peers"][name]["build_commit"] = next((e.build_commit for e in cols if e.build_commit), None)

    heads = "".join(f" {name} (best) | perfxlm / {name} |" for name in peer_columns)
    print(f"\n| workload | perfxlm {args.perfxlm_dtype} | llama.cpp {llama.desc} | perfxlm / llama.cpp |"
          + heads)
    print("|---|---:|---:|---:|" + "---:|---:|" * len(peer_columns))
    for row, spec in specs.items():
        s = summary[row]
        cell = ["{median:.1f} ({min:.1f}-{max:.1f})".format(**s[e.name]) for e in local]
        peer_cells = "".join(
            " {} {} | **{:.2f}x** |".format("{median:.1f} ({min:.1f}-{max:.1f})".format(**s[p["best"]]),
                                           "rtr" if p["repack"] else "plain", p["ratio"])
            for p in s["peers"].values())
        print(f"| {describe(row, spec)} | {cell[0]} | {cell[1]} | **{s['ratio']:.2f}x** |{peer_cells}")
    print(f"\nmedians of {args.rounds} rounds (min-max in parentheses)"
          + ("; a peer: the better of plain and -rtr (run-time repacking), named" if peer_columns else ""))

    if args.output_json:
        path = Path(args.output_json)
        path.write_text(json.dumps({"config": config, "summary": summary, "raw": raw}, indent=2))
        plot(summary, specs, config, path.with_suffix(".png"))
        print(f"saved {path} and {path.with_suffix('.png')}")
    for eng in engines:
        eng.close()


def plot(summary: dict, specs: dict, config: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    rows = list(specs)
    peers = list(config.get("peers", {}))
    # One bar per row and reference engine: llama.cpp, then each peer's better column.
    refs = [("llama.cpp", [summary[r]["ratio"] for r in rows])] + [
        (f"{p} ({'/'.join(sorted({'rtr' if summary[r]['peers'][p]['repack'] else 'plain' for r in rows}))})",
         [summary[r]["peers"][p]["ratio"] for r in rows]) for p in peers]
    width = 0.8 / len(refs)
    fig, ax = plt.subplots(figsize=(1.6 * len(rows) * len(refs) ** 0.5 + 3, 4))
    for k, (label, ratios) in enumerate(refs):
        x = [i + (k - (len(refs) - 1) / 2) * width for i in range(len(rows))]
        colors = ["tab:green" if r >= 1 else "tab:red" for r in ratios]
        bars = ax.bar(x, ratios, width, color=colors, edgecolor="black", hatch=["", "//", "..", "xx"][k % 4],
                      label=f"vs {label}")
        ax.bar_label(bars, labels=[f"{r:.2f}x" for r in ratios], fontsize=8)
    ax.set_xticks(range(len(rows)), rows)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_ylabel("perfxlm / reference (median tok/s)")
    if peers:  # bars are coloured by their ratio; the legend tells the references apart by hatch only
        legend = ax.legend(fontsize=8)
        for handle in getattr(legend, "legend_handles", None) or legend.legendHandles:
            handle.set_facecolor("white")
    ax.set_title(f"{config['cpu']}, {config['threads']} threads, tier {TIER}\n"
                 f"perfxlm {config['perfxlm']['dtype']} vs llama.cpp {config['llamacpp']['desc']}"
                 + "".join(f", {p}" for p in peers), fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    try:
        main()
    except peer_tools.PeerError as exc:  # the message names the command and its last lines: no traceback
        raise SystemExit(f"peer failed: {exc}") from None
