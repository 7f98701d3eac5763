"""Speculative decoding on every family the engine runs: greedy tokens and their logprobs equal decoding
without speculation, where the guesses are accepted in runs and rejected mid-way.

A verification step runs a request's guesses as decode rows of one sequence; each family brings its own
attention (sliding windows, local and global rope bases, soft caps, sinks, latent attention), MLP (routed
experts, shared experts) and norms into those rows. A random-weight model's output does not repeat its
prompt, so prompt lookup would rarely be accepted: the guesses are the plain run's own tokens, every
third proposal's last one wrong (test_spec_decode's oracle).

The tokens are equal everywhere. In bf16 the logprobs are equal bit for bit: every product of a decode
row runs on the engine's own kernels (bf16 rows, GEMVs, the decode attention), which give a row the same
sums alone or among others. In float32 the weights' products are torch's GEMM (MKL / oneDNN), whose sums
for a row depend on how many rows it multiplies (one row, two or three, four or more take different
kernels), so the logprobs are held within 1e-5."""

from __future__ import annotations

import pytest

from perfxlm import LLM, SamplingParams
from tests.conftest import assert_pool_whole
from tests.engine.test_spec_decode import _Oracle
from tests.model import test_architectures_vs_hf as older
from tests.model import test_recent_families_vs_hf as recent

pytestmark = pytest.mark.usefixtures("one_thread", "full_verify_budget")

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
CASES = [("older", c) for c in older.CASES] + [("recent", c) for c in recent.CASES]
# float32 products are torch's GEMM: a few ulps apart by the number of rows (see the docstring)
FLOAT32_ULPS = 1e-5


def _outputs(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]  # fmt: skip


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("module,case", CASES, ids=[c for _, c in CASES])
def test_guesses_verified_as_the_decode_steps_they_stand_for(tmp_path, module, case, dtype):
    path = str(tmp_path / case)
    (older if module == "older" else recent).build_checkpoint(path, case)
    prompts = older._prompts()
    common = dict(skip_tokenizer_init=True, dtype=dtype, num_kv_blocks=64)
    plain = _outputs(LLM(path, **common), prompts)
    llm = LLM(path, speculative_config=SPEC, **common)
    oracle = _Oracle({tuple(p): tokens for p, (tokens, _) in zip(prompts, plain)}, wrong=3)
    llm.llm_engine.core.proposer = oracle
    spec = _outputs(llm, prompts)
    for prompt, (want, want_lp), (got, got_lp) in zip(prompts, plain, spec):
        assert got == want, f"{case}: prompt of {len(prompt)} tokens"
        if dtype == "float32":
            assert max(abs(a - b) for a, b in zip(got_lp, want_lp)) < FLOAT32_ULPS, f"{case}: prompt of {len(prompt)} tokens"
        else:
            assert got_lp == want_lp, f"{case}: prompt of {len(prompt)} tokens: logprobs differ"
    stats = llm.llm_engine.scheduler.spec_stats
    assert oracle.calls > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats.as_dict()
    assert_pool_whole(llm)
