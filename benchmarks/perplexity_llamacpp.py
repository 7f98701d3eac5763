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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_llamacpp import _clear_memory, _llama_log, extra_buffers_work, llama_cpp  # noqa: E402

from perfxlm.config import default_model_path  # noqa: E402


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default=None, help="GGUF file (default: the embedded default model)")
    ap.add_argument("-f", "--file", required=True, help="text file (with --write-sharegpt-text: written)")
    ap.add_argument("-c", "--ctx-size", type=int, default=512)
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
    ap.add_argument("--output-json", default=None, metavar="PATH")
    args = ap.parse_args()
    model = args.model or default_model_path()
    if args.write_sharegpt_text:
        write_sharegpt_text(args.write_sharegpt_text, args.file, args.text_tokens, model)
        return

    extra = {"on": True, "off": False}.get(args.extra_buffers)
    if extra is None:
        extra = extra_buffers_work(model, args.threads)
    llama_cpp.llama_log_set(_llama_log, None)
    llama_cpp.llama_backend_init()
    mp = llama_cpp.llama_model_default_params()
    mp.use_extra_bufts = extra
    lm = llama_cpp.llama_model_load_from_file(model.encode(), mp)
    if not lm:
        raise SystemExit(f"llama.cpp could not load {model}")
    vocab = llama_cpp.llama_model_get_vocab(lm)
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    add_bos = bool(llama_cpp.llama_vocab_get_add_bos(vocab))
    bos = llama_cpp.llama_vocab_bos(vocab)

    n_ctx = args.ctx_size
    text = Path(args.file).read_text(encoding="utf-8")
    if args.tokens == "perfxlm":  # the token ids perfxlm scores (its tokenizer; BOS as llama.cpp's flag says)
        from perfxlm.tokenizer import get_tokenizer

        ids = get_tokenizer(model).encode(text, add_special_tokens=False)
        tokens = np.asarray(([bos] if add_bos else []) + list(ids), dtype=np.int32)
    else:
        tokens = np.asarray(tokenize(vocab, text), dtype=np.int32)
    n_windows = len(tokens) // n_ctx
    if args.chunks is not None:
        n_windows = min(n_windows, args.chunks)
    if n_windows < 1:
        raise SystemExit(f"the text tokenizes to {len(tokens)} tokens: fewer than one window of {n_ctx}")
    p = llama_cpp.llama_context_default_params()
    p.n_ctx, p.n_batch, p.n_ubatch = n_ctx, n_ctx, min(512, n_ctx)
    p.n_threads = p.n_threads_batch = args.threads
    ctx = llama_cpp.llama_init_from_model(lm, p)
    batch = llama_cpp.llama_batch_init(n_ctx, 0, 1)
    first = n_ctx // 2
    print(f"model: {model} (llama.cpp, extra buffer types {'on' if extra else 'off'}), add_bos={add_bos}, "
          f"{len(tokens)} tokens ({args.tokens}'s tokenizer), {n_windows} windows of {n_ctx}, threads={args.threads}")

    nll = nll2 = 0.0
    count = 0
    estimates = []
    t0 = time.perf_counter()
    for w in range(n_windows):
        window = tokens[w * n_ctx : (w + 1) * n_ctx].copy()
        if add_bos:
            window[0] = bos
        _clear_memory(ctx)
        np.ctypeslib.as_array(batch.token, (n_ctx,))[:] = window
        np.ctypeslib.as_array(batch.pos, (n_ctx,))[:] = np.arange(n_ctx, dtype=np.int32)
        np.ctypeslib.as_array(batch.n_seq_id, (n_ctx,))[:] = 1
        np.ctypeslib.as_array(batch.logits, (n_ctx,))[:] = (np.arange(n_ctx) >= first).astype(np.int8)
        for i in range(n_ctx):
            batch.seq_id[i][0] = 0
        batch.n_tokens = n_ctx
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise SystemExit("llama_decode failed")
        # output rows are the positions first .. n_ctx-1, in order; the last one predicts past the window
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits(ctx), (n_ctx - first, n_vocab))[:-1]
        v = -log_softmax_at(logits, window[first + 1 :].astype(np.int64))
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
    print(f"scored {count} tokens in {n_windows} windows, {seconds:.1f} s")
    print(f"Final estimate: PPL = {ppl:.4f} +/- {stderr:.5f}")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({
            "engine": "llama.cpp", "model": model, "file": str(Path(args.file).resolve()), "ctx_size": n_ctx,
            "add_bos": add_bos, "tokens": args.tokens, "extra_buffers": extra, "threads": args.threads, "text_tokens": len(tokens),
            "n_chunks": n_windows, "n_tokens": count, "ppl": ppl, "stderr": stderr,
            "chunk_estimates": estimates, "seconds": seconds}, indent=2))
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(lm)


if __name__ == "__main__":
    main()
