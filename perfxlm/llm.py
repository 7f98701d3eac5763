"""`LLM`: the offline entry point, with vLLM's constructor arguments and generate()/chat()."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Sequence

from tqdm import tqdm

from perfxlm.config import EngineConfig
from perfxlm.engine.input_processor import PromptType
from perfxlm.engine.llm_engine import LLMEngine
from perfxlm.outputs import RequestOutput
from perfxlm.sampling_params import RequestOutputKind, SamplingParams

_ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig) if f.init} - {"hf_config", "torch_dtype", "eos_token_ids"}
# GPU-only knobs of vLLM's LLM(): accepted so that vLLM code runs, with no effect on CPU.
_GPU_ONLY = {"gpu_memory_utilization", "swap_space", "cpu_offload_gb", "max_seq_len_to_capture",
             "disable_custom_all_reduce", "tokenizer_mode", "trust_remote_code", "revision", "tokenizer_revision",
             "disable_log_stats"}


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        tokenizer: str | None = None,
        skip_tokenizer_init: bool = False,
        tensor_parallel_size: int = 1,
        dtype: str = "auto",
        quantization: str | None = None,
        seed: int | None = 0,
        enforce_eager: bool = True,
        **kwargs: Any,
    ) -> None:
        if quantization is not None:
            raise ValueError(f"quantization={quantization!r} is not supported yet by perfxlm.")
        engine_kwargs = {}
        for key, value in kwargs.items():
            if key in _ENGINE_FIELDS:
                engine_kwargs[key] = value
            elif key not in _GPU_ONLY:
                raise TypeError(f"LLM() got an unexpected keyword argument {key!r}.")
        config = EngineConfig(
            model=model,
            tokenizer=tokenizer,
            skip_tokenizer_init=skip_tokenizer_init,
            dtype=dtype,
            seed=seed,
            enforce_eager=enforce_eager,
            tensor_parallel_size=tensor_parallel_size,
            **engine_kwargs,
        )
        self.llm_engine = LLMEngine(config)
        self._counter = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return SamplingParams()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        **unused: Any,
    ) -> list[RequestOutput]:
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
        **unused: Any,
    ) -> list[RequestOutput]:
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("chat() needs a tokenizer; this LLM was created with skip_tokenizer_init=True.")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(
                conversation, chat_template=chat_template, add_generation_prompt=add_generation_prompt, tokenize=False
            )
            # The template already holds the special tokens: tokenize without adding more.
            prompts.append({"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm)

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
