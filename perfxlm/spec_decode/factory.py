"""The proposer a SpeculativeConfig names."""

from __future__ import annotations

from typing import Any

from perfxlm.spec_decode.proposer import Proposer


def make_proposer(spec: Any, target_config: Any, num_kv_blocks: int) -> Proposer:
    """`spec`: a SpeculativeConfig; `target_config`: the engine's EngineConfig (dtype, block size, seed);
    `num_kv_blocks`: the target's KV pool, which a draft model's own pool matches in tokens."""
    if spec.method == "ngram":
        from perfxlm.spec_decode.ngram import NgramProposer

        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    from perfxlm.spec_decode.draft_model import DraftModelProposer

    return DraftModelProposer(spec, target_config, num_kv_blocks)
