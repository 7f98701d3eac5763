"""The fused all-decode step (one native call per layer) against the module path it replaces."""

import pytest

from perfxlm import LLM, SamplingParams
from perfxlm.model.fused_decode import FusedDecode
from perfxlm.ops import cpu_plan, native

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]


def _run(llm, monkeypatch, fused: bool):
    calls = {"fused": 0}
    original = FusedDecode.run

    def counting(self, *args):
        calls["fused"] += 1
        return original(self, *args)

    monkeypatch.setattr(FusedDecode, "run", counting)
    if not fused:
        monkeypatch.setattr(FusedDecode, "applies", lambda self, x, meta: False)
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=3, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    monkeypatch.undo()
    return outs, calls["fused"]


@pytest.mark.parametrize(
    "dtype, activations",
    [("float32", "auto"), ("bfloat16", "auto"), ("bfloat16", "float32"), ("float32", "int8")],
)
def test_fused_decode_matches_module_path(default_model, monkeypatch, dtype, activations):
    """Under each activation option for the file's Q4_1 / Q8_0 tensors: auto (bfloat16: int8 blocks
    where the build has int8 dots; float32: float), float32 activations, int8 blocks asked explicitly."""
    if native.kernels() is None:
        pytest.skip("native kernels unavailable on this machine")
    if activations == "int8" and not cpu_plan.has_int8_dots():
        pytest.skip("int8 blocks asked on a build without int8 dot products (scalar): the file's row-group "
                    "weights take them and its plain ones cannot, so every step takes the module path")
    llm = LLM(default_model, dtype=dtype, kv_cache_gib=0.5, enable_prefix_caching=False,
              quant_activations=activations)  # fmt: skip
    fused, n_fused = _run(llm, monkeypatch, fused=True)
    plain, n_plain = _run(llm, monkeypatch, fused=False)
    assert n_fused >= 20 and n_plain == 0  # the fused path really ran, and then really did not
    # the same kernels in the same order: equal up to float rounding, in bf16 (weights and KV cache) too
    tol = 1e-5
    for a, b in zip(fused, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys()
            for tok in la:
                assert la[tok].logprob == pytest.approx(lb[tok].logprob, abs=tol)
