"""Prompt lookup: the longest suffix n-gram (prompt_lookup_max down to prompt_lookup_min tokens) that
occurred earlier in the request's tokens, prompt or output, proposes the tokens that followed its most
recent earlier occurrence. Free to compute and right whenever the output copies its input (code edits,
quotes, summaries, structured output over given data)."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from perfxlm.spec_decode.proposer import DraftRequest, Proposer


class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, lookup_min: int, lookup_max: int) -> None:
        self.lookup_min = lookup_min
        self.lookup_max = lookup_max
        # request id -> (its tokens as int64, grown by doubling; how many are filled): a request's tokens
        # only ever grow, so each step copies only what it gained
        self._tokens: dict[str, tuple[np.ndarray, int]] = {}

    def propose(self, batch: list[DraftRequest]) -> list[list[int]]:
        return [self._propose_one(r) for r in batch]

    def drop(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._tokens.pop(rid, None)

    def _array(self, r: DraftRequest) -> np.ndarray:
        buf, n = self._tokens.get(r.request_id, (None, 0))
        total = len(r.token_ids)
        if buf is None or n > total:  # new (or a re-added id)
            buf, n = np.empty(max(64, 2 * total), dtype=np.int64), 0
        elif buf.shape[0] < total:
            grown = np.empty(2 * total, dtype=np.int64)
            grown[:n] = buf[:n]
            buf = grown
        if n < total:
            buf[n:total] = r.token_ids[n:total]
        self._tokens[r.request_id] = (buf, total)
        return buf[:total]

    def _propose_one(self, r: DraftRequest) -> list[int]:
        tokens = self._array(r)
        return propose_ngram(tokens, self.lookup_min, self.lookup_max, r.max_drafts)


def propose_ngram(tokens: np.ndarray, lookup_min: int, lookup_max: int, max_drafts: int) -> list[int]:
    """The tokens after the most recent earlier occurrence of the longest matching suffix n-gram."""
    total = tokens.shape[0]
    for n in range(min(lookup_max, total - 1), lookup_min - 1, -1):
        suffix = tokens[total - n :]
        # occurrences starting at i < total - n (not the suffix itself), each followed by a token
        starts = np.flatnonzero(tokens[: total - n] == suffix[0])
        for j in range(1, n):
            if starts.size == 0:
                break
            starts = starts[tokens[starts + j] == suffix[j]]
        if starts.size:
            begin = int(starts[-1]) + n
            return tokens[begin : begin + max_drafts].tolist()
    return []
