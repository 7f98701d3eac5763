"""Speculative decoding with quantized weights: a verification step's rows compute, bit for bit, what the
one-row decode steps they stand for compute (the same product kernels, attention cut into the same ranges
whatever the batch), so greedy tokens AND their logprobs equal decoding without speculation exactly, for
several requests in one batch, on the default model's GGUF file and on Q4_0 / Q8_0 / int4 weights."""

import gguf
import pytest

from perfxlm import LLM, SamplingParams
from perfxlm.spec_decode import ngram
from tests.conftest import assert_pool_whole, make_llama_checkpoint

NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
# Past 128 tokens of context the decode attention cuts a sequence into ranges; a verification step has
# k + 1 rows of one sequence, so these lengths are where a batch-dependent cut would show.
TOKEN_PROMPTS = [
    [11, 12, 13, 14, 15, 16, 17] * 23 + [11, 12],
    [7, 300, 8, 301, 9] * 31 + [7, 300],
    list(range(40, 173)) + list(range(40, 61)),
]


def _runs(path: str, prompts, params, oracle: bool = False, **kwargs):
    """Outputs without and with speculation, every prompt in one batch; asserts the pools are whole.
    `oracle`: the guesses are the plain run's own tokens, every third proposal's last one wrong (a random
    model's output does not copy its prompt, so prompt lookup would rarely be accepted)."""
    from tests.engine.test_spec_decode import _Oracle

    outs = []
    for spec in (None, NGRAM):
        llm = LLM(path, speculative_config=spec, kv_cache_gib=0.05, **kwargs)
        if spec is not None and oracle:
            llm.llm_engine.core.proposer = _Oracle(
                {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in outs[0]}, wrong=3)
        outs.append(llm.generate(prompts, params, use_tqdm=False))
        assert_pool_whole(llm)
        if spec is not None:
            stats = llm.llm_engine.scheduler.spec_stats
            assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens > stats.num_accepted_tokens
    return outs


def _identical(plain, spec):
    for a, b in zip(plain, spec):
        x, y = a.outputs[0], b.outputs[0]
        assert x.token_ids == y.token_ids, (a.prompt_token_ids[-8:], x.token_ids, y.token_ids)
        # the logprobs too, bit for bit: a near-tie would not hide a row computed another way
        assert [lp[t].logprob for lp, t in zip(x.logprobs, x.token_ids)] == \
            [lp[t].logprob for lp, t in zip(y.logprobs, y.token_ids)]  # fmt: skip


def test_default_model_gguf(default_model):
    """Its Q4_1 and Q8_0 tensors as a bfloat16 model runs them (int8 activation blocks); the random models
    below take float activations too."""
    with open(ngram.__file__, encoding="utf-8") as f:
        code = f.read()[-700:]
    prompts = [f"Repeat this code exactly:\n{code}\nRepeated:\n",
               "Count: one two three four five six seven, one two three four five six seven, one two three four five "
               + "six seven, one two three four five six seven, one two three four five six seven, one two"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    _identical(*_runs(default_model, prompts, params, dtype="bfloat16"))


@pytest.fixture(scope="module")
def llama_odd(tmp_path_factory) -> str:
    return make_llama_checkpoint(str(tmp_path_factory.mktemp("llama_odd")), hidden_size=128, intermediate_size=320,
                                 num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)  # fmt: skip


# (weights, activations): 4-bit and 8-bit codes, each product kind (int8 activation blocks, float ones)
@pytest.mark.parametrize("weights,activations", [("q4_0", "int8"), ("q8_0", "int8"), ("q8_0", "float32"),
                                                 ("int4", "float32")])  # fmt: skip
def test_random_model_quantized(llama_odd, tmp_path, weights, activations, monkeypatch):
    from tests.quant.test_quant_engine import write_quantized_llama_gguf

    monkeypatch.setenv("PERFXLM_QUANT_ACTIVATIONS", activations)
    Q = gguf.GGMLQuantizationType
    parts = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    path, kwargs = llama_odd, {"quantization": "int4"}
    if weights != "int4":
        path, kwargs = str(tmp_path / f"{weights}.gguf"), {}
        qtype = Q.Q4_0 if weights == "q4_0" else Q.Q8_0
        write_quantized_llama_gguf(path, llama_odd, {**{p: qtype for p in parts}, "token_embd": Q.Q8_0})
    params = SamplingParams(temperature=0, max_tokens=29, ignore_eos=True, logprobs=1)
    prompts = [{"prompt_token_ids": p} for p in TOKEN_PROMPTS]
    _identical(*_runs(path, prompts, params, oracle=True, skip_tokenizer_init=True, dtype="float32", **kwargs))
