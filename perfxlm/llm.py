"""`LLM`: the offline entry point, with vLLM's constructor arguments, generate()/chat() (the generate runner)
and embed()/classify()/score()/encode() (the pooling runner, `perfxlm/pooling/`)."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Sequence

from tqdm import tqdm

from perfxlm.beam_search import BeamSearch, BeamSearchOutput, BeamSearchSequence
from perfxlm.compat import split_vllm_kwargs
from perfxlm.config import EngineConfig
from perfxlm.engine.input_processor import PromptType
from perfxlm.engine.llm_engine import LLMEngine
from perfxlm.generation_defaults import load_generation_defaults
from perfxlm.lora.request import LoRARequest
from perfxlm.outputs import RequestOutput
from perfxlm.pooling.llm_api import PoolingMethods
from perfxlm.pooling.runner_kind import select_runner
from perfxlm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

_ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig) if f.init} - {"hf_config", "torch_dtype", "eos_token_ids"}
# vLLM arguments with no engine field here (GPU sizing, hub revisions, ...) are handled by compat.py.


class LLM(PoolingMethods):
    def __init__(
        self,
        model: str | None = None,
        *,
        tokenizer: str | None = None,
        skip_tokenizer_init: bool = False,
        tensor_parallel_size: int = 1,
        dtype: str = "auto",
        quantization: str | dict[str, Any] | None = None,
        seed: int | None = 0,
        enforce_eager: bool = False,
        **kwargs: Any,
    ) -> None:
        generation_config = kwargs.pop("generation_config", "auto")
        kwargs, engine_kwargs = split_vllm_kwargs(kwargs)
        for key, value in kwargs.items():
            if key in _ENGINE_FIELDS:
                engine_kwargs[key] = value
            else:
                raise TypeError(f"LLM() got an unexpected keyword argument {key!r}.")
        config = EngineConfig(
            model=model,
            tokenizer=tokenizer,
            skip_tokenizer_init=skip_tokenizer_init,
            dtype=dtype,
            seed=seed,
            enforce_eager=enforce_eager,
            quantization=quantization,
            tensor_parallel_size=tensor_parallel_size,
            **engine_kwargs,
        )
        # the runner kind picks the engine: generation (scheduler, KV cache, sampler) or pooling (no cache)
        self.runner_kind = select_runner(config)
        if self.runner_kind == "pooling":
            from perfxlm.pooling.engine import PoolingEngine

            self.llm_engine: Any = PoolingEngine(config)
        else:
            self.llm_engine = LLMEngine(config)
        self._counter = itertools.count()
        self.default_sampling = load_generation_defaults(self.llm_engine.config.model, generation_config)

    @classmethod
    def from_engine_args(cls, engine_args: Any) -> "LLM":
        """vLLM's shape: LLM.from_engine_args(EngineArgs(model=..., ...))."""
        return cls(**engine_args.as_kwargs())

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's defaults, with the model's generation_config.json sampling values over them
        (generation_config="vllm" at construction leaves vLLM's alone)."""
        return SamplingParams(**self.default_sampling)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: list[int] | None = None,
        **unsupported: Any,
    ) -> list[RequestOutput]:
        """`lora_request`: one adapter for every prompt, or one (or None) per prompt (enable_lora=True)."""
        _refuse_unsupported("generate", unsupported)
        self._require_runner("generate", "generate")
        if priority is not None and any(p != 0 for p in priority):
            raise ValueError("priority: perfxlm schedules first come, first served (vLLM's default policy), where "
                             "a priority other than 0 is refused; drop it.")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"Got {len(params_list)} SamplingParams for {len(prompts)} prompts: give one, or one per prompt."
                )
        if not isinstance(lora_request, (list, tuple)):  # one for all (checked when the request is added)
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"Got {len(loras)} lora_requests for {len(prompts)} prompts: give one, or one "
                                 "(or None) per prompt.")
        return self._run(prompts, params_list, use_tqdm, loras)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        **unsupported: Any,
    ) -> list[RequestOutput]:
        """vLLM's chat(): tools and chat_template_kwargs (e.g. {"enable_thinking": False}) reach the
        template; continue_final_message continues the last assistant message instead of opening a new one."""
        _refuse_unsupported("chat", unsupported, ignored=("chat_template_content_format", "mm_processor_kwargs"))
        self._require_runner("generate", "chat")
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("chat() needs a tokenizer; this LLM was created with skip_tokenizer_init=True.")
        if continue_final_message and add_generation_prompt:
            add_generation_prompt = False  # vLLM: continuing the final message opens no new one
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(
                conversation, chat_template=chat_template, add_generation_prompt=add_generation_prompt, tokenize=False,
                continue_final_message=continue_final_message, tools=tools, **(chat_template_kwargs or {}),
            )
            # The template already holds the special tokens: tokenize without adding more.
            prompts.append({"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def beam_search(
        self,
        prompts: Sequence[PromptType],
        params: BeamSearchParams,
        lora_request: LoRARequest | None = None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search: per prompt, the beam_width best sequences (prompt tokens first, text decoded
        from all of them) after max_tokens steps; rules in perfxlm/beam_search.py. Each step is one engine
        run over every live beam; concurrency_limit bounds how many prompts search together."""
        self._require_runner("generate", "beam_search")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}.")
        if concurrency_limit is not None and (not isinstance(concurrency_limit, int) or concurrency_limit < 1):
            raise ValueError(f"concurrency_limit must be None or an integer >= 1, got {concurrency_limit!r}.")
        processor = self.llm_engine.input_processor
        token_lists = [processor.tokenize_prompt(p)[1] for p in prompts]
        processor.check_beam_search(params, token_lists)
        eos = processor.eos_token_ids()
        limit = concurrency_limit or max(1, len(token_lists))
        results: list[list[BeamSearchSequence]] = []
        groups = range(0, len(token_lists), limit)
        for start in tqdm(groups, desc="Beam search", dynamic_ncols=True, disable=not use_tqdm):
            search = BeamSearch(token_lists[start : start + limit], params, eos)
            while beams := search.pending():
                outs = self._run([{"prompt_token_ids": b.tokens} for b in beams],
                                 [search.step_params] * len(beams), use_tqdm=False,
                                 loras=[lora_request] * len(beams))
                search.advance([o.outputs[0].logprobs[0] if o.outputs[0].logprobs else None for o in outs])
            results.extend(search.results())
        tokenizer = self.get_tokenizer()
        for beams in results:
            for beam in beams:
                beam.text = tokenizer.decode(beam.tokens) if tokenizer is not None else None
        return [BeamSearchOutput(sequences=beams) for beams in results]

    def _run(self, prompts: list[PromptType], params_list: list[SamplingParams], use_tqdm: bool,
             loras: list[LoRARequest | None]) -> list[RequestOutput]:
        engine = self.llm_engine
        ids = [str(next(self._counter)) for _ in prompts]
        added: list[str] = []
        try:
            for rid, prompt, params, lora in zip(ids, prompts, params_list, loras):
                params = params.clone()
                params.output_kind = RequestOutputKind.FINAL_ONLY  # generate() only needs the end
                engine.add_request(rid, prompt, params, lora_request=lora)
                added.append(rid)
        except Exception:
            engine.abort_request(added)  # all or nothing: a bad prompt leaves no request behind
            raise
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        num_out_tokens = 0
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        num_out_tokens += len(out.outputs[0].token_ids)
                        bar.update(1)
                        elapsed = bar.format_dict["elapsed"] or 1e-9
                        bar.set_postfix_str(f"output: {num_out_tokens / elapsed:.1f} toks/s", refresh=False)
        except BaseException:
            engine.abort_request([rid for rid in ids if rid not in results])
            raise
        finally:
            bar.close()
        return [results[rid] for rid in ids]


def _refuse_unsupported(method: str, kwargs: dict[str, Any], ignored: tuple[str, ...] = ()) -> None:
    """vLLM arguments perfxlm has no equivalent for fail by name instead of being dropped silently."""
    unknown = sorted(k for k, v in kwargs.items() if not (k in ignored and v in (None, "auto", "string")))
    if unknown:
        raise TypeError(f"LLM.{method}() got argument(s) perfxlm does not support: {', '.join(unknown)}.")
