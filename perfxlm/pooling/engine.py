"""The pooling engine: requests checked and tokenized at the edge, batched by total tokens (sorted by
length, so a batch's attention pads little), run through the pooling runner, and turned into each task's
output. No scheduler and no KV cache: a pooling request is one forward pass of its whole input."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from perfxlm.config import EngineConfig
from perfxlm.outputs import PoolingOutput, PoolingRequestOutput
from perfxlm.pooling.model_config import PoolerConfig, resolve_pooler_config
from perfxlm.pooling.pooler import classifier_activation, embedding_head, pool
from perfxlm.pooling.runner import PoolingRunner, PoolingSeq
from perfxlm.pooling_params import PoolingParams

# tasks whose output is the classifier's logits (a cross-encoder's score is one)
_LOGIT_TASKS = ("classify", "score")


@dataclass(slots=True)
class PoolingInput:
    """One checked, tokenized request."""

    request_id: str
    seq: PoolingSeq
    task: str
    params: PoolingParams
    pooling_type: str  # what the task pools (per-token tasks: ALL)


class PoolingEngine:
    runner_kind = "pooling"

    def __init__(self, config: EngineConfig) -> None:
        from perfxlm.model.loader import load_model

        self.config = config.resolve(runner_kind="pooling")
        _check_supported(config)
        self.tokenizer = None
        if not config.skip_tokenizer_init:
            from perfxlm.tokenizer import get_tokenizer

            self.tokenizer = get_tokenizer(config.model, config.tokenizer)
        _convert_lm_head(config.hf_config, self.tokenizer)
        self.model = load_model(config)
        self.pooler_config: PoolerConfig = resolve_pooler_config(
            self.model, config.hf_config, config.model, int(config.max_model_len), config.pooler_config,
            self.tokenizer,
        )
        _check_convert(config.convert, self.pooler_config)
        self.max_model_len = self.pooler_config.max_len
        self.vocab_size = int(config.hf_config.vocab_size)
        self.runner = PoolingRunner(self.model)
        self._lock = threading.Lock()  # one forward pass at a time (the server's threads share the engine)

    # ---- requests ------------------------------------------------------------------------
    def process(self, request_id: str, prompt: Any, params: PoolingParams | None, task: str,
                pair: Any = None) -> PoolingInput:
        """Check and tokenize one request (`pair`: the second text of a cross-encoder's pair). ValueError
        naming what to fix."""
        if params is not None and not isinstance(params, PoolingParams):
            raise ValueError(f"pooling_params must be a PoolingParams, got {type(params).__name__}.")
        params = (params or PoolingParams()).clone()
        pc = self.pooler_config
        if task not in pc.tasks:
            kind = "a classifier (cross-encoder)" if pc.num_labels else "an embedding model"
            raise ValueError(
                f"task {task!r} is not served by this model, {kind}; it serves {', '.join(sorted(pc.tasks))}."
            )
        if params.dimensions is not None:
            if task != "embed":
                raise ValueError(f"dimensions applies to embeddings only, not to task {task!r}.")
            pc.check_dimensions(params.dimensions)
        limit = params.truncate_prompt_tokens
        if limit == -1:
            limit = self.max_model_len
        if limit is not None and limit > self.max_model_len:
            raise ValueError(
                f"truncate_prompt_tokens ({limit}) is larger than the model's window ({self.max_model_len})."
            )
        seq = self._tokenize(prompt, pair, limit)
        n = len(seq.token_ids)
        if n == 0:
            raise ValueError("The input is empty: give at least one token.")
        if n > self.max_model_len:
            raise ValueError(
                f"The input has {n} tokens, more than the model's window of {self.max_model_len}; shorten it or "
                "pass truncate_prompt_tokens to cut it."
            )
        bad = [t for t in seq.token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids holds {bad[0]!r}, outside the vocabulary [0, {self.vocab_size}).")
        pooling_type = "ALL" if task in ("token_embed", "reward") else pc.pooling_type
        params.task = task
        return PoolingInput(request_id, seq, task, params, pooling_type)

    def _tokenize(self, prompt: Any, pair: Any, limit: int | None) -> PoolingSeq:
        if isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
            if pair is not None:
                raise ValueError("a pair of inputs (a cross-encoder's) must be given as text, not token ids.")
            ids = list(prompt["prompt_token_ids"])
            return PoolingSeq(ids[:limit] if limit is not None else ids)
        text = prompt.get("prompt") if isinstance(prompt, Mapping) else prompt
        if not isinstance(text, str) or (pair is not None and not isinstance(pair, str)):
            raise ValueError(
                "An input must be a string, {'prompt': str} or {'prompt_token_ids': [...]}; "
                f"got {type(text).__name__}."
            )
        if self.tokenizer is None:
            raise ValueError("The tokenizer was not initialised (skip_tokenizer_init=True): pass prompt_token_ids.")
        kwargs: dict[str, Any] = {"truncation": True, "max_length": limit} if limit is not None else {}
        enc = self.tokenizer(text, pair, **kwargs) if pair is not None else self.tokenizer(text, **kwargs)
        types = enc.get("token_type_ids") if pair is not None else None
        return PoolingSeq(list(enc["input_ids"]), list(types) if types is not None else None)

    # ---- running -------------------------------------------------------------------------
    def batches(self, inputs: list[PoolingInput]) -> list[list[int]]:
        """Indices of `inputs` in batches of at most max_num_batched_tokens tokens and max_num_seqs
        sequences, longest first (a sequence longer than the token budget goes alone)."""
        order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i].seq.token_ids))
        budget, max_seqs = int(self.config.max_num_batched_tokens), int(self.config.max_num_seqs)
        out: list[list[int]] = []
        current: list[int] = []
        tokens = 0
        for i in order:
            n = len(inputs[i].seq.token_ids)
            if current and (tokens + n > budget or len(current) >= max_seqs):
                out.append(current)
                current, tokens = [], 0
            current.append(i)
            tokens += n
        if current:
            out.append(current)
        return out

    def run(self, inputs: list[PoolingInput],
            on_batch: Callable[[int], None] | None = None) -> list[PoolingRequestOutput]:
        results: list[PoolingRequestOutput | None] = [None] * len(inputs)
        for batch in self.batches(inputs):
            chosen = [inputs[i] for i in batch]
            with self._lock:
                outs = self._run_batch(chosen)
            for i, out in zip(batch, outs):
                results[i] = out
            if on_batch is not None:
                on_batch(len(batch))
        return results  # type: ignore[return-value]

    def _run_batch(self, inputs: list[PoolingInput]) -> list[PoolingRequestOutput]:
        seqs = [x.seq for x in inputs]
        hidden, lens = self.runner.forward(seqs)
        pooled = {t: pool(hidden, lens, t) for t in {x.pooling_type for x in inputs if x.task not in _LOGIT_TASKS}}
        dense = self.pooler_config.dense
        if dense is not None:  # sentence-transformers' Dense modules: over sentence embeddings, not per token
            pooled.update({t: list(dense(torch.stack(rows)).unbind(0)) for t, rows in pooled.items() if t != "ALL"})
        logit_rows = [i for i, x in enumerate(inputs) if x.task in _LOGIT_TASKS]
        logits = self.runner.classify(hidden, lens, logit_rows) if logit_rows else None
        logit_of = {row: j for j, row in enumerate(logit_rows)}
        outs = []
        for i, x in enumerate(inputs):
            p = x.params
            if x.task in _LOGIT_TASKS:
                data = classifier_activation(logits[logit_of[i]], p.use_activation is not False)
            elif x.task == "reward":
                data = pooled[x.pooling_type][i]
            else:  # embed, encode, token_embed: embeddings (per token for token_embed)
                normalize = self.pooler_config.normalize if p.normalize is None else p.normalize
                data = embedding_head(pooled[x.pooling_type][i], p.dimensions, normalize)
            outs.append(PoolingRequestOutput(x.request_id, PoolingOutput(data), x.seq.token_ids, True))
        return outs

    def shutdown(self) -> None:
        pass


def _check_supported(config: EngineConfig) -> None:
    """What the pooling runner does not do, refused before the model loads."""
    from perfxlm.model.registry import is_pooling_only

    if config.tensor_parallel_size > 1 or config.data_parallel_size > 1:
        raise ValueError("the pooling runner runs in one process: tensor_parallel_size and data_parallel_size "
                         "must be 1 (run one server per replica).")
    quant = config.quant_config
    if quant is not None and getattr(quant, "calibration", None) is not None and is_pooling_only(config.hf_config):
        raise ValueError("quantization calibration runs a causal LM over text windows, which an encoder is not: "
                         "pass calibration false (e.g. {\"method\": \"int4\", \"calibration\": false}), "
                         "or int8 / w8a8.")


def _convert_lm_head(hf_config: Any, tokenizer: Any) -> None:
    """A causal LM's checkpoint served as a classifier from its LM head's rows (hf_overrides'
    classifier_from_token): the tokens resolved to ids on the config, before the model is built."""
    from perfxlm.model.models import classifier_from_tokens
    from perfxlm.model.models.seq_classification import DecoderForSequenceClassification
    from perfxlm.model.registry import resolve_model_class

    if not classifier_from_tokens.requested(hf_config):
        return
    model_cls = resolve_model_class(hf_config)
    if not issubclass(model_cls, DecoderForSequenceClassification):
        raise ValueError(
            f"classifier_from_token converts a decoder's LM head into a score head, which {model_cls.__name__} "
            "is not: set hf_overrides' architectures to the *ForSequenceClassification of its causal LM "
            '(e.g. ["Qwen3ForSequenceClassification"]).'
        )
    classifier_from_tokens.resolve(hf_config, tokenizer)


def _check_convert(convert: str, pc: PoolerConfig) -> None:
    if convert == "classify" and not pc.num_labels:
        raise ValueError("convert='classify' needs a checkpoint with a classification head "
                         "(*ForSequenceClassification); this model has none.")
    if convert == "embed" and pc.num_labels:
        raise ValueError("convert='embed': this checkpoint is a classifier (cross-encoder); use convert='classify'.")
