"""Every SamplingParams field, checked by behaviour on a real engine (float32)."""

import math

import pytest
import torch

from perfxlm import LLM, SamplingParams
from perfxlm.model.layers.logits_processors import Penalties, apply_penalties
from tests.conftest import assert_pool_whole

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def hf_tiny(tiny_llama):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return LLM(tiny_llama, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=256)


def _ids(n, seed=0):
    return torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_logprobs_and_ranks_match_transformers(tiny, hf_tiny):
    prompt = _ids(12)
    out = tiny.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=6, logprobs=3,
                        ignore_eos=True), use_tqdm=False)[0].outputs[0]
    seq = prompt + out.token_ids
    with torch.no_grad():
        ref = hf_tiny(torch.tensor([seq])).logits[0].float().log_softmax(-1)
    assert len(out.logprobs) == 6
    cum = 0.0
    for i, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(prompt) - 1 + i]
        assert tok in lp and len(lp) == 3  # greedy token is also the top-1
        assert abs(lp[tok].logprob - row[tok].item()) < 1e-4 and lp[tok].rank == 1
        top = row.topk(3)
        for rank, (tid, val) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
            assert abs(lp[tid].logprob - val) < 1e-4 and lp[tid].rank == rank
        cum += lp[tok].logprob
    assert math.isclose(out.cumulative_logprob, cum, abs_tol=1e-4)


def test_sampled_token_rank_is_its_place_in_the_distribution(tiny, hf_tiny):
    prompt = _ids(9, seed=3)
    out = tiny.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=2.0, seed=7, max_tokens=8, logprobs=0,
                        ignore_eos=True), use_tqdm=False)[0].outputs[0]
    with torch.no_grad():
        ref = hf_tiny(torch.tensor([prompt + out.token_ids])).logits[0].float().log_softmax(-1)
    for i, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(prompt) - 1 + i]
        assert list(lp) == [tok]
        assert lp[tok].rank == int((row > row[tok]).sum()) + 1


def test_prompt_logprobs_match_transformers_even_when_chunked(tiny_llama, hf_tiny):
    prompt = _ids(40, seed=1)
    llm = LLM(tiny_llama, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=2),
                       use_tqdm=False)[0]
    with torch.no_grad():
        ref = hf_tiny(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        tok = prompt[pos]
        assert abs(entry[tok].logprob - ref[pos - 1, tok].item()) < 1e-4
        assert entry[tok].rank == int((ref[pos - 1] > ref[pos - 1, tok]).sum()) + 1
        assert len(entry) in (2, 3)
    assert_pool_whole(llm)


def test_min_tokens_suppresses_eos_and_stop_ids(smollm_fp32):
    chat = [{"role": "user", "content": "Say yes."}]
    short = smollm_fp32.chat(chat, SamplingParams(temperature=0, max_tokens=100), use_tqdm=False)[0].outputs[0]
    assert short.finish_reason == "stop"
    n = len(short.token_ids)
    eos = short.token_ids[-1]
    longer = smollm_fp32.chat(chat, SamplingParams(temperature=0, max_tokens=100, min_tokens=n + 5,
                                                   stop_token_ids=[eos]), use_tqdm=False)[0].outputs[0]
    assert len(longer.token_ids) >= n + 5
    assert eos not in longer.token_ids[: n + 4]


def test_logit_bias_forces_a_token(tiny):
    out = tiny.generate({"prompt_token_ids": _ids(5)}, SamplingParams(temperature=1.0, max_tokens=8,
                        logit_bias={42: 100.0}, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [42] * 8


def test_allowed_token_ids_restrict_output(tiny):
    allowed = [10, 20, 30]
    out = tiny.generate({"prompt_token_ids": _ids(5)}, SamplingParams(temperature=1.5, seed=0, max_tokens=20,
                        allowed_token_ids=allowed, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert set(out.token_ids) <= set(allowed)


def test_bad_words_never_appear(smollm_fp32):
    base = smollm_fp32.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    assert "Paris" in base.text
    out = smollm_fp32.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, bad_words=["Paris"]),
                               use_tqdm=False)[0].outputs[0]
    assert "Paris" not in out.text


@pytest.mark.parametrize("field,value", [("repetition_penalty", 1.8), ("frequency_penalty", 1.5),
                                         ("presence_penalty", 1.5)])
def test_penalties_match_reference(tiny, hf_tiny, field, value):
    prompt = _ids(8, seed=5)
    out = tiny.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                        **{field: value}), use_tqdm=False)[0].outputs[0]
    # Reference: greedy decoding with the penalty applied by hand to transformers' logits.
    seq = list(prompt)
    for _ in range(10):
        with torch.no_grad():
            logits = hf_tiny(torch.tensor([seq])).logits[0, -1].float()
        generated = seq[len(prompt):]
        counts = torch.bincount(torch.tensor(generated, dtype=torch.int64), minlength=logits.numel()).float()
        if field == "repetition_penalty":
            seen = torch.zeros_like(logits, dtype=torch.bool)
            seen[torch.tensor(seq)] = True
            logits = torch.where(seen, torch.where(logits > 0, logits / value, logits * value), logits)
        elif field == "frequency_penalty":
            logits = logits - value * counts
        else:
            logits = logits - value * (counts > 0).float()
        seq.append(int(logits.argmax()))
    assert out.token_ids == seq[len(prompt):]


def test_penalty_kernel_matches_reference_on_random_logits():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    prompt = torch.tensor([[1, 2, 50], [3, 50, 50], [4, 4, 5]])
    output = torch.tensor([[2, 2, 7], [9, 50, 50], [50, 50, 50]])
    p = Penalties(torch.tensor([1.5, 1.0, 2.0]), torch.tensor([0.5, 0.0, 1.0]), torch.tensor([0.3, 1.0, 0.0]),
                  prompt, output)
    got = apply_penalties(logits.clone(), p)
    ref = logits.clone()
    for r in range(3):
        out_tokens = [t for t in output[r].tolist() if t < 50]
        seen = set(t for t in prompt[r].tolist() if t < 50) | set(out_tokens)
        for t in seen:
            rp = p.repetition[r].item()
            ref[r, t] = ref[r, t] / rp if ref[r, t] > 0 else ref[r, t] * rp
        for t in set(out_tokens):
            ref[r, t] -= p.frequency[r].item() * out_tokens.count(t) + p.presence[r].item()
    torch.testing.assert_close(got, ref)


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny):
    p = SamplingParams(temperature=1.0, seed=99, max_tokens=12, ignore_eos=True)
    prompt = {"prompt_token_ids": _ids(6, seed=9)}
    alone = tiny.generate(prompt, p, use_tqdm=False)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": _ids(n, seed=n)} for n in (3, 17, 30)]
    batch = tiny.generate([others[0], prompt, others[1], others[2]],
                          [SamplingParams(temperature=1.0, max_tokens=12), p,
                           SamplingParams(temperature=0.7, max_tokens=5), SamplingParams(temperature=0)],
                          use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    assert tiny.generate(prompt, p, use_tqdm=False)[0].outputs[0].token_ids == alone


def test_n4_with_seed_prefills_prompt_once(tiny):
    engine = tiny.llm_engine
    prompt = _ids(37, seed=11)
    before = engine.scheduler.num_prompt_tokens_computed
    out = tiny.generate({"prompt_token_ids": prompt}, SamplingParams(n=4, seed=5, temperature=1.0, max_tokens=10,
                        ignore_eos=True), use_tqdm=False)[0]
    assert engine.scheduler.num_prompt_tokens_computed - before == 37
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    seqs = [tuple(c.token_ids) for c in out.outputs]
    assert all(len(s) == 10 for s in seqs) and len(set(seqs)) > 1
    again = tiny.generate({"prompt_token_ids": prompt}, SamplingParams(n=4, seed=5, temperature=1.0, max_tokens=10,
                          ignore_eos=True), use_tqdm=False)[0]
    assert [tuple(c.token_ids) for c in again.outputs] == seqs
    assert_pool_whole(tiny)


def test_best_of_returns_top_n_by_cumulative_logprob(tiny):
    out = tiny.generate({"prompt_token_ids": _ids(7)}, SamplingParams(n=2, best_of=5, seed=1, temperature=1.0,
                        max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs) == 2
    assert out.outputs[0].cumulative_logprob >= out.outputs[1].cumulative_logprob
    assert_pool_whole(tiny)


def test_stop_string_included_when_asked(smollm_fp32):
    out = smollm_fp32.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, stop=["Paris"],
                                                      include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert out.text.endswith("Paris") and out.stop_reason == "Paris"


def test_truncate_prompt_tokens_keeps_the_end(tiny):
    prompt = _ids(30)
    a = tiny.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                      truncate_prompt_tokens=10), use_tqdm=False)[0]
    b = tiny.generate({"prompt_token_ids": prompt[-10:]}, SamplingParams(temperature=0, max_tokens=4,
                      ignore_eos=True), use_tqdm=False)[0]
    assert a.prompt_token_ids == prompt[-10:] and a.outputs[0].token_ids == b.outputs[0].token_ids


def test_detokenize_false_and_special_tokens(smollm_fp32):
    out = smollm_fp32.generate(PROMPT, SamplingParams(temperature=0, max_tokens=5, detokenize=False),
                               use_tqdm=False)[0].outputs[0]
    assert out.text == "" and len(out.token_ids) == 5


def test_out_of_vocab_ids_name_the_field(tiny):
    for kwargs, field in [({"logit_bias": {5000: 1.0}}, "logit_bias"), ({"allowed_token_ids": [5000]},
                          "allowed_token_ids"), ({"stop_token_ids": [5000]}, "stop_token_ids")]:
        with pytest.raises(ValueError, match=field):
            tiny.generate({"prompt_token_ids": [5, 6]}, SamplingParams(**kwargs), use_tqdm=False)
    assert_pool_whole(tiny)
