"""Putting quantized weights into a model as its checkpoint streams in.

`QuantizedLoader` is handed every checkpoint tensor bound for a projection weight before it would be
copied into its Parameter (`CausalLM.load_weights(weights, sink=...)`). Two sources:
- a `QuantizedWeight` from a GGUF file (kept quantized): Linear / MergedLinear weights, the embedding
  table and the LM head;
- a float tensor, quantized here with the configured quantizer (`quantization=` on a float checkpoint):
  every Linear except MoE routers and gates (`Linear.quantize_weight`), and MoE expert stacks; and the
  embedding table and LM head as 8-bit codes, one scale per 64 values (`QuantizationConfig.quantize_table`,
  as llama.cpp stores them; `lm_head: false` keeps them float, as vLLM's quantized checkpoints do).
Each weight is quantized with its own options: `mixed_precision` gives some 5-bit codes, as
llama.cpp's Q4_K_M allocates its bits, an embedding table that is only looked up included
(`perfxlm.quant.mixed`), and `calibration` first collects activation statistics with the model loaded
once as int8 (`perfxlm.quant.calibration`, `QuantizedLoader.calibrate`), which weigh each weight's
squared error in int4's search. Each piece is quantized as it arrives, so a model never exists whole in
float: shards of a fused weight (q, k, v; gate, up; an expert's gate and up) wait as quantized pieces
until their weight is complete, then are concatenated (`split_rows.join_rows`: one weight, or parts kept
apart where one form would widen some, as Q6_K beside Q4_K) and replace the module's Parameter, whose
untouched float storage is freed.
A tied LM head gets the embedding's `QuantizedWeight`. Each weight takes the
model's `ActivationMode` as it is installed (`take_activations`, the engine's `quant_activations`).
A pre-quantized checkpoint (AWQ, GPTQ, ...) stores its embedding table and LM head in float, as vLLM
keeps them; they are quantized here as `quantize_table` does for int4 where `packed_head` says (the
option `{"method": "awq", "lm_head": true, "head_bits": 6}`, else PERFXLM_PACKED_LM_HEAD, else
PACKED_HEAD's default): every decode step reads the head whole, and in bfloat16 it can outweigh all
the 4-bit projections of a small model.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from typing import Any

from torch import nn

from perfxlm.quant import joining
from perfxlm.quant import mixed, split_rows
from perfxlm.quant.config import CHECKPOINT_METHODS, GGUF, METHODS, QuantizationConfig
from perfxlm.quant.formats import PackedCheckpoint
from perfxlm.quant.targets import TABLE, QuantizableLayer, QuantizableWeight
from perfxlm.quant.weight import ActivationMode, QuantizedWeight

logger = logging.getLogger("perfxlm")

# A pre-quantized checkpoint's float embedding table and LM head, by its codes' kind (the format's
# `activation_source`), where neither quantization= nor PACKED_HEAD_ENV says: the head_bits they are
# quantized to at load (absent: kept float). Measured on the default model's real weights (turned off
# their 4-bit grid by benchmarks/make_rotated_model.py, packed as AWQ group 64 the way the tests pack it;
# 20 windows of 512 ShareGPT tokens against the bf16 model): mean KLD 0.5401 with the head bf16, 0.5443
# with it 6-bit (perplexity 11.444 -> 11.449, same top token 69.37 -> 69.45 %): 1 % of the checkpoint's
# own error, for a head 2.4x smaller that every decode step reads whole.
PACKED_HEAD: dict[str, int] = {"int4": 6}
# formats whose default keeps them float whatever their codes: MXFP4 checkpoints (gpt-oss) quantize only
# the experts, their attention stays float as well
PACKED_HEAD_FLOAT = ("mxfp4",)
# stands in for the default above (a knob for tests and benchmarks; quantization='s lm_head wins):
# "auto" (PACKED_HEAD), "float" (keep them float), "6" or "8" (head_bits for every pre-quantized format)
PACKED_HEAD_ENV = "PERFXLM_PACKED_LM_HEAD"
PACKED_HEAD_CHOICES = ("auto", "float", "6", "8")


def install(module: nn.Module, name: str, weight: QuantizedWeight) -> Any:
    """Make `module.<name>` the QuantizedWeight (a plain attribute); returns the Parameter it replaces."""
    old = module._parameters.pop(name, None)
    setattr(module, name, weight)
    return old


def _declared(module: nn.Module) -> dict[str, QuantizableWeight]:
    """The weights `module` declares quantizable (QuantizableLayer), by parameter name."""
    if not isinstance(module, QuantizableLayer):
        return {}
    return {w.param: w for w in module.quantizable_weights()}


def _kind(module: nn.Module, local: str) -> str | None:
    declared = _declared(module).get(local)
    return None if declared is None else declared.kind


def quantizable(model: nn.Module) -> list[tuple[str, nn.Module, str, int]]:
    """(qualified name, module, parameter, in_features) of every weight `quantization=` quantizes."""
    out = []
    for name, module in model.named_modules():
        for w in _declared(module).values():
            if w.kind != TABLE and w.at_load:
                out.append((name, module, w.param, w.in_features))
    return out


def lookup_tables(model: nn.Module) -> set[int]:
    """ids of the table Parameters that are only looked up (an embedding untied from the LM head)."""
    lookups: dict[int, bool] = {}
    for module in model.modules():
        for w in _declared(module).values():
            param = module._parameters.get(w.param) if w.kind == TABLE else None
            if param is not None:
                lookups[id(param)] = lookups.get(id(param), True) and w.lookup
    return {p for p, only in lookups.items() if only}


def quantizable_tables(model: nn.Module) -> list[tuple[str, nn.Module, str, int]]:
    """(qualified name, module, "weight", hidden size) of the embedding table and the LM head, each
    Parameter once: a tied head shares the table's, and gets its QuantizedWeight at `finish`."""
    out, seen = [], set()
    for name, module in model.named_modules():
        for w in _declared(module).values():
            param = module._parameters.get(w.param) if w.kind == TABLE else None
            if param is not None and id(param) not in seen:
                seen.add(id(param))
                out.append((name, module, w.param, w.in_features))
    return out


class QuantizedLoader:
    def __init__(
        self, model: nn.Module, config: QuantizationConfig | None = None, packed: PackedCheckpoint | None = None,
        head: QuantizationConfig | None = None,
    ) -> None:
        self.config = config if config is not None and config.quantizes else None
        self.packed = packed  # a pre-quantized checkpoint's weights arrive packed, kept like GGUF blocks
        self.quantize = self.config.quantizer() if self.config is not None else None
        # what quantizes the float embedding table and LM head (`quantize_table`): the method's own config,
        # or `head` for a pre-quantized checkpoint that stores them float (`packed_head`)
        self.head = self.config if self.config is not None and self.config.lm_head else head
        # (id(module), parameter) -> qualified weight name, for every weight this loader quantizes
        targets = quantizable(model) if self.config is not None else []
        tables = quantizable_tables(model) if self.head is not None else []
        self.tables = {(id(m), p) for _, m, p, _ in tables}
        lookups = lookup_tables(model) if self.config is not None and self.config.mixed_precision else set()
        # the projections, and a table that is only looked up: the weights mixed precision sizes
        mixed_targets = targets + [t for t in tables if id(t[1]._parameters[t[2]]) in lookups]
        self.lookups = {(id(m), p) for _, m, p, _ in mixed_targets} & self.tables
        targets += tables
        self.names = {(id(m), p): f"{n}.{p}" for n, m, p, _ in targets}
        self.targets = set(self.names)
        mixed_on = self.config is not None and self.config.mixed_precision
        # weight name -> code width under mixed precision (Q4_K_M's allocation); absent: the method's own
        looked_up = {f"{n}.{p}" for n, m, p, _ in mixed_targets if (id(m), p) in self.lookups}
        self.bits = (
            mixed.code_bits({f"{n}.{p}": k for n, _, p, k in mixed_targets}, tables=looked_up) if mixed_on else {}
        )
        self.importance: dict[str, Any] = {}  # weight name -> mean square input activation [K]
        self.pending: dict[tuple[int, str, int | None], dict[str, Any]] = {}
        self.experts: dict[tuple[int, str], dict[int, QuantizedWeight]] = {}
        self.floats: set[tuple[int, str]] = set()  # fused weights some of whose shards arrived in float
        self.replaced: dict[int, QuantizedWeight] = {}
        self.kept: Counter[str] = Counter()
        self.model = model
        self.activations = ActivationMode.FLOAT

    @property
    def format_name(self) -> str:
        """The registry name of the linear method the weights this sink installs run by: the packed
        checkpoint's format, the method quantizing at load, or "gguf" (kept)."""
        if self.packed is not None:
            return self.packed.format.method
        return GGUF if self.config is None else self.config.method

    @property
    def source(self) -> str:
        """Where the quantized weights come from: the method quantizing at load, a pre-quantized
        checkpoint's equivalent method (its format's `activation_source`), or "gguf" (kept)."""
        if self.packed is not None:
            return self.packed.format.activation_source
        return GGUF if self.config is None else self.config.method

    def check(self) -> None:
        """ValueError, before any weight is read, where a weight's shape cannot take the format."""
        if self.config is None:
            return
        for name, _, param, in_features in quantizable(self.model):
            self.config.check_in_features(in_features, f"{name}.{param}")

    def take_activations(self, mode: ActivationMode) -> None:
        """The activation mode every weight installed from now on gets; ValueError, before any weight is
        read, where int8 blocks do not fit a weight quantized at load (GGUF rows are whole blocks of 32)."""
        if mode is ActivationMode.INT8 and self.config is not None and self.config.method != "w8a8":
            for name, _, param, in_features in quantizable(self.model):
                QuantizedWeight.check_activation_blocks(in_features, f"{name}.{param}")
        self.activations = mode

    def _quantize(self, module: nn.Module, local: str, tensor: Any) -> QuantizedWeight:
        name = self.names[(id(module), local)]
        if (id(module), local) in self.tables and (id(module), local) not in self.lookups:
            return self.head.quantize_table(tensor)  # type: ignore[union-attr]
        importance = self.importance.get(name)
        if importance is not None and importance.shape[-1] != tensor.shape[-1]:
            # a tensor-parallel rank's row-parallel shard: its input columns of the whole model's statistics
            importance = importance.narrow(-1, *module.input_part)
        return self.config.quantize_weight(  # type: ignore[union-attr]
            tensor, importance=importance, bits=self.bits.get(name)
        )

    # ---- loading -------------------------------------------------------------------------------------
    def load(self, module: nn.Module, local: str, tensor: Any, shard: str | None, expert: int | None) -> bool:
        """Take `tensor` (bound for `module.<local>`, shard `shard` of expert `expert`); False leaves it
        to the caller's plain copy (a QuantizedWeight is then dequantized by the caller)."""
        kind = _kind(module, local)
        if kind is None:
            return False
        quantized = isinstance(tensor, QuantizedWeight)
        key2 = (id(module), local)
        if not quantized:
            if key2 not in self.targets:
                if shard is not None:
                    self._spill_to_float(module, local, expert)  # a float shard: the fused weight is float
                    self.floats.add(key2)
                return False
            self._check_shape(module, local, tensor.shape, shard, expert)
            tensor = self._quantize(module, local, tensor)
        else:
            self._check_shape(module, local, tensor.shape, shard, expert)
            if shard is not None and key2 in self.floats:
                return False  # another shard of this weight is float: store it in float as well
        if shard is None and expert is None:
            self._install(module, local, tensor)
            return True
        key = (id(module), local, expert)
        parts = self.pending.setdefault(key, {"module": module})
        parts[shard] = tensor
        order = self._shard_order(module, local, expert)
        if all(s in parts for s in order):
            del self.pending[key]
            try:
                whole = split_rows.join_rows([parts[s] for s in order])
            except ValueError as e:  # e.g. act-order shards of one input with different orders
                where = next((n for n, m in self.model.named_modules() if m is module), type(module).__name__)
                raise ValueError(f"checkpoint weights of {where}.{local} ({', '.join(order)}): {e}") from None
            if expert is None:
                self._install(module, local, whole)
            else:
                self._expert_done(module, local, expert, whole)
        return True

    def _shard_order(self, module: nn.Module, local: str, expert: int | None) -> list[str]:
        if expert is not None:
            return ["gate", "up"] if local == "gate_up_proj" else ["down"]
        return list(module.output_sizes)

    def _expected_shape(self, module: nn.Module, local: str, shard: str | None, expert: int | None) -> tuple:
        full = tuple(getattr(module, local).shape)
        if _kind(module, local) == "experts":
            if expert is None:
                return full
            rows = full[1] // 2 if local == "gate_up_proj" else full[1]
            return (rows, full[2])
        if shard is None:
            return full
        return (module.output_sizes[shard], full[1])

    def _check_shape(self, module, local, shape, shard, expert) -> None:
        want = self._expected_shape(module, local, shard, expert)
        if tuple(shape) != want:
            what = f"shard {shard!r}" if shard is not None else local
            raise ValueError(f"{what}: checkpoint shape {tuple(shape)} != {want}")

    def _spill_to_float(self, module: nn.Module, local: str, expert: int | None) -> None:
        """Quantized shards already waiting for this weight are written into its float Parameter."""
        key = (id(module), local, expert)
        parts = self.pending.pop(key, None)
        if not parts:
            return
        param = module._parameters[local]
        for shard, piece in parts.items():
            if shard != "module":
                module.load_shard(param, piece.dense(), shard, expert)
        logger.info("A fused weight mixes quantized and float shards: stored in float.")

    def _expert_done(self, module: nn.Module, local: str, expert: int, weight: QuantizedWeight) -> None:
        done = self.experts.setdefault((id(module), local), {})
        done[expert] = weight
        if len(done) == module.num_experts:
            del self.experts[(id(module), local)]
            self._install(module, local, joining.stack_experts([done[e] for e in range(module.num_experts)]))

    def _install(self, module: nn.Module, local: str, weight: "QuantizedWeight | split_rows.SplitRows") -> None:
        weight.use_activations(self.activations, f"{type(module).__name__}.{local}")
        old = install(module, local, weight)
        if old is not None:
            self.replaced[id(old)] = weight
        self.kept[weight.describe()] += 1

    def finish(self) -> None:
        """A module still holding a Parameter that was replaced (a tied LM head) gets its QuantizedWeight."""
        if not self.replaced:
            return
        for module in self.model.modules():
            for name, p in list(module._parameters.items()):
                if p is not None and id(p) in self.replaced:
                    install(module, name, self.replaced[id(p)])

    def quantize_loaded(self) -> None:
        """Quantize the weights already in the model (random dummy weights), one module at a time."""
        if self.quantize is None:
            return
        for _, module, param, _ in quantizable(self.model) + (quantizable_tables(self.model) if self.tables else []):
            self._install(module, param, self._quantize(module, param, getattr(module, param).data))
        self.finish()

    def summary(self) -> str:
        kinds = ", ".join(f"{n} x {k}" for k, n in sorted(self.kept.items()))
        weights = unique_quantized_weights(self.model)
        size = sum(w.nbytes for w in weights)
        bpw = 8 * size / max(1, sum(w.shape.numel() for w in weights))
        return f"quantized weights: {kinds}; {size / 2**20:.1f} MiB, {bpw:.2f} bits per weight"


def quantized_bytes(model: nn.Module) -> int:
    """Bytes held by the model's QuantizedWeights (each counted once)."""
    seen: dict[int, int] = {}
    for module in model.modules():
        for value in vars(module).values():
            for piece in split_rows.pieces(value):
                seen[id(piece)] = piece.nbytes
    return sum(seen.values())


def unique_quantized_weights(model: nn.Module) -> list[QuantizedWeight]:
    """The model's QuantizedWeights, each once (a tied head shares the table's; a split weight's parts)."""
    seen: dict[int, QuantizedWeight] = {}
    for module in model.modules():
        for value in vars(module).values():
            for piece in split_rows.pieces(value):
                seen.setdefault(id(piece), piece)
    return list(seen.values())


def has_quantized_weights(model: nn.Module) -> bool:
    return any(split_rows.is_quantized(v) for m in model.modules() for v in vars(m).values())


def quantized_loader(
    model: nn.Module, quantization: Any, load_format: str, model_path: str, packed: PackedCheckpoint | None = None
) -> QuantizedLoader | None:
    """The sink `load_weights` offers tensors to, or None where no weight ends up quantized. ValueError,
    before any weight is read, when the format and the checkpoint do not go together. `packed`: the
    checkpoint's pre-quantized format (`PackedCheckpoint.open`), whose weights the sink keeps."""
    config = quantization
    if not isinstance(config, QuantizationConfig):
        config = QuantizationConfig.resolve(quantization)
    check_compatible(config, load_format, model_path, packed)
    if packed is not None:
        return QuantizedLoader(model, packed=packed, head=packed_head(config, packed))
    if load_format == "gguf" and (config is None or not config.quantizes):
        return QuantizedLoader(model) if config is None or config.method == GGUF else None
    if config is None or not config.quantizes:
        return None
    loader = QuantizedLoader(model, config)
    loader.check()
    return loader


def packed_head(config: QuantizationConfig | None, packed: PackedCheckpoint) -> QuantizationConfig | None:
    """How a pre-quantized checkpoint's float embedding table and LM head are stored (their
    `quantize_table`), None keeping them float: as `{"method": ..., "lm_head": ..., "head_bits": ...}`
    says, else PACKED_HEAD's default for the checkpoint's kind of codes."""
    if config is not None and config.head_explicit:
        return config if config.lm_head else None
    choice = (os.environ.get(PACKED_HEAD_ENV) or "auto").strip().lower()
    if choice not in PACKED_HEAD_CHOICES:
        raise ValueError(f"{PACKED_HEAD_ENV}={choice!r} is not supported; supported: {', '.join(PACKED_HEAD_CHOICES)}.")
    if choice == "auto":
        bits = None if packed.format.method in PACKED_HEAD_FLOAT else PACKED_HEAD.get(packed.format.activation_source)
    else:
        bits = None if choice == "float" else int(choice)
    return None if bits is None else QuantizationConfig(packed.format.method, head_bits=bits)


def gguf_quantized_types(path: str) -> list[str]:
    """The quantized tensor types of a GGUF file (its header only; empty for an F32 / F16 / BF16 file)."""
    from perfxlm.model.loader.gguf_reader import open_gguf

    floats = {"F32", "F16", "BF16"}
    return sorted({t.ggml_type.name for t in open_gguf(path).tensors.values()} - floats)


def check_compatible(
    config: QuantizationConfig | None, load_format: str, model_path: str, packed: PackedCheckpoint | None = None
) -> None:
    """ValueError where `quantization=` (`config`) and the checkpoint (a GGUF file, or `packed`, a
    pre-quantized folder's format) do not go together."""
    if packed is not None:
        method = packed.format.method
        if config is not None and config.method != method:
            raise ValueError(
                f"quantization={config.method!r}: {model_path!r} is a pre-quantized {method} checkpoint; its "
                f"weights are kept as they are packed, not quantized again or widened. Supported with it: "
                f"quantization=None or {method!r}; for another format, start from its float checkpoint."
            )
        packed_head(config, packed)  # a bad PERFXLM_PACKED_LM_HEAD fails here, at configuration
        return
    if config is None:
        return
    if config.method in CHECKPOINT_METHODS:
        raise ValueError(
            f"quantization={config.method!r} names a pre-quantized checkpoint format, but {model_path!r} has "
            "no quantization_config with that quant_method in its config.json. Supported for it: "
            f"{', '.join(METHODS)} (quantize at load), or none."
        )
    quantized_types = gguf_quantized_types(model_path) if config.quantizes and load_format == "gguf" else []
    if quantized_types:
        raise ValueError(
            f"quantization={config.method!r}: {model_path!r} is a GGUF file with quantized tensors "
            f"({', '.join(quantized_types)}); they are kept as they are, not quantized "
            "twice. Supported with this file: quantization=None or 'gguf' (keep), 'none' (dequantize to "
            "dtype); a float GGUF (F32 / F16 / BF16 tensors) can be quantized at load like any checkpoint."
        )
    if config.method == GGUF and load_format != "gguf":
        raise ValueError(
            f"quantization='gguf' needs a .gguf file; {model_path!r} is loaded as {load_format}. Supported "
            f"for it: {', '.join(METHODS)}, or none."
        )
