"""vLLM's pooling methods of `LLM` (embed, classify, score, encode, reward), for an LLM built with the
pooling runner. `LLM` inherits them; they drive its `PoolingEngine`."""

from __future__ import annotations

from typing import Any, Sequence

from tqdm import tqdm

from perfxlm.outputs import (
    ClassificationRequestOutput, EmbeddingRequestOutput, PoolingRequestOutput, ScoringRequestOutput,
)
from perfxlm.pooling import scoring
from perfxlm.pooling_params import PoolingParams


class PoolingMethods:
    runner_kind: str
    llm_engine: Any

    def _require_runner(self, runner: str, method: str) -> None:
        if self.runner_kind != runner:
            hint = ("an embedding or classification model: load it with runner='pooling' (or task='embed')"
                    if runner == "pooling" else "a generative model loaded with runner='generate'")
            raise ValueError(f"LLM.{method}() needs {hint}; this LLM runs the {self.runner_kind!r} runner.")

    def _ids(self, n: int) -> list[str]:
        return [str(next(self._counter)) for _ in range(n)]  # type: ignore[attr-defined]

    def _pool(self, method: str, prompts: Any, params: Any, task: str, use_tqdm: bool,
              truncate_prompt_tokens: int | None = None) -> list[PoolingRequestOutput]:
        self._require_runner("pooling", method)
        engine = self.llm_engine
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        if not prompts:
            raise ValueError(f"LLM.{method}() got no inputs.")
        params_list = _params_list(params, len(prompts), truncate_prompt_tokens)
        inputs = [engine.process(rid, p, q, task) for rid, p, q in zip(self._ids(len(prompts)), prompts, params_list)]
        with tqdm(total=len(inputs), desc=f"Processed prompts ({method})", disable=not use_tqdm) as bar:
            return engine.run(inputs, bar.update)

    def embed(self, prompts: Any, truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              lora_request: Any = None) -> list[EmbeddingRequestOutput]:
        _no_lora(lora_request)
        outs = self._pool("embed", prompts, pooling_params, "embed", use_tqdm, truncate_prompt_tokens)
        return [EmbeddingRequestOutput.from_base(o) for o in outs]

    def classify(self, prompts: Any, use_tqdm: bool = True,
                 pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
                 lora_request: Any = None) -> list[ClassificationRequestOutput]:
        _no_lora(lora_request)
        outs = self._pool("classify", prompts, pooling_params, "classify", use_tqdm)
        return [ClassificationRequestOutput.from_base(o) for o in outs]

    def encode(self, prompts: Any, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
               use_tqdm: bool = True, lora_request: Any = None, pooling_task: str | None = None,
               truncate_prompt_tokens: int | None = None) -> list[PoolingRequestOutput]:
        """The pooled tensors themselves; `pooling_task` as vLLM names it ("embed", "classify",
        "token_embed", "reward"; default: the model's own, embed or classify)."""
        _no_lora(lora_request)
        self._require_runner("pooling", "encode")
        task = pooling_task or ("classify" if self.llm_engine.pooler_config.num_labels else "embed")
        return self._pool("encode", prompts, pooling_params, task, use_tqdm, truncate_prompt_tokens)

    def reward(self, prompts: Any, use_tqdm: bool = True,
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
               lora_request: Any = None) -> list[PoolingRequestOutput]:
        """Per-token hidden states (vLLM's reward pooling: ALL)."""
        _no_lora(lora_request)
        return self._pool("reward", prompts, pooling_params, "reward", use_tqdm)

    def score(self, data_1: Any, data_2: Any, truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              pooling_params: PoolingParams | None = None, lora_request: Any = None) -> list[ScoringRequestOutput]:
        """One score per pair: a cross-encoder's sigmoid relevance, or a bi-encoder's cosine similarity."""
        _no_lora(lora_request)
        self._require_runner("pooling", "score")
        params = _params_list(pooling_params, 1, truncate_prompt_tokens)[0]
        first, _ = scoring.pair_up(data_1, data_2)
        with tqdm(total=len(first), desc="Processed prompts (score)", disable=not use_tqdm) as bar:
            outs = scoring.score(self.llm_engine, self._ids(len(first)), data_1, data_2, params, bar.update)
        return [ScoringRequestOutput.from_base(o) for o in outs]


def _params_list(params: Any, n: int, truncate_prompt_tokens: int | None) -> list[PoolingParams]:
    if params is None:
        params = PoolingParams()
    if isinstance(params, PoolingParams):
        params_list = [params] * n
    elif isinstance(params, (list, tuple)):
        params_list = list(params)
        if len(params_list) != n:
            raise ValueError(f"Got {len(params_list)} PoolingParams for {n} inputs: give one, or one per input.")
    else:
        raise ValueError(f"pooling_params must be a PoolingParams (or a list of them), got {type(params).__name__}.")
    if truncate_prompt_tokens is not None:
        params_list = [_with_truncation(p, truncate_prompt_tokens) for p in params_list]
    return params_list


def _with_truncation(params: Any, limit: int) -> PoolingParams:
    if not isinstance(params, PoolingParams):
        raise ValueError(f"pooling_params must be a PoolingParams, got {type(params).__name__}.")
    out = params.clone()
    out.truncate_prompt_tokens = limit
    out.__post_init__()  # checks the value
    return out


def _no_lora(lora_request: Any) -> None:
    if lora_request is not None:
        raise ValueError("lora_request: LoRA adapters are not supported by perfxlm; merge the adapter into the "
                         "weights (peft's merge_and_unload) and load the merged model.")
