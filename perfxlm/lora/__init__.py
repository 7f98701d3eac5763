"""LoRA adapters served over one base model, vLLM's interface (`LoRARequest`, `enable_lora`).

- `request.py`: `LoRARequest(lora_name, lora_int_id, lora_path)`, what a caller names an adapter with;
- `config.py`: the engine's bounds (`max_loras`, `max_lora_rank`, `max_cpu_loras`);
- `targets.py`: which projections of the built model an adapter may target, and how a PEFT module name
  maps onto them (the fused q|k|v and gate|up projections take one slice each);
- `adapter.py`: a PEFT adapter folder read, checked against the targets and kept as float32 A / B pairs;
- `registry.py`: the front end's cache of loaded adapters (LRU, `max_cpu_loras`), and named adapters;
- `layers.py`: `LoRALinear`, the wrapper that adds each row's adapter product to a base projection;
- `slots.py`: the runner's `max_loras` adapter slots (LRU) and the per-step `LoRABatch` that applies
  every row's adapter in one pair of products per projection, whatever the mix of adapters.
"""
