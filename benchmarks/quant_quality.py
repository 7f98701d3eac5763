"""Quantization quality of perfxlm and llama.cpp on the same weights, the same text, in one run.

The model is the one benchmarks/make_rotated_model.py writes: the default model turned by a random
rotation (so its weights are not already on a 4-bit grid), saved in bf16 and converted by llama.cpp's
converter to rotated.bf16.gguf, then quantized by llama.cpp to rotated.<ftype>.gguf. Each engine is
measured against its own bf16 base, as llama-perplexity's --kl-divergence does:

- llama.cpp (benchmarks/perplexity_llamacpp.py, llama-cpp-python): the BF16 file is the base; each of
  Q8_0, Q6_K, Q4_K_M, Q4_0 is compared with it on the base's windows of llama.cpp's tokens;
- perfxlm (perfxlm/eval/kld.py): the BF16 file with dtype auto (bf16 weights, float32 compute on a CPU
  without native bf16 matmuls) is the base; each GGUF file as stored, and each `quantization=` method the
  engine offers (perfxlm/quant/config.py METHODS) applied to the BF16 file, is compared with it on the
  base's windows of perfxlm's tokens.
Both engines' statistics come from perfxlm/eval/kld_stats.py (llama.cpp's definitions).

Columns: bits per weight over the weight matrices (embedding and head included; norms left out), for
llama.cpp the GGUF file's tensor bytes, for perfxlm what the loaded model holds
(perfxlm.eval.quant_table.weight_footprint); PPL; Δppl = PPL(Q)/PPL(base) - 1; mean KLD ± its standard
error; 99th percentile KLD; the share of tokens whose most likely token is the base's (same top p).

    python benchmarks/make_rotated_model.py --llama-cpp path/to/llama.cpp
    python benchmarks/perplexity_llamacpp.py --write-sharegpt-text sharegpt.json --text-tokens 20000 -f text.txt
    python benchmarks/quant_quality.py --text text.txt -c 512 --chunks 20

Writes quality.md, quality.json and quality.png into --results (default DIR/results), and the run's
base log-probability files and per-run JSON beside them. Formats that fail (a method another branch is
rewriting, say) get a row with the error instead of stopping the run.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
DEFAULT_DIR = Path.home() / ".cache" / "perfxlm" / "quality"
GGUF_FORMATS = ("q8_0", "q6_k", "q4_k_m", "q4_0")


def perfxlm_methods() -> tuple[str, ...]:
    """The `quantization=` methods this checkout offers, read at run time so the table follows the code."""
    from perfxlm.quant.config import METHODS

    return tuple(METHODS)


@dataclass
class Row:
    engine: str  # "llama.cpp" | "perfxlm"
    label: str  # Q8_0, int8, BF16 ...
    source: str  # the file, and the quantization applied at load
    bits_per_weight: float = math.nan
    detail: str = ""  # tensor types, or the method's description
    ppl: float = math.nan
    ppl_error: float = math.nan
    delta_ppl_pct: float = math.nan
    delta_ppl_error_pct: float = math.nan
    kld_mean: float = math.nan
    kld_error: float = math.nan
    kld_99: float = math.nan
    same_top_pct: float = math.nan
    same_top_error_pct: float = math.nan
    n_tokens: int = 0
    seconds: float = math.nan
    error: str = ""

    def fill(self, stats: dict[str, Any], n_tokens: int, seconds: float) -> "Row":
        """From KldSummary.to_dict()."""
        ratio = stats["ppl_ratio"]
        self.ppl, self.ppl_error = stats["ppl_model"]["value"], stats["ppl_model"]["error"]
        self.delta_ppl_pct, self.delta_ppl_error_pct = 100 * (ratio["value"] - 1), 100 * (ratio["error"] or 0.0)
        self.kld_mean, self.kld_error = stats["kld_mean"]["value"], stats["kld_mean"]["error"]
        self.kld_99 = stats["kld_percentiles"]["99"]
        self.same_top_pct = 100 * stats["same_top"]["value"]
        self.same_top_error_pct = 100 * (stats["same_top"]["error"] or 0.0)
        self.n_tokens, self.seconds = n_tokens, seconds
        return self


def gguf_bits(path: Path) -> tuple[float, str]:
    """(bits per weight over the file's matrices, their tensor types) of a GGUF file."""
    from perfxlm.model.loader.gguf_reader import open_gguf

    mats = [t for t in open_gguf(str(path)).tensors.values() if len(t.shape) >= 2]
    weights = sum(math.prod(t.shape) for t in mats)
    types = Counter(t.ggml_type.name for t in mats)
    return 8 * sum(t.nbytes for t in mats) / weights, ", ".join(f"{n} {k}" for k, n in types.most_common())


def say(message: str, t0: float) -> None:
    print(f"[{time.perf_counter() - t0:7.1f} s] {message}", flush=True)


# ---- llama.cpp ------------------------------------------------------------------------------------------

def run_llamacpp(args: list[str], json_path: Path) -> dict[str, Any]:
    """benchmarks/perplexity_llamacpp.py in a child process (llama.cpp frees nothing reliably through
    ctypes on errors, and a crash must not end the whole comparison); its output streams through."""
    env = dict(os.environ)
    import perfxlm

    root = str(Path(perfxlm.__file__).resolve().parents[1])  # the child imports the same perfxlm as this process
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, str(HERE / "perplexity_llamacpp.py"), *args, "--output-json", str(json_path)]
    proc = subprocess.run(cmd, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}")
    return json.loads(json_path.read_text())


def llamacpp_rows(opts, files: dict[str, Path], out: Path, t0: float) -> tuple[list[Row], dict]:
    base_file = out / "llamacpp.base.kld"
    common = ["--threads", str(opts.threads)]
    say(f"llama.cpp base: {files['bf16'].name}", t0)
    base = run_llamacpp(["-m", str(files["bf16"]), "-f", opts.text, "-c", str(opts.ctx_size), "--chunks",
                         str(opts.chunks), "--kl-divergence-base", str(base_file), *common],
                        out / "llamacpp.bf16.json")  # fmt: skip
    bits, types = gguf_bits(files["bf16"])
    rows = [Row("llama.cpp", "BF16", files["bf16"].name, bits, types, ppl=base["ppl"], ppl_error=base["stderr"],
                n_tokens=base["n_tokens"], seconds=base["seconds"])]
    say(f"llama.cpp base: PPL {base['ppl']:.4f} ({base['seconds']:.0f} s)", t0)
    for fmt in opts.gguf_formats:
        bits, types = gguf_bits(files[fmt])
        row = Row("llama.cpp", fmt.upper(), files[fmt].name, bits, types)
        say(f"llama.cpp {row.label}", t0)
        try:
            r = run_llamacpp(["-m", str(files[fmt]), "--kl-divergence-base", str(base_file), "--kl-divergence",
                              *common], out / f"llamacpp.{fmt}.json")  # fmt: skip
            row.fill(r["statistics"], r["n_tokens"], r["seconds"])
        except Exception as e:  # noqa: BLE001 - one failed format is one row
            row.error = str(e)
        rows.append(row)
        say(f"llama.cpp {row.label}: {summary_line(row)}", t0)
    window_tokens = list(kld_tokens(base_file)) if base_file.exists() else []
    if not opts.keep_base:
        base_file.unlink(missing_ok=True)
    return rows, {"text_tokens": base["text_tokens"], "n_windows": base["n_chunks"], "window_tokens": window_tokens}


def kld_tokens(path: Path) -> list[int]:
    from perfxlm.eval import kld_base

    return list(kld_base.open_base(str(path)).header["tokens"])


# ---- perfxlm --------------------------------------------------------------------------------------------

def perfxlm_rows(opts, files: dict[str, Path], out: Path, t0: float) -> tuple[list[Row], dict]:
    import torch

    from perfxlm import LLM
    from perfxlm.eval.inputs import read_text
    from perfxlm.eval.kld import kl_divergence, save_base_logprobs
    from perfxlm.eval.quant_table import weight_footprint

    torch.set_num_threads(opts.threads)
    # prefix caching off: a cached prefix would skip the prompt positions whose distributions are read
    engine = {"dtype": "auto", "enable_prefix_caching": False, "kv_cache_gib": opts.kv_cache_gib}
    base_file = out / "perfxlm.base.kld"
    bf16 = str(files["bf16"])

    def footprint(llm) -> float:
        weights, size = weight_footprint(llm.llm_engine.core.model)
        return 8 * size / weights

    say(f"perfxlm base: {files['bf16'].name}, dtype auto", t0)
    start = time.perf_counter()
    llm = LLM(bf16, **engine)
    dtype = str(llm.llm_engine.config.weight_dtype).replace("torch.", "")
    base = save_base_logprobs(llm, read_text(opts.text), str(base_file), opts.ctx_size, n_chunks=opts.chunks,
                              progress=opts.progress)
    base_row = Row("perfxlm", {"bfloat16": "BF16", "float32": "F32"}.get(dtype, dtype), f"{files['bf16'].name}, dtype auto",
                   footprint(llm), f"{dtype} weights", seconds=time.perf_counter() - start)
    del llm
    gc.collect()
    say(f"perfxlm base: {base.windows.n_windows} windows, {base_row.seconds:.0f} s", t0)

    candidates: list[tuple[str, str, dict[str, Any]]] = [
        (fmt.upper(), files[fmt].name, {"model": str(files[fmt])}) for fmt in opts.gguf_formats
    ] + [(m, f"{files['bf16'].name}, quantization={m}", {"model": bf16, "quantization": m}) for m in opts.methods]
    rows = []
    for label, source, kwargs in candidates:
        row = Row("perfxlm", label, source)
        say(f"perfxlm {label}", t0)
        try:
            kw = dict(kwargs)
            llm = LLM(kw.pop("model"), **engine, **kw)
            qc = llm.llm_engine.config.quant_config
            row.detail = qc.describe() if qc is not None else "as stored"
            row.bits_per_weight = footprint(llm)
            r = kl_divergence(llm, base, progress=opts.progress)
            row.fill(r.summary.to_dict(), r.summary.n_tokens, r.seconds)
            (out / f"perfxlm.{label.lower()}.json").write_text(json.dumps({"label": label, **r.to_dict()}, indent=2))
            del llm
        except Exception as e:  # noqa: BLE001 - one failed format is one row
            row.error = f"{type(e).__name__}: {e}"
        gc.collect()
        rows.append(row)
        say(f"perfxlm {label}: {summary_line(row)}", t0)
    # the base's own perplexity, as every comparison saw it
    done = [r for r in rows if not r.error]
    if done:
        stats = json.loads((out / f"perfxlm.{done[0].label.lower()}.json").read_text())["statistics"]
        base_row.ppl, base_row.ppl_error = stats["ppl_base"]["value"], stats["ppl_base"]["error"]
        base_row.n_tokens = done[0].n_tokens
    window_tokens = list(base.header["tokens"])
    del base
    if not opts.keep_base:
        base_file.unlink(missing_ok=True)
    return [base_row, *rows], {"text_tokens": _count_tokens(bf16, opts.text), "n_windows": len(window_tokens) // opts.ctx_size,
                               "window_tokens": window_tokens}  # fmt: skip


def _count_tokens(model: str, text_path: str) -> int:
    """All of the text's tokens under perfxlm's tokenizer (the base file keeps only the windows' tokens)."""
    from perfxlm.eval.inputs import read_text
    from perfxlm.tokenizer import get_tokenizer

    return len(get_tokenizer(model).encode(read_text(text_path), add_special_tokens=False))


# ---- report ---------------------------------------------------------------------------------------------

def summary_line(r: Row) -> str:
    if r.error:
        return f"failed: {r.error}"
    return (f"{r.bits_per_weight:.2f} bpw, PPL {r.ppl:.4f}, Δppl {r.delta_ppl_pct:+.3f} %, "
            f"KLD {r.kld_mean:.5f} ± {r.kld_error:.5f}, same top {r.same_top_pct:.2f} %")


def _fmt(value: float, spec: str, err: float | None = None, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    text = format(value, spec)
    if err is not None and not math.isnan(err):
        text += f" ± {format(err, spec.lstrip('+'))}"
    return text + suffix


def markdown(rows: list[Row]) -> str:
    lines = ["| engine | format | bits/weight | PPL | Δppl | mean KLD | 99% KLD | same top p | seconds | tensors / method |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if r.error:
            lines.append(f"| {r.engine} | {r.label} | {_fmt(r.bits_per_weight, '.2f')} | failed: {r.error} |"
                         + " |" * 6)
            continue
        base = math.isnan(r.kld_mean)
        lines.append(
            f"| {r.engine} | {r.label}{' (base)' if base else ''} | {_fmt(r.bits_per_weight, '.2f')} | "
            f"{_fmt(r.ppl, '.4f')} | {_fmt(r.delta_ppl_pct, '+.3f', r.delta_ppl_error_pct, ' %')} | "
            f"{_fmt(r.kld_mean, '.5f', r.kld_error)} | {_fmt(r.kld_99, '.4f')} | "
            f"{_fmt(r.same_top_pct, '.2f', r.same_top_error_pct, ' %')} | {_fmt(r.seconds, '.0f')} | {r.detail} |"
        )
    return "\n".join(lines)


def _find(rows: list[Row], engine: str, label: str) -> Row | None:
    return next((r for r in rows if r.engine == engine and r.label == label and not r.error), None)


# (perfxlm method, llama.cpp reference, factor allowed, whether the bits must not exceed the reference's)
TARGETS = (("int8", "Q8_0", 1.0, False), ("w8a8", "Q8_0", 2.0, False), ("int4", "Q4_K_M", 1.0, True),
           ("nf4", "Q4_K_M", 1.5, False))


def targets(rows: list[Row]) -> list[dict[str, Any]]:
    """The issue's targets, each checked where both rows exist. Δppl is compared by magnitude: a
    negative change is noise around zero as much as a positive one."""
    out = []
    for method, ref_label, factor, bits_cap in TARGETS:
        mine, ref = _find(rows, "perfxlm", method), _find(rows, "llama.cpp", ref_label)
        if mine is None or ref is None:
            continue
        checks = {
            "kld": mine.kld_mean <= factor * ref.kld_mean,
            "delta_ppl": abs(mine.delta_ppl_pct) <= factor * abs(ref.delta_ppl_pct),
        }
        if bits_cap:
            checks["bits"] = mine.bits_per_weight <= ref.bits_per_weight
        out.append({"target": f"{method} ≤ {'' if factor == 1 else f'{factor:g}x '}llama.cpp {ref_label}",
                    "mine": {"kld": mine.kld_mean, "delta_ppl_pct": mine.delta_ppl_pct, "bits": mine.bits_per_weight},
                    "reference": {"kld": ref.kld_mean, "delta_ppl_pct": ref.delta_ppl_pct, "bits": ref.bits_per_weight},
                    "checks": checks, "met": all(checks.values())})  # fmt: skip
    same, ref = _find(rows, "perfxlm", "Q8_0"), _find(rows, "llama.cpp", "Q8_0")
    if same is not None and ref is not None:
        ratio = same.kld_mean / ref.kld_mean
        out.append({"target": "perfxlm's mean KLD of the Q8_0 file within 10 % of llama.cpp's",
                    "mine": {"kld": same.kld_mean}, "reference": {"kld": ref.kld_mean},
                    "checks": {"ratio": abs(ratio - 1) <= 0.10}, "ratio": ratio, "met": abs(ratio - 1) <= 0.10})
    return out


def targets_markdown(results: list[dict[str, Any]]) -> str:
    lines = ["| target | perfxlm | llama.cpp | met |", "|---|---|---|---|"]
    for t in results:
        show = lambda d: ", ".join(  # noqa: E731
            {"kld": f"KLD {d.get('kld', math.nan):.5f}", "delta_ppl_pct": f"Δppl {d.get('delta_ppl_pct', 0):+.3f} %",
             "bits": f"{d.get('bits', 0):.2f} bpw"}[k] for k in d)
        met = "yes" if t["met"] else "no (" + ", ".join(k for k, ok in t["checks"].items() if not ok) + ")"
        lines.append(f"| {t['target']} | {show(t['mine'])} | {show(t['reference'])} | {met} |")
    return "\n".join(lines)


def plot(rows: list[Row], path: Path, title: str) -> None:
    """Mean KLD against bits per weight, one marker per engine (lower left is better)."""
    from perfxlm.bench.plots import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for engine, marker, color in (("llama.cpp", "s", "tab:orange"), ("perfxlm", "o", "tab:blue")):
        pts = [r for r in rows if r.engine == engine and not r.error and not math.isnan(r.kld_mean)]
        if not pts:
            continue
        ax.errorbar([r.bits_per_weight for r in pts], [max(r.kld_mean, 1e-7) for r in pts],
                    yerr=[r.kld_error for r in pts], fmt=marker, color=color, label=engine)
        for r in pts:
            ax.annotate(r.label, (r.bits_per_weight, max(r.kld_mean, 1e-7)), textcoords="offset points",
                        xytext=(5, 4 if engine == "perfxlm" else -10), fontsize=8, color=color)
    ax.set_yscale("log")
    ax.set_xlabel("bits per weight (weight matrices, embedding and head included)")
    ax.set_ylabel("mean KL divergence from the engine's own bf16 base (nats)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- main -----------------------------------------------------------------------------------------------

def model_files(folder: Path, formats: list[str]) -> dict[str, Path]:
    files = {"bf16": folder / "rotated.bf16.gguf", **{f: folder / f"rotated.{f}.gguf" for f in formats}}
    missing = [str(p) for p in files.values() if not p.is_file()]
    if missing:
        raise SystemExit(f"missing: {', '.join(missing)}. Make them with benchmarks/make_rotated_model.py "
                         f"--out {folder} --ftypes {','.join(formats)}.")
    return files


def split_formats(value: str | None) -> tuple[list[str], list[str]]:
    """--formats into (llama.cpp file formats, perfxlm methods), each checked against what exists."""
    methods = perfxlm_methods()
    if value is None:
        return list(GGUF_FORMATS), list(methods)
    names = [v.strip().lower() for v in value.split(",") if v.strip()]
    unknown = [n for n in names if n not in GGUF_FORMATS and n not in methods]
    if unknown:
        raise SystemExit(f"--formats: {', '.join(unknown)} unknown; choose from GGUF files "
                         f"{', '.join(GGUF_FORMATS)} and perfxlm methods {', '.join(methods)}.")
    return [n for n in names if n in GGUF_FORMATS], [n for n in names if n in methods]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=str(DEFAULT_DIR), help="make_rotated_model.py's --out (default: %(default)s)")
    ap.add_argument("--text", required=True, help="the text (UTF-8), e.g. from perplexity_llamacpp.py --write-sharegpt-text")
    ap.add_argument("-c", "--ctx-size", type=int, default=512, help="tokens per window")
    ap.add_argument("--chunks", type=int, default=20, help="windows scored (default: %(default)s)")
    ap.add_argument("--formats", default=None, metavar="LIST",
                    help=f"comma list of GGUF files ({', '.join(GGUF_FORMATS)}) and perfxlm methods (those "
                         "the checkout offers); default: all")
    ap.add_argument("--engines", default="llama.cpp,perfxlm", help="comma list: llama.cpp, perfxlm")
    ap.add_argument("--threads", type=int, default=2, help="threads for both engines")
    ap.add_argument("--kv-cache-gib", type=float, default=1.0, help="perfxlm's KV cache (windows are short)")
    ap.add_argument("--results", default=None, help="output folder (default: DIR/results)")
    ap.add_argument("--keep-base", action="store_true", help="keep the base log-probability files (~0.5 GB each)")
    ap.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    args = ap.parse_args(argv)
    args.gguf_formats, args.methods = split_formats(args.formats)
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    bad = [e for e in args.engines if e not in ("llama.cpp", "perfxlm")]
    if bad:
        raise SystemExit(f"--engines: {', '.join(bad)} unknown; choose from llama.cpp, perfxlm.")
    if not Path(args.text).is_file():
        raise SystemExit(f"--text {args.text}: not a file. Write one with benchmarks/perplexity_llamacpp.py "
                         "--write-sharegpt-text SHAREGPT.json -f TEXT.")
    return args


def cpu_description(threads: int) -> str:
    name, flags = "unknown CPU", []
    with open("/proc/cpuinfo") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                name = value.strip()
            elif key.strip() == "flags":
                flags = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_int8") if f in value.split()]
                break
    return f"{name}, {' '.join(flags)}, {threads} threads"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    opts = parse_args(argv)
    t0 = time.perf_counter()
    folder = Path(opts.dir).expanduser()
    out = Path(opts.results).expanduser() if opts.results else folder / "results"
    out.mkdir(parents=True, exist_ok=True)
    files = model_files(folder, opts.gguf_formats)
    runners: dict[str, Callable] = {"llama.cpp": llamacpp_rows, "perfxlm": perfxlm_rows}
    rows: list[Row] = []
    tokens: dict[str, dict] = {}
    for engine in opts.engines:
        start = time.perf_counter()
        got, info = runners[engine](opts, files, out, t0)
        rows += got
        tokens[engine] = {**info, "seconds": time.perf_counter() - start}
    cpu = cpu_description(opts.threads)
    title = (f"rotated SmolLM2-135M, {opts.chunks} windows of {opts.ctx_size}, {Path(opts.text).name}; {cpu}")
    goals = targets(rows)
    notes = [f"{engine}: the text is {info['text_tokens']} tokens under its tokenizer; {info['n_windows']} windows "
             f"scored; {info['seconds']:.0f} s" for engine, info in tokens.items()]
    if len(tokens) == 2:
        notes.append(compare_tokens(*(info.pop("window_tokens") for info in tokens.values())))
    for info in tokens.values():
        info.pop("window_tokens", None)
    report = "\n\n".join([f"# Quantization quality\n\n{title}", markdown(rows), targets_markdown(goals),
                           "\n".join(f"- {n}" for n in notes)])
    (out / "quality.md").write_text(report + "\n")
    payload = {"cpu": cpu, "text": str(Path(opts.text).resolve()), "ctx_size": opts.ctx_size, "chunks": opts.chunks,
               "engines": tokens, "rows": [_clean(asdict(r)) for r in rows], "targets": goals,
               "seconds": time.perf_counter() - t0}  # fmt: skip
    (out / "quality.json").write_text(json.dumps(payload, indent=2))
    plot(rows, out / "quality.png", title)
    print(report)
    say(f"wrote {out / 'quality.md'}, quality.json, quality.png", t0)
    return payload


def compare_tokens(a: list[int], b: list[int]) -> str:
    """Whether the two engines scored the same token ids (each uses its own tokenizer)."""
    n = min(len(a), len(b))
    first = next((i for i in range(n) if a[i] != b[i]), None)
    if first is None and len(a) == len(b):
        return f"both engines' windows hold the same {n} token ids"
    differ = sum(1 for i in range(n) if a[i] != b[i])
    return (f"the engines' windows differ: first at token {first if first is not None else n}, "
            f"{differ} of {n} positions differ")


def _clean(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in d.items()}


if __name__ == "__main__":
    main()
