"""The pooling runner's attention: sequences of one flattened batch attend to themselves only, equal to one
SDPA per sequence (bidirectional, causal, sliding window, grouped KV heads, odd sizes)."""

import pytest
import torch
import torch.nn.functional as F

from perfxlm.model.forward_context import CachelessBatch
from perfxlm.ops.varlen_attention import varlen_attention


def _reference(q, k, v, lens, scale, causal, window):
    out, start = [], 0
    for n in lens:
        qs, ks, vs = (t[start : start + n].transpose(0, 1) for t in (q, k, v))
        pos = torch.arange(n)
        mask = pos[None, :] <= pos[:, None] if causal else torch.ones(n, n, dtype=torch.bool)
        if window is not None:
            near = (pos[None, :] - pos[:, None]).abs() < window if not causal else pos[None, :] > pos[:, None] - window
            mask &= near
        out.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)
                   .transpose(0, 1))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (True, 3), (False, 3), (False, 9)])
@pytest.mark.parametrize("lens", [[7], [5, 1, 13, 2], [1, 1, 1], [9, 9, 9, 4, 4, 9, 1]])
def test_varlen_equals_one_sdpa_per_sequence(causal, window, lens):
    torch.manual_seed(sum(lens))
    total, heads, kv_heads, dim = sum(lens), 6, 2, 11
    # q, k and v as a fused projection's views (strided rows), as the models pass them
    fused = torch.randn(total, heads + 2 * kv_heads, dim)
    q, k, v = fused.split([heads, kv_heads, kv_heads], dim=1)
    batch = CachelessBatch.of(lens)
    assert sum(count * length for _, count, length in batch.runs) == total
    got = varlen_attention(q, k, v, batch.runs, 0.3, causal, window)
    torch.testing.assert_close(got, _reference(q, k, v, lens, 0.3, causal, window), atol=1e-5, rtol=1e-5)
