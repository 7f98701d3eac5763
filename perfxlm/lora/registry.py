"""The front end's loaded adapters: a request's LoRARequest becomes a checked LoRAAdapter here, in the
caller's thread, before the request reaches the scheduler. Up to `max_cpu_loras` stay loaded, least
recently used dropped first; a request in flight keeps its adapter alive whatever the cache drops."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from perfxlm.lora.adapter import LoRAAdapter, load_adapter
from perfxlm.lora.config import LoRAConfig
from perfxlm.lora.request import LoRARequest
from perfxlm.lora.targets import LoRATargets


class LoRARegistry:
    def __init__(self, targets: LoRATargets, config: LoRAConfig) -> None:
        self.targets = targets
        self.config = config
        self._loaded: OrderedDict[int, LoRAAdapter] = OrderedDict()  # lora_int_id -> adapter, LRU order
        self._lock = threading.Lock()
        self.num_loads = 0

    def get(self, request: Any) -> LoRAAdapter:
        """The loaded adapter for `request` (ValueError when it cannot run on this model)."""
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a perfxlm.lora.request.LoRARequest, got {type(request).__name__}.")
        with self._lock:
            adapter = self._loaded.get(request.lora_int_id)
            # the same id with another name or folder is another adapter: load it (vLLM keys by id alone)
            if adapter is not None and adapter.request == request:
                self._loaded.move_to_end(request.lora_int_id)
                return adapter
            adapter = load_adapter(request, self.targets, self.config.max_lora_rank)
            self.num_loads += 1
            self._loaded[request.lora_int_id] = adapter
            self._loaded.move_to_end(request.lora_int_id)
            while len(self._loaded) > self.config.cache_size:
                self._loaded.popitem(last=False)
            return adapter

    def remove(self, lora_int_id: int) -> bool:
        with self._lock:
            return self._loaded.pop(lora_int_id, None) is not None

    def loaded_ids(self) -> list[int]:
        with self._lock:
            return list(self._loaded)
