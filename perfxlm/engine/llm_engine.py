"""The synchronous engine: input processor -> scheduler -> model runner -> output processor, one step at a time."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from perfxlm.config import EngineConfig
from perfxlm.engine.input_processor import InputProcessor, PromptType
from perfxlm.engine.kv_cache_manager import KVCacheManager
from perfxlm.engine.output_processor import OutputProcessor
from perfxlm.engine.request import RequestStatus
from perfxlm.engine.scheduler import Scheduler
from perfxlm.model.loader import get_model
from perfxlm.outputs import RequestOutput
from perfxlm.sampling_params import SamplingParams
from perfxlm.worker.model_runner import ModelRunner

logger = logging.getLogger("perfxlm")

DEFAULT_KV_CACHE_GIB = 4.0


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config.resolve()
        if config.seed is not None:
            torch.manual_seed(config.seed)
        self.tokenizer = None
        if not config.skip_tokenizer_init:
            from perfxlm.tokenizer import get_tokenizer

            self.tokenizer = get_tokenizer(config.model, config.tokenizer)
        self.model = get_model(config.model, config.hf_config, config.torch_dtype, config.load_format, config.seed)
        self.num_kv_blocks = self._num_kv_blocks()
        self.runner = ModelRunner(self.model, self.num_kv_blocks, config.block_size, config.torch_dtype)
        self.kv_cache_manager = KVCacheManager(self.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.kv_cache_manager, config.max_num_seqs, config.max_num_batched_tokens, config.max_model_len
        )
        self.input_processor = InputProcessor(config, self.tokenizer, self.num_kv_blocks)
        self.output_processor = OutputProcessor(self.tokenizer)
        logger.info(
            "perfxlm engine: model=%s dtype=%s kv_blocks=%d x %d tokens, max_model_len=%d",
            config.model, config.torch_dtype, self.num_kv_blocks, config.block_size, config.max_model_len,
        )

    def _num_kv_blocks(self) -> int:
        c = self.config
        if c.num_kv_blocks is not None:
            return c.num_kv_blocks
        per_block = ModelRunner.kv_bytes_per_block(self.model, c.block_size, c.torch_dtype)
        if c.kv_cache_gib is not None:
            if c.kv_cache_gib <= 0:
                raise ValueError(f"kv_cache_gib must be > 0, got {c.kv_cache_gib}.")
            num = int(c.kv_cache_gib * (1 << 30) // per_block)
        else:
            # Never more than every seat filled to max_model_len could use.
            ceiling = c.max_num_seqs * -(-c.max_model_len // c.block_size)
            num = min(int(DEFAULT_KV_CACHE_GIB * (1 << 30) // per_block), ceiling)
        if num < 1:
            raise ValueError(f"kv_cache_gib={c.kv_cache_gib} is too small for one block ({per_block} bytes).")
        return num

    # ---- requests ------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams, arrival_time: float | None = None
    ) -> None:
        arrival_time = arrival_time if arrival_time is not None else time.time()
        if request_id in self.output_processor.states:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        pr = self.input_processor.process(request_id, prompt, params, arrival_time)
        self.scheduler.add_request(pr.request)
        self.output_processor.add_request(
            request_id, pr.child_ids, pr.child_params, pr.prompt, pr.request.prompt_token_ids, pr.params, arrival_time
        )

    def abort_request(self, request_ids: list[str]) -> list[RequestOutput]:
        outs = []
        for rid in request_ids:
            state = self.output_processor.states.get(rid)
            if state is not None:
                self.scheduler.finish_requests(state.child_ids, RequestStatus.FINISHED_ABORTED)
                outs.append(self.output_processor.abort(rid))
        return [o for o in outs if o is not None]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        so = self.scheduler.schedule()
        if so.is_empty:
            return []
        mro = self.runner.execute(so)
        core_outputs = self.scheduler.update_from_output(so, mro)
        outputs, stopped = self.output_processor.process(core_outputs)
        for rid, stop in stopped:
            self.scheduler.finish_requests([rid], RequestStatus.FINISHED_STOPPED, stop_reason=stop)
        return outputs

    # ---- introspection -------------------------------------------------------------------
    def check_invariants(self) -> dict[str, int]:
        return self.kv_cache_manager.check_invariants()

    def get_tokenizer(self) -> Any:
        return self.tokenizer
