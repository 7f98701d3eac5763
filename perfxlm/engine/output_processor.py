"""Engine-core outputs -> user-facing RequestOutputs.

Per request: detokenize incrementally, apply stop strings, collect logprobs, and shape the result
per output_kind (CUMULATIVE / DELTA / FINAL_ONLY). A request with n > 1 (or best_of) runs in the core
as several sibling sequences; here they are gathered back into one RequestOutput, whose
`outputs` list holds one CompletionOutput per sibling (best_of: the n with the highest cumulative
logprob, when all have finished).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from perfxlm.engine.detokenizer import IncrementalDetokenizer
from perfxlm.engine.input_processor import ProcessedRequest
from perfxlm.engine.messages import EngineCoreOutput, LogprobEntry
from perfxlm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from perfxlm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("perfxlm")


class SequenceState:
    """One generated sequence (one sibling of the request)."""

    def __init__(self, index: int, params: SamplingParams, tokenizer: Any, prompt_token_ids: list[int]) -> None:
        self.index = index
        self.params = params
        self.detokenizer = (
            IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
            if tokenizer is not None and params.detokenize
            else None
        )
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.text = ""
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.needs_sampled_logprob else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.sent_tokens = 0  # DELTA bookkeeping
        self.sent_chars = 0
        self.sent_logprobs = 0
        self.max_stop_len = max((len(s) for s in params.stop), default=0)
        self.updated = False

    def add(self, out: EngineCoreOutput) -> str | None:
        """Take one engine output; return a stop string if one matched (the sequence must end)."""
        if len(out.new_token_ids) > 1 and self.params.stop and self.detokenizer is not None:
            # Several tokens at once (speculative decoding): one at a time, so a stop string ends the
            # output at the token that completed it, as it would have without speculation.
            last = len(out.new_token_ids) - 1
            for i, token in enumerate(out.new_token_ids):
                lp = out.new_logprobs[i : i + 1] if out.new_logprobs else None
                one = dataclasses.replace(out, new_token_ids=[token], new_logprobs=lp,
                                          finish_reason=out.finish_reason if i == last else None,
                                          stop_reason=out.stop_reason if i == last else None)  # fmt: skip
                stop = self._add(one)
                if stop is not None:
                    return stop
            return None
        return self._add(out)

    def _add(self, out: EngineCoreOutput) -> str | None:
        self.updated |= bool(out.new_token_ids) or out.finish_reason is not None
        self.token_ids.extend(out.new_token_ids)
        if out.finish_reason is not None:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
        for entry in out.new_logprobs or ():
            if self.cumulative_logprob is not None:
                self.cumulative_logprob += entry[1][0]
            if self.logprobs is not None:
                self.logprobs.append(to_logprob_dict(entry, self.tokenizer))
        if self.detokenizer is None:
            return None
        new_ids = out.new_token_ids
        if out.finish_reason == "stop" and not isinstance(out.stop_reason, str) and not (
            self.params.include_stop_str_in_output and out.stop_reason is not None
        ):
            new_ids = new_ids[:-1]  # the EOS / stop token is not part of the text
        old_len = len(self.text)
        self.text += self.detokenizer.add_tokens(new_ids)
        # vLLM: stop strings count only from min_tokens on, and a stop string completed by the token
        # that reached max_tokens still ends (and is cut from) the text: "stop" wins over "length".
        if (self.params.stop and self.finish_reason in (None, "length")
                and len(self.token_ids) >= self.params.min_tokens):
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

    def completion(self, kind: RequestOutputKind) -> CompletionOutput:
        finished = self.finish_reason is not None
        text_end = len(self.text)
        if not finished and self.params.stop and not self.params.include_stop_str_in_output:
            # Hold back what might be the start of a stop string, so it is never streamed.
            text_end = max(self.sent_chars, text_end - self.max_stop_len + 1)
        if kind == RequestOutputKind.DELTA:
            text, token_ids = self.text[self.sent_chars : text_end], self.token_ids[self.sent_tokens :]
            logprobs = None if self.logprobs is None else self.logprobs[self.sent_logprobs :]
            self.sent_chars, self.sent_tokens = text_end, len(self.token_ids)
            self.sent_logprobs = len(self.logprobs or ())
        else:
            text, token_ids = self.text[:text_end], list(self.token_ids)
            logprobs = None if self.logprobs is None else list(self.logprobs)
        self.updated = False
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=self.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


def to_logprob_dict(entry: LogprobEntry, tokenizer: Any) -> dict[int, Logprob]:
    ids, lps, rank = entry
    result: dict[int, Logprob] = {}
    for pos, (tid, lp) in enumerate(zip(ids, lps)):
        if tid in result:
            continue
        # Column 0 is the chosen token (its own rank); columns 1.. are the top-k in order.
        token_rank = rank if pos == 0 else pos
        text = decode_token(tokenizer, tid) if tokenizer is not None else None
        result[tid] = Logprob(logprob=lp, rank=token_rank, decoded_token=text)
    return result


def decode_token(tokenizer: Any, token_id: int) -> str:
    """One token's text, decoded once per tokenizer and id: logprob rows repeat the same candidates
    step after step, and a decode call costs microseconds each."""
    cache = getattr(tokenizer, "_perfxlm_token_text", None)
    if cache is None:
        cache = {}
        try:
            tokenizer._perfxlm_token_text = cache
        except AttributeError:  # a tokenizer that takes no attributes: decode every time
            return tokenizer.decode([token_id])
    text = cache.get(token_id)
    if text is None:
        text = cache[token_id] = tokenizer.decode([token_id])
    return text


class RequestState:
    def __init__(
        self,
        request_id: str,
        child_ids: list[str],
        child_params: list[SamplingParams],
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
        self.tokenizer = tokenizer
        self.child_ids = child_ids
        self.seqs = [SequenceState(i, p, tokenizer, prompt_token_ids) for i, p in enumerate(child_params)]
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = (
            [None] if params.prompt_logprobs is not None else None
        )
        self.num_cached_tokens = 0
        self.lora_request = None  # the request's LoRARequest, echoed on its outputs as vLLM does
        self.metrics = RequestMetrics(arrival_time=arrival_time, last_token_time=arrival_time)
        self.spec_counts: dict[int, tuple[int, int]] = {}  # sequence index -> (draft, accepted tokens)

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)

    def add_spec_counts(self, index: int, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """A sequence's speculative-decoding totals so far; the metrics hold the sums over sequences."""
        self.spec_counts[index] = (num_draft_tokens, num_accepted_tokens)
        self.metrics.spec_num_draft_tokens = sum(d for d, _ in self.spec_counts.values())
        self.metrics.spec_num_accepted_tokens = sum(a for _, a in self.spec_counts.values())

    def add_prompt_logprobs(self, first: int, entries: list[LogprobEntry]) -> None:
        if self.prompt_logprobs is None:
            return
        for offset, entry in enumerate(entries):
            if first + offset == len(self.prompt_logprobs):  # recomputation after preemption repeats positions
                self.prompt_logprobs.append(to_logprob_dict(entry, self.tokenizer))

    def make_output(self, now: float) -> RequestOutput | None:
        finished = self.finished
        if finished:
            self.metrics.finished_time = now
        kind = self.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        n = self.params.n
        if len(self.seqs) > n:  # best_of: only the final answer, the n best
            if not finished:
                return None
            ranked = sorted(self.seqs, key=lambda s: s.cumulative_logprob or 0.0, reverse=True)[:n]
            completions = [s.completion(RequestOutputKind.CUMULATIVE) for s in ranked]
            for i, c in enumerate(completions):
                c.index = i
        elif kind == RequestOutputKind.DELTA:
            # Only what changed: a sibling that finished earlier already sent its final delta.
            completions = [s.completion(kind) for s in self.seqs if s.updated]
        else:
            completions = [s.completion(kind) for s in self.seqs]
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=self.prompt_logprobs,
            outputs=completions,
            finished=finished,
            metrics=self.metrics,
            num_cached_tokens=self.num_cached_tokens,
            lora_request=self.lora_request,
        )


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}
        self.child_to_parent: dict[str, tuple[RequestState, int]] = {}

    def add_request(self, request_id: str, pr: ProcessedRequest, arrival_time: float) -> None:
        state = RequestState(request_id, pr.child_ids, pr.child_params, pr.prompt, pr.request.prompt_token_ids,
                             pr.params, self.tokenizer, arrival_time)
        if pr.request.lora is not None:
            state.lora_request = pr.request.lora.request
        self.states[request_id] = state
        for i, cid in enumerate(pr.child_ids):
            self.child_to_parent[cid] = (state, i)

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[tuple[str, str]]]:
        """Returns the RequestOutputs to deliver and (sequence id, stop string) pairs to end in the core."""
        now = time.time()
        touched: dict[str, RequestState] = {}
        stopped: list[tuple[str, str]] = []
        for out in outputs:
            found = self.child_to_parent.get(out.request_id)
            if found is None:
                continue
            state, index = found
            if state.seqs[index].finish_reason is not None:
                continue  # ended here (stop string) while the core was already computing its next token
            if out.error is not None:
                logger.warning("request %r failed on its own and was aborted: %s", state.request_id, out.error)
            m = state.metrics
            if m.first_scheduled_time is None and out.first_scheduled_time is not None:
                m.first_scheduled_time = out.first_scheduled_time
                m.time_in_queue = out.first_scheduled_time - m.arrival_time
            if out.new_token_ids:
                if m.first_token_time is None:
                    m.first_token_time = now
                m.last_token_time = now
            state.num_cached_tokens = out.num_cached_tokens
            if out.num_draft_tokens:
                state.add_spec_counts(index, out.num_draft_tokens, out.num_accepted_tokens)
            if out.new_prompt_logprobs is not None:
                state.add_prompt_logprobs(*out.new_prompt_logprobs)
            stop = state.seqs[index].add(out)
            if stop is not None:
                stopped.append((out.request_id, stop))
            touched[state.request_id] = state
        results = []
        for state in touched.values():
            if not any(s.updated for s in state.seqs):
                continue  # only prompt logprobs of a chunk so far
            result = state.make_output(now)
            if result is not None:
                results.append(result)
            if state.finished:
                self._drop(state)
        return results, stopped

    def _drop(self, state: RequestState) -> None:
        self.states.pop(state.request_id, None)
        for cid in state.child_ids:
            self.child_to_parent.pop(cid, None)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish a request as aborted; returns its final output (None if unknown)."""
        state = self.states.get(request_id)
        if state is None:
            return None
        for seq in state.seqs:
            if seq.finish_reason is None:
                seq.finish_reason, seq.stop_reason, seq.updated = "abort", None, True
        out = state.make_output(time.time())
        self._drop(state)
        return out
