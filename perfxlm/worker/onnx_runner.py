"""The model runner for an exported graph: the engine's scheduling (continuous batching, the KV block
accounting, prefix caching, sampling) around an ONNX Runtime session instead of the module model.

The graph keeps K/V as dense per-sequence past tensors, not the paged cache, so the runner holds one past
per request (the block pool still bounds how many tokens all of them may hold: its bytes per block are the
graph's). A request whose computed length differs from its past (a prefix-cache hit, a forked child,
a preemption) has the tokens before its new ones computed again from its token ids, so every path gives
the logits of the whole sequence. Each sequence is one call."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from perfxlm.engine.messages import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from perfxlm.model.forward_context import AttentionMetadata
from perfxlm.worker.model_runner import ModelRunner
from perfxlm.worker.onnx_graph import OnnxDecoderGraph


class _LogitRows(nn.Module):
    """The graph returns logits: the runner's 'hidden' rows are already them."""

    def compute_logits(self, rows: torch.Tensor) -> torch.Tensor:
        return rows


class OnnxModelRunner(ModelRunner):
    def __init__(self, graph: OnnxDecoderGraph, num_blocks: int, block_size: int, dtype) -> None:
        super().__init__(_LogitRows(), num_blocks, block_size, dtype)
        self.graph = graph
        self.pasts: dict[str, list[np.ndarray]] = {}  # request id -> its K/V [1, kv_heads, tokens, head_dim]

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for rid in so.finished_request_ids:
            self.pasts.pop(rid, None)
        return super().execute(so)

    def _forward(self, order: list[ScheduledRequest], input_ids: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        return torch.cat([torch.from_numpy(self._run(s)) for s in order])

    def _run(self, s: ScheduledRequest) -> np.ndarray:
        computed = s.num_computed_tokens
        past = self.pasts.get(s.request_id)
        ids = list(s.token_ids)
        if past is None or past[0].shape[2] != computed:
            known = (list(s.prompt_token_ids) + list(s.output_token_ids))[:computed]
            past, ids = self.graph.empty_past(), known + ids
        logits, self.pasts[s.request_id] = self.graph.run(ids, past)
        return logits[len(ids) - len(s.token_ids):]
