"""Score windows with the engine's own forward path: one request per window, prompt logprobs only.

Each window is a token-id prompt with `prompt_logprobs=0` (only the logprob of the actual next token at
each position) and `max_tokens=1`, so whatever the engine runs (weight format, KV cache dtype, CPU plan,
batching) is what gets measured. Windows are submitted together, up to `max_in_flight` at a time, and
the scheduler batches them like any requests. Prompt-logprob requests never read the prefix cache.

`step_budget` (the perplexity API's `score_chunk`) lowers the scheduler's token budget per step while
scoring: a window is then prefilled in chunks of at most that many tokens, and every chunk after the
first attends to the earlier tokens' K/V read back from the KV cache (quantized when the cache is),
as decoding does. Without it a 512-token window is prefilled in one pass that attends to its own K/V.
"""

from __future__ import annotations

import contextlib
import uuid
from collections import deque
from typing import Callable, Iterator

from perfxlm.eval.windows import Windows
from perfxlm.sampling_params import RequestOutputKind, SamplingParams


def progress_bar(total: int, desc: str, enabled: bool):
    """A tqdm bar over windows (a disabled one when not `enabled`)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="win", dynamic_ncols=True, disable=not enabled, leave=False)


@contextlib.contextmanager
def step_budget(llm, tokens: int | None) -> Iterator[None]:
    """Temporarily cap the tokens one engine step computes (chunked prefill); None leaves it alone."""
    if tokens is None:
        yield
        return
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"score_chunk must be an integer >= 1 (tokens per prefill chunk), got {tokens!r}.")
    scheduler = llm.llm_engine.scheduler
    saved = scheduler.max_num_batched_tokens
    scheduler.max_num_batched_tokens = min(saved, tokens)
    try:
        yield
    finally:
        scheduler.max_num_batched_tokens = saved


def score_windows(
    llm,
    windows: Windows,
    max_in_flight: int | None = None,
    on_window: Callable[[int, list[float]], None] | None = None,
    on_submit: Callable[[str, int], None] | None = None,
) -> list[list[float]]:
    """Negative log-likelihoods of each window's scored tokens (windows.targets(i)), in window order.

    on_window(i, nlls) is called as each window finishes (in completion order); on_submit(request_id, i)
    as window i is handed to the engine (callers that watch the model runner map requests to windows)."""
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    limit = windows.n_windows if max_in_flight is None else max_in_flight
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"batch_size must be an integer >= 1 (windows in flight), got {max_in_flight!r}.")
    tag = uuid.uuid4().hex[:8]
    pending = deque(range(windows.n_windows))
    in_flight: dict[str, int] = {}
    results: list[list[float] | None] = [None] * windows.n_windows
    first = windows.first
    try:
        while pending or in_flight:
            while pending and len(in_flight) < limit:
                i = pending.popleft()
                rid = f"perplexity-{tag}-{i}"
                if on_submit is not None:
                    on_submit(rid, i)
                engine.add_request(rid, {"prompt_token_ids": windows.window(i)}, params)
                in_flight[rid] = i
            for out in engine.step():
                if not out.finished or out.request_id not in in_flight:
                    continue
                i = in_flight.pop(out.request_id)
                lps = out.prompt_logprobs
                aborted = bool(out.outputs) and out.outputs[0].finish_reason == "abort"
                if aborted or lps is None or len(lps) != windows.n_ctx:
                    raise RuntimeError(f"window {i} was not scored (finish_reason "
                                       f"{out.outputs[0].finish_reason if out.outputs else None!r}).")
                targets = windows.targets(i)
                # lps[j] holds the logprob of prompt token j given tokens 0..j-1
                nlls = [-lps[first + 1 + k][t].logprob for k, t in enumerate(targets)]
                results[i] = nlls
                if on_window is not None:
                    on_window(i, nlls)
    except BaseException:
        engine.abort_request(list(in_flight))
        raise
    return results  # type: ignore[return-value]
