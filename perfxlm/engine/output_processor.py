"""Engine-core outputs -> user-facing RequestOutputs: detokenize, apply stop strings, shape per
output_kind (CUMULATIVE / DELTA / FINAL_ONLY), and stamp the request's metrics."""

from __future__ import annotations

import time
from typing import Any

from perfxlm.engine.detokenizer import IncrementalDetokenizer
from perfxlm.engine.messages import EngineCoreOutput
from perfxlm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from perfxlm.sampling_params import RequestOutputKind, SamplingParams


class RequestState:
    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Any,
        arrival_time: float,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.output_kind = params.output_kind
        self.detokenizer = (
            IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
            if tokenizer is not None and params.detokenize
            else None
        )
        self.token_ids: list[int] = []
        self.text = ""
        self.sent_tokens = 0  # DELTA bookkeeping
        self.sent_chars = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0
        self.metrics = RequestMetrics(arrival_time=arrival_time, last_token_time=arrival_time)
        self.max_stop_len = max((len(s) for s in params.stop), default=0)

    def add(self, out: EngineCoreOutput, now: float) -> str | None:
        """Take one engine output; return a stop string if one matched (the request must end)."""
        m = self.metrics
        if m.first_scheduled_time is None and out.first_scheduled_time is not None:
            m.first_scheduled_time = out.first_scheduled_time
            m.time_in_queue = out.first_scheduled_time - m.arrival_time
        if out.new_token_ids and m.first_token_time is None:
            m.first_token_time = now
        m.last_token_time = now
        self.num_cached_tokens = out.num_cached_tokens
        self.token_ids.extend(out.new_token_ids)
        if out.finish_reason is not None:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
        if self.detokenizer is None:
            return None
        new_ids = out.new_token_ids
        if out.finish_reason == "stop" and not isinstance(out.stop_reason, str):
            new_ids = new_ids[:-1]  # the EOS / stop token is not part of the text
        old_len = len(self.text)
        self.text += self.detokenizer.add_tokens(new_ids)
        if self.params.stop and self.finish_reason is None:
            return self._check_stop_strings(old_len)
        return None

    def _check_stop_strings(self, old_len: int) -> str | None:
        search_from = max(0, old_len - self.max_stop_len + 1)
        best: tuple[int, str] | None = None
        for stop in self.params.stop:
            idx = self.text.find(stop, search_from)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        idx, stop = best
        self.text = self.text[: idx + len(stop)] if self.params.include_stop_str_in_output else self.text[:idx]
        self.finish_reason, self.stop_reason = "stop", stop
        return stop

    def make_output(self, now: float) -> RequestOutput | None:
        finished = self.finish_reason is not None
        if finished:
            self.metrics.finished_time = now
        if self.output_kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        text_end = len(self.text)
        if not finished and self.params.stop and not self.params.include_stop_str_in_output:
            # Hold back what might be the start of a stop string, so it is never streamed.
            text_end = max(self.sent_chars, text_end - self.max_stop_len + 1)
        if self.output_kind == RequestOutputKind.DELTA:
            text, token_ids = self.text[self.sent_chars : text_end], self.token_ids[self.sent_tokens :]
            self.sent_chars, self.sent_tokens = text_end, len(self.token_ids)
        else:
            text, token_ids = self.text[:text_end], list(self.token_ids)
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=None,
            logprobs=None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=None,
            outputs=[completion],
            finished=finished,
            metrics=self.metrics,
            num_cached_tokens=self.num_cached_tokens,
        )


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float) -> None:
        self.states[request_id] = RequestState(request_id, prompt, prompt_token_ids, params, self.tokenizer, arrival_time)

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[tuple[str, str]]]:
        """Returns the RequestOutputs to deliver and (request_id, stop string) pairs to end in the core."""
        now = time.time()
        results: list[RequestOutput] = []
        stopped: list[tuple[str, str]] = []
        for out in outputs:
            state = self.states.get(out.request_id)
            if state is None:
                continue
            stop = state.add(out, now)
            if stop is not None:
                stopped.append((out.request_id, stop))
            result = state.make_output(now)
            if result is not None:
                results.append(result)
            if state.finish_reason is not None:
                del self.states[out.request_id]
        return results, stopped

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish a request as aborted; returns its final output (None if unknown)."""
        state = self.states.pop(request_id, None)
        if state is None:
            return None
        state.finish_reason, state.stop_reason = "abort", None
        return state.make_output(time.time())
