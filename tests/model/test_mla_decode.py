"""DeepSeek's decode steps through the latent decode kernel (ops/mla.py, one call per layer): the kernel is
the path the engine takes, in all-decode steps and in steps that mix decodes with a prefill chunk, and
greedy float32 output stays token-identical with transformers; a mixed step gives each row what a step of
its own kind gives it, and leaves the same latent cache."""

from __future__ import annotations

import pytest
import torch

from perfxlm.model.forward_context import (
    AttentionMetadata,
    PrefillSeq,
    get_forward_context,
    set_forward_context,
)
from perfxlm.model.layers import attention_backend
from perfxlm.ops import native
from tests.model.test_architectures_vs_hf import assert_greedy_matches
from tests.model.test_recent_families_vs_hf import build_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("case", ["deepseekv2-lite-yarn", "deepseekv3-noaux-grouped"])
def test_decode_steps_run_the_latent_kernel(tmp_path, monkeypatch, case):
    if native.kernels() is None:
        pytest.skip("no compiler for the native kernels")
    calls = _count_kernel_calls(monkeypatch)
    path = str(tmp_path / case)
    assert_greedy_matches(path, build_checkpoint(path, case))
    assert calls and max(rows for rows, _ in calls) > 1  # decode steps, batched rows among them
    # the chunked prompts run beside other requests' decodes: those steps' decode rows take the kernel
    assert any(mixed for _, mixed in calls)


def _count_kernel_calls(monkeypatch) -> list[tuple[int, bool]]:
    """(decode rows, whether the step also has prefill rows) of each latent decode kernel call."""
    calls = []
    kernel = attention_backend.mla_decode_attention

    def counted(*args, **kwargs):
        calls.append((args[0].shape[0], bool(get_forward_context().prefills)))
        return kernel(*args, **kwargs)

    monkeypatch.setattr(attention_backend, "mla_decode_attention", counted)
    return calls


BLOCK = 8


Decode = tuple[int, list[int]]  # (position, blocks)
Chunk = tuple[int, int, list[int]]  # (context tokens, new tokens, blocks)


def _meta(decodes: list[Decode], prefills: list[Chunk]) -> AttentionMetadata:
    """A step's metadata: decodes as (position, blocks), prefills as (context tokens, new tokens, blocks)."""
    slots = [blocks[pos // BLOCK] * BLOCK + pos % BLOCK for pos, blocks in decodes]
    seqs, row = [], len(decodes)
    for context, new, blocks in prefills:
        slots += [blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(context, context + new)]
        seqs.append(PrefillSeq(row, row + new, context, torch.tensor(blocks)))
        row += new
    tables = lens = None
    if decodes:
        width = max(len(b) for _, b in decodes)
        tables = torch.tensor([b + [0] * (width - len(b)) for _, b in decodes])
        lens = torch.tensor([pos + 1 for pos, _ in decodes])
    return AttentionMetadata(torch.tensor(slots), len(decodes), tables, lens, None, seqs)


def _positions(decodes, prefills) -> torch.Tensor:
    return torch.tensor([pos for pos, _ in decodes] + [p for c, n, _ in prefills for p in range(c, c + n)])


@pytest.mark.parametrize("case,kv_cache_dtype", [("deepseekv2-lite-yarn", "auto"),
                                                 ("deepseekv3-noaux-grouped", "int8")])
def test_mixed_step_equals_separate_steps(tmp_path, monkeypatch, case, kv_cache_dtype):
    """One step with two decodes and a prefill chunk over cached context against the decodes alone and
    the chunk alone from the same cache: the same logits per row, the same cache after."""
    if native.kernels() is None:
        pytest.skip("no compiler for the native kernels")
    from perfxlm.model.loader import get_model, load_hf_config
    from perfxlm.ops.kv_quant import KVCacheSpec
    from perfxlm.worker.model_runner import ModelRunner

    path = str(tmp_path / case)
    build_checkpoint(path, case)
    config = load_hf_config(path)
    model = get_model(path, config, torch.float32, "safetensors")
    spec = KVCacheSpec.resolve(kv_cache_dtype, torch.float32)
    runner = ModelRunner(model, num_blocks=16, block_size=BLOCK, dtype=spec)
    g = torch.Generator().manual_seed(0)
    vocab = config.vocab_size
    blocks_a, blocks_b, blocks_c = [3, 0, 7], [5, 1, 9], [2, 11, 4, 13]  # scattered, out of order

    def run(decodes, prefills, ids) -> torch.Tensor:
        with torch.inference_mode(), set_forward_context(_meta(decodes, prefills)):
            return model.compute_logits(model(ids, _positions(decodes, prefills)))

    # fill the cache: A and B's prompts (17 and 11 tokens), C's first chunk (9 of its 22)
    first = [(0, 17, blocks_a), (0, 11, blocks_b), (0, 9, blocks_c)]
    run([], first, torch.randint(vocab, (37,), generator=g))
    decodes, chunk = [(17, blocks_a), (11, blocks_b)], [(9, 13, blocks_c)]
    ids = torch.randint(vocab, (2 + 13,), generator=g)
    tensors = [t for cache in runner.kv_caches for t in cache.tensors()]
    before = [t.clone() for t in tensors]

    calls = _count_kernel_calls(monkeypatch)
    mixed = run(decodes, chunk, ids)
    assert calls and all(rows == 2 for rows, _ in calls)  # every layer's decode rows in the kernel
    after_mixed = [t.clone() for t in tensors]
    for t, b in zip(tensors, before):
        t.copy_(b)
    alone = torch.cat((run(decodes, [], ids[:2]), run([], chunk, ids[2:])))
    torch.testing.assert_close(mixed, alone, atol=1e-5, rtol=1e-5)
    # the same rows to float rounding (kv_a_proj's product over more rows); int8 codes within one step
    for got, want in zip(after_mixed, tensors):
        assert (got.float() - want.float()).abs().max() <= (1 if got.dtype == torch.int8 else 1e-5)
