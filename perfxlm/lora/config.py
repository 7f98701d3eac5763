"""The engine's LoRA bounds, vLLM's argument names and defaults."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# vLLM's lora_dtype values this engine stores adapters in ("auto": the base weights' kind, see storage_dtype),
# and "int8" (perfxlm's: codes with a scale per row of A and column of B, a quarter of float32's bytes)
_DTYPES = {"auto": None, "float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "int8": torch.int8}


@dataclass(frozen=True)
class LoRAConfig:
    max_loras: int = 1  # distinct adapters one step may run (the runner's slots)
    max_lora_rank: int = 16  # the largest rank an adapter may have
    max_cpu_loras: int | None = None  # adapters kept loaded between requests (None: max_loras)
    dtype: str = "auto"  # vLLM's lora_dtype: what A and B are stored in

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
        key = str(self.dtype).removeprefix("torch.")
        if key not in _DTYPES:
            raise ValueError(f"lora_dtype={self.dtype!r} is not supported: adapters are stored in float32, "
                             "bfloat16 or int8 (use 'auto', 'float32', 'bfloat16' or 'int8').")
        object.__setattr__(self, "dtype", key)
        cpu = self.max_cpu_loras
        if cpu is not None and (isinstance(cpu, bool) or not isinstance(cpu, int) or cpu < self.max_loras):
            raise ValueError(f"max_cpu_loras must be an integer >= max_loras ({self.max_loras}), got {cpu!r}.")

    @property
    def cache_size(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    def storage_dtype(self, weight_dtype: torch.dtype, quantized: bool = False) -> torch.dtype:
        """A's and B's dtype beside base weights of `weight_dtype` (`quantized`: the linear weights stay
        quantized codes, GGUF or `quantization=`). "auto" keeps float32 adapters beside float32 weights (a
        float32 engine equals peft), bfloat16 ones beside bf16 weights, and int8 ones beside quantized
        weights: decode with an adapter is bound by reading A and B, which at bf16 cost a 4-bit model a
        tenth more bytes per step, and the base is no closer to the checkpoint than that (the README gives
        int8's measured distance from float32 adapters)."""
        chosen = _DTYPES[self.dtype]
        if chosen is not None:
            return chosen
        if weight_dtype == torch.float32:
            return torch.float32
        return torch.int8 if quantized else torch.bfloat16
