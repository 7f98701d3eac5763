"""Speculative decoding of guided (structured-output) requests on the default model: greedy outputs
token-identical to guided decoding without speculation (json schema, regex, mixed with free requests),
even when the drafts are the unguided model's own favourites; seeded sampling keeps the grammar-constrained
distribution; a bad grammar fails alone; no KV block leaked."""

from __future__ import annotations

from collections import Counter

import pytest

from perfxlm import LLM, SamplingParams
from perfxlm.sampling_params import StructuredOutputsParams as S
from perfxlm.spec_decode.proposer import DraftRequest, Proposer
from tests.conftest import assert_pool_whole
from tests.engine.test_spec_decode import _two_sample_chi_square_ok

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "disable_by_batch_size": 1000}  # every request speculates, whatever the batch
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
PROMPTS = [
    'Copy this JSON exactly: {"name": "Ada Lovelace", "age": 36}\nCopy:',
    "The phone number is 555-0123-9. Repeat the phone number: ",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    'Copy this JSON exactly: {"name": "Grace Hopper", "age": 85}\nCopy:',
]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=30, structured_outputs=S(json=PERSON)),
    SamplingParams(temperature=0, max_tokens=13, structured_outputs=S(regex=r"[0-9]{3}-[0-9]{3}")),
    SamplingParams(temperature=0, max_tokens=17, ignore_eos=True),  # free, in the same batch
    SamplingParams(temperature=0, max_tokens=30, logprobs=2, structured_outputs=S(json=PERSON)),
]


@pytest.fixture(scope="module")
def spec(default_model):
    return LLM(default_model, dtype="float32", kv_cache_gib=0.25, max_model_len=512, max_num_seqs=256,
               speculative_config=NGRAM)


@pytest.fixture(scope="module")
def reference(smollm_fp32):
    return [o.outputs[0] for o in smollm_fp32.generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.fixture(scope="module")
def unguided(smollm_fp32):
    """What the model says with no grammar: the drafts a careless proposer would make."""
    free = [SamplingParams(temperature=0, max_tokens=p.max_tokens, ignore_eos=True) for p in PARAMS]
    return [o.outputs[0].token_ids for o in smollm_fp32.generate(PROMPTS, free, use_tqdm=False)]


def _same(outs, reference):
    for o, r in zip(outs, reference):
        c = o.outputs[0]
        assert c.token_ids == r.token_ids, (o.prompt, c.text, r.text)
        assert (c.finish_reason, c.stop_reason) == (r.finish_reason, r.stop_reason)
        if r.logprobs is not None:
            for a, b in zip(c.logprobs, r.logprobs):
                assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)


class _Continuation(Proposer):
    """Proposes, at each request's offset, a fixed continuation of its prompt."""

    name = "continuation"

    def __init__(self, prompts: list[list[int]], continuations: list[list[int]]) -> None:
        self.by_prompt = {tuple(p): c for p, c in zip(prompts, continuations)}

    def propose(self, batch: list[DraftRequest]) -> list[list[int]]:
        out = []
        for r in batch:
            for prompt, cont in self.by_prompt.items():
                if tuple(r.token_ids[: len(prompt)]) == prompt:
                    done = len(r.token_ids) - len(prompt)
                    out.append(list(cont[done : done + r.max_drafts]))
                    break
            else:
                out.append([])
        return out


def test_ngram_guided_and_free_requests_token_identical(spec, reference):
    stats = spec.llm_engine.scheduler.spec_stats
    before = stats.num_accepted_tokens
    outs = spec.generate(PROMPTS, PARAMS, use_tqdm=False)
    _same(outs, reference)
    assert stats.num_accepted_tokens > before
    assert outs[0].metrics.spec_num_accepted_tokens > 0  # the guided JSON copy speculated and hit
    assert outs[0].outputs[0].text.strip().startswith("{") and outs[0].outputs[0].finish_reason == "stop"
    assert_pool_whole(spec)


def test_drafts_the_grammar_forbids_are_rejected(spec, reference, unguided):
    """The guided JSON and regex requests get the unguided greedy continuation as drafts: wherever the
    grammar steers the output elsewhere the draft is the raw argmax, so only the per-position grammar
    mask rejects it. The others get their true continuation: long accepted runs, guided rows included."""
    prompts = [o.prompt_token_ids for o in spec.generate(PROMPTS, SamplingParams(max_tokens=1), use_tqdm=False)]
    core = spec.llm_engine.core
    drafts = [unguided[0], unguided[1], reference[2].token_ids, reference[3].token_ids]
    assert unguided[0] != reference[0].token_ids and unguided[1] != reference[1].token_ids
    keep, core.proposer = core.proposer, _Continuation(prompts, drafts)
    try:
        outs = spec.generate(PROMPTS, PARAMS, use_tqdm=False)
    finally:
        core.proposer = keep
    _same(outs, reference)
    assert all(o.metrics.spec_num_draft_tokens > 0 for o in outs)
    assert outs[3].metrics.spec_acceptance_rate > 0.9
    assert_pool_whole(spec)


def test_sampled_guided_tokens_keep_the_distribution(spec, smollm_fp32):
    """Seeded temperature-1 sampling under a digits regex over many seeds: the histograms of the verified
    tokens with speculation (likely drafts, and drafts the grammar forbids) match those without it."""
    n = 160
    prompt = "Three random digits: "
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=4, structured_outputs=S(regex="[0-9]{3}"))
              for s in range(n)]
    plain = [o.outputs[0].token_ids for o in smollm_fp32.generate([prompt] * n, params, use_tqdm=False)]
    likely = {}
    for t1 in {o[0] for o in plain}:
        likely[t1] = list(Counter(tuple(o[1:]) for o in plain if o[0] == t1).most_common(1)[0][0])
    plen = len(spec.generate(prompt, SamplingParams(max_tokens=1), use_tqdm=False)[0].prompt_token_ids)
    letter = spec.get_tokenizer().encode("Q", add_special_tokens=False)[0]

    class Likely(Proposer):
        name = "likely"
        calls = 0

        def propose(self, batch):
            out = []
            for r in batch:
                d = likely.get(r.token_ids[plen], []) if len(r.token_ids) == plen + 1 else []
                self.calls += 1
                if self.calls % 3 == 0 and d:
                    d = [d[0], letter]  # a draft the grammar forbids, after a plausible one
                out.append(d[: r.max_drafts])
            return out

    core = spec.llm_engine.core
    keep, core.proposer = core.proposer, Likely()
    stats = core.scheduler.spec_stats
    before = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
    try:
        guessed = [o.outputs[0] for o in spec.generate([prompt] * n, params, use_tqdm=False)]
    finally:
        core.proposer = keep
    drafts, tokens, accepted = (stats.num_drafts - before[0], stats.num_draft_tokens - before[1],
                                stats.num_accepted_tokens - before[2])
    assert drafts >= n // 2 and 0 < accepted < tokens
    assert all(c.finish_reason == "stop" and len(c.text) == 3 and c.text.isdigit() for c in guessed)
    for position in (1, 2):
        a, b = Counter(o[position] for o in plain), Counter(c.token_ids[position] for c in guessed)
        _two_sample_chi_square_ok(a, b)
    assert_pool_whole(spec)


def test_bad_grammar_fails_alone(spec, reference):
    with pytest.raises(ValueError, match="parenthesis"):
        spec.generate(PROMPTS[1], SamplingParams(max_tokens=4, structured_outputs=S(regex="(ab")), use_tqdm=False)
    with pytest.raises(ValueError, match="not valid JSON"):
        spec.generate(PROMPTS[0], SamplingParams(max_tokens=4, structured_outputs=S(json="{nope")), use_tqdm=False)
    _same(spec.generate(PROMPTS[:2], PARAMS[:2], use_tqdm=False), reference[:2])
    assert_pool_whole(spec)
