"""Quantized forms beyond the affine codes in the `ort` / `standard` flavors, run in ONNX Runtime against
the engine on the same weights: gpt-oss with MXFP4 experts (E2M1 codes, an E8M0 exponent per 32 weights;
the ort flavor writes each as two 4-bit MatMulNBits whose products add up, the E2M1 value doubled clamped
to [-8, 7] and the rest, the exponent as the blocks' scale: the same values), from OpenAI's checkpoint
layout; and a GPTQ act-order checkpoint, whose codes' columns are input channels in another order
(MatMulNBits after a Gather of the inputs; float matrices with the columns put back in the standard flavor). Float32 logits of a prompt and 16 decode steps
within 1e-4 of transformers' on the values the weights hold, greedy tokens and logprobs the engine's."""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
import torch

from perfxlm import LLM, SamplingParams
from perfxlm.export.package import export_onnx
from tests.export.onnx_helpers import ort_greedy

STEPS = 16
PROMPT = [int(t) for t in np.random.RandomState(11).randint(3, 990, size=19)]  # past gpt-oss's window of 7

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _float_tables(monkeypatch):
    """The checkpoints' float embedding and LM head kept float, as transformers' reference reads them."""
    monkeypatch.setenv("PERFXLM_PACKED_LM_HEAD", "float")


def _engine_greedy(source: str) -> tuple[list[int], list[float]]:
    llm = LLM(source, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=32, quant_activations="float32")
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=0)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0]
    return list(out.token_ids), [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)]


def _assert_runs_as_the_engine(out: str, source: str, hf) -> None:
    def reference(ids):
        with torch.no_grad():
            return hf(torch.tensor([ids])).logits[0].numpy()

    tokens, logprobs, diffs = ort_greedy(out, PROMPT, STEPS, reference)
    assert len(diffs) == STEPS + 1 and max(diffs) < 1e-4, diffs
    want_tokens, want_logprobs = _engine_greedy(source)
    assert tokens == want_tokens and len(set(tokens)) >= 3
    np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-4, rtol=0)


def _nodes(out: str) -> list:
    return list(onnx.load(os.path.join(out, "model.onnx"), load_external_data=False).graph.node)


@pytest.mark.parametrize("flavor", ["ort", "standard"])
def test_gpt_oss_mxfp4_experts_run_in_onnx_runtime_as_the_engine(tmp_path, flavor):
    """(A GGUF file's MXFP4 stacks load to the same form, `quant/mxfp4.py`: its nibble order is the one
    the engine keeps.)"""
    from tests.model.test_gpt_oss_mxfp4 import _mxfp4_checkpoint, build_gpt_oss

    hf = build_gpt_oss(seed=1)  # heads of 24 channels: ONNX Runtime's GroupQueryAttention takes them
    path = str(tmp_path / "gpt-oss-mxfp4")
    hf.load_state_dict(_mxfp4_checkpoint(path, hf), strict=False)  # the values the checkpoint holds
    out = str(tmp_path / "onnx")
    export_onnx(path, out, flavor=flavor)
    nodes = _nodes(out)
    experts = [n for n in nodes if ".experts." in n.name and n.name.endswith("_proj")]
    assert len(experts) == 3 * 5 * 2  # three layers, five experts, gate|up and down
    if flavor == "ort":  # codes: two 4-bit MatMulNBits (levels clamped to [-8, 7], the rest), blocks of 32
        high = [n for n in nodes if ".experts." in n.name and n.name.endswith("_proj.part1")]
        assert len(high) == len(experts) and {n.op_type for n in experts + high} == {"MatMulNBits"}
        attrs = {(a.name, a.i) for n in experts + high for a in n.attribute if a.name in ("bits", "block_size")}
        assert attrs == {("bits", 4), ("block_size", 32)}
    else:
        assert {n.op_type for n in experts} == {"Gemm"}
    _assert_runs_as_the_engine(out, path, hf)


@pytest.mark.parametrize("flavor", ["ort", "standard"])
def test_act_order_gptq_runs_in_onnx_runtime_as_the_engine(tmp_path, flavor):
    from tests.quant.packed_checkpoints import write_packed
    from tests.quant.test_prequantized import PACKED, tiny_llama

    make_parts, qconfig, _ = PACKED["gptq-4bit-g32-sym-act-order"]
    path = str(tmp_path / "gptq")
    hf = tiny_llama()
    write_packed(path, hf, make_parts, qconfig)  # hf then holds the dequantized weights
    out = str(tmp_path / "onnx")
    export_onnx(path, out, flavor=flavor)
    qkv = next(n for n in _nodes(out) if n.name == "model.layers.0.self_attn.qkv_proj")
    if flavor == "ort":  # the codes as stored, the inputs gathered into their order
        assert qkv.op_type == "MatMulNBits"
    _assert_runs_as_the_engine(out, path, hf)
