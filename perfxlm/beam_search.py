"""Beam search with vLLM's types and rules (`LLM.beam_search`, `AsyncLLM.beam_search`, `use_beam_search`).

Each step runs every live beam as an ordinary one-token request for its whole token list asking for
2 * beam_width logprobs; the prefix cache holds the blocks earlier steps computed (the prompt's, shared
by all beams of that prompt), so a step recomputes at most one partial block per beam. The search
itself is plain bookkeeping over those logprob rows, here, so the offline and the asynchronous front
ends run the same rules:

- every candidate of a beam's row is a new beam with cum_logprob + logprob; one ending in an EOS id
  (unless ignore_eos) is set aside as completed, whatever its rank among the row's 2 * beam_width;
- the beam_width best of the rest go on, ranked by `get_beam_search_score`: cum_logprob divided by
  (the whole sequence's length, prompt included, EOS not counted) ** length_penalty;
- after max_tokens steps the answer is the beam_width best of completed and live beams together.

transformers' `generate(num_beams=...)` differs in three places: it divides by the generated length
(EOS counted), keeps an EOS candidate only when it ranks among the best num_beams of the step, and with
early_stopping=True stops once num_beams beams have finished. With no EOS in play (ignore_eos here,
eos_token_id=None there) both return the same beams in the same order; tests/engine/test_beam_search.py
checks that, and the rest against a plain reference of the rules above on transformers' logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Sequence

from perfxlm.outputs import CompletionOutput, Logprob, RequestOutput
from perfxlm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams


@dataclass
class BeamSearchSequence:
    """One beam: all its tokens (the prompt's first), one logprob row per generated token, and its score's sum."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    lora_request: Any = None
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (an EOS id), "length" (max_tokens reached)
    stop_reason: int | str | None = None
    multi_modal_data: Any = None
    mm_processor_kwargs: Any = None


@dataclass
class BeamSearchOutput:
    """The beam_width best sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


class BeamSearchInstance:
    """One prompt's search: its live beams and those that ended in an EOS id."""

    def __init__(self, prompt_tokens: list[int], lora_request: Any = None,
                 logprobs: list[dict[int, Logprob]] | None = None, **kwargs: Any) -> None:
        self.beams = [BeamSearchSequence(tokens=list(prompt_tokens), logprobs=list(logprobs or ()),
                                         lora_request=lora_request, **kwargs)]
        self.completed: list[BeamSearchSequence] = []


def get_beam_search_score(tokens: list[int], cumulative_logprob: float, eos_token_id: int | Collection[int],
                          length_penalty: float = 1.0) -> float:
    """vLLM's score: the sum of logprobs over (the sequence's length, prompt included, a final EOS not
    counted) ** length_penalty."""
    eos = {eos_token_id} if isinstance(eos_token_id, int) else eos_token_id
    seq_len = len(tokens)
    if tokens and tokens[-1] in eos:
        seq_len -= 1
    return cumulative_logprob / (seq_len ** length_penalty)


def create_sort_beams_key_function(eos_token_id: int | Collection[int], length_penalty: float
                                   ) -> Callable[[BeamSearchSequence], float]:
    eos = {eos_token_id} if isinstance(eos_token_id, int) else frozenset(eos_token_id)

    def sort_beams_key(beam: BeamSearchSequence) -> float:
        return get_beam_search_score(beam.tokens, beam.cum_logprob, eos, length_penalty)

    return sort_beams_key


def check_beam_search(params: BeamSearchParams, prompt_lens: Sequence[int], max_model_len: int,
                      max_logprobs: int, vocab_size: int) -> None:
    """Engine bounds, checked before the first step runs (ValueError saying what to change)."""
    if not isinstance(params, BeamSearchParams):
        raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}.")
    wanted = 2 * params.beam_width
    if wanted > max_logprobs:
        raise ValueError(
            f"beam_width must be at most {max_logprobs // 2}, got {params.beam_width}: each step ranks "
            f"2 * beam_width candidates per beam, and the engine's max_logprobs is {max_logprobs} "
            "(raise max_logprobs for wider beams).")
    if wanted > vocab_size:
        raise ValueError(f"beam_width must be at most half the vocabulary ({vocab_size // 2}), "
                         f"got {params.beam_width}.")
    for n in prompt_lens:
        if n == 0:
            raise ValueError("The prompt is empty: give at least one token.")
        if n + params.max_tokens > max_model_len:
            raise ValueError(
                f"The prompt ({n} tokens) plus max_tokens ({params.max_tokens}) is {n + params.max_tokens} "
                f"tokens, more than max_model_len ({max_model_len}): lower max_tokens or shorten the prompt.")


class BeamSearch:
    """The search over several prompts, one step at a time: `pending()` lists the beams to run next,
    `advance(rows)` takes each one's logprob row, `results()` ranks what is left."""

    def __init__(self, prompts: Sequence[list[int]], params: BeamSearchParams, eos_token_ids: Collection[int]
                 ) -> None:
        self.params = params
        # With ignore_eos an EOS id is an ordinary token, in the score's length too (vLLM still discounts
        # it there, which ranks a beam lower for the step it ends in EOS and contradicts ignoring it).
        self.eos = frozenset(() if params.ignore_eos else eos_token_ids)
        self.sort_key = create_sort_beams_key_function(self.eos, params.length_penalty)
        self.instances = [BeamSearchInstance(list(p)) for p in prompts]
        self.steps_left = params.max_tokens
        # 2 * beam_width candidates per beam, as transformers gathers them; the step's own sampled token
        # (temperature > 0) joins its row as vLLM's does.
        self.step_params = SamplingParams(logprobs=2 * params.beam_width, max_tokens=1,
                                          temperature=params.temperature, ignore_eos=True,
                                          output_kind=RequestOutputKind.FINAL_ONLY)

    def pending(self) -> list[BeamSearchSequence]:
        if self.steps_left <= 0:
            return []
        return [beam for instance in self.instances for beam in instance.beams]

    def advance(self, rows: Sequence[dict[int, Logprob] | None]) -> None:
        """rows[i]: the next-token logprobs after pending()[i], or None for a beam that could not run."""
        pending = self.pending()
        if len(rows) != len(pending):
            raise ValueError(f"advance() got {len(rows)} rows for {len(pending)} beams")
        it = iter(rows)
        for instance in self.instances:
            candidates: list[BeamSearchSequence] = []
            for beam in instance.beams:
                row = next(it)
                if row is None:
                    continue
                for token_id, lp in row.items():
                    new = BeamSearchSequence(tokens=beam.tokens + [token_id], logprobs=beam.logprobs + [row],
                                             lora_request=beam.lora_request, cum_logprob=beam.cum_logprob + lp.logprob)
                    if token_id in self.eos:
                        new.finish_reason, new.stop_reason = "stop", token_id
                        instance.completed.append(new)
                    else:
                        candidates.append(new)
            candidates.sort(key=self.sort_key, reverse=True)  # stable: ties keep the row's rank order
            instance.beams = candidates[: self.params.beam_width]
        self.steps_left -= 1

    def results(self) -> list[list[BeamSearchSequence]]:
        """Per prompt, the beam_width best of completed and live beams, best first."""
        out = []
        for instance in self.instances:
            for beam in instance.beams:
                beam.finish_reason = "length"
            ranked = sorted(instance.completed + instance.beams, key=self.sort_key, reverse=True)
            out.append(ranked[: self.params.beam_width])
        return out


def to_request_output(request_id: str, prompt: str | None, prompt_token_ids: list[int],
                      beams: list[BeamSearchSequence], params: BeamSearchParams, tokenizer: Any,
                      logprobs: int | None = None) -> RequestOutput:
    """vLLM's asynchronous result: one finished RequestOutput, a completion per beam holding the generated
    tokens only (the EOS token and its text only with include_stop_str_in_output) and, unless logprobs is
    None, each token's logprob with that many of its row's best candidates."""
    n = len(prompt_token_ids)
    outputs = []
    for i, beam in enumerate(beams):
        generated = beam.tokens[n:]
        if beam.finish_reason == "stop" and not params.include_stop_str_in_output:
            generated = generated[:-1]
        text = tokenizer.decode(generated, skip_special_tokens=False) if tokenizer is not None else ""
        rows = None
        if logprobs is not None:
            rows = [{t: lp for t, lp in row.items() if t == chosen or (lp.rank or 0) <= logprobs}
                    for row, chosen in zip(beam.logprobs, generated)]
        outputs.append(CompletionOutput(index=i, text=text, token_ids=generated, cumulative_logprob=beam.cum_logprob,
                                        logprobs=rows, finish_reason=beam.finish_reason,
                                        stop_reason=beam.stop_reason))
    return RequestOutput(request_id=request_id, prompt=prompt, prompt_token_ids=list(prompt_token_ids),
                         prompt_logprobs=None, outputs=outputs, finished=True)
