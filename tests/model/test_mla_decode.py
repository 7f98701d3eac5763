"""DeepSeek's decode steps through the latent decode kernel (ops/mla.py, one call per layer): the kernel is
the path the engine takes, and greedy float32 output stays token-identical with transformers."""

from __future__ import annotations

import pytest

from perfxlm.model.layers import attention_backend
from perfxlm.ops import native
from tests.model.test_architectures_vs_hf import assert_greedy_matches
from tests.model.test_recent_families_vs_hf import build_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("case", ["deepseekv2-lite-yarn", "deepseekv3-noaux-grouped"])
def test_decode_steps_run_the_latent_kernel(tmp_path, monkeypatch, case):
    if native.kernels() is None:
        pytest.skip("no compiler for the native kernels")
    calls = []
    kernel = attention_backend.mla_decode_attention

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return kernel(*args, **kwargs)

    monkeypatch.setattr(attention_backend, "mla_decode_attention", counted)
    path = str(tmp_path / case)
    assert_greedy_matches(path, build_checkpoint(path, case))
    assert calls and max(calls) > 1  # decode steps, batched rows among them
