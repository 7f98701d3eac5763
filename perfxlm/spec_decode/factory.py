"""The proposer a SpeculativeConfig names."""

from __future__ import annotations

from typing import Any

from perfxlm.spec_decode.proposer import Proposer


def make_proposer(spec: Any, target_config: Any, num_kv_blocks: int, target_model: Any = None) -> Proposer:
    """`spec`: a SpeculativeConfig; `target_config`: the engine's EngineConfig (dtype, block size, seed);
    `num_kv_blocks`: the target's KV pool, which a draft model's or MTP layer's own pool matches in tokens;
    `target_model`: the target in this process (`mtp` shares its embedding or head where the checkpoint
    leaves them out)."""
    if spec.method == "ngram":
        from perfxlm.spec_decode.ngram import NgramProposer

        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method == "mtp":
        from perfxlm.spec_decode.mtp import MTPProposer

        return MTPProposer(target_config, target_model, num_kv_blocks)
    from perfxlm.spec_decode.draft_model import DraftModelProposer

    return DraftModelProposer(spec, target_config, num_kv_blocks)
