"""`LLM`: the offline entry point, with vLLM's constructor arguments, generate()/chat() (the generate runner)
and embed()/classify()/score()/encode() (the pooling runner, `perfxlm/pooling/`)."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Sequence

from tqdm import tqdm

from perfxlm.compat import split_vllm_kwargs
from perfxlm.config import EngineConfig
from perfxlm.engine.input_processor import PromptType
from perfxlm.engine.llm_engine import LLMEngine
from perfxlm.generation_defaults import load_generation_defaults
from perfxlm.outputs import RequestOutput
from perfxlm.pooling.llm_api import PoolingMethods
from perfxlm.pooling.runner_kind import select_runner
from perfxlm.sampling_params import RequestOutputKind, SamplingParams

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
        enforce_eager: bool = True,
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
        lora_request: Any = None,
        priority: list[int] | None = None,
        **unsupported: Any,
    ) -> list[RequestOutput]:
        _refuse_unsupported("generate", unsupported)
        self._require_runner("generate", "generate")
        if lora_request is not None:
            raise ValueError("lora_request: LoRA adapters are not supported by perfxlm; merge the adapter into the "
                             "weights (peft's merge_and_unload) and load the merged model.")
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
        return self._run(prompts, params_list, use_tqdm)

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
        lora_request: Any = None,
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

    def _run(self, prompts: list[PromptType], params_list: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        ids = [str(next(self._counter)) for _ in prompts]
        added: list[str] = []
        try:
            for rid, prompt, params in zip(ids, prompts, params_list):
                params = params.clone()
                params.output_kind = RequestOutputKind.FINAL_ONLY  # generate() only needs the end
                engine.add_request(rid, prompt, params)
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
