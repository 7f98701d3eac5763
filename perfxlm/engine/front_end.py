"""What every front end (the offline LLMEngine, the threaded engine behind the server) builds the same
way: the tokenizer, the core (one EngineCore, or the data-parallel router over replicas of it) and the
input and output processors."""

from __future__ import annotations

from perfxlm.config import EngineConfig
from perfxlm.engine.data_parallel import DataParallelCore
from perfxlm.engine.engine_core import EngineCore
from perfxlm.engine.input_processor import InputProcessor
from perfxlm.engine.output_processor import OutputProcessor
from perfxlm.lora.registry import LoRARegistry


class EngineFrontEndParts:
    """What every front end builds the same way: tokenizer, core, input and output processors."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config.resolve()
        _check_generate_runner(config)
        self.tokenizer = None
        if not config.skip_tokenizer_init:
            from perfxlm.tokenizer import get_tokenizer

            self.tokenizer = get_tokenizer(config.model, config.tokenizer)
        if config.data_parallel_size > 1:  # replicas in their own processes, one router here
            self.core = DataParallelCore(config)
        else:
            self.core = EngineCore(config)
        self.num_kv_blocks = self.core.num_kv_blocks
        # the engine's decisions, max_model_len fitted to the KV pool: what requests are checked against
        self.resolved = self.core.resolved
        self.loras = None  # enable_lora: the loaded adapters, shared by every caller thread
        if config.lora_config is not None:
            self.loras = LoRARegistry(self.core.lora_targets, config.lora_config)
        self.input_processor = InputProcessor(config, self.resolved, self.tokenizer, self.num_kv_blocks, self.loras)
        self.output_processor = OutputProcessor(self.tokenizer)


def _check_generate_runner(config: EngineConfig) -> None:
    """These front ends run the generate runner; a pooling model goes through LLM(runner="pooling") or the
    pooling server (perfxlm/pooling/), refused here before anything loads."""
    from perfxlm.model.registry import is_pooling_only

    if is_pooling_only(config.hf_config):
        raise ValueError(f"{config.hf_config.architectures[0]} is an encoder with no language-model head: it cannot "
                         "generate. Use LLM(model, runner='pooling') (embed, classify, score) or `perfxlm serve`.")
    if config.runner == "pooling" or config.convert in ("embed", "classify", "reward"):
        raise ValueError("runner='pooling' is served by LLM(model, runner='pooling') and `perfxlm serve`; this "
                         "engine runs the generate runner.")
