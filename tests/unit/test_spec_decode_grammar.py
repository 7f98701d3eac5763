"""Speculative decoding under a grammar, its parts alone: the matcher masks each verification row as the
grammar stands at that draft and is rolled back; the rejection sampler with those masks keeps the
grammar-constrained target distribution (a small vocabulary, chi-square) and rejects forbidden drafts."""

import numpy as np
import pytest
import torch

from perfxlm.model.layers.rejection_sampler import RejectionSampler
from perfxlm.model.layers.sampler import Sampler, SamplingMetadata

xgr = pytest.importorskip("xgrammar")

# a, b, c, then end of sequence; the grammar "a b+ c"
VOCAB = ["a", "b", "c", "</s>", "d"]
A, B, C, EOS, D = range(5)


@pytest.fixture(scope="module")
def grammar():
    info = xgr.TokenizerInfo(VOCAB, stop_token_ids=[EOS])
    return xgr.GrammarCompiler(info).compile_regex("ab+c")


def _allowed(bitmask: torch.Tensor, row: int) -> set[int]:
    return {t for t in range(len(VOCAB)) if int(bitmask[row, t // 32]) >> (t % 32) & 1}


def test_rows_follow_the_drafts_and_the_matcher_rolls_back(grammar):
    from perfxlm.structured_output import GrammarMatchers

    m = GrammarMatchers()
    # a plain row at 0, then a request with drafts [b, b, c] at rows 1..4 (its output so far: "a")
    masked, bitmask, failed = m.fill([(0, "p", grammar, [], None), (1, "r", grammar, [A], None, [B, B, C])], 5)
    assert not failed and masked == [0, 1, 2, 3, 4]
    assert _allowed(bitmask, 0) == {A}
    assert _allowed(bitmask, 1) == {B}  # after "a"
    assert _allowed(bitmask, 2) == _allowed(bitmask, 3) == {B, C}  # after "ab", "abb"
    assert _allowed(bitmask, 4) == {EOS}  # after "abbc": only the end
    # rolled back: next step it catches up with what verification accepted ("a" + "b" + the target's "c")
    masked, bitmask, failed = m.fill([(0, "r", grammar, [A, B, C], None)], 1)
    assert not failed and masked == [0] and _allowed(bitmask, 0) == {EOS}


def test_a_forbidden_draft_ends_the_masked_rows(grammar):
    from perfxlm.structured_output import GrammarMatchers

    m = GrammarMatchers()
    masked, bitmask, failed = m.fill([(0, "r", grammar, [A], None, [B, D, B])], 4)
    # row 1 (after "ab") is masked and excludes d, so verification rejects d there; rows 2, 3 stay free
    assert not failed and masked == [0, 1] and D not in _allowed(bitmask, 1)
    assert _allowed(bitmask, 2) == _allowed(bitmask, 3) == set(range(len(VOCAB)))
    masked, _, failed = m.fill([(0, "r", grammar, [A, B], None, [C, EOS])], 3)
    # after "abc" + EOS the grammar has ended: nothing past it is constrained (ignore_eos runs on freely)
    assert not failed and masked == [0, 1]
    masked, bitmask, failed = m.fill([(0, "r", grammar, [A, B, C, EOS], None, [D])], 2)
    assert not failed and masked == [] and bitmask is None


def test_start_token_inside_the_drafts(grammar):
    """A reasoning model's end-of-thinking token among the drafts: rows up to it are free, later ones
    constrained; the matcher stays unstarted until the token is in the output."""
    from perfxlm.structured_output import GrammarMatchers

    m = GrammarMatchers()
    end = C  # pretend "c" ends thinking
    masked, bitmask, failed = m.fill([(0, "r", grammar, [D], end, [D, end, A, B])], 5)
    assert not failed and masked == [2, 3, 4]
    assert _allowed(bitmask, 2) == {A} and _allowed(bitmask, 3) == {B} and _allowed(bitmask, 4) == {B, C}
    masked, bitmask, failed = m.fill([(0, "r", grammar, [D, D, end, A], end, [B])], 2)
    assert not failed and masked == [0, 1] and _allowed(bitmask, 0) == {B}


def test_grammar_state_failure_is_reported_for_its_request_alone(grammar):
    from perfxlm.structured_output import GrammarMatchers

    m = GrammarMatchers()
    masked, _, failed = m.fill([(0, "bad", grammar, [B], None, [A]), (2, "ok", grammar, [A], None, [B])], 4)
    assert set(failed) == {"bad"} and "rejects token" in failed["bad"] and masked == [2, 3]


def _meta(rows: int, temperature: float) -> SamplingMetadata:
    return SamplingMetadata(torch.full((rows,), temperature), temperature == 0, None, None, None, {})


def test_masked_verification_greedy_and_random():
    """With each row's grammar mask the verification is that of the constrained target: greedy rejects
    a forbidden draft even where it is the raw argmax; random rows keep the masked distribution."""
    torch.manual_seed(0)
    rs = RejectionSampler(Sampler())
    vocab, n = 5, 6000
    p = torch.tensor([[0.1, 0.4, 0.2, 0.25, 0.05], [0.3, 0.1, 0.1, 0.2, 0.3], [0.2] * 5])
    allowed = [{0, 2, 3}, {0, 1, 4}, set(range(vocab))]  # token 1, the raw favourite of row 0, forbidden
    bits = torch.zeros(3, 1, dtype=torch.int32)
    for row, toks in enumerate(allowed):
        bits[row, 0] = sum(1 << t for t in toks)
    greedy = _meta(3, 0.0)
    greedy.grammar = ([0, 1], bits)
    assert rs(p.log(), greedy, [[1, 4]]).token_ids == [[3]]  # the forbidden argmax draft: rejected
    greedy.grammar = ([0, 1], bits)
    assert rs(p.log(), greedy, [[3, 4]]).token_ids == [[3, 0]]
    logits = p.log().repeat(n, 1)
    meta = _meta(3 * n, 1.0)
    meta.grammar = ([r for r in range(3 * n) if r % 3 < 2], bits.repeat(n, 1))
    drafts = [[1, 4]] * (n // 2) + [[3, 0]] * (n // 2)  # a forbidden and an allowed first draft
    out = rs(logits, meta, drafts).token_ids
    masked = [p[r] * torch.tensor([t in allowed[r] for t in range(vocab)]) for r in range(2)]
    masked = [(m / m.sum()).numpy() for m in masked]
    for first_draft in (1, 3):
        group = [o for o, d in zip(out, drafts) if d[0] == first_draft]
        first = np.bincount([o[0] for o in group], minlength=vocab)
        assert first[1] == 0 and first[4] == 0  # never a token the grammar forbids
        _chi_square_ok(first, masked[0])
        second = np.bincount([o[1] for o in group if o[0] == first_draft], minlength=vocab)
        if first_draft == 3:
            _chi_square_ok(second, masked[1])


def _chi_square_ok(counts: np.ndarray, probs: np.ndarray) -> None:
    keep = probs > 0
    assert counts[~keep].sum() == 0
    expected = probs[keep] * counts.sum()
    stat = float(((counts[keep] - expected) ** 2 / expected).sum())
    assert stat < 18.5, (counts, expected, stat)  # df <= 4: p <= 0.001
