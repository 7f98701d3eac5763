"""SchedulerOutput as a value for the worker processes: a request's prompt and sampling parameters are
sent once, then per step only its new output tokens, its new KV blocks and how many tokens to compute.

The encoder (engine side) and the decoder (each worker) keep the same mirror of every request the
workers know: its tokens and its block table. A step's tokens to compute are a slice of the mirrored
tokens (`num_computed_tokens` onwards), so they never travel. A block table sent before is extended when
the new table starts with it (the usual case: blocks appended as the sequence grows), else sent whole
(after a preemption). Finished requests leave both mirrors first, so a re-added id starts afresh.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from perfxlm.engine.messages import ScheduledRequest, SchedulerOutput


@dataclass(slots=True)
class _Sent:
    blocks: np.ndarray
    num_outputs: int


@dataclass(slots=True)
class StepDelta:
    # (request id, sampling params, prompt token ids) for requests the workers have not seen
    new: list[tuple[str, Any, list[int]]]
    # (request id, num tokens, num computed, do_sample, new output ids, blocks, blocks replace, fork children,
    # draft token ids: the guesses behind the first token, which the mirror cannot know)
    scheduled: list[tuple[str, int, int, bool, list[int], list[int], bool, list, list[int]]]
    num_batched_tokens: int
    finished_request_ids: set[str] = field(default_factory=set)
    num_preemptions: int = 0
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)


class DeltaEncoder:
    def __init__(self) -> None:
        self.sent: dict[str, _Sent] = {}

    def encode(self, so: SchedulerOutput) -> StepDelta:
        for rid in so.finished_request_ids:
            self.sent.pop(rid, None)
        new: list[tuple[str, Any, list[int]]] = []
        items = []
        for s in so.scheduled:
            rid = s.request_id
            blocks = np.asarray(s.block_ids, dtype=np.int64)
            state = self.sent.get(rid)
            if state is None:
                new.append((rid, s.sampling_params, list(s.prompt_token_ids)))
                state = self.sent[rid] = _Sent(np.empty(0, dtype=np.int64), 0)
            n_old = len(state.blocks)
            if len(blocks) >= n_old and np.array_equal(blocks[:n_old], state.blocks):
                new_blocks, replace = blocks[n_old:].tolist(), False
            else:
                new_blocks, replace = blocks.tolist(), True
            state.blocks = blocks.copy()
            outputs = s.output_token_ids
            new_outputs = list(outputs[state.num_outputs :])
            state.num_outputs = len(outputs)
            drafts = list(s.draft_token_ids)
            items.append((rid, len(s.token_ids) - len(drafts), s.num_computed_tokens, s.do_sample, new_outputs,
                          new_blocks, replace, list(s.fork_children), drafts))
        return StepDelta(new, items, so.num_batched_tokens, set(so.finished_request_ids), so.num_preemptions,
                         list(so.blocks_to_copy))


@dataclass(slots=True)
class _Mirror:
    params: Any
    prompt: list[int]
    outputs: list[int]
    blocks: list[int]


class DeltaDecoder:
    def __init__(self) -> None:
        self.requests: dict[str, _Mirror] = {}

    def decode(self, delta: StepDelta) -> SchedulerOutput:
        for rid in delta.finished_request_ids:
            self.requests.pop(rid, None)
        for rid, params, prompt in delta.new:
            self.requests[rid] = _Mirror(params, prompt, [], [])
        scheduled = []
        for rid, n, computed, do_sample, new_outputs, blocks, replace, forks, drafts in delta.scheduled:
            m = self.requests[rid]
            m.outputs.extend(new_outputs)
            if replace:
                m.blocks = blocks
            else:
                m.blocks.extend(blocks)
            n_prompt = len(m.prompt)
            if computed + n <= n_prompt:
                token_ids = m.prompt[computed : computed + n]
            elif computed >= n_prompt:
                token_ids = m.outputs[computed - n_prompt : computed - n_prompt + n]
            else:
                token_ids = (m.prompt + m.outputs)[computed : computed + n]
            scheduled.append(ScheduledRequest(rid, token_ids + drafts if drafts else token_ids, computed, m.blocks,
                                              do_sample, m.params, m.prompt, m.outputs, forks, drafts))
        return SchedulerOutput(scheduled, delta.num_batched_tokens, delta.finished_request_ids,
                               delta.num_preemptions, delta.blocks_to_copy)
