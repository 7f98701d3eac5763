"""The grouped mixture-of-experts computation against the token-by-token reference."""

import pytest
import torch

from perfxlm.model.layers.moe import FusedMoE
from perfxlm.ops.reference import moe_reference


@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 4, 2), (37, 5, 2), (64, 8, 3), (9, 3, 3)])
@pytest.mark.parametrize("renormalize", [False, True])
def test_grouped_experts_match_reference(num_tokens, num_experts, top_k, renormalize):
    torch.manual_seed(num_tokens)
    hidden, inter = 24, 40
    moe = FusedMoE(num_experts, top_k, hidden, inter, renormalize)
    with torch.no_grad():
        moe.gate_up_proj.normal_(0, 0.2)
        moe.down_proj.normal_(0, 0.2)
    x = torch.randn(num_tokens, hidden)
    logits = torch.randn(num_tokens, num_experts) * 2
    out = moe(x, logits)
    ref = moe_reference(x, logits, moe.gate_up_proj, moe.down_proj, top_k, renormalize)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_per_expert_shards_load_into_stacked_parameters():
    moe = FusedMoE(3, 2, 4, 5, renormalize=True)
    gate, up, down = torch.randn(5, 4), torch.randn(5, 4), torch.randn(4, 5)
    moe.load_shard(moe.gate_up_proj, gate, "gate", expert=2)
    moe.load_shard(moe.gate_up_proj, up, "up", expert=2)
    moe.load_shard(moe.down_proj, down, "down", expert=2)
    assert torch.equal(moe.gate_up_proj[2], torch.cat([gate, up]))
    assert torch.equal(moe.down_proj[2], down)
    assert moe.expected_shards("gate_up_proj") == ["0.gate", "0.up", "1.gate", "1.up", "2.gate", "2.up"]
    with pytest.raises(ValueError, match="expert index 3 out of range"):
        moe.load_shard(moe.down_proj, down, "down", expert=3)
    with pytest.raises(ValueError, match="checkpoint shape"):
        moe.load_shard(moe.down_proj, down.T, "down", expert=0)
