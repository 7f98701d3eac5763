"""Structured outputs offline: every constraint kind parses when the request stops, n > 1 siblings and
preempted requests keep their grammar state, a bad schema fails only its own call, and unguided rows
in the same batch are untouched."""

from __future__ import annotations

import json
import re

import pytest

from perfxlm import LLM, SamplingParams
from perfxlm.sampling_params import GuidedDecodingParams, StructuredOutputsParams as S
from tests.conftest import assert_pool_whole

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
MSGS = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]


def _check_person(text: str) -> None:
    value = json.loads(text)
    assert isinstance(value["name"], str) and isinstance(value["age"], int)
    assert set(value) == {"name", "age"}  # vLLM's default: objects closed to other keys


@pytest.fixture(scope="module")
def llm(default_model):
    return LLM(default_model, dtype="float32", kv_cache_gib=0.25, max_model_len=1024)


def test_every_constraint_kind(llm):
    cases = [
        (S(json=PERSON), _check_person),
        (S(json=json.dumps(PERSON), disable_any_whitespace=True), lambda t: (_check_person(t), " " not in t)),
        (S(json_object=True), lambda t: isinstance(json.loads(t), dict)),
        (S(regex=r"[0-9]{3}-[a-z]{2}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
        (S(choice=["Paris", "Lon\"don"]), lambda t: t in ("Paris", "Lon\"don")),
        (S(grammar='root ::= ("yes" | "no") "!"'), lambda t: t in ("yes!", "no!")),
        (GuidedDecodingParams(choice=["a", "b"]), lambda t: t in ("a", "b")),  # vLLM's earlier name
    ]
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=so) for so, _ in cases]
    outs = llm.chat([MSGS] * len(cases), params, use_tqdm=False)
    for (so, check), out in zip(cases, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (so, c.text)
        assert check(c.text) is not False, (so, c.text)
    assert_pool_whole(llm)


def test_guided_rows_leave_unguided_rows_alone(llm):
    plain = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    alone = llm.chat(MSGS, plain, use_tqdm=False)[0].outputs[0].token_ids
    guided = SamplingParams(temperature=0, max_tokens=10, structured_outputs=S(json=PERSON))
    mixed = llm.chat([MSGS, MSGS, MSGS], [guided, plain, guided], use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone
    assert mixed[0].outputs[0].token_ids == mixed[2].outputs[0].token_ids


def test_siblings_each_follow_the_grammar(llm):
    params = SamplingParams(temperature=1.0, n=3, seed=7, max_tokens=80, structured_outputs=S(json=PERSON))
    out = llm.chat(MSGS, params, use_tqdm=False)[0]
    assert len(out.outputs) == 3
    for c in out.outputs:
        if c.finish_reason == "stop":
            _check_person(c.text)
    assert len({c.text for c in out.outputs}) > 1


def test_grammar_state_survives_preemption(default_model):
    # 4 requests of about 35 + 40 tokens in a pool of 14 blocks x 16 tokens: the newest is preempted and
    # recomputed; its matcher must carry on from the tokens it had.
    llm = LLM(default_model, dtype="float32", num_kv_blocks=14, max_model_len=192, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=40, structured_outputs=S(json=PERSON))
    outs = llm.chat([MSGS] * 4, [params] * 4, use_tqdm=False)
    assert llm.llm_engine.core.scheduler.num_preemptions_total > 0
    for out in outs:
        c = out.outputs[0]
        if c.finish_reason == "stop":
            _check_person(c.text)
    assert_pool_whole(llm)


def test_uncompilable_constraints_fail_alone(llm):
    for so, words in [(S(json={"type": "foo"}), "Unsupported type"), (S(regex="(ab"), "parenthesis"),
                      (S(grammar="root ::= missing"), "missing"), (S(json="{not json"), "not valid JSON")]:
        with pytest.raises(ValueError, match=words):
            llm.generate("x", SamplingParams(max_tokens=4, structured_outputs=so), use_tqdm=False)
    with pytest.raises(ValueError, match="exactly one"):
        S(json=PERSON, regex="a")
    with pytest.raises(ValueError, match="disable_any_whitespace"):
        S(json=PERSON, whitespace_pattern=" ")
    # the engine goes on serving
    assert llm.generate("x", SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    assert_pool_whole(llm)


def test_bitmask_applies_to_listed_rows_only():
    import torch

    from perfxlm.model.layers.logits_processors import apply_grammar_bitmask

    logits = torch.randn(3, 70)
    before = logits.clone()
    bitmask = torch.zeros(3, 3, dtype=torch.int32)  # nothing allowed...
    bitmask[1, 0] = 0b101  # ...but tokens 0 and 2 of row 1
    bitmask[0] = -1
    apply_grammar_bitmask(logits, [1], bitmask)
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    assert torch.isfinite(logits[1]).tolist() == [i in (0, 2) for i in range(70)]


def test_grammar_waits_for_the_end_of_thinking(llm):
    """Under a reasoning parser the grammar constrains only what follows the end-of-thinking token."""
    from perfxlm.structured_output import GrammarMatchers

    tok = llm.get_tokenizer()
    grammar = llm.llm_engine.input_processor._compile_grammar(
        SamplingParams(structured_outputs=S(choice=["yes"])), {2})
    end = tok.encode(" done", add_special_tokens=False)[0]
    matchers = GrammarMatchers()
    masked, bitmask, failed = matchers.fill([(0, "r", grammar, [5, 7], end)], 1)
    assert masked == [] and bitmask is None and not failed  # still thinking: free
    masked, bitmask, failed = matchers.fill([(0, "r", grammar, [5, 7, end], end)], 1)
    allowed = [t for t in range(bitmask.shape[1] * 32) if bitmask[0, t // 32] >> (t % 32) & 1]
    assert masked == [0] and tok.decode(allowed[:1]) and all("yes".startswith(tok.decode([t])) for t in allowed)
    yes = tok.encode("yes", add_special_tokens=False)
    masked, _, failed = matchers.fill([(0, "r", grammar, [5, 7, end, *yes], end)], 1)
    assert masked == [0] and not failed  # only EOS left


def test_prompt_decides_whether_thinking_is_over():
    from perfxlm.entrypoints.openai.serving_base import ServerContext
    from perfxlm.entrypoints.openai.serving_chat import _thinking_end

    ctx = ServerContext(None, "m", 100, None, reasoning_token_ids=(10, 11))
    assert _thinking_end(ctx, [1, 2, 3]) == 11  # the model will think first
    assert _thinking_end(ctx, [1, 10, 4]) == 11  # the template opened <think>
    assert _thinking_end(ctx, [1, 10, 11, 4]) is None  # enable_thinking=False: an empty, closed block
    assert _thinking_end(ServerContext(None, "m", 100, None), [1]) is None  # no single-token tags


def test_compiled_grammar_pickles_for_worker_processes(llm):
    """Tensor-parallel workers receive requests pickled: the compiled grammar travels as JSON."""
    import pickle

    import xgrammar as xgr

    params = SamplingParams(structured_outputs=S(regex="[0-9]+"))
    params._grammar = llm.llm_engine.input_processor.compile_structured_outputs(params)
    copy = pickle.loads(pickle.dumps(params.clone()))
    matcher = xgr.GrammarMatcher(copy._grammar.value)
    assert matcher.accept_string("123") and not matcher.accept_string("a")
