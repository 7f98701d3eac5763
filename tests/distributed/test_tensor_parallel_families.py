"""Tensor parallelism for the families whose layers are not Llama's: gpt-oss (sinks, alternating windows,
biased MXFP4 experts) and DeepSeek (multi-head latent attention, shared and routed experts). Two ranks of
one core each give one process's greedy float32 output token for token."""

from __future__ import annotations

import pytest

from tests.distributed.test_tensor_parallel import _children_gone, _run

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_thread")]


def test_gpt_oss_mxfp4_tp2_equals_one_process(tmp_path, monkeypatch):
    """9 query heads over 3 KV heads split 6 + 3 (their sinks with them); the MXFP4 experts' 64
    intermediate columns 32 a rank, cut as codes on whole blocks, biases added once; the windowed and
    full layers as in one process. Decode steps run fused on every rank's shard."""
    from tests.model.test_gpt_oss_mxfp4 import _mxfp4_checkpoint, build_gpt_oss

    monkeypatch.setenv("PERFXLM_QUANT_ACTIVATIONS", "float32")  # both runs multiply the codes in float
    path = str(tmp_path / "gpt-oss-mxfp4")
    _mxfp4_checkpoint(path, build_gpt_oss(seed=3, num_attention_heads=9, num_key_value_heads=3))
    kw = dict(block_size=4, max_num_batched_tokens=16, num_kv_blocks=64)
    ids = _run(path, 2, **kw)[0]
    assert min(_run.fused_steps) > 0 and len(_run.fused_steps) == 2
    assert ids == _run(path, 1, **kw)[0]
    assert _children_gone()


def test_deepseek_v3_mla_tp2_equals_one_process(tmp_path):
    """5 heads split 3 + 2: q_b and kv_b column-parallel by whole heads, o_proj row-parallel over the
    same heads, q_a / kv_a replicated and the latent cached whole on each rank; a dense first layer, then
    23 routed and 23 shared intermediate columns split 12 + 11, the sigmoid grouped router replicated."""
    from tests.model.test_recent_families_vs_hf import build_checkpoint

    path = str(tmp_path / "deepseek-v3")
    build_checkpoint(path, "deepseekv3-noaux-grouped", seed=2, num_attention_heads=5, num_key_value_heads=5,
                     moe_intermediate_size=23)  # fmt: skip
    kw = dict(block_size=4, max_num_batched_tokens=16, num_kv_blocks=64)
    ids = _run(path, 2, **kw)[0]
    assert ids == _run(path, 1, **kw)[0]
    assert len({t for seq in ids for t in seq}) > 4  # random enough that greedy output varies
    assert _children_gone()
