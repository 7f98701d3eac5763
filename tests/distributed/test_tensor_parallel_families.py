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
