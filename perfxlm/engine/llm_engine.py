"""The synchronous engine: input processor -> scheduler -> model runner -> output processor, one step at a time."""

from __future__ import annotations

import time
from typing import Any

from perfxlm.config import EngineConfig
from perfxlm.engine.front_end import EngineFrontEndParts
from perfxlm.engine.input_processor import PromptType
from perfxlm.engine.request import RequestStatus
from perfxlm.outputs import RequestOutput
from perfxlm.sampling_params import SamplingParams


class LLMEngine(EngineFrontEndParts):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.scheduler = self.core.scheduler
        self.kv_cache_manager = self.core.kv_cache_manager

    # ---- requests ------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams, arrival_time: float | None = None,
        lora_request: Any = None,
    ) -> None:
        arrival_time = arrival_time if arrival_time is not None else time.time()
        if request_id in self.output_processor.states:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        pr = self.input_processor.process(request_id, prompt, params, arrival_time, lora_request)
        self.scheduler.add_request(pr.request)
        self.output_processor.add_request(request_id, pr, arrival_time)

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
        core_outputs = self.core.step()
        if not core_outputs:
            return []
        outputs, stopped = self.output_processor.process(core_outputs)
        for rid, stop in stopped:
            self.scheduler.finish_requests([rid], RequestStatus.FINISHED_STOPPED, stop_reason=stop)
        return outputs

    def shutdown(self) -> None:
        """Stop the model's worker processes (tensor parallelism); also done when the engine is collected."""
        self.core.shutdown()

    # ---- introspection -------------------------------------------------------------------
    def check_invariants(self) -> dict[str, int]:
        return self.kv_cache_manager.check_invariants()

    def get_tokenizer(self) -> Any:
        return self.tokenizer
