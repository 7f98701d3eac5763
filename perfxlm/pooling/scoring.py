"""Scores of text pairs, as vLLM's `LLM.score` and `/score` compute them: a cross-encoder (a classifier with
one label) reads each pair tokenized together and returns its sigmoid; a bi-encoder embeds both sides
and returns their cosine similarity."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch.nn.functional as F

from perfxlm.outputs import PoolingOutput, PoolingRequestOutput
from perfxlm.pooling.engine import PoolingInput
from perfxlm.pooling_params import PoolingParams


def pair_up(data_1: Any, data_2: Any) -> tuple[list[Any], list[Any]]:
    """vLLM's pairing: one first text against every second text, or the two lists side by side."""
    first = [data_1] if isinstance(data_1, (str, dict)) else list(data_1)
    second = [data_2] if isinstance(data_2, (str, dict)) else list(data_2)
    if not first or not second:
        raise ValueError("score needs at least one text on each side.")
    if len(first) == 1:
        first = first * len(second)
    elif len(first) != len(second):
        raise ValueError(f"score pairs texts one to one, or one against many: got {len(first)} and {len(second)}.")
    return first, second


@dataclass
class ScoreJob:
    """The checked inputs of a score call, and how their pooled outputs become one output per pair."""

    inputs: list[PoolingInput]
    finish: Callable[[list[PoolingRequestOutput]], list[PoolingRequestOutput]]


def prepare(engine: Any, request_ids: Sequence[str], data_1: Any, data_2: Any,
            params: PoolingParams | None) -> ScoreJob:
    """Check and tokenize every pair (ValueError before anything runs)."""
    first, second = pair_up(data_1, data_2)
    if len(request_ids) != len(first):
        raise ValueError("one request id per pair")
    if engine.pooler_config.num_labels:  # tasks() holds "score" only for a one-label classifier
        inputs = [engine.process(rid, a, params, "score", pair=b) for rid, a, b in zip(request_ids, first, second)]
        return ScoreJob(inputs, lambda outs: outs)
    if "score" not in engine.pooler_config.tasks:
        engine.process(request_ids[0], first[0], params, "score")  # raises, naming the tasks it serves
    if params is not None and params.dimensions is not None:
        raise ValueError("dimensions applies to embeddings only, not to scores.")
    embed_params = PoolingParams(truncate_prompt_tokens=params.truncate_prompt_tokens if params else None)
    inputs = [engine.process(f"{i}", t, embed_params, "embed") for i, t in enumerate(first + second)]
    n = len(first)

    def cosines(embedded: list[PoolingRequestOutput]) -> list[PoolingRequestOutput]:
        outs = []
        for i, rid in enumerate(request_ids):
            a, b = embedded[i], embedded[n + i]
            value = F.cosine_similarity(a.outputs.data[None], b.outputs.data[None], dim=-1)
            outs.append(PoolingRequestOutput(rid, PoolingOutput(value), a.prompt_token_ids + b.prompt_token_ids))
        return outs

    return ScoreJob(inputs, cosines)


def score(engine: Any, request_ids: Sequence[str], data_1: Any, data_2: Any, params: PoolingParams | None,
          on_batch: Callable[[int], None] | None = None) -> list[PoolingRequestOutput]:
    """One output per pair, its data a one-value tensor (the score)."""
    job = prepare(engine, request_ids, data_1, data_2, params)
    return job.finish(engine.run(job.inputs, on_batch))
