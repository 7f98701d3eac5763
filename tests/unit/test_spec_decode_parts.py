"""Speculative decoding's parts alone: the config as vLLM spells it, prompt lookup, the rejection sampler
(exact for greedy rows, the target's distribution for random rows) and the KV trim of rejected slots."""

import numpy as np
import pytest
import torch

from perfxlm.config import EngineConfig
from perfxlm.engine.kv_cache_manager import KVCacheManager
from perfxlm.engine.request import Request
from perfxlm.model.layers.rejection_sampler import RejectionSampler
from perfxlm.model.layers.sampler import Sampler, SamplingMetadata
from perfxlm.sampling_params import SamplingParams
from perfxlm.spec_decode.config import SpeculativeConfig, check_draft_against_target
from perfxlm.spec_decode.ngram import (NgramProposer, draft_rule, propose_by_match, propose_ngram,
                                       reanchor_after)
from perfxlm.spec_decode.ngram_reanchor import reanchor
from perfxlm.spec_decode.proposer import DraftRequest
from perfxlm.spec_decode.stats import SpecDecodeStats


def test_config_as_vllm_spells_it():
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4,
                                 "prompt_lookup_min": 2})
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 5, 2, 4)
    assert SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}').prompt_lookup_max == 5
    one = SpeculativeConfig.parse({"method": "[ngram]", "num_speculative_tokens": 1, "prompt_lookup_max": 3})
    assert (one.method, one.prompt_lookup_min, one.prompt_lookup_max) == ("ngram", 3, 3)
    m = SpeculativeConfig.parse({"method": "deepseek_mtp", "num_speculative_tokens": 2})
    assert (m.method, m.num_speculative_tokens) == ("mtp", 2)  # vLLM's other name
    d = SpeculativeConfig.parse({"model": "/some/draft", "num_speculative_tokens": 4})
    assert (d.method, d.model) == ("draft_model", "/some/draft")
    assert SpeculativeConfig.parse(None) is None


@pytest.mark.parametrize("value,match", [
    ({"method": "eagle7", "num_speculative_tokens": 3}, r"method 'eagle7'.*ngram, draft_model, mtp"),
    ({"method": "ngram", "num_speculative_tokens": 0}, r"num_speculative_tokens must be in 1\.\.16, got 0"),
    ({"method": "ngram", "num_speculative_tokens": 17}, r"1\.\.16, got 17"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": "3"}, "must be an integer"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 5, "prompt_lookup_max": 2},
     r"prompt_lookup_min \(5\) must be <= prompt_lookup_max \(2\)"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 0}, ">= 1"),
    ({"method": "ngram", "num_speculative_tokens": 3, "lookahead": 2}, "unknown key.*'lookahead'"),
    ({"method": "mtp", "num_speculative_tokens": 17}, r"1\.\.16, got 17"),
    ({"method": "deepseek_mtp", "num_speculative_tokens": 0}, r"1\.\.16, got 0"),
    ({"model": "/d", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2},
     "draft_tensor_parallel_size must be 1 .*, got 2"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
    ({"num_speculative_tokens": 2}, "needs a 'method'"),
    ("{not json", "JSON object"),
    ([1, 2], "must be a dict"),
])
def test_bad_config_names_the_value(value, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.parse(value)
    # the engine's configuration refuses it at construction, before any model is read
    with pytest.raises(ValueError, match=match):
        EngineConfig(model="/nonexistent", speculative_config=value)


def test_draft_checked_against_target_from_configs():
    from transformers import LlamaConfig

    target = LlamaConfig(vocab_size=1000, hidden_size=96, intermediate_size=192, num_hidden_layers=3,
                         num_attention_heads=6, num_key_value_heads=2)
    small = LlamaConfig(vocab_size=1000, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=3, num_key_value_heads=1)
    check_draft_against_target(small, target, "d")
    check_draft_against_target(target, target, "d")  # the target's own quantized file is allowed
    other_vocab = LlamaConfig(vocab_size=1001, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                              num_attention_heads=3, num_key_value_heads=1)
    with pytest.raises(ValueError, match="vocabulary of 1001 tokens, the target 1000"):
        check_draft_against_target(other_vocab, target, "d")
    with pytest.raises(ValueError, match="larger than the target"):
        check_draft_against_target(target, small, "d")


def test_prompt_lookup_takes_longest_most_recent_match():
    t = np.array([1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 8, 1, 2, 3, 4])
    # suffix [2, 3, 4] (max 3) last seen at index 6 -> followed by 7, 8, 1
    assert propose_ngram(t, 1, 3, 3) == [7, 8, 1]
    assert propose_ngram(t, 1, 3, 10) == [7, 8, 1, 2, 3, 4]  # runs into the suffix itself, ends at the end
    assert propose_ngram(np.array([5, 6, 7, 8]), 1, 3, 4) == []  # nothing repeats
    assert propose_ngram(np.array([5, 6, 7, 6]), 2, 3, 4) == []  # only a 1-gram repeats: below the minimum
    assert propose_ngram(np.array([5, 6, 7, 6]), 1, 3, 4) == [7, 6]
    assert propose_ngram(np.array([3]), 1, 3, 4) == []


def test_prompt_lookup_by_match_takes_the_furthest_reaching_match_and_half_its_length():
    t = np.array([1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 8, 1, 2, 3, 4])
    # [2, 3, 4] occurs at 1 and 6; at 1 the token before (1) agrees with the suffix's too: 4 tokens agree,
    # so it proposes 4 // 2 = 2 of what followed it (the most recent occurrence agrees over 3 only)
    assert propose_by_match(t, 1, 3, 10, 2) == [5, 9]
    # one allowed: a 3-token reach already binds, but two occurrences are left: the one reaching further
    assert propose_by_match(t, 1, 3, 1, 2) == [5]
    # equal reach: the most recent occurrence; a 2-token match proposes one token
    assert propose_by_match(np.array([8, 5, 6, 1, 9, 5, 6, 2, 7, 5, 6]), 2, 3, 5, 2) == [2]
    # a long copied span: the whole allowance (its reach stops counting at twice the allowance)
    span = list(range(100, 130))
    assert propose_by_match(np.array([1, *span, 2, *span[:20]]), 2, 4, 6, 2) == span[20:26]
    assert propose_by_match(np.array([5, 6, 7, 8]), 1, 3, 4) == []  # nothing repeats
    assert propose_by_match(np.array([5, 6, 7, 6]), 2, 3, 4) == []  # below the minimum
    assert propose_by_match(np.array([3]), 1, 3, 4) == []
    assert propose_by_match(np.array([3, 3]), 1, 3, 4, 2) == [3]
    assert propose_by_match(np.array([3, 3, 3, 3, 3]), 1, 3, 4, 2) == [3]  # agrees back to the start: 4 // 2 tokens left
    # reaching back to the first token stops there (no wrap-around)
    assert propose_by_match(np.array([4, 5, 4, 5]), 2, 2, 8, 2) == [4]



def test_prompt_lookup_by_match_one_guess_per_matched_token():
    t = np.array([1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 8, 1, 2, 3, 4])
    # the occurrence at 1 agrees over 4 tokens: up to 4 guesses (the request's own suffix ends the run)
    assert propose_by_match(t, 1, 3, 10) == [5, 9, 2, 3]
    assert propose_by_match(t, 1, 3, 3) == [5, 9, 2]
    # a 2-token match proposes two; equal reach: the most recent occurrence
    assert propose_by_match(np.array([8, 5, 6, 1, 9, 5, 6, 2, 7, 5, 6]), 2, 3, 5) == [2, 7]
    # past the allowance the reach goes on while occurrences are left to tell apart: the one agreeing
    # furthest back wins though the most recent agrees over the whole allowance too
    span = list(range(100, 112))
    t = np.array([*span, 50, *span[6:], 60, *span[:10]])
    assert propose_by_match(t, 2, 4, 2) == span[10:12]
    assert propose_by_match(np.array([5, 6, 7, 8]), 1, 3, 4) == []
    assert propose_by_match(np.array([3, 3, 3, 3, 3]), 1, 3, 4) == [3]  # 4 agree, one token left to copy


def test_prompt_lookup_reanchoring_is_forcible(monkeypatch):
    src = list(range(100, 130))
    tokens = [1, *src, 2, *src[:10], 7]
    monkeypatch.delenv("PERFXLM_NGRAM_REANCHOR", raising=False)
    assert reanchor_after() == 0  # off by default
    assert NgramProposer(2, 4).propose([DraftRequest("a", tokens, 5)]) == [[]]
    monkeypatch.setenv("PERFXLM_NGRAM_REANCHOR", "3")
    assert NgramProposer(2, 4).propose([DraftRequest("a", tokens, 5)]) == [src[11:16]]
    monkeypatch.setenv("PERFXLM_NGRAM_REANCHOR", "many")
    with pytest.raises(ValueError, match="PERFXLM_NGRAM_REANCHOR='many'"):
        reanchor_after()


def test_prompt_lookup_reanchors_across_one_edit():
    src = list(range(100, 130))
    # the output copies src but wrote 7 where src has 110: plain lookup has no n-gram ending in 7
    t = np.array([1, *src, 2, *src[:10], 7])
    assert propose_by_match(t, 2, 4, 5) == []
    assert reanchor(t, 2, 3, 20) == (10, 12)  # 10 tokens agree before the edit; src[11] is at index 12
    assert propose_by_match(t, 2, 4, 5, reanchor_after=3) == src[11:16]
    # two tokens past the edit: plain lookup's 2-gram match proposes two, the re-anchored span five
    t = np.array([1, *src, 2, *src[:10], 7, *src[11:13]])
    assert propose_by_match(t, 2, 4, 5) == src[13:15]
    assert propose_by_match(t, 2, 4, 5, reanchor_after=3) == src[13:18]
    # an inserted token (src's 110 follows it) and a dropped one (src's 110 skipped)
    assert propose_by_match(np.array([1, *src, 2, *src[:10], 7, 110]), 2, 4, 5, reanchor_after=3) == src[11:16]
    assert propose_by_match(np.array([1, *src, 2, *src[:10], 111]), 2, 4, 5, reanchor_after=3) == src[12:17]
    # the reach counts the agreement on both sides, so it is bounded as plain lookup's: 2 before + 1 after
    t = np.array([5, 6, 9, 8, 40, 41, 42, 5, 6, 7, 8])
    assert reanchor(t, 2, 3, 20) == (3, 4)
    assert propose_by_match(t, 2, 4, 5, reanchor_after=3) == [40, 41, 42]
    # nothing agrees with the anchor before any gap: nothing proposed
    assert reanchor(np.array([1, 2, 3, 4, 5, 6]), 2, 3, 20) == (0, -1)
    assert propose_by_match(np.array([1, 2, 3, 4, 5, 6]), 2, 4, 5, reanchor_after=3) == []


def test_ngram_draft_rule_is_forcible(monkeypatch):
    monkeypatch.delenv("PERFXLM_NGRAM_DRAFTS", raising=False)
    assert draft_rule() == "match"
    assert NgramProposer(1, 2).follows_budget is False  # its match length bounds the guesses
    assert NgramProposer(1, 2).per_guess == 1
    monkeypatch.setenv("PERFXLM_NGRAM_DRAFTS", "half")
    p = NgramProposer(1, 2)
    assert p.by_match and p.per_guess == 2 and p.follows_budget is False
    assert p.propose([DraftRequest("a", [1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 8, 1, 2, 3, 4], 10)]) == [[5, 9]]
    monkeypatch.setenv("PERFXLM_NGRAM_DRAFTS", "budget")
    p = NgramProposer(1, 2)
    assert p.follows_budget is True and not p.by_match
    monkeypatch.setenv("PERFXLM_NGRAM_DRAFTS", "longest")
    with pytest.raises(ValueError, match="PERFXLM_NGRAM_DRAFTS='longest'.*match, half, budget"):
        draft_rule()


def test_ngram_proposer_follows_a_growing_request():
    p = NgramProposer(1, 2, rule="budget")
    tokens = [1, 2, 3, 1]
    assert p.propose([DraftRequest("a", tokens, 2)]) == [[2, 3]]
    tokens += [2, 3, 9] + list(range(100, 190))  # grows past the first buffer
    tokens += [2, 3]
    assert p.propose([DraftRequest("a", tokens, 3)]) == [[9, 100, 101]]
    p.drop(["a"])
    assert p.propose([DraftRequest("a", [4, 4], 2)]) == [[4]]  # a re-used id starts afresh


def _meta(rows: int, temperature: float, seed: int | None = None) -> SamplingMetadata:
    gens = {r: torch.Generator().manual_seed(seed) for r in range(rows)} if seed is not None else {}
    return SamplingMetadata(torch.full((rows,), temperature), temperature == 0, None, None, None, gens)


def test_greedy_verification_is_the_argmax_chain():
    rs = RejectionSampler(Sampler())
    logits = torch.full((4, 7), -5.0)
    for row, best in enumerate([3, 1, 6, 2]):
        logits[row, best] = 5.0
    assert rs(logits, _meta(4, 0.0), [[3, 1, 6]]).token_ids == [[3, 1, 6, 2]]  # all accepted + bonus
    assert rs(logits, _meta(4, 0.0), [[3, 4, 6]]).token_ids == [[3, 1]]  # first mismatch: the argmax
    assert rs(logits, _meta(4, 0.0), [[0, 1, 6]]).token_ids == [[3]]
    two = torch.cat([logits[:2], logits[:4]])  # two requests: 1 draft, 3 drafts
    assert rs(two, _meta(6, 0.0), [[3], [3, 1, 5]]).token_ids == [[3, 1], [3, 1, 6]]


def test_random_verification_keeps_the_target_distribution():
    """First emitted token ~ p0; given it equals the first draft, the second ~ p1 (chi-square, small vocab)."""
    torch.manual_seed(0)
    vocab, n = 5, 6000
    p = torch.tensor([[0.1, 0.4, 0.2, 0.25, 0.05], [0.3, 0.1, 0.1, 0.2, 0.3], [0.2] * 5])
    logits = p.log().repeat(n, 1)
    drafts = [[1, 4]] * (n // 2) + [[0, 3]] * (n // 2)  # a likely and an unlikely first draft
    out = RejectionSampler(Sampler())(logits, _meta(3 * n, 1.0), drafts).token_ids
    for first_draft in (1, 0):
        group = [o for o, d in zip(out, drafts) if d[0] == first_draft]
        first = np.bincount([o[0] for o in group], minlength=vocab)
        _chi_square_ok(first, p[0].numpy())
        second = np.bincount([o[1] for o in group if o[0] == first_draft], minlength=vocab)
        _chi_square_ok(second, p[1].numpy())
    assert all(1 <= len(o) <= 3 for o in out)


def _chi_square_ok(counts: np.ndarray, probs: np.ndarray) -> None:
    expected = probs * counts.sum()
    stat = float(((counts - expected) ** 2 / expected).sum())
    assert stat < 18.5, (counts, expected, stat)  # df 4: p = 0.001


def test_seeded_verification_is_reproducible():
    logits = torch.randn(4, 11)
    rs = RejectionSampler(Sampler())
    a = rs(logits, _meta(4, 0.8, seed=3), [[1, 2, 3]]).token_ids
    b = rs(logits, _meta(4, 0.8, seed=3), [[1, 2, 3]]).token_ids
    assert a == b


def test_trim_gives_back_rejected_slots():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r = Request("r", list(range(6)), SamplingParams(), 10, set())
    assert kv.allocate_slots(r, 6)
    r.num_computed_tokens = 5
    assert kv.allocate_slots(r, 1 + 6)  # the last token and 6 drafts: positions 5..11 -> 3 blocks
    assert len(kv.block_ids("r")) == 3
    kv.trim(r, 7)  # the input token and one accepted draft
    assert len(kv.block_ids("r")) == 2
    counts = kv.check_invariants()
    assert counts["used"] == 2 and counts["free"] == 6
    kv.free(r)
    assert kv.check_invariants()["used"] == 0


def test_stats_count_like_vllm():
    s = SpecDecodeStats()
    s.observe(4, 2)
    s.observe(3, 3)
    assert s.accepted_per_position == [2, 2, 1, 0]
    assert s.acceptance_rate == 5 / 7 and s.mean_acceptance_length == 1 + 5 / 2


def test_draft_tokens_reach_tensor_parallel_workers():
    """The worker's mirror knows a request's tokens, never its drafts: the step delta carries them."""
    from perfxlm.engine.messages import ScheduledRequest, SchedulerOutput
    from perfxlm.executor.delta import DeltaDecoder, DeltaEncoder

    params = SamplingParams(max_tokens=8)
    prompt, out = [3, 4, 5], [6]
    enc, dec = DeltaEncoder(), DeltaDecoder()
    first = ScheduledRequest("r", [3, 4, 5], 0, np.array([0]), True, params, prompt, [])
    dec.decode(enc.encode(SchedulerOutput([first], 3)))
    step = ScheduledRequest("r", [6, 9, 8], 3, np.array([0, 1]), True, params, prompt, out, draft_token_ids=[9, 8])
    got = dec.decode(enc.encode(SchedulerOutput([step], 3))).scheduled[0]
    assert (got.token_ids, got.draft_token_ids, got.num_computed_tokens, list(got.block_ids)) == (
        [6, 9, 8], [9, 8], 3, [0, 1])


def test_bench_serve_reads_acceptance_from_metrics():
    from perfxlm.bench.serve import spec_decode_delta

    before = {"num_drafts": 2.0, "num_draft_tokens": 8.0, "num_accepted_tokens": 4.0}
    after = {"num_drafts": 12.0, "num_draft_tokens": 48.0, "num_accepted_tokens": 34.0}
    d = spec_decode_delta(before, after)
    assert d["num_draft_tokens"] == 40 and d["acceptance_rate"] == 0.75 and d["mean_acceptance_length"] == 4.0
    assert spec_decode_delta(None, None) is None and spec_decode_delta(after, after) is None


def test_draft_budget_follows_the_last_verification():
    """Two more guesses after a full acceptance, one past the accepted ones after a partial one; after a
    miss, proposals sat out (1, 2, 4 ... 16), then one guess; always within what the engine asks."""
    from perfxlm.spec_decode.draft_budget import MAX_BACKOFF, DraftBudget

    b = DraftBudget()
    assert b.take(5) == 5 and b.take(3) == 3  # nothing seen yet: what is asked
    b.observe(5, 2)
    assert b.take(5) == 3 and b.take(2) == 2
    b.observe(3, 3)
    assert b.take(7) == 5 and b.take(5) == 5
    sat_out = []
    for _ in range(7):
        b.observe(1, 0)
        n = 0
        while b.take(5) == 0:
            n += 1
        sat_out.append(n)
    assert sat_out == [1, 2, 4, 8, 16, 16, 16] and MAX_BACKOFF == 16
    b.observe(1, 1)  # any acceptance ends the pauses and grows the guesses again
    assert b.take(9) == 3
    b.observe(3, 0)
    assert b.take(9) == 0 and b.take(9) == 1


def test_payoff_pauses_while_guesses_lose_and_probes_while_they_win(monkeypatch):
    """SpeculationPayoff: speculation from the start; after MIN_SAMPLES speculative steps, PROBE_PLAIN
    plain ones for a baseline and a verdict; while guesses cost more per token than plain steps, pauses
    of 8, 16, ... 256 plain steps; while they win, PROBE_PLAIN plain steps every PROBE_EVERY speculative
    ones and never a pause."""
    from perfxlm.spec_decode import payoff as P

    def run(pay, spec_cost, plain_cost, steps):
        decisions = []
        for _ in range(steps):
            s = pay.speculate()
            decisions.append(s)
            pay.record(s, spec_cost if s else plain_cost, 3 if s else 1)  # seconds, tokens
        return decisions

    losing = run(P.SpeculationPayoff(), 0.03, 0.005, 4 + 2 + 8 + 4 + 16 + 4 + 32)
    assert losing[:4] == [True] * 4 and losing[4:6] == [False] * 2  # the baseline
    assert losing[6:14] == [False] * 8 and losing[14:18] == [True] * 4
    assert losing[18:34] == [False] * 16 and losing[34:38] == [True] * 4 and not any(losing[38:])
    pay = P.SpeculationPayoff()
    run(pay, 0.03, 0.005, 2000)
    assert pay.backoff == P.MAX_PAUSE
    pay = P.SpeculationPayoff()
    winning = run(pay, 0.006, 0.005, 400)
    runs = [len(r) for r in "".join("s" if d else "p" for d in winning).split("s") if r]
    assert max(runs) == P.PROBE_PLAIN and pay.backoff == 0  # probes only
    assert winning.count(False) <= P.PROBE_PLAIN * (1 + 400 // P.PROBE_EVERY)
    # a step that emitted nothing, or took no time, says nothing
    pay = P.SpeculationPayoff()
    pay.record(True, 0.01, 0)
    pay.record(False, 0.0, 1)
    assert not pay.spec and not pay.plain


def test_payoff_env_knob(monkeypatch):
    from perfxlm.spec_decode.payoff import payoff_enabled

    monkeypatch.setenv("PERFXLM_SPEC_PAYOFF", "off")
    assert not payoff_enabled()
    monkeypatch.setenv("PERFXLM_SPEC_PAYOFF", "")
    assert payoff_enabled()
    monkeypatch.setenv("PERFXLM_SPEC_PAYOFF", "sometimes")
    with pytest.raises(ValueError, match="auto or off"):
        payoff_enabled()
