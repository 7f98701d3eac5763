"""Prompt lookup across one edit: where the output copies its input but changed a token (a renamed
identifier in a code edit, a word swapped in a quoted sentence), the suffix n-gram that contains the new
token occurred nowhere before, so plain lookup proposes nothing (or follows a short echo elsewhere) for
the next few steps, until the suffix is past the edit again. Those steps are the ones a copy loses most.

Re-anchoring matches the request's recent tokens against an earlier span with one gap in the agreement:
`before` tokens agree, then the output holds `gap_out` tokens where the source held `gap_src` (a
replacement 1/1, an insertion 0/1, a deletion 1/0), then the last `after` tokens agree again. The source
position after its agreeing tokens is where the copy resumes, and what follows it is proposed. The reach
(tokens that agree on both sides of the gap) is compared with plain lookup's match length, and the longer
one proposes (propose_by_match), so a re-anchored guess is only taken where it is better supported than
the plain one.
"""

from __future__ import annotations

import numpy as np

# (source tokens, output tokens) of the gap: a replaced token, an inserted one, a dropped one
GAPS = ((1, 1), (0, 1), (1, 0))


def reanchor(tokens: np.ndarray, anchor: int, max_after: int, limit: int) -> tuple[int, int]:
    """(reach, begin): the earlier span agreeing with the request's last tokens over the most tokens,
    counting `anchor`..`limit` tokens before one gap (GAPS) and 0..`max_after` after it, the most recent of
    equals; `begin` is the index of the token that followed it there. (0, -1) when none agrees with at
    least `anchor` tokens before the gap."""
    total = tokens.shape[0]
    best_reach, best_begin = 0, -1
    for after in range(max_after + 1):
        for gap_src, gap_out in GAPS:
            w = total - after - gap_out  # the output's gap starts here (its anchor ends here)
            if w - anchor < 1:
                continue
            a0 = w - anchor
            # c: where the source's gap starts, its anchor tokens [c - anchor, c) equal the output's
            starts = np.flatnonzero(tokens[: a0] == tokens[a0])
            for m in range(1, anchor):
                if starts.size == 0:
                    break
                starts = starts[tokens[starts + m] == tokens[a0 + m]]
            if starts.size == 0:
                continue
            c = starts + anchor
            resume = c + gap_src  # the source's tokens after the gap
            c, resume = c[resume + after < total], resume[resume + after < total]  # a token follows them
            for m in range(after):
                keep = tokens[resume + m] == tokens[total - after + m]
                c, resume = c[keep], resume[keep]
            if gap_src == gap_out == 1 and c.size:  # a "replacement" by the same token is plain lookup's
                keep = tokens[c] != tokens[w]
                c, resume = c[keep], resume[keep]
            if c.size == 0:
                continue
            # grow the agreement before the anchor, as plain lookup does, over the occurrences still agreeing
            length, alive = anchor, np.arange(c.size)
            while length < limit and alive.size > 0:
                back = c[alive] - length - 1
                ok = back >= 0
                ok[ok] = tokens[back[ok]] == tokens[w - length - 1] if w - length - 1 >= 0 else False
                if not ok.any():
                    break
                alive, length = alive[ok], length + 1
            reach = length + after
            begin = int(resume[alive[-1]]) + after
            if reach > best_reach or (reach == best_reach and begin > best_begin):
                best_reach, best_begin = reach, begin
    return best_reach, best_begin
