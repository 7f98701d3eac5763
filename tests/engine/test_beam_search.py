"""LLM.beam_search against transformers in float32 on random-weight checkpoints.

vLLM's rules (perfxlm/beam_search.py) and transformers' `generate(num_beams=...)` agree where no EOS
is in play: ignore_eos here, eos_token_id=None there, any length_penalty (every live beam has the same
length, so dividing by it never reorders them). With EOS in play they differ (transformers divides by
the generated length, admits an EOS candidate only from the step's best num_beams, and early_stopping=True
stops at num_beams finished), so those runs are checked against `reference_beam_search`, the rules
written out plainly over transformers' own next-token logprobs; and, where the settings make both rules
one (length_penalty=0.0, early_stopping="never": transformers' "canonical" beam search), against
generate() as well.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from perfxlm import LLM, BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from tests.conftest import assert_pool_whole, make_llama_checkpoint

VOCAB = 301
EOS = 2


@pytest.fixture(scope="module")
def eos_prone_checkpoint(tmp_path_factory) -> str:
    """A random Llama whose untied head favours EOS enough that beams end in it now and then."""
    path = make_llama_checkpoint(str(tmp_path_factory.mktemp("beam_llama")), seed=3, vocab_size=VOCAB,
                                 num_hidden_layers=2, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight[EOS] *= 2.2
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hf(eos_prone_checkpoint):
    return AutoModelForCausalLM.from_pretrained(eos_prone_checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(eos_prone_checkpoint):
    return LLM(eos_prone_checkpoint, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=96, block_size=16,
               max_model_len=256)


def _prompts(*lengths: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def hf_beams(hf, prompt: list[int], width: int, max_tokens: int, length_penalty: float, eos: int | None,
             early_stopping: bool | str = "never"):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width, num_return_sequences=width,
                          max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos, pad_token_id=0,
                          early_stopping=early_stopping, length_penalty=length_penalty,
                          output_scores=True, return_dict_in_generate=True)
    seqs = []
    for row in out.sequences.tolist():
        gen = row[len(prompt):]
        if eos is not None and eos in gen:  # finished beams are padded after their EOS
            gen = gen[: gen.index(eos) + 1]
        seqs.append(gen)
    return seqs


def reference_beam_search(hf, prompt: list[int], p: BeamSearchParams, eos: int,
                          eos_from_best_only: bool = False) -> list[tuple[list[int], float]]:
    """vLLM's rules, spelled out over transformers' next-token logprobs. eos_from_best_only: transformers'
    rule instead, an EOS candidate counts only when it ranks among the step's best beam_width."""
    ends = set() if p.ignore_eos else {eos}

    def score(beam):
        tokens, cum = beam
        return cum / ((len(tokens) - (tokens[-1] in ends)) ** p.length_penalty)

    beams, completed = [(list(prompt), 0.0)], []
    for _ in range(p.max_tokens):
        with torch.no_grad():  # live beams all have the same length: one batch
            rows = hf(torch.tensor([tokens for tokens, _ in beams])).logits[:, -1].log_softmax(-1)
        values, ids = rows.topk(2 * p.beam_width)
        candidates = [(tokens + [t], cum + v) for (tokens, cum), vs, ts in zip(beams, values.tolist(), ids.tolist())
                      for v, t in zip(vs, ts)]
        if eos_from_best_only:
            best = sorted(candidates, key=lambda c: c[1], reverse=True)[: p.beam_width]
            completed += [c for c in best if c[0][-1] in ends]
        else:
            completed += [c for c in candidates if c[0][-1] in ends]
        live = [c for c in candidates if c[0][-1] not in ends]
        beams = sorted(live, key=score, reverse=True)[: p.beam_width]
    return sorted(completed + beams, key=score, reverse=True)[: p.beam_width]


@pytest.mark.parametrize("width,length_penalty", [(1, 1.0), (3, 1.0), (4, 0.7)])
def test_without_eos_equals_transformers_generate(llm, hf, width, length_penalty):
    prompts = _prompts(5, 19)
    params = BeamSearchParams(beam_width=width, max_tokens=7, ignore_eos=True, length_penalty=length_penalty)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    assert all(isinstance(o, BeamSearchOutput) for o in outs)
    for prompt, out in zip(prompts, outs):
        assert all(isinstance(s, BeamSearchSequence) for s in out.sequences)
        assert [s.tokens[: len(prompt)] for s in out.sequences] == [prompt] * width
        got = [s.tokens[len(prompt):] for s in out.sequences]
        for early_stopping in (True, False, "never"):  # with no EOS nothing finishes early
            assert got == hf_beams(hf, prompt, width, 7, length_penalty, None, early_stopping)
        assert all(len(s.logprobs) == 7 and s.finish_reason == "length" for s in out.sequences)
        # cum_logprob is the sum of the chosen tokens' logprobs, best beam first
        for s in out.sequences:
            chosen = sum(row[t].logprob for row, t in zip(s.logprobs, s.tokens[len(prompt):]))
            assert s.cum_logprob == pytest.approx(chosen, abs=1e-9)
        cums = [s.cum_logprob for s in out.sequences]
        assert cums == sorted(cums, reverse=True)
    assert_pool_whole(llm)


@pytest.mark.parametrize("width,length_penalty", [(2, 1.0), (3, 0.0), (5, 1.3)])
def test_with_eos_follows_vllm_rules(llm, hf, width, length_penalty):
    prompts = _prompts(3, 18, seed=1)
    params = BeamSearchParams(beam_width=width, max_tokens=9, length_penalty=length_penalty)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    finished_early = 0
    for prompt, out in zip(prompts, outs):
        want = reference_beam_search(hf, prompt, params, EOS)
        assert [s.tokens for s in out.sequences] == [t for t, _ in want]
        assert [s.cum_logprob for s in out.sequences] == pytest.approx([c for _, c in want], abs=1e-4)
        for s in out.sequences:
            ended = s.tokens[-1] == EOS
            finished_early += ended
            assert s.finish_reason == ("stop" if ended else "length")
            assert EOS not in s.tokens[len(prompt):-1]  # a beam ends at its first EOS
    assert finished_early > 0  # the checkpoint does make beams end in EOS
    assert_pool_whole(llm)


def test_where_transformers_differs(llm, hf):
    """length_penalty=0 and early_stopping="never" (transformers' "canonical" beam search): both keep the
    best sums of logprobs, and differ only in which EOS candidates count. The reference with
    transformers' rule is generate() itself; with vLLM's it is the engine; on this prompt the two differ."""
    prompt = _prompts(11, seed=1)[0]
    params = BeamSearchParams(beam_width=3, max_tokens=9, length_penalty=0.0)
    got = [s.tokens for s in llm.beam_search([{"prompt_token_ids": prompt}], params)[0].sequences]
    assert got == [t for t, _ in reference_beam_search(hf, prompt, params, EOS)]
    as_transformers = [t[len(prompt):] for t, _ in reference_beam_search(hf, prompt, params, EOS, True)]
    assert as_transformers == hf_beams(hf, prompt, 3, 9, 0.0, eos=EOS)
    assert [t[len(prompt):] for t in got] != as_transformers


def test_steps_reuse_the_prompt_blocks(llm, monkeypatch):
    """Each step runs every beam as a fresh request; the prefix cache serves what earlier steps computed."""
    prompt = _prompts(40, seed=2)[0]
    cached: list[list[int]] = []
    run = llm._run

    def spy(prompts, params, use_tqdm, **kwargs):
        outs = run(prompts, params, use_tqdm, **kwargs)
        cached.append([o.num_cached_tokens for o in outs])
        return outs

    monkeypatch.setattr(llm, "_run", spy)
    llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True))
    assert len(cached) == 5 and cached[0] in ([0], [32])  # the first step may find the prompt from an earlier test
    for step in cached[1:]:
        assert len(step) == 3 and all(n >= 32 for n in step)  # the prompt's two full blocks, shared by every beam
    assert_pool_whole(llm)


def test_text_prompts_and_text(smollm_fp32):
    llm = smollm_fp32
    tok = llm.get_tokenizer()
    out = llm.beam_search([{"prompt": "The capital of France is"}, "1, 2, 3,"],
                          BeamSearchParams(beam_width=2, max_tokens=5))
    for o in out:
        assert len(o.sequences) == 2
        for s in o.sequences:
            assert s.text == tok.decode(s.tokens)  # vLLM's offline text: the prompt's and the beam's tokens
    assert out[1].sequences[0].tokens[: len(tok.encode("1, 2, 3,"))] == tok.encode("1, 2, 3,")
    assert_pool_whole(llm)


@pytest.mark.parametrize("fields,match", [
    ({"beam_width": 0}, "beam_width must be an integer >= 1"),
    ({"beam_width": -2}, "beam_width must be an integer >= 1"),
    ({"beam_width": 2.5}, "beam_width must be an integer >= 1"),
    ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
    ({"temperature": -1.0}, "temperature must be a finite number >= 0"),
    ({"length_penalty": float("nan")}, "length_penalty must be a finite number"),
])
def test_bad_params_are_refused(fields, match):
    with pytest.raises(ValueError, match=match):
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **fields})


def test_engine_bounds_are_refused_before_any_step(llm):
    prompt = {"prompt_token_ids": _prompts(7)[0]}
    with pytest.raises(ValueError, match=r"beam_width must be at most 10.*max_logprobs"):
        llm.beam_search([prompt], BeamSearchParams(beam_width=11, max_tokens=3))
    with pytest.raises(ValueError, match="beam_width must be at most 10"):
        llm.beam_search([prompt], BeamSearchParams(beam_width=10**9, max_tokens=3))
    with pytest.raises(ValueError, match="more than max_model_len"):
        llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=250))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.beam_search([{"prompt_token_ids": [5, VOCAB]}], BeamSearchParams(beam_width=2, max_tokens=3))
    with pytest.raises(ValueError, match="params must be a BeamSearchParams"):
        llm.beam_search([prompt], {"beam_width": 2})
    assert not llm.llm_engine.has_unfinished_requests()
    assert_pool_whole(llm)
    assert len(llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=3))[0].sequences) == 2


def test_async_beam_search_equals_offline(eos_prone_checkpoint, llm):
    """AsyncLLM.beam_search: one finished RequestOutput, generated tokens only; the EOS token and its
    logprob row only with include_stop_str_in_output; cancelling it mid-search frees every block."""
    import asyncio

    from perfxlm import AsyncLLM, EngineConfig

    prompt = _prompts(11, seed=1)[0]
    params = BeamSearchParams(beam_width=3, max_tokens=9, length_penalty=0.0)
    offline = llm.beam_search([{"prompt_token_ids": prompt}], params)[0].sequences
    engine = AsyncLLM(EngineConfig(model=eos_prone_checkpoint, skip_tokenizer_init=True, dtype="float32",
                                   num_kv_blocks=96))
    try:
        async def search(p, request_id):
            return [out async for out in engine.beam_search({"prompt_token_ids": prompt}, request_id, p)]

        async def cancelled():
            task = asyncio.ensure_future(search(BeamSearchParams(beam_width=4, max_tokens=40, ignore_eos=True), "c"))
            await asyncio.sleep(0.3)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

        for include in (False, True):
            p = BeamSearchParams(beam_width=3, max_tokens=9, length_penalty=0.0, include_stop_str_in_output=include)
            (out,) = asyncio.run(search(p, f"b{include}"))
            assert out.finished and out.prompt_token_ids == prompt
            for c, s in zip(out.outputs, offline):
                ended = s.tokens[-1] == EOS
                want = s.tokens[len(prompt):] if include or not ended else s.tokens[len(prompt):-1]
                assert c.token_ids == want and c.finish_reason == ("stop" if ended else "length")
                assert c.cumulative_logprob == pytest.approx(s.cum_logprob, abs=1e-6)
                assert len(c.logprobs) == len(want)
        with pytest.raises(ValueError, match="beam_width must be at most 10"):
            asyncio.run(search(BeamSearchParams(beam_width=12, max_tokens=2), "bad"))
        asyncio.run(cancelled())
        assert engine.engine.wait_idle(30)
        counts = engine.engine.check_invariants()
        assert counts["used"] == 0 and counts["free"] + counts["cached"] == engine.engine.num_kv_blocks
    finally:
        engine.shutdown()
