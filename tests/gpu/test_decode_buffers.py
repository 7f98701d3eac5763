"""The static decode inputs a CUDA graph replays (attention_backend.DecodeBuffers): a padded step read from
them attends exactly as the same step built from its own tensors, including after a larger step left
other values in the padding rows. Runs in Triton's interpreter where there is no GPU."""

from __future__ import annotations

import torch

from perfxlm.model.forward_context import AttentionMetadata
from perfxlm.model.layers.attention_backend import AttentionOptions, TritonAttentionBackend
from perfxlm.ops.kv_quant import KVCache
from perfxlm.worker.cuda_graphs import GraphPlan, capture_sizes


def _meta(tables, lens, slots, device, prepared=None):
    return AttentionMetadata(slot_mapping=slots.to(device), num_decode_tokens=0 if lens is None else len(lens), decode_block_tables=tables,
                             decode_seq_lens=lens, decode_mask=None, prefills=[], prepared=prepared)  # fmt: skip


def test_padded_static_step_equals_the_step_itself(device):
    g = torch.Generator().manual_seed(3)
    block_size, heads, kv_heads, dim, num_blocks = 4, 6, 2, 24, 23
    cache = KVCache(torch.randn(num_blocks, block_size, kv_heads, dim, generator=g).to(device),
                    torch.randn(num_blocks, block_size, kv_heads, dim, generator=g).to(device), None, None)  # fmt: skip
    backend = TritonAttentionBackend()
    options = AttentionOptions(scale=dim**-0.5)
    buffers = backend.decode_buffers(max_rows=8, max_blocks=6, device=torch.device(device))
    sink = num_blocks - 1
    # a wider step first: its rows stay behind in the padding of the next one
    for rows, padded in ((7, 8), (3, 4)):
        lens = torch.randint(1, 5 * block_size, (rows,), generator=g)
        width = int((lens.max() + block_size - 1) // block_size)
        tables = torch.randint(0, sink, (rows, width), generator=g)
        slots = tables[torch.arange(rows), (lens - 1) // block_size] * block_size + (lens - 1) % block_size
        q = torch.randn(rows, heads, dim, generator=g).to(device)
        k = torch.randn(rows, kv_heads, dim, generator=g).to(device)
        v = torch.randn(rows, kv_heads, dim, generator=g).to(device)
        want = backend.forward(q, k, v, cache, _meta(tables, lens, slots, device), options)
        assert buffers.fits(rows, width) and not buffers.fits(rows, 7) and not buffers.fits(9, width)
        buffers.fill(tables, lens)
        pad = padded - rows
        q_pad = torch.cat([q, torch.randn(pad, heads, dim, generator=g).to(device)])
        kv_pad = [torch.cat([t, torch.zeros(pad, kv_heads, dim, device=device)]) for t in (k, v)]
        slots_pad = torch.cat([slots, torch.full((pad,), sink * block_size)])
        meta = _meta(None, None, slots_pad, device, prepared=buffers.step(padded))
        meta.num_decode_tokens = padded
        got = backend.forward(q_pad, *kv_pad, cache, meta, options)[:rows]
        assert torch.equal(got.cpu(), want.cpu())
        assert buffers.step(padded) is meta.prepared  # made once per size, reused by every later step


def test_capture_sizes_follow_vllm():
    assert capture_sizes(256)[:5] == [1, 2, 4, 8, 16] and capture_sizes(256)[-1] == 256
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(1) == [1]
    assert capture_sizes(10_000)[-1] == 512
    assert GraphPlan.of(64, 100_000, 16).max_blocks == 512  # vLLM's max_seq_len_to_capture, 8192 tokens
    assert GraphPlan.of(64, 1000, 16).max_blocks == 63
