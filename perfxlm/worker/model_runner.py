"""The model runner: SchedulerOutput in, sampled token ids out.

It never sees a Request. Per step it builds, in one pass over the scheduled requests, the
flattened unpadded batch (decodes first, then multi-token prefill chunks), runs the model,
computes logits only for rows that sample, and samples.
"""

from __future__ import annotations

import numpy as np
import torch

from perfxlm.engine.messages import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from perfxlm.model.forward_context import AttentionMetadata, PrefillSeq, set_forward_context
from perfxlm.model.layers.attention import Attention
from perfxlm.model.layers.sampler import Sampler, SamplingMetadata
from perfxlm.ops.attention import decode_mask
from perfxlm.sampling_params import SamplingType


class ModelRunner:
    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype) -> None:
        self.model = model
        self.block_size = block_size
        self.sampler = Sampler()
        self.generators: dict[str, torch.Generator] = {}
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        for module in model.modules():
            if isinstance(module, Attention):
                shape = (num_blocks, block_size, module.num_kv_heads, module.head_dim)
                cache = (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
                module.kv_cache = cache
                self.kv_caches.append(cache)

    @staticmethod
    def kv_bytes_per_block(model: torch.nn.Module, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return sum(
            2 * block_size * m.num_kv_heads * m.head_dim * elem for m in model.modules() if isinstance(m, Attention)
        )

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for rid in so.finished_request_ids:
            self.generators.pop(rid, None)
        # Decodes (one new token) first so they form one contiguous slice for batched attention.
        decodes = [s for s in so.scheduled if len(s.token_ids) == 1]
        prefills = [s for s in so.scheduled if len(s.token_ids) > 1]
        order = decodes + prefills
        input_ids, positions, meta, sample_rows = self._prepare(order, len(decodes))
        with set_forward_context(meta):
            hidden = self.model(input_ids, positions)
        sampled = [s for s in order if s.do_sample]
        if not sampled:
            return ModelRunnerOutput(sampled_token_ids={})
        logits = self.model.compute_logits(hidden[sample_rows])  # [num_sampled, vocab] fp32
        token_ids = self.sampler(logits, self._sampling_metadata(sampled)).tolist()
        return ModelRunnerOutput(sampled_token_ids={s.request_id: t for s, t in zip(sampled, token_ids)})

    def _prepare(
        self, order: list[ScheduledRequest], num_decodes: int
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        bs = self.block_size
        lens = np.fromiter((len(s.token_ids) for s in order), dtype=np.int64, count=len(order))
        starts = np.fromiter((s.num_computed_tokens for s in order), dtype=np.int64, count=len(order))
        ends = np.cumsum(lens)
        num_tokens = int(ends[-1])
        ids: list[int] = []
        for s in order:
            ids.extend(s.token_ids)
        # positions: start of each request + offset within its new tokens
        req_of_token = np.repeat(np.arange(len(order)), lens)
        positions = starts[req_of_token] + (np.arange(num_tokens) - (ends - lens)[req_of_token])
        max_blocks = max(len(s.block_ids) for s in order)
        tables = np.zeros((len(order), max_blocks), dtype=np.int64)
        for i, s in enumerate(order):
            tables[i, : len(s.block_ids)] = s.block_ids
        slot_mapping = tables[req_of_token, positions // bs] * bs + positions % bs
        tables_t = torch.from_numpy(tables)
        decode_tables = decode_lens = mask = None
        if num_decodes:
            dec_max = max(len(s.block_ids) for s in order[:num_decodes])
            decode_tables = tables_t[:num_decodes, :dec_max]
            decode_lens = torch.from_numpy(starts[:num_decodes] + 1)
            mask = decode_mask(decode_lens, dec_max * bs)
        prefills = [
            PrefillSeq(int(ends[i] - lens[i]), int(ends[i]), int(starts[i]), tables_t[i, : len(order[i].block_ids)])
            for i in range(num_decodes, len(order))
        ]
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slot_mapping),
            num_decode_tokens=num_decodes,
            decode_block_tables=decode_tables,
            decode_seq_lens=decode_lens,
            decode_mask=mask,
            prefills=prefills,
        )
        sample_rows = torch.tensor([int(ends[i]) - 1 for i, s in enumerate(order) if s.do_sample], dtype=torch.int64)
        return torch.tensor(ids, dtype=torch.int64), torch.from_numpy(positions), meta, sample_rows

    def _sampling_metadata(self, sampled: list[ScheduledRequest]) -> SamplingMetadata:
        params = [s.sampling_params for s in sampled]
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32)
        all_greedy = all(p.sampling_type == SamplingType.GREEDY for p in params)
        top_p = top_k = min_p = None
        if not all_greedy:
            if any(p.top_p < 1.0 for p in params):
                top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
            if any(p.top_k > 0 for p in params):
                top_k = torch.tensor([p.top_k if p.top_k > 0 else 1 << 30 for p in params], dtype=torch.int64)
            if any(p.min_p > 0 for p in params):
                min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32)
        generators: dict[int, torch.Generator] = {}
        for row, s in enumerate(sampled):
            seed = s.sampling_params.seed
            if seed is not None and s.sampling_params.sampling_type == SamplingType.RANDOM_SEED:
                gen = self.generators.get(s.request_id)
                if gen is None:
                    gen = self.generators[s.request_id] = torch.Generator().manual_seed(seed)
                generators[row] = gen
        return SamplingMetadata(temperature, all_greedy, top_p, top_k, min_p, generators)
