"""Expert stacks in row groups in the engine: a Qwen3-MoE GGUF file (benchmarks/make_dummy_gguf.py's body,
its matrices and expert stacks in Q8_0 / Q4_0) loads with its stacks in row groups under
PERFXLM_ROW_INTERLEAVE=8 and plain under 0, and both give the same greedy text (prefill experts on the
int8 GEMM reading the groups, decode on the row-group GEMV over runs of an expert's rows; a request alone
and in a batch); an export writes the stacks' plain layout."""

from __future__ import annotations

import pytest

from perfxlm import LLM, SamplingParams
from perfxlm.model.layers.moe import FusedMoE
from perfxlm.ops import native
from perfxlm.quant.layouts import CodeLayout
from tests.conftest import default_model_or_skip
from tests.model.dummy_gguf import converter

pytestmark = pytest.mark.skipif(native.kernels() is None, reason="no compiler for the native kernels")

# the expert width 96: three 32-blocks (an odd block count) for down's inputs, 12 groups of gate|up rows
SHAPES = dict(hidden=64, layers=2, intermediate=96, heads=4, kv_heads=2, context=256, rope_theta=1e6,
              experts=6, experts_used=2, head_dim=16)
# Between the layouts a product differs in its last bits (a row's blocks summed in another order); where
# that moves a later activation across an int8 rounding boundary, a logprob moves by a step's worth
RELAXED = 3e-2
PROMPTS = [[11, 12, 13, 14, 15, 16, 17] * 9, [7, 300, 8, 301, 9] * 3, list(range(40, 97))]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    donor = default_model_or_skip()
    root = tmp_path_factory.mktemp("moe_rg")
    out = {}
    for qtype in ("Q8_0", "Q4_0"):
        out[qtype] = str(root / f"moe.{qtype.lower()}.gguf")
        converter().write_dummy(out[qtype], donor, seed=3, quant_type=qtype, **SHAPES)
    return out


def _stack_layouts(llm) -> set[CodeLayout]:
    moes = [m for m in llm.llm_engine.core.model.modules() if isinstance(m, FusedMoE)]
    assert moes
    return {w.layout for m in moes for w in (m.gate_up_proj, m.down_proj)}


def _greedy(llm, prompts):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_row_group_stacks_give_the_plain_stacks_greedy_text(files, interleave, qtype):
    runs = {}
    for value in (0, 8):
        interleave(value)
        llm = LLM(files[qtype], skip_tokenizer_init=True, dtype="float32", kv_cache_gib=0.05,
                  quant_activations="int8")
        assert _stack_layouts(llm) == ({CodeLayout.ROWS8} if value else {CodeLayout.PLAIN})
        if value:  # an export writes the stacks' plain layout, the same values
            from perfxlm.export.decoder import _array

            for m in llm.llm_engine.core.model.modules():
                if isinstance(m, FusedMoE):
                    written = _array(m.down_proj)
                    assert written.layout is CodeLayout.PLAIN and written.dequantize().equal(m.down_proj.dequantize())
        batch = _greedy(llm, PROMPTS)
        alone = [_greedy(llm, [p])[0] for p in PROMPTS]
        for (ta, la), (tb, lb) in zip(alone, batch):  # a request alone is what it is in the batch
            assert ta == tb
            assert la == pytest.approx(lb, abs=1e-4)
        runs[value] = batch
    for (ta, la), (tb, lb) in zip(runs[0], runs[8]):
        assert ta == tb
        assert la == pytest.approx(lb, abs=RELAXED)
