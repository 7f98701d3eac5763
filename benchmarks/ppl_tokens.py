"""Per-token log-probabilities of both engines on the same GGUF file, text and windows, side by side.

`perfxlm eval perplexity` and `perplexity_llamacpp.py --tokens perfxlm` print one number each; this saves
every scored token's negative log-likelihood (a [windows, n_ctx/2 - 1] float64 array, .npy) per engine,
then compares two such arrays: the mean and spread of the per-token difference, per window, per position
in the window (quarters of the scored half), by how sure the model is, and how many windows it takes for
the mean to settle within 0.1 %.

    python benchmarks/ppl_tokens.py dump --engine perfxlm -m FILE -f text.txt --chunks 20 -o a.npy
    python benchmarks/ppl_tokens.py dump --engine llamacpp -m FILE -f text.txt --chunks 20 -o b.npy
    python benchmarks/ppl_tokens.py compare a.npy b.npy

A perfxlm run follows the environment as `perfxlm eval perplexity` does (PERFXLM_ISA, ...) and takes
engine options as --kwargs JSON (e.g. '{"kv_cache_dtype": "float32"}' or '{"dtype": "float32"}').
Not a test: the llama.cpp side needs llama-cpp-python.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np


def dump_perfxlm(args) -> np.ndarray:
    from perfxlm import LLM
    from perfxlm.eval.perplexity import prepare_windows
    from perfxlm.eval.scoring import score_windows

    llm = LLM(args.model, **json.loads(args.kwargs or "{}"))
    windows = prepare_windows(llm, Path(args.file).read_text(encoding="utf-8"), args.ctx_size, args.chunks, None)
    return np.asarray(score_windows(llm, windows), dtype=np.float64)


def dump_llamacpp(args) -> np.ndarray:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import perplexity_llamacpp as pl
    from compare_llamacpp import extra_buffers_work

    extra = {"on": True, "off": False}.get(args.extra_buffers)
    if extra is None:
        extra = extra_buffers_work(args.model, args.threads)
    scorer = pl.LlamaScorer(args.model, args.ctx_size, args.threads, extra)
    ns = argparse.Namespace(file=args.file, tokens="perfxlm")
    tokens = pl.text_tokens(ns, scorer, args.model)
    windows = pl.make_windows(tokens, args.ctx_size, args.chunks, scorer.bos if scorer.add_bos else None)
    rows = []
    for w in range(windows.n_windows):
        window = np.asarray(windows.window(w), dtype=np.int32)
        logits = scorer.scored_logits(window)
        rows.append(-pl.log_softmax_at(logits, window[windows.first + 1:].astype(np.int64)))
    scorer.close()
    return np.asarray(rows, dtype=np.float64)


def compare(a: np.ndarray, b: np.ndarray, names: tuple[str, str]) -> None:
    """a - b of negative log-likelihoods: positive where `a` gives the token less probability."""
    n = min(len(a), len(b))
    a, b = a[:n], b[:n]
    d = a - b
    ppl_a, ppl_b = math.exp(a.mean()), math.exp(b.mean())
    print(f"{n} windows, {d.size} tokens: PPL {names[0]} {ppl_a:.4f}, {names[1]} {ppl_b:.4f}, "
          f"difference {100 * (ppl_a / ppl_b - 1):+.3f} %")
    se = d.std(ddof=1) / math.sqrt(d.size)
    print(f"per-token NLL difference: mean {d.mean():+.5f} (standard error {se:.5f}), s.d. {d.std():.4f}, "
          f"|d| median {np.median(np.abs(d)):.4f}, 99th pct {np.percentile(np.abs(d), 99):.4f}, max {np.abs(d).max():.4f}")
    pw = d.mean(axis=1)
    print(f"per-window mean: s.d. {100 * pw.std(ddof=1):.3f} %, range {100 * pw.min():+.3f} % .. {100 * pw.max():+.3f} %; "
          f"windows with {names[0]} lower: {(pw < 0).sum()} of {n}")
    print("per window (%): " + " ".join(f"{100 * x:+.2f}" for x in pw))
    q = d.shape[1] // 4
    print("by position in the scored half (quarters): " + ", ".join(
        f"{100 * d[:, i * q:(i + 1) * q].mean():+.3f} %" for i in range(4)))
    conf = np.exp(-b)  # the reference's probability of the actual token
    for lo, hi in ((0, 0.1), (0.1, 0.5), (0.5, 0.9), (0.9, 1.01)):
        m = (conf >= lo) & (conf < hi)
        if m.any():
            print(f"  {names[1]} p(token) in [{lo}, {hi}): {m.sum():5d} tokens, mean d {d[m].mean():+.5f}, "
                  f"sum share {100 * d[m].sum() / d.size:+.3f} %")
    # the running mean: how many windows before it stays within 0.1 %
    run = np.cumsum(pw) / np.arange(1, n + 1)
    print("running mean difference (%): " + " ".join(f"{100 * x:+.3f}" for x in run))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    dp = sub.add_parser("dump")
    dp.add_argument("--engine", choices=["perfxlm", "llamacpp"], required=True)
    dp.add_argument("-m", "--model", required=True)
    dp.add_argument("-f", "--file", required=True)
    dp.add_argument("-c", "--ctx-size", type=int, default=512)
    dp.add_argument("--chunks", type=int, default=20)
    dp.add_argument("--threads", type=int, default=2)
    dp.add_argument("--extra-buffers", choices=["auto", "on", "off"], default="auto")
    dp.add_argument("--kwargs", default=None, help="perfxlm: LLM keyword arguments as JSON")
    dp.add_argument("-o", "--output", required=True)
    cp = sub.add_parser("compare")
    cp.add_argument("a")
    cp.add_argument("b")
    args = ap.parse_args(argv)
    if args.cmd == "dump":
        nll = dump_perfxlm(args) if args.engine == "perfxlm" else dump_llamacpp(args)
        np.save(args.output, nll)
        print(f"{args.output}: {nll.shape}, PPL {math.exp(nll.mean()):.4f}")
    else:
        compare(np.load(args.a), np.load(args.b), (Path(args.a).stem, Path(args.b).stem))


if __name__ == "__main__":
    main()
