"""How the model runner runs a step's forward pass: eagerly, or, for decode steps on a GPU, by replaying a
CUDA graph captured for a padded batch size (vLLM's idea).

At batch 1 a decode step of a 7B model is a few hundred small kernels; launched one by one from Python
the GPU waits on the CPU between them. A graph captured once per size in `sizes` launches them all at
once. What a captured forward reads lives in static device memory: token ids, positions and KV slots
(copied from the step's own tensors) and the attention backend's decode inputs (`decode_buffers`: block
tables and lengths, one host-to-device copy per step). A step of B rows replays the smallest size >= B;
the padding rows write their K/V to a block of their own past the manager's pool (`sink_block`) and
their outputs are never read. Steps with prefills, draft tokens, adapters or more rows than the largest
size run eagerly.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass
from typing import Any

import torch

from perfxlm.model.forward_context import AttentionMetadata, set_forward_context

logger = logging.getLogger("perfxlm")


# vLLM's max_seq_len_to_capture: decode steps whose sequences are longer run eagerly (the static block
# tables are this wide)
MAX_SEQ_LEN_TO_CAPTURE = 8192


def capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's capture sizes: 1, 2, 4, then every multiple of 8, up to max_num_seqs (at most 512)."""
    top = min(max_num_seqs, 512)
    return sorted({s for s in [1, 2, 4, *range(8, top + 1, 8)] if s <= top} | {top})


@dataclass(frozen=True)
class GraphPlan:
    """What to capture: the padded decode batch sizes, and the longest sequence in blocks a captured
    step may hold (wider steps run eagerly)."""

    sizes: list[int]
    max_blocks: int

    @classmethod
    def of(cls, max_num_seqs: int, max_model_len: int, block_size: int) -> "GraphPlan":
        return cls(capture_sizes(max_num_seqs), -(-min(max_model_len, MAX_SEQ_LEN_TO_CAPTURE) // block_size))


class EagerForward:
    """Every step as it comes: the model's modules called under the step's forward context."""

    replays = 0

    def __call__(self, model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        with set_forward_context(meta):
            return model(input_ids, positions)


class CudaGraphForward(EagerForward):
    """Decode steps replayed from graphs captured at `sizes`; anything else eagerly."""

    def __init__(self, model: torch.nn.Module, backend: Any, sizes: list[int], max_blocks: int, sink_block: int,
                 block_size: int, device: torch.device) -> None:
        self.sizes = sorted(sizes)
        self.replays = 0
        top = self.sizes[-1]
        self.sink_block, self.sink_slot = sink_block, sink_block * block_size
        self.buffers = backend.decode_buffers(top, max_blocks, device)
        self.input_ids = torch.zeros(top, dtype=torch.int64, device=device)
        self.positions = torch.zeros(top, dtype=torch.int64, device=device)
        self.slots = torch.full((top,), self.sink_slot, dtype=torch.int64, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, AttentionMetadata]] = {}
        self._capture(model, device)

    def _meta(self, rows: int) -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=self.slots[:rows], num_decode_tokens=rows, decode_block_tables=None,
                                 decode_seq_lens=None, decode_mask=None, prefills=[],
                                 prepared=self.buffers.step(rows))  # fmt: skip

    @torch.inference_mode()
    def _capture(self, model: torch.nn.Module, device: torch.device) -> None:
        # every row a one-token sequence writing to the sink block: capturing touches no request's blocks
        top = self.sizes[-1]
        self.buffers.fill(torch.full((top, 1), self.sink_block, dtype=torch.int32), torch.ones(top, dtype=torch.int32))
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device)
        for rows in reversed(self.sizes):  # largest first: the smaller ones reuse its memory
            meta = self._meta(rows)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):  # warm-up (Triton compiles, allocator settles) off the capture
                with set_forward_context(meta):
                    model(self.input_ids[:rows], self.positions[:rows])
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                with set_forward_context(meta):
                    out = model(self.input_ids[:rows], self.positions[:rows])
            self.graphs[rows] = (graph, out, meta)
        torch.cuda.synchronize(device)
        logger.info("CUDA graphs captured for decode batch sizes %s", self.sizes)

    def __call__(self, model, input_ids, positions, meta):
        rows = meta.num_decode_tokens
        tables = meta.decode_block_tables
        if (meta.prefills or rows != input_ids.shape[0] or meta.lora is not None or tables is None
                or not self.buffers.fits(rows, tables.shape[1])):
            return super().__call__(model, input_ids, positions, meta)
        size = self.sizes[bisect.bisect_left(self.sizes, rows)]
        graph, out, _ = self.graphs[size]
        self.buffers.fill(tables, meta.decode_seq_lens)
        self.input_ids[:rows].copy_(input_ids)
        self.positions[:rows].copy_(positions)
        self.slots[:rows].copy_(meta.slot_mapping)
        if size > rows:
            self.slots[rows:size].fill_(self.sink_slot)
        graph.replay()
        self.replays += 1
        return out[:rows]
