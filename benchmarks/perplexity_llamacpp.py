"""llama.cpp's perplexity of a GGUF file on a text, through llama-cpp-python's low-level API.

Computes what `llama-perplexity -m MODEL -f FILE -c N` computes, so that `perfxlm eval perplexity` can be
compared with it on the same file and text: the text tokenized once (llama.cpp's tokenizer, BOS in front
when the model adds one), windows of N tokens without overlap, each window's first token replaced by
BOS when the model adds one, logits requested for the second half of each window only, and every token
after position N/2 scored; the running estimate per window and `Final estimate: PPL = X +/- Y`.
One window per llama_decode call, the KV cache cleared between windows.

    python benchmarks/perplexity_llamacpp.py -f text.txt -c 512 --threads 2
    # the text of the README's table: the human/gpt turns of a ShareGPT file, first ~20k tokens
    python benchmarks/perplexity_llamacpp.py --write-sharegpt-text sharegpt.json --text-tokens 20000 -f text.txt

KL divergence, as `llama-perplexity --kl-divergence-base FILE [--kl-divergence]`:

    # the base: its perplexity, and every scored position's whole log-softmax saved to FILE
    python benchmarks/perplexity_llamacpp.py -m base.gguf -f text.txt -c 512 --kl-divergence-base base.kld
    # a model against it: the same windows of the same tokens (read from FILE), llama.cpp's statistics
    python benchmarks/perplexity_llamacpp.py -m q8_0.gguf --kl-divergence-base base.kld --kl-divergence

FILE is perfxlm's base log-probability file (perfxlm/eval/kld_base.py), not llama.cpp's own layout, and
the statistics are perfxlm/eval/kld_stats.py's, so both engines' figures come from one implementation;
a base file written here can also be read by `perfxlm eval kld --base-logits` when the tokens agree.
Log-softmax in float64, of the logits llama.cpp returns for the second half of each window.

llama.cpp moves quantized weights into extra buffer types (AMX, repacked layouts) by default; on some AMX
CPUs its AMX int8 matmul crashes the process, so `--extra-buffers auto` probes them in a child process
first (as benchmarks/compare_llamacpp.py does) and loads with use_extra_bufts=False when they crash.
Not a test: it needs llama-cpp-python (pip install -e ".[llamacpp]").
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_llamacpp import _clear_memory, _llama_log, extra_buffers_work, llama_cpp  # noqa: E402

from perfxlm.config import default_model_path  # noqa: E402
from perfxlm.eval import kld_base  # noqa: E402
from perfxlm.eval.kld_stats import KldAccumulator, token_stats  # noqa: E402
from perfxlm.eval.windows import Windows  # noqa: E402

_SLICE = 64  # scored positions compared at once: bounds the float64 [rows, vocab] temporaries


def write_sharegpt_text(src: str, out: str, text_tokens: int, model: str) -> None:
    """The human/gpt turns of a ShareGPT JSON file, in file order, separated by blank lines, until the
    text holds about `text_tokens` tokens of the model's tokenizer."""
    from perfxlm.tokenizer import get_tokenizer

    tok = get_tokenizer(model)
    parts, total = [], 0
    for conv in json.loads(Path(src).read_text()):
        for turn in conv.get("conversations", []):
            if turn.get("from") not in ("human", "gpt") or not turn.get("value", "").strip():
                continue
            parts.append(turn["value"].strip())
            total += len(tok.encode(turn["value"], add_special_tokens=False)) + 1
            if total >= text_tokens:
                break
        if total >= text_tokens:
            break
    Path(out).write_text("\n\n".join(parts) + "\n", encoding="utf-8")
    print(f"wrote {out}: {len(parts)} turns, about {total} tokens")


def tokenize(vocab, text: str) -> list[int]:
    data = text.encode("utf-8")
    cap = len(data) + 16
    buf = (llama_cpp.llama_token * cap)()
    n = llama_cpp.llama_tokenize(vocab, data, len(data), buf, cap, True, False)  # add_special, no parse_special
    if n < 0:
        raise RuntimeError(f"llama_tokenize needs {-n} tokens")
    return list(buf[:n])


def log_softmax_at(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """log p(target) per row, float64 sums as llama.cpp's log_softmax."""
    x = logits.astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    lse = np.log(np.exp(x - m).sum(axis=1)) + m[:, 0]
    return x[np.arange(len(targets)), targets] - lse


class LlamaScorer:
    """One llama.cpp model and context that returns a window's logits at its scored positions."""

    def __init__(self, model: str, n_ctx: int, threads: int, extra_buffers: bool) -> None:
        llama_cpp.llama_log_set(_llama_log, None)
        llama_cpp.llama_backend_init()
        mp = llama_cpp.llama_model_default_params()
        mp.use_extra_bufts = extra_buffers
        self.model = llama_cpp.llama_model_load_from_file(model.encode(), mp)
        if not self.model:
            raise SystemExit(f"llama.cpp could not load {model}")
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(self.vocab))
        self.bos = llama_cpp.llama_vocab_bos(self.vocab)
        self.n_ctx = n_ctx
        p = llama_cpp.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch = n_ctx, n_ctx, min(512, n_ctx)
        p.n_threads = p.n_threads_batch = threads
        self.ctx = llama_cpp.llama_init_from_model(self.model, p)
        self.batch = llama_cpp.llama_batch_init(n_ctx, 0, 1)

    def scored_logits(self, window: np.ndarray) -> np.ndarray:
        """Logits [n_ctx - first - 1, vocab] at positions first .. n_ctx - 2 (first = n_ctx // 2): the
        rows that predict the window's tokens first + 1 .. n_ctx - 1. A view into llama.cpp's buffer,
        valid until the next call."""
        n_ctx, first, batch = self.n_ctx, self.n_ctx // 2, self.batch
        _clear_memory(self.ctx)
        np.ctypeslib.as_array(batch.token, (n_ctx,))[:] = window
        np.ctypeslib.as_array(batch.pos, (n_ctx,))[:] = np.arange(n_ctx, dtype=np.int32)
        np.ctypeslib.as_array(batch.n_seq_id, (n_ctx,))[:] = 1
        # logits only for the second half: llama.cpp computes the head for flagged rows alone
        np.ctypeslib.as_array(batch.logits, (n_ctx,))[:] = (np.arange(n_ctx) >= first).astype(np.int8)
        for i in range(n_ctx):
            batch.seq_id[i][0] = 0
        batch.n_tokens = n_ctx
        if llama_cpp.llama_decode(self.ctx, batch) != 0:
            raise SystemExit("llama_decode failed")
        # output rows are the positions first .. n_ctx-1, in order; the last one predicts past the window
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits(self.ctx), (n_ctx - first, self.n_vocab))[:-1]

    def close(self) -> None:
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)
        llama_cpp.llama_model_free(self.model)


def log_softmax64(logits: np.ndarray) -> torch.Tensor:
    """Whole log-softmax rows in float64 (llama.cpp's KLD sums in double as well)."""
    return torch.from_numpy(np.array(logits, dtype=np.float64)).log_softmax(dim=-1)


def text_tokens(args, scorer: LlamaScorer, model: str) -> np.ndarray:
    text = Path(args.file).read_text(encoding="utf-8")
    if args.tokens == "perfxlm":  # the token ids perfxlm scores (its tokenizer; BOS as llama.cpp's flag says)
        from perfxlm.tokenizer import get_tokenizer

        ids = get_tokenizer(model).encode(text, add_special_tokens=False)
        return np.asarray(([scorer.bos] if scorer.add_bos else []) + list(ids), dtype=np.int32)
    return np.asarray(tokenize(scorer.vocab, text), dtype=np.int32)


def score_text(args, scorer: LlamaScorer, windows: Windows, base: kld_base.BaseLogprobs | None) -> dict:
    """Perplexity over the windows; with `base` (a new base file) every scored row's log-softmax is
    written into it as well."""
    nll = nll2 = 0.0
    count = 0
    estimates = []
    t0 = time.perf_counter()
    for w in range(windows.n_windows):
        window = np.asarray(windows.window(w), dtype=np.int32)
        logits = scorer.scored_logits(window)
        targets = window[windows.first + 1 :].astype(np.int64)
        if base is not None:
            lp = log_softmax64(logits)
            base.write(w, 0, lp)
            v = -lp[torch.arange(len(targets)), torch.from_numpy(targets)].numpy()
        else:
            v = -log_softmax_at(logits, targets)
        nll += float(v.sum())
        nll2 += float((v * v).sum())
        count += len(v)
        estimates.append(math.exp(nll / count))
        print(f"[{w + 1}]{estimates[-1]:.4f},", end="", flush=True)
    print()
    seconds = time.perf_counter() - t0
    mean = nll / count
    ppl = math.exp(mean)
    var = nll2 / count - mean * mean
    stderr = math.sqrt(var / (count - 1)) * ppl if count > 1 and var > 0 else float("nan")
    print(f"scored {count} tokens in {windows.n_windows} windows, {seconds:.1f} s")
    print(f"Final estimate: PPL = {ppl:.4f} +/- {stderr:.5f}")
    return {"n_chunks": windows.n_windows, "n_tokens": count, "ppl": ppl, "stderr": stderr,
            "chunk_estimates": estimates, "seconds": seconds}


def kl_divergence(scorer: LlamaScorer, base: kld_base.BaseLogprobs, windows: Windows) -> dict:
    """The model's statistics against the base file, window by window, as llama.cpp prints them."""
    acc = KldAccumulator()
    t0 = time.perf_counter()
    for w in range(windows.n_windows):
        window = np.asarray(windows.window(w), dtype=np.int32)
        lp = log_softmax64(scorer.scored_logits(window))
        ref = base.rows(w)
        targets = torch.tensor(windows.targets(w))
        for a in range(0, lp.shape[0], _SLICE):
            b = min(a + _SLICE, lp.shape[0])
            acc.add(token_stats(ref[a:b], lp[a:b], targets[a:b]))
        ppl, kld, top = acc.running()
        print(f"{w + 1:4d}  PPL(Q) {ppl:10.4f}  KLD {kld:9.6f}  same top {100 * top:7.3f} %", flush=True)
    seconds = time.perf_counter() - t0
    summary = acc.summary()
    print(summary.report())
    return {"n_chunks": windows.n_windows, "n_tokens": summary.n_tokens, "seconds": seconds,
            "base": base.header.get("produced_by", {}), "statistics": summary.to_dict()}


def base_windows(args, base: kld_base.BaseLogprobs, scorer_vocab: int) -> Windows:
    """The base file's windows (its tokens, as llama-perplexity reads them from its file), checked."""
    h = base.header
    if args.ctx_size is not None and args.ctx_size != int(h["n_ctx"]):
        raise SystemExit(f"-c {args.ctx_size}: the base file {base.path} was made with windows of {h['n_ctx']}; "
                         "leave -c out or make the base again.")
    if base.vocab_size != scorer_vocab:
        raise SystemExit(f"the base file has a vocabulary of {base.vocab_size} tokens and this model "
                         f"{scorer_vocab}: KL divergence needs both models to share one vocabulary.")
    w = base.windows
    n = w.n_windows if args.chunks is None else min(w.n_windows, args.chunks)
    return Windows(tokens=w.tokens, n_ctx=w.n_ctx, n_windows=n, bos_token_id=w.bos_token_id)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default=None, help="GGUF file (default: the embedded default model)")
    ap.add_argument("-f", "--file", default=None, help="text file (with --write-sharegpt-text: written)")
    ap.add_argument("-c", "--ctx-size", type=int, default=None,
                    help="tokens per window (default 512; with --kl-divergence: the base file's)")
    ap.add_argument("--chunks", type=int, default=None, help="score only the first N windows")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--extra-buffers", choices=["auto", "on", "off"], default="auto",
                    help="llama.cpp's extra buffer types for quantized weights (auto: probe for the AMX crash)")
    ap.add_argument("--write-sharegpt-text", default=None, metavar="JSON",
                    help="write the human/gpt turns of this ShareGPT file to --file and exit")
    ap.add_argument("--text-tokens", type=int, default=20000, help="with --write-sharegpt-text: about this many")
    ap.add_argument("--tokens", choices=["llamacpp", "perfxlm"], default="llamacpp",
                    help="whose tokenizer cuts the text: llama.cpp's (as llama-perplexity), or perfxlm's (the same "
                         "windows as `perfxlm eval perplexity`, so that only the arithmetic differs)")
    ap.add_argument("--kl-divergence-base", default=None, metavar="FILE",
                    help="with -f: also write every scored position's log-softmax to FILE; with "
                         "--kl-divergence: the base to compare with")
    ap.add_argument("--kl-divergence", action="store_true",
                    help="compare the model with --kl-divergence-base FILE on its windows and tokens")
    ap.add_argument("--output-json", default=None, metavar="PATH")
    args = ap.parse_args(argv)
    if args.kl_divergence and not args.kl_divergence_base:
        ap.error("--kl-divergence reads the base's log-probabilities: name them with --kl-divergence-base FILE")
    if not args.kl_divergence and not args.file:
        ap.error("the text to score: -f FILE")
    return args


def main(argv: list[str] | None = None) -> dict | None:
    args = parse_args(argv)
    model = args.model or default_model_path()
    if args.write_sharegpt_text:
        write_sharegpt_text(args.write_sharegpt_text, args.file, args.text_tokens, model)
        return None

    base = kld_base.open_base(args.kl_divergence_base) if args.kl_divergence else None
    n_ctx = int(base.header["n_ctx"]) if base is not None else (args.ctx_size or 512)
    extra = {"on": True, "off": False}.get(args.extra_buffers)
    if extra is None:
        extra = extra_buffers_work(model, args.threads)
    scorer = LlamaScorer(model, n_ctx, args.threads, extra)
    if base is not None:
        windows = base_windows(args, base, scorer.n_vocab)
        source = f"read from the base file, cut by {base.header.get('produced_by', {}).get('tokens', '?')}'s tokenizer"
    else:
        tokens = text_tokens(args, scorer, model)
        windows = make_windows(tokens, n_ctx, args.chunks, scorer.bos if scorer.add_bos else None)
        source = f"{args.tokens}'s tokenizer"
    print(f"model: {model} (llama.cpp, extra buffer types {'on' if extra else 'off'}), add_bos={scorer.add_bos}, "
          f"{len(windows.tokens)} tokens ({source}), {windows.n_windows} windows of {n_ctx}, threads={args.threads}")

    result = {"engine": "llama.cpp", "model": model, "ctx_size": n_ctx, "add_bos": scorer.add_bos,
              "tokens": args.tokens, "extra_buffers": extra, "threads": args.threads,
              "text_tokens": len(windows.tokens)}
    if base is not None:
        result.update(kl_divergence(scorer, base, windows))
    else:
        result["file"] = str(Path(args.file).resolve())
        new_base = None
        if args.kl_divergence_base:
            produced_by = {"engine": "llama.cpp", "llama_cpp_python": llama_cpp.__version__, "model": model,
                           "tokens": args.tokens}
            new_base = kld_base.create(args.kl_divergence_base, windows, scorer.n_vocab, produced_by)
        result.update(score_text(args, scorer, windows, new_base))
        if new_base is not None:
            new_base.finish()
            result["kl_divergence_base"] = args.kl_divergence_base
            print(f"saved the base's log-probabilities: {args.kl_divergence_base}")
    scorer.close()
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2))
    return result


def make_windows(tokens: np.ndarray, n_ctx: int, chunks: int | None, bos: int | None) -> Windows:
    n_windows = len(tokens) // n_ctx
    if chunks is not None:
        n_windows = min(n_windows, chunks)
    if n_windows < 1:
        raise SystemExit(f"the text tokenizes to {len(tokens)} tokens: fewer than one window of {n_ctx}")
    return Windows(tokens=[int(t) for t in tokens], n_ctx=n_ctx, n_windows=n_windows, bos_token_id=bos)


if __name__ == "__main__":
    main()
