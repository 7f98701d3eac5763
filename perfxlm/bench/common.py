"""Helpers shared by the engine benchmarks: building the LLM, writing results."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from typing import Any


def make_llm(engine_kwargs: dict[str, Any], skip_tokenizer_init: bool = False,
             log: Callable[[str], None] | None = print) -> Any:
    """An LLM from the CLI's engine kwargs. A model folder without a tokenizer still benchmarks on
    token ids: the tokenizer is skipped (and so is detokenization), with a note."""
    from perfxlm import LLM

    kwargs = dict(engine_kwargs)
    model = kwargs.pop("model", None)
    try:
        return LLM(model, skip_tokenizer_init=skip_tokenizer_init, **kwargs)
    except ValueError as exc:
        if skip_tokenizer_init or "Could not load a tokenizer" not in str(exc):
            raise
        if log is not None:
            log("note: the model has no tokenizer; benchmarking on token ids without detokenization.")
        return LLM(model, skip_tokenizer_init=True, **kwargs)


def size_engine_for_batch(engine_kwargs: dict[str, Any], batch_size: int, input_len: int,
                          output_len: int) -> dict[str, Any]:
    """Engine settings that run one batch as the latency benchmark means it: all B prompts prefilled
    in one step, B seats, and (unless the user sized it) a KV pool of just what the batch needs,
    so that the memory figure is the batch's and not a default pool's."""
    kwargs = dict(engine_kwargs)
    kwargs["max_num_seqs"] = max(kwargs.get("max_num_seqs") or 0, batch_size)
    if kwargs.get("max_num_batched_tokens") is None:
        kwargs["max_num_batched_tokens"] = max(batch_size * input_len, 2048)
    if kwargs.get("kv_cache_gib") is None and kwargs.get("num_kv_blocks") is None:
        block = kwargs.get("block_size") or 16
        kwargs["num_kv_blocks"] = batch_size * (math.ceil((input_len + output_len) / block) + 1)
    return kwargs


def write_json(path: str, payload: dict[str, Any]) -> str:
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=_json_default)
        f.write("\n")
    return path


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "item"):  # numpy / torch scalars
        return obj.item()
    if hasattr(obj, "tolist"):
        return obj.tolist()
    return str(obj)


def sibling_path(path: str | None, ext: str) -> str | None:
    """`results.json` -> `results.png`: where a figure or table goes when only --output-json is given."""
    if not path:
        return None
    root, _ = os.path.splitext(path)
    return root + ext
