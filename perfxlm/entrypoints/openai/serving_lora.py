"""LoRA adapters the server serves by name: `--lora-modules name=path` at start, and, where the operator
allows it (VLLM_ALLOW_RUNTIME_LORA_UPDATING or PERFXLM_ALLOW_RUNTIME_LORA_UPDATING), loaded and unloaded
at run time through /v1/load_lora_adapter and /v1/unload_lora_adapter, as in vLLM. A request's `model`
field names the base model or one adapter; each adapter is listed in /v1/models."""

from __future__ import annotations

import itertools
import json
import os
import threading
from typing import Any

from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from perfxlm.entrypoints.openai.errors import APIError
from perfxlm.entrypoints.openai.off_loop import run_off_loop
from perfxlm.lora.request import LoRARequest

RUNTIME_UPDATING_ENV = ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "PERFXLM_ALLOW_RUNTIME_LORA_UPDATING")


def runtime_updating_allowed() -> bool:
    return any(os.environ.get(name, "").strip().lower() in ("1", "true", "yes") for name in RUNTIME_UPDATING_ENV)


def parse_lora_modules(values: list[str] | None) -> list[tuple[str, str, str | None]]:
    """--lora-modules entries as (name, path, base model name); ValueError naming a malformed one."""
    modules = []
    for value in values or ():
        if value.lstrip().startswith("{"):
            try:
                spec = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--lora-modules {value!r}: not valid JSON ({exc}).") from None
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not isinstance(spec.get("path"), str):
                raise ValueError(f"--lora-modules {value!r}: the JSON form needs string fields name and path.")
            modules.append((spec["name"], spec["path"], spec.get("base_model_name")))
            continue
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {value!r}: expected name=path.")
        modules.append((name, path, None))
    return modules


class ServedAdapters:
    """Adapter names -> LoRARequests. An adapter is loaded (and so checked against the model) when it is
    added; a failure is the caller's ValueError and leaves nothing registered."""

    def __init__(self, engine: Any, base_name: str) -> None:
        self.registry = engine.engine.loras  # the engine's LoRARegistry, None without enable_lora
        self.base_name = base_name
        self.by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.registry is not None

    def add(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        if self.registry is None:
            raise ValueError("LoRA adapters need the server started with --enable-lora.")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ValueError("lora_name and lora_path must be non-empty strings.")
        with self._lock:
            if name == self.base_name or name in self.by_name:
                raise ValueError(f"The lora adapter '{name}' has already been loaded.")
            request = LoRARequest(name, next(self._ids), path, base_model_name)
        self.registry.get(request)  # reads and checks the adapter now (ValueError)
        with self._lock:
            if name in self.by_name:
                raise ValueError(f"The lora adapter '{name}' has already been loaded.")
            self.by_name[name] = request
        return request

    def remove(self, name: str) -> LoRARequest | None:
        with self._lock:
            request = self.by_name.pop(name, None)
        if request is not None:
            self.registry.remove(request.lora_int_id)  # requests in flight keep their own reference
        return request

    def get(self, name: str) -> LoRARequest | None:
        return self.by_name.get(name)

    def model_cards(self, created: int, max_model_len: int) -> list[dict]:
        return [{"id": r.lora_name, "object": "model", "created": created, "owned_by": "perfxlm",
                 "root": r.lora_path, "parent": r.base_model_name or self.base_name, "max_model_len": max_model_len}
                for r in list(self.by_name.values())]


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


def add_lora_routes(app: Any, adapters: ServedAdapters) -> None:
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's bodies and answers)."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(req: LoadLoRAAdapterRequest):
        try:  # reading and checking the adapter's files happens off the event loop
            await run_off_loop(adapters.add, req.lora_name, req.lora_path)
        except ValueError as exc:
            raise APIError(400, str(exc), "lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest):
        known = adapters.get(req.lora_name)
        if known is None or (req.lora_int_id is not None and req.lora_int_id != known.lora_int_id):
            raise APIError(404, f"The lora adapter '{req.lora_name}' cannot be found.", "lora_name",
                           "model_not_found")
        adapters.remove(req.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
