"""KL divergence of a model from a base model on a text, through the engine's own forward path.

Two runs, as llama.cpp's `llama-perplexity --kl-divergence-base FILE` / `--kl-divergence`:
1. `save_base_logprobs(base_llm, text, path)`: the text cut into perplexity's windows
   (perfxlm/eval/windows.py), each window scored by the base, and the whole log-probability vector of
   every scored position written to a file (perfxlm/eval/kld_base.py) with the tokens, so the base
   (the big or slow model) runs once;
2. `kl_divergence(llm, path)`: the same windows scored by the model under test, each position's
   distribution compared with the base's as it comes out of the model runner (nothing vocabulary-sized
   is kept beyond one chunk), and llama.cpp's statistics (perfxlm/eval/kld_stats.py) at the end.

Both runs read whole distributions through the model runner's prompt-logprobs observer, so they need
the model in this process (tensor_parallel_size 1). Whatever the engine runs for the model (weight
format, KV cache dtype with `score_chunk`, CPU plan) is what is measured.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from perfxlm.eval import kld_base
from perfxlm.eval.kld_stats import KldAccumulator, KldSummary, TokenStats, token_stats
from perfxlm.eval.perplexity import prepare_windows
from perfxlm.eval.scoring import progress_bar, score_windows, step_budget
from perfxlm.eval.windows import Windows, tokenize_text


_SLICE = 64  # scored positions compared at once


@contextlib.contextmanager
def observe_prompt_logprobs(llm, observer: Callable[[str, int, torch.Tensor], None]) -> Iterator[None]:
    runner = llm.llm_engine.core.runner
    if runner is None:
        raise ValueError(
            "KL divergence reads whole distributions from the model runner, which runs in worker processes "
            "under tensor parallelism: use tensor_parallel_size=1."
        )
    runner.prompt_logprobs_observer = observer
    try:
        yield
    finally:
        runner.prompt_logprobs_observer = None


def vocab_size(llm) -> int:
    """Width of the model's logits (the LM head's rows)."""
    return int(llm.llm_engine.config.hf_config.vocab_size)


class _Rows:
    """Routes the runner's prompt rows to (window, scored row) slots; never raises into the engine
    step (a failure is kept and raised by the scoring loop, which aborts what is in flight)."""

    def __init__(self, windows: Windows, sink: Callable[[int, int, torch.Tensor], None], vocab: int) -> None:
        self.windows, self.sink, self.vocab = windows, sink, vocab
        self.window_of: dict[str, int] = {}
        self.filled = np.zeros((windows.n_windows, windows.scored_per_window), dtype=bool)
        self.error: BaseException | None = None

    def submit(self, request_id: str, window: int) -> None:
        self.window_of[request_id] = window

    def __call__(self, request_id: str, first: int, logprobs: torch.Tensor) -> None:
        window = self.window_of.get(request_id)
        if window is None or self.error is not None:
            return
        try:
            if logprobs.shape[1] != self.vocab:
                raise ValueError(
                    f"the model's logits have {logprobs.shape[1]} entries where the base's have {self.vocab}: "
                    "KL divergence needs both models to share one vocabulary (same tokenizer)."
                )
            # row j predicts the token at position first + j; scored rows predict windows.first + 1 ...
            lo = self.windows.first + 1
            start = max(first, lo)
            end = min(first + logprobs.shape[0], lo + self.windows.scored_per_window)
            if start >= end:
                return
            self.sink(window, start - lo, logprobs[start - first : end - first])
            self.filled[window, start - lo : end - lo] = True
        except BaseException as e:  # noqa: BLE001 - handed to the scoring loop
            self.error = e

    def check(self, window: int | None = None) -> None:
        if self.error is not None:
            raise self.error
        if window is not None and not self.filled[window].all():
            missing = int((~self.filled[window]).sum())
            raise RuntimeError(f"window {window}: {missing} scored positions never reached the observer.")


def _describe(llm) -> dict[str, Any]:
    c = llm.llm_engine.config
    quant = c.quant_config.describe() if c.quant_config is not None else "none"
    return {"model": c.model, "dtype": str(c.weight_dtype).replace("torch.", ""), "quantization": quant,
            "kv_cache_dtype": c.kv_cache_dtype}  # fmt: skip


def save_base_logprobs(
    llm,
    text_or_ids: str | Sequence[int],
    path: str,
    ctx_size: int = 512,
    *,
    n_chunks: int | None = None,
    batch_size: int | None = None,
    score_chunk: int | None = None,
    add_bos: bool | None = None,
    progress: bool = False,
) -> kld_base.BaseLogprobs:
    """Score the text's windows with `llm` (the base) and write every scored distribution to `path`."""
    windows = prepare_windows(llm, text_or_ids, ctx_size, n_chunks, add_bos)
    vocab = vocab_size(llm)
    base = kld_base.create(path, windows, vocab, _describe(llm))
    rows = _Rows(windows, base.write, vocab)
    bar = progress_bar(windows.n_windows, "base windows", progress)

    def finished(i: int, nlls: list[float]) -> None:
        rows.check(i)
        bar.update(1)

    _score_observed(llm, windows, rows, batch_size, score_chunk, finished, bar)
    base.finish()
    return kld_base.open_base(path)


@dataclass
class KldResult:
    summary: KldSummary
    n_windows: int
    ctx_size: int
    base: dict[str, Any]  # what produced the base file
    model: dict[str, Any]
    window_lines: list[str] = field(default_factory=list)  # running figures after each window
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"base": self.base, "model": self.model, "n_windows": self.n_windows, "ctx_size": self.ctx_size,
                "seconds": self.seconds, "statistics": self.summary.to_dict()}  # fmt: skip


def check_same_text(base: kld_base.BaseLogprobs, llm, text: str) -> None:
    """ValueError unless `text`, tokenized by this model, is the base file's token sequence."""
    tokenizer = llm.get_tokenizer()
    if tokenizer is None:
        raise ValueError("checking the text needs a tokenizer; this LLM has none: leave the text out.")
    bos = base.header["bos_token_id"]
    ours = tokenize_text(text, tokenizer, bos is not None)
    theirs = base.header["tokens"]
    n = min(len(theirs), len(ours))
    diff = next((i for i in range(n) if ours[i] != theirs[i] and not (i % base.header["n_ctx"] == 0 and bos is not None)), None)
    if diff is None and len(ours) < len(theirs):
        diff = len(ours)
    if diff is not None:
        got = ours[diff] if diff < len(ours) else "end of text"
        raise ValueError(
            f"the text differs from the one the base file was made from (or this model tokenizes it "
            f"differently): first difference at token {diff} ({got} here, {theirs[diff]} in the base file)."
        )


def kl_divergence(
    llm,
    base: str | kld_base.BaseLogprobs,
    text: str | None = None,
    *,
    batch_size: int | None = None,
    score_chunk: int | None = None,
    progress: bool = False,
    on_window: Callable[[int, str], None] | None = None,
) -> KldResult:
    """The model's statistics against a saved base (a path or an open file). `text`, when given, is
    checked to tokenize to the base's tokens under this model's tokenizer."""
    if isinstance(base, str):
        base = kld_base.open_base(base)
    vocab = vocab_size(llm)
    if vocab != base.vocab_size:
        raise ValueError(
            f"the base has a vocabulary of {base.vocab_size} tokens and this model {vocab}: KL divergence "
            "needs both models to share one vocabulary (same tokenizer)."
        )
    if text is not None:
        check_same_text(base, llm, text)
    windows = base.windows
    max_len = int(llm.llm_engine.resolved.max_model_len)
    if windows.n_ctx >= max_len:
        raise ValueError(f"the base file's windows are {windows.n_ctx} tokens; this engine's max_model_len is "
                         f"{max_len}: raise max_model_len above {windows.n_ctx}.")
    s = windows.scored_per_window
    parts = {name: np.zeros((windows.n_windows, s)) for name in ("kld", "nll_model", "nll_base", "delta_p")}
    same = np.zeros((windows.n_windows, s), dtype=bool)
    targets = [torch.tensor(windows.targets(i)) for i in range(windows.n_windows)]

    def compare(window: int, row: int, logprobs: torch.Tensor) -> None:
        ref = base.rows(window)
        for a in range(0, logprobs.shape[0], _SLICE):  # slices bound the float64 temporaries
            b = min(a + _SLICE, logprobs.shape[0])
            stats = token_stats(ref[row + a : row + b], logprobs[a:b], targets[window][row + a : row + b])
            for name in parts:
                parts[name][window, row + a : row + b] = getattr(stats, name)
            same[window, row + a : row + b] = stats.same_top

    rows = _Rows(windows, compare, vocab)
    acc = KldAccumulator()
    done: set[int] = set()
    lines: list[str] = []
    bar = progress_bar(windows.n_windows, "kld windows", progress)

    def finished(i: int, nlls: list[float]) -> None:
        rows.check(i)
        done.add(i)
        bar.update(1)
        while len(acc.parts) in done:  # accumulate in window order, as llama.cpp
            w = len(acc.parts)
            acc.add(TokenStats(**{k: v[w] for k, v in parts.items()}, same_top=same[w]))
            ppl, kld, top = acc.running()
            lines.append(f"{w + 1:4d}  PPL(Q) {ppl:10.4f}  KLD {kld:9.6f}  same top {100 * top:7.3f} %")
            if on_window is not None:
                on_window(w + 1, lines[-1])

    t0 = time.perf_counter()
    _score_observed(llm, windows, rows, batch_size, score_chunk, finished, bar)
    return KldResult(
        summary=acc.summary(), n_windows=windows.n_windows, ctx_size=windows.n_ctx,
        base=base.header.get("produced_by", {}), model=_describe(llm), window_lines=lines,
        seconds=time.perf_counter() - t0,
    )  # fmt: skip


def _score_observed(llm, windows: Windows, rows: _Rows, batch_size, score_chunk, finished, bar) -> None:
    """Score every window with `rows` watching the model runner; raise what the observer kept."""
    try:
        with observe_prompt_logprobs(llm, rows), step_budget(llm, score_chunk):
            score_windows(llm, windows, batch_size, finished, on_submit=rows.submit)
    finally:
        bar.close()
    rows.check()
