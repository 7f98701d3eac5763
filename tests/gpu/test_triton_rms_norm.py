"""The Triton RMSNorm for 16-bit activations against the torch path it replaces on a GPU (the same
rounding steps; only the order of the float32 sum of squares differs), with and without the residual."""

from __future__ import annotations

import pytest
import torch

from perfxlm.model.layers.norm import RMSNorm
from perfxlm.ops.gpu.rms_norm import KERNELS


@pytest.mark.parametrize("hidden", [96, 200])
def test_norm_and_fused_add_match_the_torch_path(device, hidden):
    dtype = torch.float16 if device == "cpu" else torch.bfloat16  # the interpreter's numpy has no bfloat16
    g = torch.Generator().manual_seed(hidden)
    norm = RMSNorm(hidden, eps=1e-5)
    norm.weight.data = (1 + 0.3 * torch.randn(hidden, generator=g)).to(dtype)
    x = (3 * torch.randn(7, hidden, generator=g)).to(dtype)
    residual = torch.randn(7, hidden, generator=g).to(dtype)
    want = norm._norm(x)
    want_sum = x + residual
    want_fused = norm._norm(want_sum)
    x, residual, weight = x.to(device), residual.to(device), norm.weight.data.to(device)
    got = KERNELS.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(got.cpu(), want, atol=0, rtol=1e-2)
    assert (got.cpu() == want).float().mean() > 0.97  # equal but for a last-bit rounding here and there
    KERNELS.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(residual.cpu(), want_sum)  # the residual sum is rounded exactly as torch rounds it
    torch.testing.assert_close(x.cpu(), want_fused, atol=0, rtol=1e-2)
