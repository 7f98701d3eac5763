"""GPTQ act-order checkpoints (4- and 8-bit, every projection's input in its own order: q|k|v and gate|up
each share their input's, as GPTQ derives it from that input) on the engine's fast paths: the fused decode
layer takes them and gives the module path's tokens and logprobs, both transformers' on the dequantized
weights (float32, token-exact); under int8 activation blocks and the int8 GEMM (prefill past the GEMV's
rows, batched decode past the plan's GEMM rows) fused and module decode still agree; a request alone
decodes as it does in a batch. The products themselves: tests/unit/test_act_order_products.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from perfxlm import SamplingParams
from perfxlm.model.fused_decode import FusedDecode
from perfxlm.ops import cpu_plan, native
from tests.model.test_architectures_vs_hf import hf_greedy_with_logprobs
from tests.quant.packed_checkpoints import write_packed
from tests.quant.test_prequantized import PROMPTS, engine, fused_decode_of, make_gptq, model_of, projections, tiny_llama

pytestmark = pytest.mark.skipif(native.kernels() is None, reason="no compiler for the native kernels")

CHECKPOINTS = {
    "gptq-4bit-g32-sym-act-order": lambda: make_gptq(4, 32, act_order=True, seed=3),
    "gptq-8bit-g32-asym-act-order": lambda: make_gptq(8, 32, sym=False, act_order=True, seed=4),
}
NEW_TOKENS = 10


@pytest.fixture(autouse=True)
def _one_thread_plan_restored(monkeypatch):
    monkeypatch.setenv("PERFXLM_QUANT_ACTIVATIONS", "float32")  # auto's choice, where a test does not name one
    monkeypatch.setenv("PERFXLM_PACKED_LM_HEAD", "float")  # the float head transformers' reference reads
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    cpu_plan.reset()
    yield
    cpu_plan.reset()
    torch.set_num_threads(n)


def llama_in_64s():
    """Inputs of 128 and 192 (multiples of 64: every product takes int8 activation blocks natively, which
    the fused layer needs under quant_activations='int8'), 4 heads on 2 KV."""
    torch.manual_seed(2)
    config = transformers.LlamaConfig(
        vocab_size=1000, hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, initializer_range=0.15,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (folder, transformers on the dequantized weights), for the odd-sized model and the one in 64s."""
    root = tmp_path_factory.mktemp("act-order")
    paths = {}
    for name, make in CHECKPOINTS.items():
        for shape, build in (("", tiny_llama), ("-64s", llama_in_64s)):
            parts, qconfig = make()
            hf = build()
            write_packed(str(root / (name + shape)), hf, parts, qconfig)
            paths[name + shape] = (str(root / (name + shape)), hf)
    return paths


def _run(llm, fused: bool, prompts=PROMPTS):
    """Greedy tokens and chosen logprobs of `prompts` as one batch, and the steps the fused layer ran."""
    before = fused_decode_of(llm).steps
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    with pytest.MonkeyPatch.context() as mp:
        if not fused:  # the module path
            mp.setattr(FusedDecode, "applies", lambda self, x, meta: False)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
    return tokens, logprobs, fused_decode_of(llm).steps - before


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_fused_decode_takes_act_order_as_the_module_path_and_transformers(checkpoints, name):
    path, hf = checkpoints[name]
    llm = engine(path)
    orders = {n: w.input_order for n, w in projections(model_of(llm)).items()}
    assert all(o is not None for o in orders.values())
    layer0 = [orders[f"model.layers.0.{p}"] for p in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj")]
    assert not torch.equal(layer0[0], layer0[1]) and not torch.equal(layer0[0], layer0[2])  # orders of their own
    fused_tokens, fused_lp, steps = _run(llm, fused=True)
    assert steps >= NEW_TOKENS - 1 and fused_decode_of(llm).eligible
    plain_tokens, plain_lp, none = _run(llm, fused=False)
    assert none == 0
    assert fused_tokens == plain_tokens
    np.testing.assert_allclose(fused_lp, plain_lp, atol=1e-5, rtol=0)
    for prompt, got, got_lp in zip(PROMPTS, fused_tokens, fused_lp):
        want, want_lp = hf_greedy_with_logprobs(hf, prompt, NEW_TOKENS)
        assert got == want
        np.testing.assert_allclose(got_lp, want_lp, atol=2e-4, rtol=0)


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_int8_blocks_and_the_int8_gemm_fused_as_module(checkpoints, name):
    """quant_activations='int8' with the int8 GEMM from 2 rows: the 41-token prefill and the batch's decode
    steps run the GEMM on gathered rows, one-row steps the block GEMV; fused and module decode the same."""
    path, _ = checkpoints[name + "-64s"]
    cpu_plan.use(quant_gemm="int8", quant_gemm_rows=2, quant_max_rows=4, quant_block_max_rows=-1)
    llm = engine(path, quant_activations="int8")
    fused_tokens, fused_lp, steps = _run(llm, fused=True)
    assert steps >= NEW_TOKENS - 1
    plain_tokens, plain_lp, _ = _run(llm, fused=False)
    assert fused_tokens == plain_tokens
    np.testing.assert_allclose(fused_lp, plain_lp, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_a_request_alone_decodes_as_in_a_batch(checkpoints, name):
    path, _ = checkpoints[name]
    llm = engine(path)
    batch_tokens, batch_lp, _ = _run(llm, fused=True)
    for i, prompt in enumerate(PROMPTS):
        tokens, lp, steps = _run(llm, fused=True, prompts=[prompt])
        assert steps >= NEW_TOKENS - 1
        assert tokens[0] == batch_tokens[i]
        np.testing.assert_allclose(lp[0], batch_lp[i], atol=1e-5, rtol=0)
