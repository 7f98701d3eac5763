"""The Triton GGUF matmul against gguf's own dequantizer followed by a float matmul."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from perfxlm.ops.gpu.gguf_matmul import gguf_matmul


def _packed(out_features: int, in_features: int, qtype: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((out_features, in_features)).astype(np.float32)
    kind = getattr(GGMLQuantizationType, qtype)
    packed = quants.quantize(w, kind)  # [N, K / 32 * block_bytes] uint8
    dense = quants.dequantize(packed, kind)  # what the file's values are
    return torch.from_numpy(packed.copy()), torch.from_numpy(dense.copy()).float()


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
@pytest.mark.parametrize("rows,out_features,in_features", [(1, 70, 96), (5, 33, 64), (19, 130, 160)])
def test_matches_dequantized_matmul(device, qtype, rows, out_features, in_features):
    packed, dense = _packed(out_features, in_features, qtype, seed=rows)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    got = gguf_matmul(x.to(device), packed.to(device), qtype).cpu()
    torch.testing.assert_close(got, x @ dense.T, atol=1e-4, rtol=1e-4)


def test_leading_dims_and_half_input(device):
    packed, dense = _packed(48, 64, "Q4_0", seed=3)
    x = torch.randn(2, 3, 64)
    got = gguf_matmul(x.to(device).to(torch.float16), packed.to(device), "Q4_0").cpu()
    assert got.shape == (2, 3, 48) and got.dtype == torch.float16
    torch.testing.assert_close(got.float(), x.half().float() @ dense.T, atol=2e-2, rtol=2e-2)


def test_bad_input_is_named(device):
    packed, _ = _packed(8, 64, "Q8_0", seed=0)
    with pytest.raises(ValueError, match="Q5_K"):
        gguf_matmul(torch.randn(1, 64), packed, "Q5_K")
    with pytest.raises(ValueError, match="do not hold 96 inputs"):
        gguf_matmul(torch.randn(1, 96), packed, "Q8_0")
    with pytest.raises(ValueError, match="2-D uint8"):
        gguf_matmul(torch.randn(1, 64), packed.float(), "Q8_0")
