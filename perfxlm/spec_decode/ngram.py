"""Prompt lookup: the longest suffix n-gram (prompt_lookup_max down to prompt_lookup_min tokens) that
occurred earlier in the request's tokens, prompt or output, proposes the tokens that followed it. Free to
compute and right whenever the output copies its input (code edits, quotes, summaries, structured output
over given data).

Which occurrence, and how many of its tokens: a verification row is not free on a CPU, so a guess that
is likely wrong costs more than it can win. How far the match reaches back predicts how long the copy
goes on: a 2-gram seen once ("self .") is followed by the same token about half the time, the tail of a
20-token copied span nearly always. So, by default (`PERFXLM_NGRAM_DRAFTS=match`), among the occurrences
of that n-gram the one whose agreement with the request's suffix reaches furthest back proposes (the most
recent of equals), and a match of L tokens proposes at most L tokens (a 2-gram two, a 5-token match
five). That bound replaces the per-request budget (draft_budget.py) for this proposer.

How many per matched token follows the row cost. When a row cost ~25 % of a one-row step, half as many
as matched (`PERFXLM_NGRAM_DRAFTS=half`) did best: replayed over the greedy outputs of
benchmarks/spec_decode.py's prompts it raised the modelled speed-up on code edits from 1.55x to 1.91x
over the most recent occurrence with the budget. Since the row-group GEMVs take a step's rows in tiles
of 4, a step of 2-4 rows costs only 1.06x, 1.21x, 1.39x one row (one thread, CPU time per step), and the
same replay at those costs (5 guesses, 3 prompts per kind, mean modelled speed-up) favours one guess per
matched token: code edit 1.70x -> 1.76x, quote 1.79x -> 1.82x, summary 1.72x -> 1.74x, chat 1.41x ->
1.44x. `PERFXLM_NGRAM_DRAFTS=budget`: the most recent occurrence, as many tokens as the budget allows
(the first rule).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import numpy as np

from perfxlm.spec_decode.ngram_reanchor import reanchor
from perfxlm.spec_decode.proposer import DraftRequest, Proposer

DRAFT_RULES = ("match", "half", "budget")
# Re-anchoring across an edit (ngram_reanchor.py): tokens after the edit up to which it is tried when
# switched on, tokens that must agree before it, and how much further than plain lookup's match it must
# reach to propose. Off by default: replayed over the greedy outputs of benchmarks/spec_decode.py's
# prompts it lowered the modelled speed-up of every kind and every setting tried (anchors 2-12 tokens,
# margins 0-6, 1-5 tokens after the edit): the default model does not copy across edits, it leaves the
# source there (code edit 1.76x -> 1.56-1.71x, acceptance 61 % -> 43 % at the settings below).
REANCHOR_AFTER = 3
REANCHOR_ANCHOR = 2
REANCHOR_MARGIN = 0
# matched tokens per guess under each rule that bounds its guesses by the match
_PER_GUESS = {"match": 1, "half": 2}


def draft_rule() -> str:
    """PERFXLM_NGRAM_DRAFTS: "match" (default: a guess per matched token), "half" (one per two) or
    "budget" (the per-request budget bounds them)."""
    value = os.environ.get("PERFXLM_NGRAM_DRAFTS", "match").strip().lower() or "match"
    if value not in DRAFT_RULES:
        raise ValueError(f"PERFXLM_NGRAM_DRAFTS={value!r}: expected one of {', '.join(DRAFT_RULES)}.")
    return value


def reanchor_after() -> int:
    """PERFXLM_NGRAM_REANCHOR: tokens after an edit up to which lookup re-anchors across it (0, the
    default: never)."""
    value = os.environ.get("PERFXLM_NGRAM_REANCHOR", "0").strip() or "0"
    if not value.isdigit() or int(value) > 16:
        raise ValueError(f"PERFXLM_NGRAM_REANCHOR={value!r}: expected a number of tokens, 0..16.")
    return int(value)


class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, lookup_min: int, lookup_max: int, rule: str | None = None) -> None:
        self.lookup_min = lookup_min
        self.lookup_max = lookup_max
        rule = rule or draft_rule()
        self.by_match = rule in _PER_GUESS
        self.per_guess = _PER_GUESS.get(rule, 1)
        self.reanchor_after = reanchor_after() if self.by_match else 0
        # the match's length bounds each guess run, so the per-request budget would only cut it shorter
        self.follows_budget = not self.by_match
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
        if self.by_match:
            return propose_by_match(tokens, self.lookup_min, self.lookup_max, r.max_drafts, self.per_guess,
                                    self.reanchor_after)
        return propose_ngram(tokens, self.lookup_min, self.lookup_max, r.max_drafts)


def _longest_suffix(tokens: np.ndarray, lookup_min: int, lookup_max: int) -> tuple[int, np.ndarray]:
    """(n, the starts of its earlier occurrences, ascending) for the longest suffix n-gram that occurred
    before, each followed by a token; (0, empty) when none of lookup_min..lookup_max tokens did. One scan
    of the tokens: the earlier positions holding the last token, narrowed one token back at a time (each
    n-gram's occurrences are those agreeing over n), instead of a scan per n-gram length."""
    total = tokens.shape[0]
    none = (0, np.empty(0, dtype=np.int64))
    if total < 2:
        return none
    ends = np.flatnonzero(tokens[: total - 1] == tokens[total - 1])  # where an occurrence would end
    n, found = (1, ends) if lookup_min <= 1 and ends.size else none
    for back in range(1, min(lookup_max, total - 1)):
        ends = ends[ends >= back]
        ends = ends[tokens[ends - back] == tokens[total - 1 - back]]
        if ends.size == 0:
            break
        if back + 1 >= lookup_min:
            n, found = back + 1, ends
    return (n, found - (n - 1)) if n else none


def propose_ngram(tokens: np.ndarray, lookup_min: int, lookup_max: int, max_drafts: int) -> list[int]:
    """The tokens after the most recent earlier occurrence of the longest matching suffix n-gram."""
    n, starts = _longest_suffix(tokens, lookup_min, lookup_max)
    if not n:
        return []
    begin = int(starts[-1]) + n
    return tokens[begin : begin + max_drafts].tolist()


def propose_by_match(tokens: np.ndarray, lookup_min: int, lookup_max: int, max_drafts: int,
                     per_guess: int = 1, reanchor_after: int = 0) -> list[int]:
    """The tokens after the occurrence of the longest matching suffix n-gram whose agreement with the
    tokens before the suffix reaches furthest back (the most recent of equals), one per `per_guess`
    tokens that agree (at least one). With `reanchor_after` > 0, a span agreeing across one edit
    (ngram_reanchor.py, up to that many tokens after the edit) proposes instead where it reaches further."""
    n, starts = _longest_suffix(tokens, lookup_min, lookup_max)
    length, begin = _reach(tokens, n, starts, max_drafts, per_guess) if n else (0, -1)
    if reanchor_after and length < per_guess * max_drafts:
        reach, at = reanchor(tokens, REANCHOR_ANCHOR, reanchor_after, 4 * max_drafts)
        if reach > length + REANCHOR_MARGIN:
            length, begin = reach - REANCHOR_MARGIN, at
    if not length:
        return []
    return tokens[begin : begin + min(max_drafts, max(1, length // per_guess))].tolist()


def _reach(tokens: np.ndarray, n: int, starts: np.ndarray, max_drafts: int,
           per_guess: int) -> tuple[int, int]:
    """(how far the chosen occurrence agrees back, the index of the token after it)."""
    total = tokens.shape[0]
    # Grow the match backwards one token at a time over the occurrences that still agree. Past
    # per_guess * max_drafts tokens the bound no longer binds, but while several occurrences are left,
    # reaching on (up to four times the allowance) still tells them apart: the one reaching further is
    # the span being copied (on the quote prompts, 3x instead of 2x took acceptance 76 % -> 78 %).
    bound = per_guess * max_drafts
    length, alive = n, starts
    while length < 4 * max_drafts and length < total - 1 and (length < bound or alive.size > 1):
        back = alive - (length - n) - 1  # the token before each occurrence's agreeing run
        keep = back >= 0
        keep[keep] = tokens[back[keep]] == tokens[total - length - 1]
        if not keep.any():
            break
        alive, length = alive[keep], length + 1
    return length, int(alive[-1]) + n
