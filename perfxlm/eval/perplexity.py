"""`perplexity(llm, text or token ids, ctx_size=512)`: llama.cpp's perplexity, run by this engine."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

from perfxlm.eval.scoring import progress_bar, score_windows, step_budget
from perfxlm.eval.stats import NllAccumulator, format_chunk_estimates, format_final
from perfxlm.eval.windows import Windows, make_windows, tokenize_text, tokenizer_adds_bos


@dataclass
class PerplexityResult:
    ppl: float
    stderr: float  # NaN where llama.cpp prints no estimate
    n_tokens: int  # tokens scored
    n_chunks: int  # windows scored
    ctx_size: int
    text_tokens: int  # tokens in the whole text (BOS included)
    add_bos: bool
    score_chunk: int | None
    chunk_estimates: list[float] = field(default_factory=list)  # running PPL after each window
    seconds: float = 0.0

    @property
    def mean_nll(self) -> float:
        return math.log(self.ppl)

    def final_line(self) -> str:
        return format_final(self.ppl, self.stderr)

    def estimates_line(self) -> str:
        return format_chunk_estimates(self.chunk_estimates)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["stderr"] = None if math.isnan(self.stderr) else self.stderr
        return d


def _bos_token_id(llm) -> int | None:
    tokenizer = llm.get_tokenizer()
    bos = getattr(tokenizer, "bos_token_id", None) if tokenizer is not None else None
    if bos is None:
        bos = getattr(llm.llm_engine.config.hf_config, "bos_token_id", None)
    return None if bos is None else int(bos)


def prepare_windows(
    llm, text_or_ids: str | Sequence[int], ctx_size: int, n_chunks: int | None, add_bos: bool | None
) -> Windows:
    """Tokenize (text) or take (token ids) the input and cut it into windows, checking every limit."""
    max_len = int(llm.llm_engine.resolved.max_model_len)
    if isinstance(ctx_size, int) and not isinstance(ctx_size, bool) and ctx_size >= max_len:
        raise ValueError(
            f"ctx_size {ctx_size} is too large for this engine: max_model_len is {max_len}, and a window "
            f"of ctx_size tokens plus the one token each request samples must fit (ctx_size <= "
            f"{max_len - 1}). Lower ctx_size or raise max_model_len."
        )
    tokenizer = llm.get_tokenizer()
    if isinstance(text_or_ids, str):
        if tokenizer is None:
            raise ValueError("scoring a text needs a tokenizer; this LLM has none: pass token ids instead.")
        if add_bos is None:
            add_bos = tokenizer_adds_bos(tokenizer)
        tokens = tokenize_text(text_or_ids, tokenizer, add_bos)
    else:
        tokens = list(text_or_ids)
        if add_bos is None:  # token ids are taken as given; BOS replaces each window's first token as the model's
            add_bos = tokenizer is not None and tokenizer_adds_bos(tokenizer)
    bos = _bos_token_id(llm) if add_bos else None
    if add_bos and bos is None:
        raise ValueError("add_bos=True, but the model has no BOS token id.")
    return make_windows(tokens, ctx_size, n_chunks, bos)


def perplexity(
    llm,
    text_or_ids: str | Sequence[int],
    ctx_size: int = 512,
    *,
    n_chunks: int | None = None,
    batch_size: int | None = None,
    score_chunk: int | None = None,
    add_bos: bool | None = None,
    progress: bool = False,
    on_chunk: Callable[[int, float], None] | None = None,
) -> PerplexityResult:
    """Perplexity of a text as llama.cpp's `llama-perplexity -c ctx_size` computes it (see
    perfxlm/eval/windows.py), scored by this LLM's engine.

    n_chunks: score only the first n windows (llama.cpp's --chunks). batch_size: most windows in flight
    at once (default: all; the scheduler batches them under max_num_batched_tokens). score_chunk:
    prefill each window in chunks of at most this many tokens, so later chunks attend to K/V read back
    from the KV cache. add_bos: None follows the model's tokenizer. on_chunk(i, estimate) is called with
    the running estimate after windows 1..i are all scored (i from 1), in order.
    """
    windows = prepare_windows(llm, text_or_ids, ctx_size, n_chunks, add_bos)
    acc = NllAccumulator()
    estimates: list[float] = []
    done: dict[int, list[float]] = {}

    bar = progress_bar(windows.n_windows, "perplexity windows", progress)

    def finished(i: int, nlls: list[float]) -> None:
        done[i] = nlls
        bar.update(1)
        while len(estimates) in done:  # accumulate in window order, as llama.cpp
            acc.add(done.pop(len(estimates)))
            estimates.append(acc.ppl())
            bar.set_postfix_str(f"PPL {estimates[-1]:.4f}", refresh=False)
            if on_chunk is not None:
                on_chunk(len(estimates), estimates[-1])

    t0 = time.perf_counter()
    try:
        with step_budget(llm, score_chunk):
            score_windows(llm, windows, batch_size, finished)
    finally:
        bar.close()
    ppl, stderr = acc.final()
    return PerplexityResult(
        ppl=ppl, stderr=stderr, n_tokens=acc.count, n_chunks=windows.n_windows, ctx_size=windows.n_ctx,
        text_tokens=len(windows.tokens), add_bos=windows.bos_token_id is not None, score_chunk=score_chunk,
        chunk_estimates=estimates, seconds=time.perf_counter() - t0,
    )
