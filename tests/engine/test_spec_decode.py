"""Speculative decoding end to end: greedy outputs token-identical to decoding without it (prefix caching,
chunked prefill, preemption, n > 1, stop ids and strings, logprobs), seeded sampling reproducible, no KV
block leaked, and the counters."""

import pytest

from perfxlm import LLM, SamplingParams
from perfxlm.spec_decode.proposer import DraftRequest, Proposer
from tests.conftest import assert_pool_whole

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# prompts that repeat themselves, so prompt lookup finds something to propose; odd lengths
PROMPTS = [
    {"prompt_token_ids": [11, 12, 13, 14, 15] * 5 + [11, 12]},
    {"prompt_token_ids": [7, 300, 8, 301, 9] * 3 + [7, 300, 8]},
    {"prompt_token_ids": [11, 12, 13, 14, 15] * 5 + [99, 98, 97]},  # shares a prefix with the first
    {"prompt_token_ids": list(range(40, 73)) + list(range(40, 50))},
    {"prompt_token_ids": [5, 6, 7]},
]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=23, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=17, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=31, ignore_eos=True, stop_token_ids=[45]),
    SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
]


@pytest.fixture(scope="module")
def plain(tiny_llama):
    return LLM(tiny_llama, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=96, block_size=4)


@pytest.fixture(scope="module")
def reference(plain):
    return [o.outputs[0] for o in plain.generate(PROMPTS, PARAMS, use_tqdm=False)]


def _spec_llm(tiny_llama, **kwargs):
    kwargs.setdefault("num_kv_blocks", 96)
    return LLM(tiny_llama, skip_tokenizer_init=True, dtype="float32", block_size=4, speculative_config=NGRAM,
               **kwargs)


def _same(outs, reference):
    for o, r in zip(outs, reference):
        c = o.outputs[0]
        assert c.token_ids == r.token_ids, (o.prompt_token_ids, c.token_ids, r.token_ids)
        assert c.finish_reason == r.finish_reason and c.stop_reason == r.stop_reason
        if r.logprobs is not None:
            assert len(c.logprobs) == len(r.logprobs)
            for a, b in zip(c.logprobs, r.logprobs):
                assert a.keys() == b.keys()
                assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 and a[t].rank == b[t].rank for t in a)


def test_ngram_greedy_is_token_identical(tiny_llama, reference):
    llm = _spec_llm(tiny_llama)
    _same(llm.generate(PROMPTS, PARAMS, use_tqdm=False), reference)
    stats = llm.llm_engine.scheduler.spec_stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens >= stats.num_drafts
    assert_pool_whole(llm)
    # again, now from the prefix cache, one prompt at a time and chunked by a small budget
    for prompt, params, ref in zip(PROMPTS, PARAMS, reference):
        _same(llm.generate(prompt, params, use_tqdm=False), [ref])
    assert_pool_whole(llm)


def test_chunked_prefill_and_preemption(tiny_llama, reference):
    llm = _spec_llm(tiny_llama, num_kv_blocks=24, max_num_batched_tokens=11, enable_prefix_caching=False)
    _same(llm.generate(PROMPTS, PARAMS, use_tqdm=False), reference)
    assert llm.llm_engine.scheduler.num_preemptions_total > 0
    assert llm.llm_engine.scheduler.spec_stats.num_drafts > 0
    assert_pool_whole(llm)


class _Oracle(Proposer):
    """Proposes the true greedy continuation, wrong at every `wrong`-th position: drafts are accepted
    in long runs and rejected mid-way."""

    name = "oracle"

    def __init__(self, continuations: dict[tuple, list[int]], wrong: int) -> None:
        self.continuations, self.wrong, self.calls = continuations, wrong, 0

    def propose(self, batch: list[DraftRequest]) -> list[list[int]]:
        out = []
        for r in batch:
            for prompt, cont in self.continuations.items():
                n = len(prompt)
                if tuple(r.token_ids[:n]) == prompt:
                    done = len(r.token_ids) - n
                    d = list(cont[done : done + r.max_drafts])
                    self.calls += 1
                    if self.calls % self.wrong == 0 and d:
                        d[-1] = (d[-1] + 1) % 1000
                    out.append(d)
                    break
            else:
                out.append([])
        return out


@pytest.mark.usefixtures("full_verify_budget")
@pytest.mark.parametrize("wrong", [3, 1000])
def test_accepted_runs_and_rejections_give_the_same_tokens(tiny_llama, reference, wrong):
    llm = _spec_llm(tiny_llama, num_kv_blocks=40)
    oracle = _Oracle({tuple(p["prompt_token_ids"]): r.token_ids for p, r in zip(PROMPTS, reference)}, wrong)
    llm.llm_engine.core.proposer = oracle
    _same(llm.generate(PROMPTS, PARAMS, use_tqdm=False), reference)
    stats = llm.llm_engine.scheduler.spec_stats
    assert oracle.calls > 0 and stats.num_accepted_tokens > 0
    if wrong == 1000:
        assert stats.acceptance_rate > 0.95 and stats.mean_acceptance_length > 3
    assert_pool_whole(llm)


def test_seeded_sampling_reproducible_and_n_siblings(tiny_llama):
    llm = _spec_llm(tiny_llama)
    params = SamplingParams(temperature=0.7, top_p=0.9, seed=5, max_tokens=19, ignore_eos=True, n=2, logprobs=1)
    a = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    b = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    for x, y in zip(a, b):
        assert len(x.outputs) == 2
        assert [c.token_ids for c in x.outputs] == [c.token_ids for c in y.outputs]
        assert all(len(c.token_ids) == 19 and len(c.logprobs) == 19 for c in x.outputs)
    assert_pool_whole(llm)


def test_greedy_n_siblings_identical(tiny_llama, reference):
    llm = _spec_llm(tiny_llama)
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=23, ignore_eos=True, n=3),
                       use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [reference[0].token_ids] * 3
    assert_pool_whole(llm)


def test_stop_strings_on_the_default_model(default_model, smollm_fp32):
    source = "def add(a, b):\n    # the sum of a and b\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"
    text = f"Repeat the following code exactly:\n{source}\nRepeated code:\n"
    free = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ref_free = smollm_fp32.generate(text, free, use_tqdm=False)[0].outputs[0]
    stop = ref_free.text[len(ref_free.text) // 2 :][:5]  # ends the output half way
    params = [SamplingParams(temperature=0, max_tokens=20, stop=[stop]), free]
    ref = smollm_fp32.generate([text, text], params, use_tqdm=False)
    llm = LLM(default_model, dtype="float32", kv_cache_gib=0.25, speculative_config=NGRAM)
    out = llm.generate([text, text], params, use_tqdm=False)
    for o, r in zip(out, ref):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
        assert o.outputs[0].text == r.outputs[0].text
        assert (o.outputs[0].finish_reason, o.outputs[0].stop_reason) == (r.outputs[0].finish_reason,
                                                                          r.outputs[0].stop_reason)
    assert out[0].outputs[0].stop_reason == stop and len(out[0].outputs[0].token_ids) < 20
    assert llm.llm_engine.scheduler.spec_stats.mean_acceptance_length > 2
    assert_pool_whole(llm)


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory):
    from tests.conftest import make_llama_checkpoint

    return make_llama_checkpoint(str(tmp_path_factory.mktemp("draft")), seed=1, hidden_size=48,
                                 intermediate_size=80, num_hidden_layers=2, num_attention_heads=3,
                                 num_key_value_heads=1)


@pytest.mark.parametrize("which", ["small", "itself"])
def test_draft_model_greedy_is_token_identical(tiny_llama, small_draft, reference, which):
    draft = small_draft if which == "small" else tiny_llama
    llm = LLM(tiny_llama, skip_tokenizer_init=True, dtype="float32", block_size=4, num_kv_blocks=40,
              max_num_batched_tokens=13, speculative_config={"model": draft, "num_speculative_tokens": 4})
    _same(llm.generate(PROMPTS, PARAMS, use_tqdm=False), reference)
    stats = llm.llm_engine.scheduler.spec_stats
    assert stats.num_drafts > 0
    if which == "itself":  # the target as its own draft guesses right (float32, the same kernels)
        assert stats.acceptance_rate > 0.9, stats.as_dict()
    assert_pool_whole(llm)
    proposer = llm.llm_engine.core.proposer
    proposer.drop(list(proposer.seqs))
    assert proposer.kv.check_invariants()["used"] == 0


def test_draft_catch_up_runs_as_decode_rows(tiny_llama, reference, monkeypatch):
    """After every guess was accepted the draft lacks its last guess and the target's token: that short
    catch-up runs as decode rows of the draft's step (not a prefill chunk that packs the whole context
    again), a new prompt still prefills, and the target's greedy output stays token-identical."""
    from perfxlm.spec_decode.draft_model import CATCH_UP_ROWS

    monkeypatch.setenv("PERFXLM_SPEC_PAYOFF", "off")  # every step speculates, whatever it costs here

    llm = LLM(tiny_llama, skip_tokenizer_init=True, dtype="float32", block_size=4, num_kv_blocks=40,
              max_num_batched_tokens=13, speculative_config={"model": tiny_llama, "num_speculative_tokens": 4})
    runner = llm.llm_engine.core.proposer.runner
    seen: list[tuple[int, int, bool]] = []  # (new tokens, cached tokens, as decode rows) per draft request
    execute = runner.execute

    def spy(so):
        seen.extend((len(s.token_ids), s.num_computed_tokens, s.decode_rows) for s in so.scheduled)
        return execute(so)

    runner.execute = spy
    _same(llm.generate(PROMPTS, PARAMS, use_tqdm=False), reference)
    assert llm.llm_engine.scheduler.spec_stats.acceptance_rate > 0.9
    catch_ups = [rows for n, cached, rows in seen if 1 < n <= CATCH_UP_ROWS and cached > 0]
    assert catch_ups and all(catch_ups), seen
    assert any(n > 1 and cached == 0 and not rows for n, cached, rows in seen), seen  # the prompts prefill
    assert_pool_whole(llm)


@pytest.mark.parametrize("payoff", ["auto", "off"])
def test_a_draft_that_costs_more_than_it_wins_pauses(tiny_llama, reference, monkeypatch, payoff):
    """A draft model whose proposals take far longer than the steps they save: the engine measures that
    and decodes plainly for growing pauses (PERFXLM_SPEC_PAYOFF=auto), or speculates on every step (off);
    the output is token-identical to decoding without speculation either way."""
    import time

    monkeypatch.setenv("PERFXLM_SPEC_PAYOFF", payoff)
    llm = LLM(tiny_llama, skip_tokenizer_init=True, dtype="float32", block_size=4, num_kv_blocks=80,
              speculative_config={"model": tiny_llama, "num_speculative_tokens": 2})
    core = llm.llm_engine.core
    assert (core.payoff is not None) == (payoff == "auto")
    propose = core.proposer.propose

    def slow(batch):
        time.sleep(0.05)  # far more than a step of this model
        return propose(batch)

    core.proposer.propose = slow
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    out = llm.generate(PROMPTS[:1], params, use_tqdm=False)
    plain = LLM(tiny_llama, skip_tokenizer_init=True, dtype="float32", block_size=4, num_kv_blocks=80)
    _same(out, [o.outputs[0] for o in plain.generate(PROMPTS[:1], params, use_tqdm=False)])
    drafts = llm.llm_engine.scheduler.spec_stats.num_drafts  # verification steps
    # off: every step verifies (the draft is the target itself: ~3 tokens a step, ~20 steps); auto: 4
    # speculative steps, 2 plain ones and the verdict, a pause of 8 plain steps, 4 more, a pause of 16, ...
    if payoff == "auto":
        assert 0 < drafts <= 14, drafts
    else:
        assert drafts >= 18, drafts
    assert_pool_whole(llm)


def test_bad_draft_model_refused_before_loading(tiny_llama, tmp_path):
    from tests.conftest import make_llama_checkpoint

    other = make_llama_checkpoint(str(tmp_path / "other_vocab"), vocab_size=1003, hidden_size=32,
                                  intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                  num_key_value_heads=1)
    with pytest.raises(ValueError, match="vocabulary of 1003 tokens, the target 1000"):
        LLM(tiny_llama, skip_tokenizer_init=True, speculative_config={"model": other, "num_speculative_tokens": 2})
    big = make_llama_checkpoint(str(tmp_path / "big"), hidden_size=192, intermediate_size=384)
    with pytest.raises(ValueError, match="larger than the target"):
        LLM(tiny_llama, skip_tokenizer_init=True, speculative_config={"model": big, "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="neither a .gguf file nor a checkpoint folder"):
        LLM(tiny_llama, skip_tokenizer_init=True,
            speculative_config={"model": str(tmp_path), "num_speculative_tokens": 2})


def test_counters_reach_metrics_and_request_outputs(tiny_llama, reference):
    """vLLM's spec-decode counters on the server's /metrics, and each request's own in its metrics."""
    import asyncio

    import httpx

    from perfxlm import AsyncLLM, EngineConfig
    from perfxlm.entrypoints.openai.api_server import build_app

    engine = AsyncLLM(EngineConfig(model=tiny_llama, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64,
                                   block_size=4, speculative_config=NGRAM))
    try:
        app = build_app(engine, "tiny")

        async def go():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
                body = {"prompt": PROMPTS[0]["prompt_token_ids"], "max_tokens": 23, "temperature": 0,
                        "ignore_eos": True}
                done = await client.post("/v1/completions", json=body)
                return done, await client.get("/metrics")

        done, metrics = asyncio.run(go())
        assert done.status_code == 200
        lines = {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in metrics.text.splitlines()
                 if ln.startswith("perfxlm:spec_decode")}
        stats = engine.engine.core.scheduler.spec_stats
        assert lines["perfxlm:spec_decode_num_drafts_total"] == stats.num_drafts > 0
        assert lines["perfxlm:spec_decode_num_draft_tokens_total"] == stats.num_draft_tokens
        assert lines["perfxlm:spec_decode_num_accepted_tokens_total"] == stats.num_accepted_tokens
        assert lines['perfxlm:spec_decode_num_accepted_tokens_per_pos_total{position="0"}'] == \
            stats.accepted_per_position[0]
        from perfxlm.bench.serve import parse_spec_decode_counters  # what bench serve reads

        assert parse_spec_decode_counters(metrics.text) == {
            "num_drafts": stats.num_drafts, "num_draft_tokens": stats.num_draft_tokens,
            "num_accepted_tokens": stats.num_accepted_tokens}
    finally:
        engine.shutdown()
    llm = _spec_llm(tiny_llama)
    out = llm.generate(PROMPTS[0], PARAMS[0], use_tqdm=False)[0]
    m, stats = out.metrics, llm.llm_engine.scheduler.spec_stats
    assert m.spec_num_draft_tokens == stats.num_draft_tokens > 0
    assert m.spec_num_accepted_tokens == stats.num_accepted_tokens
    assert m.spec_acceptance_rate == stats.acceptance_rate


def test_guesses_shrink_and_stop_as_the_batch_grows(tiny_llama):
    llm = _spec_llm(tiny_llama)
    core = llm.llm_engine.core
    core.verify_row_budget = 8  # as a CPU whose GEMV crossover is 8 rows
    seen = []
    draft_requests = core.scheduler.draft_requests

    def spy(max_drafts, **kwargs):
        batch = draft_requests(max_drafts, **kwargs)
        seen.append((core.scheduler.num_running, max((r.max_drafts for r in batch), default=0)))
        return batch

    core.scheduler.draft_requests = spy
    llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert seen and all(n * (k + 1) <= 8 for n, k in seen)  # never past the row budget
    assert not any(n >= 5 for n, _ in seen)  # 5 requests x (1 + 1) > 8: no room for a guess
    assert any(k == 3 for _, k in seen)  # alone, the configured 3
    assert_pool_whole(llm)


def test_guesses_that_keep_missing_back_off(tiny_llama, reference):
    class Wrong(Proposer):
        name = "wrong"
        calls = 0

        def propose(self, batch):
            self.calls += len(batch)
            return [[999] * r.max_drafts for r in batch]  # never the model's token here

    llm = _spec_llm(tiny_llama)
    llm.llm_engine.core.proposer = wrong = Wrong()
    _same(llm.generate(PROMPTS[:1], PARAMS[:1], use_tqdm=False), reference[:1])
    stats = llm.llm_engine.scheduler.spec_stats
    assert stats.num_accepted_tokens == 0 and 0 < stats.num_drafts == wrong.calls
    assert wrong.calls <= 6  # 22 decode steps, pauses of 1, 2, 4, 8, 16 proposals after each miss
    assert_pool_whole(llm)


def test_proposer_forgets_finished_and_aborted_requests(tiny_llama):
    llm = _spec_llm(tiny_llama)
    engine = llm.llm_engine
    engine.add_request("a", PROMPTS[0], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    engine.add_request("b", PROMPTS[1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    for _ in range(3):
        engine.step()
    engine.abort_request(["a"])
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("c", PROMPTS[3], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    engine.core.step()  # an empty step: nothing left to forget
    assert set(engine.core.proposer._tokens) <= {"c"}
    assert_pool_whole(llm)


def test_random_sampling_keeps_the_distribution(tiny_llama):
    """Seeded top-3 sampling over many seeds: the histogram of the verified tokens (2nd and 3rd) with
    speculation matches the one without it within sampling error (two-sample chi-square)."""
    from collections import Counter

    n = 300
    prompt = PROMPTS[1]
    params = [SamplingParams(temperature=1.0, top_k=3, seed=s, max_tokens=3, ignore_eos=True) for s in range(n)]
    kw = dict(skip_tokenizer_init=True, dtype="float32", block_size=4, num_kv_blocks=4 * n, max_num_seqs=n)
    plain = [o.outputs[0].token_ids for o in LLM(tiny_llama, **kw).generate([prompt] * n, params, use_tqdm=False)]
    # guess, after each first token, the continuation the plain run took most often
    likely = {}
    for t1 in {o[0] for o in plain}:
        likely[t1] = list(Counter(tuple(o[1:]) for o in plain if o[0] == t1).most_common(1)[0][0])

    class Likely(Proposer):
        name = "likely"

        def propose(self, batch):
            plen = len(prompt["prompt_token_ids"])
            return [likely.get(r.token_ids[plen], [])[: r.max_drafts] if len(r.token_ids) == plen + 1 else []
                    for r in batch]

    spec = dict(NGRAM, disable_by_batch_size=10 * n)  # every request speculates, whatever the batch
    llm = LLM(tiny_llama, speculative_config=spec, **kw)
    llm.llm_engine.core.proposer = Likely()
    guessed = [o.outputs[0].token_ids for o in llm.generate([prompt] * n, params, use_tqdm=False)]
    stats = llm.llm_engine.scheduler.spec_stats
    assert stats.num_drafts >= n // 2 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    for position in (1, 2):
        a, b = Counter(o[position] for o in plain), Counter(o[position] for o in guessed)
        _two_sample_chi_square_ok(a, b)
    assert_pool_whole(llm)


def _two_sample_chi_square_ok(a, b) -> None:
    from scipy.stats import chi2

    keys = sorted(set(a) | set(b))
    merged = [k for k in keys if a[k] + b[k] >= 10]  # rare tokens pooled into one cell
    rest = [k for k in keys if k not in merged]
    rows = [(a[k], b[k]) for k in merged] + ([(sum(a[k] for k in rest), sum(b[k] for k in rest))] if rest else [])
    na, nb = sum(x for x, _ in rows), sum(y for _, y in rows)
    stat = sum((x * (nb / na) ** 0.5 - y * (na / nb) ** 0.5) ** 2 / (x + y) for x, y in rows if x + y)
    assert chi2.sf(stat, len(rows) - 1) > 1e-3, (rows, stat)
