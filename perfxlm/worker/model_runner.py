"""The model runner: SchedulerOutput in, sampled token ids out.

It never sees a Request. Per step it:
1. copies KV blocks the scheduler asked for (forked prompts);
2. builds, in one pass over the scheduled requests, the flattened unpadded batch (decodes first,
   then multi-token prefill chunks) and the attention metadata;
3. runs the model, computes logits only for rows that sample (plus prompt rows of requests that
   asked for prompt logprobs), and samples, one row per forked child where a prompt forks.
Structured-output rows get their grammar bitmask from a worker thread that fills it while the
forward pass runs (the matchers see only tokens known before the step: the output, and the draft tokens
of a speculating request, whose every verification row is masked as the grammar stands there).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import numpy as np
import torch

from perfxlm.engine.messages import HiddenRows, ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from perfxlm.lora.slots import LoRASlots, NoAdapters
from perfxlm.model.forward_context import AttentionMetadata, PrefillSeq, set_forward_context
from perfxlm.model.layers.attention import Attention
from perfxlm.model.layers.rejection_sampler import RejectionSampler
from perfxlm.model.layers.sampler import Sampler, compute_logprobs
from perfxlm.ops import native
from perfxlm.ops.attention import decode_mask
from perfxlm.ops.kv_quant import KVCache, KVCacheSpec, as_bits
from perfxlm.worker.cuda_graphs import CudaGraphForward, EagerForward, GraphPlan
from perfxlm.worker.sampling_inputs import SampleRow, build_sampling_metadata


class ModelRunner:
    def __init__(
        self, model: torch.nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype | KVCacheSpec,
        lora_slots: LoRASlots | NoAdapters | None = None, graphs: GraphPlan | None = None,
    ) -> None:
        """`dtype`: the KV cache's format (a KVCacheSpec, or a plain float32 / bfloat16 dtype). `lora_slots`:
        the adapter slots over the model's LoRA wrappers (enable_lora), else none. `graphs`: decode steps
        replayed from CUDA graphs of these sizes (a GPU model; worker/cuda_graphs.py), else eager."""
        self.model = model
        self.lora_slots = lora_slots if lora_slots is not None else NoAdapters()
        self.block_size = block_size
        self.sampler = Sampler()
        self.rejection_sampler = RejectionSampler(self.sampler)
        self.generators: dict[str, torch.Generator] = {}
        self.grammars = None  # GrammarMatchers, made at the first structured-output row
        self._mask_thread: ThreadPoolExecutor | None = None
        self.kv_spec = KVCacheSpec.of(dtype)
        # where the model's weights are: its KV cache, step inputs and sampling tensors go there too (the
        # batch is laid out on the CPU, then copied once per step)
        self.device = model_device(model)
        self.kv_caches: list[KVCache] = []
        # Sees every prompt-logprob computation whole: (request_id, position of the first row's token,
        # log-probabilities [rows, vocab] float32). Evaluations that need whole distributions (KL
        # divergence) set it; requests' own outputs keep only the top-k they asked for.
        self.prompt_logprobs_observer: Callable[[str, int, torch.Tensor], None] | None = None
        # Hand over each request's hidden rows before the final norm (ModelRunnerOutput.hidden_states):
        # set by the engine for a proposer that reads them (speculative decoding's `mtp`). Steps then run
        # eagerly through the model's `forward_pre_norm`.
        self.keep_hidden_states = False
        # captured steps pad their batch with rows whose K/V go to one block past the manager's pool
        sink_blocks = 1 if graphs is not None else 0
        for module in model.modules():
            if isinstance(module, Attention):
                cache = module.allocate_cache(self.kv_spec, num_blocks + sink_blocks, block_size, self.device)
                module.kv_cache = cache
                self.kv_caches.append(cache)
        self.forward_path: EagerForward = EagerForward()
        if graphs is not None:
            from perfxlm.model.layers import attention_backend

            self.forward_path = CudaGraphForward(model, attention_backend.for_device(self.device), graphs.sizes,
                                                 graphs.max_blocks, num_blocks, block_size, self.device)  # fmt: skip

    @staticmethod
    def kv_bytes_per_block(model: torch.nn.Module, block_size: int, dtype: torch.dtype | KVCacheSpec) -> int:
        spec = KVCacheSpec.of(dtype)
        return sum(
            block_size * m.cache_bytes_per_token(spec)
            for m in model.modules()
            if isinstance(m, Attention)
        )

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        out, kept = self._execute(so)
        if kept is not None:
            _hand_over_hidden(*kept, out)
        return out

    def _execute(self, so: SchedulerOutput) -> tuple[ModelRunnerOutput, tuple | None]:
        """The step's output, and (the batch's requests in order, their first rows, the rows before the
        final norm) when `keep_hidden_states` asks for them."""
        for rid in so.finished_request_ids:
            self.generators.pop(rid, None)
        if self.grammars is not None:
            self.grammars.drop(so.finished_request_ids)
        self._copy_blocks(so.blocks_to_copy)
        # Decodes (one new token, or one and its draft tokens: one decode row each) first so they form
        # one contiguous slice for batched attention.
        decodes = [s for s in so.scheduled if s.runs_as_decode_rows]
        prefills = [s for s in so.scheduled if not s.runs_as_decode_rows]
        order = decodes + prefills
        input_ids, positions, meta, token_starts = self._prepare(order, len(decodes))
        meta.lora = self.lora_slots.batch([s.lora for s in order], [len(s.token_ids) for s in order])
        rows: list[SampleRow] = []
        hidden_rows: list[int] = []
        verify = _Verification()
        for s, start in zip(order, token_starts):
            if not s.do_sample:
                continue
            if s.draft_token_ids:
                verify.add(s, start)
                continue
            last = start + len(s.token_ids) - 1
            rows.append(SampleRow(s.request_id, s.sampling_params, s.prompt_token_ids, s.output_token_ids))
            hidden_rows.append(last)
            for child_id, child_params in s.fork_children:
                rows.append(SampleRow(child_id, child_params, s.prompt_token_ids, []))
                hidden_rows.append(last)
        masks = self._start_grammar_masks(_guided(rows), len(rows))
        verify_masks = self._start_grammar_masks(verify.guided(), len(verify.rows))
        if self.keep_hidden_states:
            with set_forward_context(meta):  # eager: the hidden rows before the norm are the model's to give
                hidden, pre_norm = self.model.forward_pre_norm(input_ids, positions)
            kept = (order, token_starts, pre_norm)
        else:
            hidden, kept = self._forward(order, input_ids, positions, meta), None
        out = ModelRunnerOutput(sampled_token_ids={})
        self._prompt_logprobs(order, token_starts, hidden, out)
        if verify.requests:
            self._verify(verify, hidden, verify_masks, out)
        if not rows:
            return out, kept
        grammar, failed = _grammar_masks(masks, out)
        if failed:
            keep = [i for i, r in enumerate(rows) if r.request_id not in failed]
            remap = {old: new for new, old in enumerate(keep)}
            rows, hidden_rows = [rows[i] for i in keep], [hidden_rows[i] for i in keep]
            if grammar is not None:
                masked, bitmask = grammar
                grammar = ([remap[i] for i in masked if i in remap], bitmask[keep].contiguous())
            if not rows:
                return out, kept
        logits = self.model.compute_logits(hidden[torch.tensor(hidden_rows)])  # [rows, vocab] fp32
        try:
            meta_s = build_sampling_metadata(rows, self.generators, logits.shape[1])
            meta_s.grammar = grammar
            result = self.sampler(logits, meta_s.to(logits.device))
        except Exception:
            # One request's sampling state (its seed, filters, logit edits) must not fail the batch:
            # sample row by row, and fail only the rows that fail on their own.
            for i, r in enumerate(rows):
                try:
                    one_meta = build_sampling_metadata([r], self.generators, logits.shape[1])
                    if grammar is not None and i in grammar[0]:
                        one_meta.grammar = ([0], grammar[1][i : i + 1].contiguous())
                    one = self.sampler(logits[i : i + 1].clone(), one_meta.to(logits.device))
                except Exception as exc:
                    out.failed[r.request_id] = f"sampling failed: {type(exc).__name__}: {exc}"
                    continue
                self._record_samples([r], one, out)
            return out, kept
        self._record_samples(rows, result, out)
        return out, kept

    def _forward(self, order: list[ScheduledRequest], input_ids: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        """Hidden rows of this step's tokens, in `order` (the ONNX runner overrides this one seam)."""
        return self.forward_path(self.model, input_ids, positions, meta)

    def _verify(self, verify: "_Verification", hidden: torch.Tensor, masks, out: ModelRunnerOutput) -> None:
        """Score every draft token of the step's speculating requests and keep what the target accepts
        (RejectionSampler); a guided request's rows are masked by its grammar as it stands at each draft.
        A request whose own sampling or grammar state fails is failed alone."""
        logits = self.model.compute_logits(hidden[torch.tensor(verify.hidden_rows)])
        grammar, _ = _grammar_masks(masks, out)
        try:
            self._record_verified(verify.requests, verify.rows, verify.drafts, logits, grammar, out)
            return
        except Exception:
            pass
        row = 0
        for s, d in zip(verify.requests, verify.drafts):
            n = len(d) + 1
            try:
                self._record_verified([s], verify.rows[row : row + n], [d], logits[row : row + n].clone(),
                                      _grammar_slice(grammar, row, n), out)  # fmt: skip
            except Exception as exc:
                out.failed[s.request_id] = f"sampling failed: {type(exc).__name__}: {exc}"
            row += n

    def _record_verified(self, requests: list[ScheduledRequest], rows: list[SampleRow], drafts: list[list[int]],
                         logits: torch.Tensor, grammar, out: ModelRunnerOutput) -> None:
        meta = build_sampling_metadata(rows, self.generators, logits.shape[1])
        meta.grammar = grammar
        result = self.rejection_sampler(logits, meta.to(logits.device), drafts)
        for i, (s, tokens) in enumerate(zip(requests, result.token_ids)):
            if s.request_id in out.failed:
                continue  # its grammar state failed: its rows were not masked, nothing of them counts
            out.verified_token_ids[s.request_id] = tokens
            if result.logprobs is not None and s.sampling_params.needs_sampled_logprob:
                k = 1 + (s.sampling_params.logprobs or 0)
                ids, lps, ranks = result.logprobs[i]
                out.verified_logprobs[s.request_id] = [(a[:k], b[:k], r) for a, b, r in zip(ids, lps, ranks)]

    def _start_grammar_masks(self, guided: list[tuple], num_rows: int):
        """A future of the structured-output rows' bitmask (GrammarMatchers.fill's rows), filled on a worker
        thread while the forward pass runs; None when no row is guided (unguided batches never touch the
        grammar engine). One thread: the step's fills run in order, never on the same matcher at once."""
        if not guided:
            return None
        if self.grammars is None:
            from perfxlm.structured_output import GrammarMatchers

            self.grammars = GrammarMatchers()
            self._mask_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="perfxlm-grammar")
        return self._mask_thread.submit(self.grammars.fill, guided, num_rows)

    @staticmethod
    def _record_samples(rows: list[SampleRow], result, out: ModelRunnerOutput) -> None:
        token_ids = result.token_ids.tolist()
        out.sampled_token_ids.update({r.request_id: t for r, t in zip(rows, token_ids)})
        if result.logprobs is not None:
            ids, lps, ranks = result.logprob_token_ids.tolist(), result.logprobs.tolist(), result.sampled_ranks.tolist()
            for i, r in enumerate(rows):
                if r.params.needs_sampled_logprob:
                    k = 1 + (r.params.logprobs or 0)
                    out.logprobs[r.request_id] = (ids[i][:k], lps[i][:k], ranks[i])

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], device=self.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.device)
        for cache in self.kv_caches:
            for t in map(as_bits, cache.tensors()):  # K, V and, for a quantized cache, their scales
                t.index_copy_(0, dst, t.index_select(0, src))

    def _prompt_logprobs(
        self, order: list[ScheduledRequest], token_starts: list[int], hidden: torch.Tensor, out: ModelRunnerOutput
    ) -> None:
        """Logprob of each prompt token given the ones before it, for requests that ask for them."""
        for s, start in zip(order, token_starts):
            k = s.sampling_params.prompt_logprobs
            if k is None:
                continue
            n_prompt = len(s.prompt_token_ids)
            # Row i predicts position num_computed + i + 1; only prompt positions count.
            count = min(len(s.token_ids), n_prompt - 1 - s.num_computed_tokens)
            if count <= 0:
                continue
            logprobs = self.model.compute_logits(hidden[start : start + count]).log_softmax(dim=-1)
            first = s.num_computed_tokens + 1
            if self.prompt_logprobs_observer is not None:
                self.prompt_logprobs_observer(s.request_id, first, logprobs)
            targets = torch.tensor(s.prompt_token_ids[first : first + count], dtype=torch.int64, device=logprobs.device)
            try:
                ids, lps, ranks = compute_logprobs(logprobs, targets, k)
            except Exception as exc:  # this request's own ask (its k) failed: fail it alone
                out.failed[s.request_id] = f"prompt logprobs failed: {type(exc).__name__}: {exc}"
                continue
            entries = list(zip(ids.tolist(), lps.tolist(), ranks.tolist()))
            out.prompt_logprobs[s.request_id] = (first, entries)

    def prepare_inputs(
        self, order: list[ScheduledRequest]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """(input ids, positions, attention metadata over this runner's KV caches, each sequence's first
        row) of `order`, its single-token sequences first: for a proposer that runs its own layers' forward
        pass (speculative decoding's `mtp`)."""
        num_decodes = 0
        while num_decodes < len(order) and len(order[num_decodes].token_ids) == 1:
            num_decodes += 1
        return self._prepare(order, num_decodes)

    def _prepare(
        self, order: list[ScheduledRequest], num_decodes: int
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
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
        num_decode_tokens = int(ends[num_decodes - 1]) if num_decodes else 0
        if num_decodes:
            dec_max = max(len(s.block_ids) for s in order[:num_decodes])
            if num_decode_tokens == num_decodes:
                decode_tables = tables_t[:num_decodes, :dec_max]
                decode_lens = torch.from_numpy(starts[:num_decodes] + 1)
            else:  # draft tokens: each is a decode row of its request, seeing the tokens up to itself
                decode_tables = tables_t[torch.from_numpy(req_of_token[:num_decode_tokens]), :dec_max]
                decode_lens = torch.from_numpy(positions[:num_decode_tokens] + 1)
            if self.device.type == "cpu" and native.kernels() is None:  # the torch fallback masks padded blocks
                mask = decode_mask(decode_lens, dec_max * bs)
        prefills = [
            PrefillSeq(int(ends[i] - lens[i]), int(ends[i]), int(starts[i]), tables_t[i, : len(order[i].block_ids)])
            for i in range(num_decodes, len(order))
        ]
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slot_mapping).to(self.device, non_blocking=True),
            num_decode_tokens=num_decode_tokens,
            decode_block_tables=decode_tables,
            decode_seq_lens=decode_lens,
            decode_mask=mask,
            prefills=prefills,
        )
        token_starts = (ends - lens).tolist()
        input_ids = torch.tensor(ids, dtype=torch.int64).to(self.device, non_blocking=True)
        return input_ids, torch.from_numpy(positions).to(self.device, non_blocking=True), meta, token_starts


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of a model's first weight (the CPU for a model without any)."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _hand_over_hidden(order: list[ScheduledRequest], token_starts: list[int], pre_norm: torch.Tensor,
                      out: ModelRunnerOutput) -> None:
    """Each request's rows whose next token is known now: a prefill chunk's all (the prompt's next token,
    or the one sampled after its last), a decode's one, a verification's up to the last accepted draft."""
    for s, start in zip(order, token_starts):
        rid = s.request_id
        if rid in out.failed:
            continue
        if s.draft_token_ids:
            verified = out.verified_token_ids.get(rid)
            if not verified:
                continue
            out.hidden_states[rid] = HiddenRows(s.num_computed_tokens, pre_norm[start : start + len(verified)],
                                                list(verified))  # fmt: skip
            continue
        n = len(s.token_ids)
        nxt = list(s.token_ids[1:])
        end = s.num_computed_tokens + n  # the position after the chunk
        known = len(s.prompt_token_ids) + len(s.output_token_ids)
        if end < known:  # a chunk within the known tokens: the next one is the prompt's (or output's)
            nxt.append(s.prompt_token_ids[end] if end < len(s.prompt_token_ids)
                       else s.output_token_ids[end - len(s.prompt_token_ids)])  # fmt: skip
        elif rid in out.sampled_token_ids:
            nxt.append(out.sampled_token_ids[rid])
        rows = pre_norm[start : start + len(nxt)]
        out.hidden_states[rid] = HiddenRows(s.num_computed_tokens, rows, nxt)
        for child_id, _ in s.fork_children:  # n > 1: the same prompt rows, then the child's own first token
            if child_id in out.sampled_token_ids and len(nxt) == n:
                out.hidden_states[child_id] = HiddenRows(s.num_computed_tokens, rows,
                                                         [*nxt[:-1], out.sampled_token_ids[child_id]])  # fmt: skip


def _guided(rows: list[SampleRow]) -> list[tuple]:
    """GrammarMatchers.fill's rows for the guided sample rows."""
    return [(i, r.request_id, r.params._grammar.value, list(r.output_token_ids), r.params._grammar_start_token)
            for i, r in enumerate(rows) if r.params._grammar is not None]


def _grammar_slice(grammar, first: int, n: int):
    """The sampler's grammar mask for rows first..first + n - 1 alone, renumbered from 0."""
    if grammar is None:
        return None
    masked = [r - first for r in grammar[0] if first <= r < first + n]
    return (masked, grammar[1][first : first + n].contiguous()) if masked else None


class _Verification:
    """The step's requests with draft tokens: their sample rows (one per draft and one after the last,
    each seeing the output as it would be at that row, for penalties and bans) and hidden-state rows."""

    def __init__(self) -> None:
        self.requests: list[ScheduledRequest] = []
        self.rows: list[SampleRow] = []
        self.hidden_rows: list[int] = []
        self.drafts: list[list[int]] = []

    def add(self, s: ScheduledRequest, start: int) -> None:
        d = s.draft_token_ids
        self.requests.append(s)
        self.drafts.append(d)
        for j in range(len(d) + 1):
            output = s.output_token_ids if j == 0 else [*s.output_token_ids, *d[:j]]
            self.rows.append(SampleRow(s.request_id, s.sampling_params, s.prompt_token_ids, output))
            self.hidden_rows.append(start + j)

    def guided(self) -> list[tuple]:
        """GrammarMatchers.fill's rows for the guided requests: each owns its len(drafts) + 1 rows."""
        out, row = [], 0
        for s, d in zip(self.requests, self.drafts):
            p = s.sampling_params
            if p._grammar is not None:
                out.append((row, s.request_id, p._grammar.value, list(s.output_token_ids), p._grammar_start_token,
                            list(d)))  # fmt: skip
            row += len(d) + 1
        return out


def _grammar_masks(masks: Any, out: ModelRunnerOutput) -> tuple[tuple[Any, Any] | None, Any]:
    """The grammar thread's result for a step's rows: ((masked rows, bitmask) or None, the failed
    requests, also recorded on `out`); (None, empty) without guided rows."""
    if masks is None:
        return None, ()
    masked, bitmask, failed = masks.result()
    out.failed.update(failed)
    return (None if bitmask is None else (masked, bitmask)), failed
