"""Turn a model path into a ready model: config, architecture, weights (HF safetensors, GGUF or dummy)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from typing import Any, Iterator

import torch
from tqdm import tqdm

from perfxlm.distributed.parallel_state import SINGLE, building_for
from perfxlm.model.layers.linear_methods.base import LinearPlan
from perfxlm.model.layers.linear_methods.registry import bind
from perfxlm.model.loader.weight_arena import move_to_arena, release_freed_memory
from perfxlm.model.models.base import CausalLM
from perfxlm.model.registry import resolve_model_class
from perfxlm.ops import cpu_plan
from perfxlm.quant import calibration
from perfxlm.quant.config import resolve_activations
from perfxlm.quant.formats import PackedCheckpoint
from perfxlm.quant.layout_choice import choose_layouts
from perfxlm.quant.layouts import all_for_plan, few_rows_for_plan
from perfxlm.quant.loading import quantized_loader
from perfxlm.quant.weight import ActivationMode

logger = logging.getLogger("perfxlm")


def packed_checkpoint(model_path: str, load_format: str) -> PackedCheckpoint | None:
    """A safetensors folder's pre-quantized format (AWQ, GPTQ, compressed-tensors), its tensors' shapes
    checked against its quantization_config from the file headers; None for any other checkpoint."""
    if load_format != "safetensors" or not os.path.isdir(model_path):
        return None
    from perfxlm.model.loader.hf import safetensors_files

    return PackedCheckpoint.open(model_path, safetensors_files)


def load_hf_config(path: str) -> Any:
    if path.endswith(".gguf"):
        from perfxlm.model.loader.gguf import load_gguf_config

        return load_gguf_config(path)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{path!r} is neither a .gguf file nor a folder with a config.json.")
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _calibration_model(
    model_path: str, hf_config: Any, load_format: str, weights: Any, activations: ActivationMode | None
) -> torch.nn.Module:
    return get_model(
        model_path, hf_config, torch.float32, load_format, quantization=weights, activations=activations
    )


def load_model(config: Any, tp: Any = None) -> torch.nn.Module:
    """The model a resolved EngineConfig names, built by its frozen decisions (`config.resolved`: dtypes,
    weight format, activation mode), passed as values (nothing of the engine's choice rides on the
    model's config)."""
    r = config.resolved
    if r is None:
        raise ValueError("load_model needs a resolved EngineConfig: call config.resolve() first.")
    return get_model(
        r.model, config.hf_config, r.compute_dtype, r.load_format, r.seed, r.weight_dtype,
        tp=tp, quantization=r.quant_config, activations=r.quant_activations, device=r.device,
    )  # fmt: skip


def get_model(
    model_path: str,
    hf_config: Any,
    dtype: torch.dtype,
    load_format: str,
    seed: int | None = 0,
    weight_dtype: torch.dtype | None = None,
    tp: Any = None,
    quantization: Any = None,
    activations: ActivationMode | None = None,
    device: torch.device | str = "cpu",
    runs: bool = True,
):
    """`runs` False: the model is only read, never run (an export writes its weights out): no run-time
    layouts (bf16 panels, with a tied head's own packed copy) and no huge-page arena, whose copies would
    only raise the load's peak. `device`: where the weights live (a CUDA model is built there, its float weights loaded into it,
    and its layers bound to the methods of that device). `tp`: a distributed.parallel_state.TPGroup: build
    and load only that rank's shard (the model's parallel layers take their rows or columns of each
    checkpoint tensor). `quantization`: the
    weight format (a QuantizationConfig, or what `QuantizationConfig.resolve` takes; None keeps a GGUF
    file's blocks and a float checkpoint float). `activations`: the mode EngineConfig.resolve decided,
    else the default for these weights."""
    model_cls = resolve_model_class(hf_config)
    tp = tp or SINGLE
    packed = packed_checkpoint(model_path, load_format)  # a bad packed checkpoint fails before the build
    if packed is not None:
        logger.info("Pre-quantized checkpoint, kept packed: %s", packed.format.describe())
    if tp.parallel:
        check_tensor_parallel(model_cls, packed)
    device = torch.device(device)
    # a GPU model is built where it runs (the CPU's needs no device mode around every allocation)
    place = contextlib.nullcontext() if device.type == "cpu" else device
    with _default_dtype(dtype), torch.no_grad(), building_for(tp), place:
        # Layers allocate with torch.empty: building the model costs no initialisation pass.
        model = model_cls(hf_config)
        # quantized weights (a GGUF file's blocks, or `quantization=`): checked before any weight is read
        sink = quantized_loader(model, quantization, load_format, model_path, packed)
        if sink is not None:
            if activations is None:  # a caller loading without an EngineConfig: the weights' default
                per_token = sink.config is not None and sink.config.per_token_activations
                activations = resolve_activations("auto", sink.source, weight_dtype or dtype, per_token)
            sink.take_activations(activations)
        if sink is not None and load_format != "dummy":
            # activation statistics, where asked for: from the same checkpoint loaded as `weights` says
            sink.importance = calibration.importance(
                sink.config, model_path, hf_config,
                lambda weights: _calibration_model(model_path, hf_config, load_format, weights, activations),
            )  # fmt: skip
            release_freed_memory()  # the calibration model's pages, before this model's weights arrive
        if weight_dtype is not None and weight_dtype != dtype:
            _allocate_weights(model, weight_dtype)
        if load_format == "dummy":
            from perfxlm.model.loader.dummy import fill_dummy_weights

            fill_dummy_weights(model, seed or 0)
            if sink is not None:
                sink.quantize_loaded()
        else:
            keep = sink is not None  # GGUF blocks stay quantized
            weights = _iter_weights(model_path, hf_config, load_format, keep)
            if packed is not None:  # each packed module's parts become one QuantizedWeight
                weights = packed.stream(weights)
            model.load_weights(tqdm(weights, desc="Loading weights", unit="tensor", leave=False), sink=sink)
    stored = weight_dtype or dtype
    plan = linear_plan(stored, dtype, None if sink is None else sink.format_name, device)
    if not runs:  # the same values as rows, read as they were loaded
        plan = dataclasses.replace(plan, layout="rows")
    if sink is not None and device.type == "cpu" and runs:  # the final code layouts, by the CPU plan
        cpu = cpu_plan.plan()
        choose_layouts(model, all_for_plan(cpu.row_groups, cpu.row_groups_k), few_rows_for_plan(cpu.row_groups_k))
    bind_linear_methods(model, plan)
    if stored != dtype:
        cast_weights(model, stored, dtype)
    if device.type == "cpu" and runs:
        move_to_arena(model)  # final layouts only: after packing and casting
    else:
        model.to(device)  # what a loader put in place of a Parameter built on the device
    release_freed_memory()
    return model.eval()


def _allocate_weights(model: torch.nn.Module, weight_dtype: torch.dtype) -> None:
    """Give the weights stored narrower (`cast_weights`, the bf16 linear methods) their final dtype before
    anything is loaded, so checkpoint tensors are rounded as they are copied in (the same rounding as a
    cast afterwards) and the model never exists in the wider dtype: peak memory at start is the narrow
    model's."""
    from perfxlm.model.layers.embed_head import LMHead, VocabEmbedding
    from perfxlm.model.layers.linear import Linear
    from perfxlm.model.layers.moe import FusedMoE

    for module in model.modules():
        if isinstance(module, (Linear, LMHead, VocabEmbedding)):
            params = [module.weight]
        elif isinstance(module, FusedMoE):
            params = [module.gate_up_proj, module.down_proj]
        else:
            continue
        for p in params:  # .data: a tied head keeps sharing the embedding's Parameter
            if p.dtype != weight_dtype:
                p.data = torch.empty(p.shape, dtype=weight_dtype)


def cast_weights(model: torch.nn.Module, weight_dtype: torch.dtype, compute_dtype: torch.dtype) -> None:
    """Store the embedding tables and MoE expert stacks in `weight_dtype` while activations keep the
    model dtype (bf16 weights, float32 compute); projections and LM heads take their layout from their
    linear method (`bind_linear_methods`). Norms and biases keep the model dtype; quantized weights
    keep their codes."""
    from perfxlm.model.layers.embed_head import VocabEmbedding
    from perfxlm.model.layers.moe import FusedMoE
    from perfxlm.quant.weight import QuantizedWeight

    for module in model.modules():
        if isinstance(module, FusedMoE):
            for param in (module.gate_up_proj, module.down_proj):
                if not isinstance(param, QuantizedWeight):
                    param.data = param.data.to(weight_dtype)
        if isinstance(module, VocabEmbedding):
            module.compute_dtype = compute_dtype
            if not isinstance(module.weight, QuantizedWeight):
                module.weight.data = module.weight.data.to(weight_dtype)


def linear_plan(
    weight_dtype: torch.dtype, compute_dtype: torch.dtype, quantized_format: str | None,
    device: torch.device | str = "cpu",
) -> LinearPlan:
    """The plan a model's layers choose their linear methods by: bf16 weights under float32 activations
    take the layout the CPU plan names where the native kernels are built (ops/cpu_plan.py), else rows
    (and always on a GPU, whose weights are stored in the compute dtype: the float method)."""
    from perfxlm.ops import cpu_plan, native

    panels = (torch.device(device).type == "cpu" and weight_dtype == torch.bfloat16 and native.kernels() is not None
              and cpu_plan.plan().layout == "panels")  # fmt: skip
    return LinearPlan(weight_dtype, compute_dtype, "panels" if panels else "rows", quantized_format)


def bind_linear_methods(model: torch.nn.Module, plan: LinearPlan) -> None:
    """Every layer's linear method, chosen once for what it holds (model/layers/linear_methods/). A tied
    LM head under bf16 rows casts the table it shares; under panels it gets its own packed copy first,
    from the table as loaded, before the table is cast."""
    bind(model, plan)


def check_tensor_parallel(model_cls: type, packed: PackedCheckpoint | None) -> None:
    """A family loads under tensor parallelism when its layers are the parallel ones; their cuts take
    every weight format whose inputs are in order (act-order checkpoints gather them per product)."""
    if not (issubclass(model_cls, CausalLM) and model_cls.supports_tensor_parallel):
        raise ValueError(f"tensor_parallel_size > 1 is not supported for {model_cls.__name__} yet: its layers are "
                         "not tensor-parallel layers.")
    if packed is not None and getattr(packed.format, "desc_act", False):
        raise ValueError(f"tensor_parallel_size > 1 with an act-order checkpoint ({packed.format.describe()}) is "
                         "not supported yet: its inputs cannot be split by rank. Use tensor_parallel_size=1.")


def _iter_weights(
    model_path: str, hf_config: Any, load_format: str, keep_quantized: bool = False
) -> Iterator[tuple[str, Any]]:
    if load_format == "gguf":
        from perfxlm.model.loader.gguf import iter_gguf_weights

        return iter_gguf_weights(model_path, hf_config, keep_quantized=keep_quantized)
    from perfxlm.model.loader.hf import iter_safetensors_weights

    return iter_safetensors_weights(model_path)
