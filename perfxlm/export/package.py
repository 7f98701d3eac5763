"""`export_onnx`: a model path in, an output folder out, as ONNX Runtime and onnxruntime-genai read it:

    model.onnx, model.onnx.data    the decoder graph (decoder.py) and its weights
    genai_config.json              onnxruntime-genai's description of the graph and of generation
    config.json                    the model's Hugging Face config (the engine reads the folder too)
    tokenizer files                the model's tokenizer, saved by transformers (a GGUF file's converted)
    perfxlm_onnx.json              what the engine needs to check before running the graph: format
                                   version, flavor, family; the perfxlm flavor's: the engine's choices
                                   for the model when it was exported (engine_choices.py)

Everything is written into a hidden folder beside OUT_DIR and renamed into place at the end, so an
export that fails leaves nothing behind, and an OUT_DIR holding files is refused unless overwrite.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

from perfxlm.export.manifest import ENGINE_KEY, FORMAT_VERSION, GENAI_CONFIG, GRAPH_FILE, MANIFEST

logger = logging.getLogger(__name__)


@dataclass
class ExportResult:
    out_dir: str
    flavor: str
    model_type: str
    op_census: dict[str, int]  # op type -> node count


def check_out_dir(out_dir: str, overwrite: bool) -> None:
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ValueError(f"output {out_dir!r} exists and is not a folder.")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
        raise ValueError(f"output folder {out_dir!r} exists and is not empty; pass --overwrite to "
                         "replace it.")


def export_onnx(model: str | None, out_dir: str, flavor: str = "ort", quantization: Any = None,
                quantization_group_size: int | None = None, quantization_symmetric: bool | None = None,
                tokenizer: str | None = None, overwrite: bool = False, revision: str | None = None,
                download_dir: str | None = None, dtype: str | None = None, lora: str | None = None) -> ExportResult:
    """Load `model` as the engine does with `dtype` (None: the flavor's default, "auto" for the perfxlm
    flavor, float32 for the others) and quantized weights as `quantization` says (a GGUF file's kept), and
    write it to `out_dir` as an ONNX decoder graph of `flavor` ("ort", "standard" or "perfxlm"), its
    matrices as the engine holds them. A perfxlm-flavor folder records the engine's choices
    (export/engine_choices.py), so the engine runs it as it runs `model` with that dtype. `lora`: a PEFT
    adapter folder merged into the float weights first (export/lora_merge.py)."""
    from perfxlm.config import EngineConfig
    from perfxlm.export.decoder import build_decoder_graph, genai_model_type
    from perfxlm.export.engine_choices import EngineChoices
    from perfxlm.export.flavors import FLAVORS
    from perfxlm.export.held_weights import load_for_export

    if flavor not in FLAVORS:
        raise ValueError(f"ONNX flavor {flavor!r} is not known (known: {', '.join(FLAVORS)}).")
    ops = FLAVORS[flavor]
    dtype = ops.check_weight_dtype(ops.default_dtype if dtype is None else dtype)
    own = flavor == "perfxlm"  # run by the engine: its own choices; ONNX Runtime's flavors: weight-only float32
    out_dir = os.path.abspath(out_dir)
    check_out_dir(out_dir, overwrite)
    config = EngineConfig(model=model, tokenizer=tokenizer, dtype=dtype, quantization=quantization,
                          quantization_group_size=quantization_group_size,
                          quantization_symmetric=quantization_symmetric,
                          quant_activations="auto" if own else "float32",
                          revision=revision, download_dir=download_dir).resolve()
    if config.load_format == "onnx":
        raise ValueError(f"{config.model!r} is an ONNX export already; export its source model.")
    choices = EngineChoices.of(config) if own else None
    if choices is not None and choices.compute_dtype != "float32":
        raise ValueError(f"dtype={dtype!r} resolves bfloat16 activations here (PERFXLM_BF16_COMPUTE); a "
                         "perfxlm-flavor graph runs float32 activations: unset it for the export.")
    loaded, stored = load_for_export(config)  # no run-time copies; a bf16 checkpoint's values held in bf16
    model_type = genai_model_type(loaded, flavor)
    merged = None
    if lora is not None:
        from perfxlm.export.lora_merge import describe_merge, merge_adapter

        merged = describe_merge(lora, merge_adapter(loaded, lora, stored))
    graph = build_decoder_graph(loaded, flavor, stored)
    census: dict[str, int] = {}
    for node in graph.nodes:
        census[node.op_type] = census.get(node.op_type, 0) + 1
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".perfxlm-export-", dir=parent)
    try:
        graph.save(os.path.join(staging, GRAPH_FILE))
        kv_shape = graph.kv_shape
        del graph, loaded
        _write_configs(staging, config, model_type, flavor, choices, merged, kv_shape)
        _save_tokenizer(staging, config)
        if os.path.isdir(out_dir):
            shutil.rmtree(out_dir)  # checked above: empty, or overwrite asked for
        os.replace(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return ExportResult(out_dir, flavor, model_type, census)


def _write_configs(folder: str, config: Any, model_type: str, flavor: str, choices: Any,
                   merged_lora: dict[str, Any] | None = None, kv_shape: tuple[int, int] | None = None) -> None:
    hf = config.hf_config
    hf_dict = {k: v for k, v in hf.to_dict().items()
               if not k.startswith("perfxlm_") and k != "quantization_config"}
    hf_dict["model_type"] = hf_dict.get("model_type") or model_type  # a GGUF file's config has none
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf_dict, f, indent=2)
    if flavor != "perfxlm":  # the engine's own graph: not onnxruntime-genai's layout
        with open(os.path.join(folder, GENAI_CONFIG), "w") as f:
            json.dump(genai_config(hf, config, model_type, kv_shape), f, indent=4)
    manifest = {"format_version": FORMAT_VERSION, "flavor": flavor, "model_type": model_type,
                "graph": GRAPH_FILE, "num_hidden_layers": hf.num_hidden_layers}
    if choices is not None:
        manifest[ENGINE_KEY] = choices.to_json()
    if merged_lora is not None:  # the weights are the base model's with this adapter added
        manifest["merged_lora"] = merged_lora
    with open(os.path.join(folder, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=2)
    if os.path.isdir(config.model):
        src = os.path.join(config.model, "generation_config.json")
        if os.path.isfile(src):
            shutil.copy(src, folder)


def genai_config(hf: Any, config: Any, model_type: str, kv_shape: tuple[int, int] | None = None) -> dict[str, Any]:
    """`kv_shape`: (kv heads, head size) of the graph's pasts (a latent cache's: 1 x its width); None: the
    config's."""
    from perfxlm.model.models.llama import head_dim_of

    kv_heads, head_size = kv_shape or (getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
                                       head_dim_of(hf))
    eos = sorted(config.eos_token_ids)
    context = config.max_model_len
    return {
        "model": {
            "bos_token_id": getattr(hf, "bos_token_id", None),
            "context_length": context,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": GRAPH_FILE,
                "head_size": head_size,
                "hidden_size": hf.hidden_size,
                "inputs": {
                    "input_ids": "input_ids",
                    "attention_mask": "attention_mask",
                    "position_ids": "position_ids",
                    "past_key_names": "past_key_values.%d.key",
                    "past_value_names": "past_key_values.%d.value",
                },
                "outputs": {
                    "logits": "logits",
                    "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value",
                },
                "num_attention_heads": hf.num_attention_heads,
                "num_hidden_layers": hf.num_hidden_layers,
                "num_key_value_heads": kv_heads,
            },
            "eos_token_id": eos[0] if len(eos) == 1 else eos,
            "pad_token_id": getattr(hf, "pad_token_id", None) or (eos[0] if eos else 0),
            "type": model_type,
            "vocab_size": hf.vocab_size,
        },
        "search": {
            "diversity_penalty": 0.0, "do_sample": False, "early_stopping": True, "length_penalty": 1.0,
            "max_length": context, "min_length": 0, "no_repeat_ngram_size": 0, "num_beams": 1,
            "num_return_sequences": 1,
            "past_present_share_buffer": False,  # present = past + new, a fresh tensor each step
            "repetition_penalty": 1.0, "temperature": 1.0, "top_k": 1, "top_p": 1.0,
        },
    }


def _save_tokenizer(folder: str, config: Any) -> None:
    from perfxlm.tokenizer import get_tokenizer

    try:
        tok = get_tokenizer(config.model, config.tokenizer)
    except ValueError as exc:  # a checkpoint without one (random test weights): the graph is still whole
        logger.warning("No tokenizer written: %s", exc)
        return
    tok.save_pretrained(folder)
