"""The engine core: model, KV cache, scheduler and runner. Token ids in, token ids out; no text.

Both front ends drive it: LLMEngine (one thread, step by step) and ThreadedEngine (a background
thread stepping it while the caller's threads tokenize and detokenize).
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import replace

import torch

from perfxlm.config import EngineConfig
from perfxlm.engine.kv_cache_manager import KVCacheManager
from perfxlm.engine.kv_pool import fit_max_model_len, plan_num_blocks
from perfxlm.engine.messages import EngineCoreOutput
from perfxlm.engine.request import Request, RequestStatus
from perfxlm.engine.scheduler import Scheduler
from perfxlm.executor import make_executor
from perfxlm.ops import cpu_plan
from perfxlm.spec_decode.factory import make_proposer
from perfxlm.spec_decode.payoff import SpeculationPayoff, payoff_enabled

logger = logging.getLogger("perfxlm")

# Freezing the garbage collector changes the whole process: only a program that owns its process (the
# CLI, the server) opts in; an engine built as a library leaves the host's collector alone.
_freeze_gc_at_start = False


def freeze_gc_at_engine_start(enabled: bool = True) -> None:
    global _freeze_gc_at_start
    _freeze_gc_at_start = enabled


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.seed is not None:
            torch.manual_seed(config.seed)
        logger.info("Initializing a perfxlm engine with config: %s", config.resolved.describe())
        # In-process for one rank (model and runner here), worker processes for tensor parallelism.
        self.executor = make_executor(config)
        self.model = self.executor.model
        try:
            self.num_kv_blocks = self._num_kv_blocks()
            self.executor.initialize_cache(self.num_kv_blocks)
        except BaseException:
            self.executor.shutdown()
            raise
        # In-process, steps call the runner itself: the executor costs nothing there.
        self.runner = self.executor.runner
        self.kv_cache_manager = KVCacheManager(self.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.kv_cache_manager, config.max_num_seqs, config.max_num_batched_tokens, self.resolved.max_model_len,
            config.lora_config.max_loras if config.lora_config is not None else None,
        )
        # what LoRA adapters are checked against when a request names one (enable_lora, one process)
        self.lora_targets = self.executor.lora_targets
        spec = config.speculative_config
        # Speculative decoding: after each step, the proposer guesses the next tokens of the requests about
        # to decode; the scheduler sends them with the next step, where the runner verifies them. A draft
        # model runs here, in the engine's process, whatever the target's tensor parallelism (vLLM's
        # draft_tensor_parallel_size 1); under an external launcher only rank 0 proposes, and every rank
        # takes its drafts (`Executor.agree_draft_tokens`), so the ranks schedule the same steps.
        self.speculating = spec is not None
        self.proposer = make_proposer(spec, config, self.num_kv_blocks, self.model) \
            if spec is not None and self.executor.proposes_drafts else None  # fmt: skip
        if self.proposer is not None and self.proposer.needs_hidden_states:
            self.runner.keep_hidden_states = True  # in-process: config refuses `mtp` with distributed ranks
        # A proposer whose guesses cost passes of their own (a draft model) speculates while the engine
        # measures it paying (spec_decode/payoff.py); the seconds of the proposal that feeds the next step.
        weigh = self.proposer is not None and self.proposer.weighs_its_cost and payoff_enabled()
        self.payoff = SpeculationPayoff() if weigh else None
        self._proposal_seconds = 0.0
        self.verify_row_budget = _verify_row_budget(config)
        if _freeze_gc_at_start:
            # The model and tokenizer are long-lived: take them out of the collector's view, so the GC
            # passes that per-step allocations trigger stay short (a few % of a decode step). Unfreeze
            # first: what an earlier engine in this process left behind is collected now.
            gc.unfreeze()
            gc.collect()
            gc.freeze()
        logger.info(
            "perfxlm engine core: model=%s compute=%s weights=%s kv=%s kv_blocks=%d x %d tokens, max_model_len=%d, "
            "quantized-weight activations=%s, CPU plan: %s, model: %s",
            config.model, config.torch_dtype, config.weight_dtype, config.kv_cache_spec.name, self.num_kv_blocks,
            config.block_size, self.resolved.max_model_len, config.quant_activation_mode, _plan_text(config),
            self.executor.describe(),
        )  # fmt: skip
        logger.info(
            "KV cache: %s, %d blocks x %d = %d tokens, %d bytes per token (all layers), %.3f GiB",
            config.kv_cache_spec.describe(self._head_dim()), self.num_kv_blocks, config.block_size,
            self.num_kv_blocks * config.block_size, self.kv_bytes_per_block // config.block_size,
            self.num_kv_blocks * self.kv_bytes_per_block / 2**30,
        )  # fmt: skip

    def _head_dim(self) -> int | None:
        return self.executor.head_dim()

    def _num_kv_blocks(self) -> int:
        c = self.config
        per_block = self.kv_bytes_per_block = self.executor.kv_bytes_per_block(c.block_size, c.kv_cache_spec)
        num = plan_num_blocks(
            per_block, c.block_size, c.max_num_seqs, c.max_model_len, c.num_kv_blocks, c.kv_cache_gib,
            self.executor.kv_budget_bytes() if c.num_kv_blocks is None and c.kv_cache_gib is None else None,
            replicas=c.resolved.data_parallel_size,
        )
        num = self.executor.agree_num_blocks(num)  # ranks on several machines: the smallest pool
        # One sequence must fit the pool: the scheduler and the input checks see the fitted length, in the
        # engine's own frozen value (the user's config keeps what was asked).
        fitted = fit_max_model_len(c.resolved.max_model_len, c.max_model_len_explicit, num, c.block_size, per_block)
        self.resolved = replace(c.resolved, max_model_len=fitted)
        return num

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def finish_requests(self, request_ids: list[str], status: RequestStatus, stop_reason: str | None = None) -> None:
        self.scheduler.finish_requests(request_ids, status, stop_reason)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        so = self.scheduler.schedule()
        if so.is_empty:
            return []
        started = time.perf_counter()
        mro = (self.runner or self.executor).execute(so)
        outputs = self.scheduler.update_from_output(so, mro)
        if self.payoff is not None:
            self._weigh(so, outputs, time.perf_counter() - started)
        if self.speculating:
            drafts = self._propose(so.finished_request_ids, mro.hidden_states) if self.proposer is not None else {}
            self.scheduler.set_draft_tokens(self.executor.agree_draft_tokens(drafts))
        return outputs

    def _propose(self, finished_before: set[str], hidden_states: dict) -> dict[str, list[int]]:
        """Draft tokens for the next step, by request id. `hidden_states`: the step's HiddenRows, for a
        proposer that reads them."""
        spec, sched = self.config.speculative_config, self.scheduler
        # requests that ended before this step's schedule (aborts, stop strings) and during it
        finished = finished_before | sched.finished_request_ids
        self.proposer.drop(finished)
        if hidden_states:
            self.proposer.observe({rid: h for rid, h in hidden_states.items() if rid not in finished})
        k = spec.num_speculative_tokens
        if spec.disable_by_batch_size is not None:  # vLLM's rule, when asked for
            if sched.num_running > spec.disable_by_batch_size:
                return {}
        else:
            # Verification is nearly free while the step's decode rows stay on the weight-streaming kernels
            # (the CPU plan's measured crossover): fewer guesses per request as the batch grows, none past it.
            k = min(k, self.verify_row_budget // max(sched.num_running, 1) - 1)
            if k < 1:
                return {}
        if self.payoff is not None and not self.payoff.speculate():
            return {}
        batch = sched.draft_requests(k, budget=self.proposer.follows_budget)
        if not batch:
            return {}
        started = time.perf_counter()
        proposed = self.proposer.propose(batch)
        self._proposal_seconds = time.perf_counter() - started
        return {r.request_id: list(d[: r.max_drafts]) for r, d in zip(batch, proposed) if d}

    def _weigh(self, so, outputs: list[EngineCoreOutput], seconds: float) -> None:
        """Hand a decode-only step's time (with the proposal that fed it) and tokens to the payoff."""
        proposal, self._proposal_seconds = self._proposal_seconds, 0.0
        if not all(s.runs_as_decode_rows for s in so.scheduled):
            return  # a prefill chunk's time says nothing about decoding
        speculative = any(s.draft_token_ids for s in so.scheduled)
        self.payoff.record(speculative, seconds + proposal, sum(len(o.new_token_ids) for o in outputs))

    def check_health(self) -> None:
        """Raise if the model's worker processes (tensor parallelism) died or failed."""
        self.executor.check_health()

    def shutdown(self) -> None:
        self.executor.shutdown()

    def check_invariants(self) -> dict[str, int]:
        return self.kv_cache_manager.check_invariants()


def _plan_text(config: EngineConfig) -> str:
    """The CPU plan a CPU engine runs by; a GPU engine's device (its CPU plan is never detected: that would
    build the CPU kernels for nothing)."""
    return cpu_plan.plan().describe() if config.torch_device.type == "cpu" else f"none ({config.torch_device})"


def _verify_row_budget(config: EngineConfig) -> int:
    """Decode rows per step up to which the linear layers run the weight-streaming GEMV kernels on this CPU
    (quantized weights: `quant_max_rows`; float weights: `native_max_rows`), where scoring draft tokens
    costs little more than the one row each request decodes anyway. On a GPU, a decode step of a few
    dozen rows reads the weights once like one row does."""
    if config.torch_device.type != "cpu":
        return 32
    plan = cpu_plan.plan()
    if config._quantized_source() is None:
        return max(2, plan.native_max_rows)
    rows = plan.quant_max_rows
    if plan.quant_gemm == "int8" and plan.quant_gemm_rows > 0:
        # int8-block weights take the int8 GEMM from quant_gemm_rows rows: a verification step past it
        # would round its rows other than a one-row decode does (speculation must not change the output)
        rows = min(rows, plan.quant_gemm_rows - 1)
    return max(2, rows)
