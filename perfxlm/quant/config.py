"""`quantization=`: what the user asked for, resolved once into a `QuantizationConfig`; and
`quant_activations=`: what the products do to the activations, resolved once into an `ActivationMode`.

Names (vLLM's `quantization` argument):
- "int8": int8 weight-only (float32 activations); one scale per group of 64 by default (per output
  channel where 64 does not divide a weight's input size; measured below `_DEFAULT_GROUP`), or any
  multiple of 16, or -1 (per channel); symmetric by default, or asymmetric (uint8 with a zero point per
  group, DashInfer's InstantQuant form).
- "int4": 4-bit weight-only, group 32 by default (32/64/128 ...), asymmetric: a scale and min per
  group, searched for the least (activation-weighted) squared error (llama.cpp's Q4_K search), held as
  K-quants hold theirs where a weight's input size is a multiple of 256 (a byte per group for each, a
  float16 factor of each per 256: 4.625 bits per weight, `perfxlm.quant.two_level`), else as float16
  (5 bits); or symmetric (Q4_0's rule, `symmetric: true`).
- "nf4": 4-bit NormalFloat as QLoRA defines it: absmax per group of 64, double-quantized
  (`perfxlm.quant.nf4`), with Q4_K_M's mixed precision (below) by default; `double_quant: false` keeps
  the plain absmax in float16.
- "w8a8": int8 weights per output channel, symmetric; activations quantized to int8 per token at run
  time. On the generate runner with one scale per block of 32 activations of the token by default
  (llama.cpp's Q8 activations; measured on the default model: +0.6 % perplexity over the float model,
  against +3.3 % with one scale per token, which `activation_group_size=-1` selects). On the pooling
  runner with one scale per token by default (vLLM's W8A8 int8: dynamic per-token activations): a
  pooling batch is thousands of rows, which only per-token scales let run as one integer GEMM
  (`perfxlm.ops.int8_gemm`), and any hidden size takes it (blocks need multiples of 32); an embedding
  is compared by cosine, where per-token rounding measured 0.998-0.999 on bge-shaped models.
  `activation_group_size=32` keeps blocks there.
- "gguf": accepted on a .gguf file (vLLM's spelling): its quantized tensors stay quantized, the default.
- "none": no quantized weights; a GGUF file's quantized tensors are dequantized at load to `dtype`.
- "awq", "gptq", "compressed-tensors", "mxfp4", "fp8" (vLLM's names, "awq_marlin" / "gptq_marlin" too): accepted on a
  checkpoint whose config.json's quantization_config has that quant_method (perfxlm.quant.formats): its
  packed weights are kept packed, as they are with None.
Options: `quantization_group_size` (weights per scale; -1 = one scale per output channel) and
`quantization_symmetric` (bool). Both may also come inside the value as a dict or its JSON text:
`{"method": "int4", "group_size": 64, "symmetric": false}`; w8a8 also takes `activation_group_size`
(32, the default, or -1 for one scale per token) there. Only in the dict:
- `calibration` (int4 asymmetric; nf4 with `double_quant: false`): a UTF-8 text file whose first
  `calibration_tokens` tokens (512 by default) run through the model before it is quantized, so that
  each weight's error is weighted by its input channel's mean square activation
  (`perfxlm.quant.calibration`); "default" (what int4 does unless told otherwise) names a short English
  text shipped with the package; false: calibration-free.
  The default quietly falls back to calibration-free (a warning) where the model has no tokenizer;
  a named text fails instead.
- `mixed_precision` (int4, nf4): llama.cpp's Q4_K_M allocation (`perfxlm.quant.mixed`): 5-bit codes (one
  float16 scale per 32, searched: Q5_0's form) for the FFN down projections of half the layers and for
  every weight whose input size is not a multiple of 256 (where Q4_K_M falls back to Q5_0), Q8_0's
  8-bit form for the fused QKV of those layers where its V is such a weight (Q4_K_M's V: Q8_0 there),
  the method's 4-bit form elsewhere and for an embedding table untied from the LM head (instead of
  8-bit codes). On by default for int4 (not its symmetric Q4_0 form) and nf4.
- `super_blocks` (int4 asymmetric): the two-level form above where the input size allows (default true:
  0.375 bits per weight fewer on those rows, its scales formed from their bytes inside the kernels' loops;
  false keeps float16 scales and mins everywhere).
- `double_quant` (nf4): QLoRA's double-quantized absmax (default true); false keeps a float16 absmax
  per group, or with `calibration` a float16 scale per group searched like int4's (not QLoRA's values).
- `lm_head` (every method; vLLM's GPTQ name): the embedding table and the LM head stored as 8-bit codes,
  one symmetric float32 scale per 64 values, the min implied (Q8_0's form; 8.5 bits per weight), as every llama.cpp format stores
  them (default true). false keeps them in the model's float dtype: on the default model a float32
  head is 113 MB, more than all its int4 projections, and every decode step reads it whole.
  With a pre-quantized checkpoint's method (`{"method": "awq", "lm_head": true}`; the only options
  those take, with `head_bits`) it says what becomes of the float embedding table and LM head the
  checkpoint stores: quantized at load as int4 quantizes them (`head_bits` 6 by default) or kept float
  (false, vLLM's way); left out, `perfxlm.quant.loading.packed_head`'s default for the checkpoint applies.
- `head_bits` (int4, nf4; with `lm_head`): 8 (the form above) or 6: llama.cpp's Q6_K, as Q4_K_M and
  Q4_0 hold the LM head (`perfxlm.quant.six_bit`: 6-bit centred codes, a signed byte scale per 16 and a
  float16 factor per 256, 6.56 bits per weight; a float16 scale per 32, 6.5 bits, on rows that are not
  whole 256s). Default 6 for int4 (2 bits per weight fewer on the matrix a decode step reads most of),
  8 for nf4.

Activations (the engine's `quant_activations`, CLI `--quant-activations`; `resolve_activations`):
- "auto" (default): on a bfloat16 model, a GGUF file's tensors and "int4" round the activations to int8
  blocks of 32 where the native build has int8 dot products (llama.cpp's scheme for all its formats:
  2-3x fewer instructions at decode than widening codes to float32, and its rounding is small next to
  4-bit weights'); "int8" and "nf4" keep them float32 (weight-only, as named); "w8a8" always int8. A
  float32 model keeps float32 activations.
- "int8": int8 blocks of 32 for every quantized format, GGUF types included (llama.cpp's scheme
  throughout); where the native kernel cannot (a build without int8 dots, NF4's level tables, an input
  size its block GEMV lacks) the activations are rounded in torch the same way, so results match.
- "float32": float32 activations for every weight-only format (exact to float summation order);
  contradicts "w8a8" (ValueError).
The environment variable PERFXLM_QUANT_ACTIVATIONS (auto | int8 | float32) stands in for an option left
at "auto" (a knob for tests and benchmarks; an explicit option wins).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch

from perfxlm.quant import quantizers, six_bit, two_level
from perfxlm.quant.formats.loading import ALIASES as CHECKPOINT_ALIASES
from perfxlm.quant.formats.loading import FORMATS
from perfxlm.quant.weight import ACT_BLOCK, BLOCK4, ActivationMode, QuantizedWeight

METHODS = ("int8", "int4", "nf4", "w8a8")
GGUF, NONE = "gguf", "none"
# a pre-quantized checkpoint's own method (perfxlm.quant.formats), accepted as `quantization=` where the
# checkpoint has it (vLLM's spelling: its weights are kept packed, as with None)
CHECKPOINT_METHODS = tuple(FORMATS)
ALL_NAMES = (*METHODS, GGUF, NONE, *CHECKPOINT_METHODS)
PER_CHANNEL = -1
GROUP8 = 16  # 8-bit codes: groups are whole multiples of 16 weights (or one per row)
# int8: one scale per 64 weights. Measured on the default model's weights (its BF16 conversion, bf16
# model, 20 windows of 512 ShareGPT tokens, float32 activations): mean KL divergence from the unquantized
# model 0.00277 per channel, 0.00141 group 64, 0.00112 group 32 (same top token 97.4 / 98.2 / 98.5 %;
# perplexity +0.39 / +0.45 / +0.37 %, within its noise); batch-1 decode on an AMD EPYC Zen 3 (AVX2, 1
# thread of a shared 2-core machine), median ratio to per channel over alternating rounds of two runs:
# group 64 1.00 / 1.04, group 32 0.91 / 0.94 (its float32 scale and min add 2 bits per weight, group
# 64's 1; float16 scales measured 0.89: their conversions cost more than the bytes they save).
# A weight whose input size 64 does not divide keeps one scale per output channel (the default only).
_DEFAULT_GROUP = {"int8": 64, "int4": 32, "nf4": 64, "w8a8": PER_CHANNEL}
_DEFAULT_FALLS_BACK_PER_CHANNEL = ("int8",)
_DICT_KEYS = (
    "method", "group_size", "symmetric", "activation_group_size", "calibration", "calibration_tokens",
    "mixed_precision", "double_quant", "lm_head", "super_blocks", "head_bits",
)  # fmt: skip
HEAD_BITS = (6, 8)  # code widths of the embedding table / LM head
_DEFAULT_HEAD_BITS = {"int4": 6}  # else 8
LARGE_TABLE_ROWS = 16384  # 5-bit codes for more rows than this, calibration-free: Q5_0's one-pass rule
TABLE_GROUP = 64  # the 8-bit embedding table / LM head: weights per scale (32 where 64 does not divide)
DEFAULT_CALIBRATION = "default"  # the built-in text (perfxlm/quant/calibration.txt)
DEFAULT_CALIBRATION_TOKENS = 512
MIN_CALIBRATION_TOKENS = 16
_DEFAULT_SYMMETRIC = {"int8": True, "int4": False, "nf4": True, "w8a8": True}
# calibration text by method where the user names none: measured on a 135M Llama, int4 group 32 goes
# from +10 % perplexity calibration-free to +2.6 % for about one more load of the model (README)
_DEFAULT_CALIBRATION = {"int4": DEFAULT_CALIBRATION, "nf4": None}
# both widen like Q4_K_M by default. Measured on the default model turned off its 4-bit grid (README, 20
# windows): int4 mean KLD 0.0666 at 6.03 bits per weight against Q4_K_M's 0.0852 at 6.04; nf4 0.115 at
# 5.90 (1.35x Q4_K_M's), where QLoRA's uniform form (`mixed_precision: false`) has 0.621 at 6.22
_DEFAULT_MIXED = {"int4": True, "nf4": True}
ACTIVATION_GROUPS = (ACT_BLOCK, PER_CHANNEL)  # w8a8: activations per scale, or one scale per token


# The engine's `quant_activations` (see the module docstring) and its environment default.
QUANT_ACTIVATIONS = ("auto", "int8", "float32")
ACTIVATIONS_ENV = "PERFXLM_QUANT_ACTIVATIONS"
# `auto` for a bfloat16 model, by where its quantized weights came from (a float32 model: float32).
_AUTO_ACTIVATIONS = {
    GGUF: ActivationMode.INT8_NATIVE,  # llama.cpp's own scheme for its formats: GGUF decode keeps its speed
    "int4": ActivationMode.INT8_NATIVE,  # 4-bit rounding dwarfs the activations'; int8 dots keep its speed
    "int8": ActivationMode.FLOAT,  # weight-only as named: int8 blocks would double its loss
    "nf4": ActivationMode.FLOAT,  # its levels are not integers: no int8 dot path, float32 in any case
    "w8a8": ActivationMode.INT8,  # the format quantizes activations by definition
}


def _names() -> str:
    return ", ".join(ALL_NAMES)


def check_quant_activations(value: Any, name: str = "quant_activations") -> str:
    """The choice `value` names (auto, int8 or float32); ValueError naming the choices otherwise."""
    choice = value.strip().lower() if isinstance(value, str) else None
    if choice not in QUANT_ACTIVATIONS:
        raise ValueError(f"{name}={value!r} is not supported; supported: {', '.join(QUANT_ACTIVATIONS)}.")
    return choice


def resolve_activations(
    option: Any, source: str | None, weight_dtype: torch.dtype, per_token: bool = False
) -> ActivationMode:
    """The `ActivationMode` of a model's quantized weights, decided once at configuration.

    `option`: the engine's quant_activations (auto: the environment's PERFXLM_QUANT_ACTIVATIONS, else the
    format's default); `source`: where the quantized weights come from (one of METHODS, "gguf" for a GGUF
    file's tensors kept quantized, None when no weight stays quantized); `weight_dtype`: the model's
    weight dtype (under auto a float32 model keeps float32 activations, bfloat16 takes the table above);
    `per_token`: W8A8 with one scale per token, whose layers round whole rows themselves whatever the
    mode, so the mode reaches only the 8-bit embedding table and LM head: weight-only there under auto,
    as `QuantizationConfig.quantize_table` says (blocks of 32 would also refuse a hidden size that is
    not a multiple of 32). ValueError where the option contradicts the format or has nothing to apply to."""
    option = check_quant_activations(option)
    explicit = option != "auto"
    if not explicit:  # the environment stands in for an option left at auto (tests, benchmarks)
        option = check_quant_activations(os.environ.get(ACTIVATIONS_ENV, "auto") or "auto", ACTIVATIONS_ENV)
    if source is None:
        if explicit and option == "int8":
            raise ValueError(
                "quant_activations='int8' applies to quantized weights and this model has none; add "
                f"quantization= ({', '.join(METHODS)}), or load a GGUF file's quantized tensors as they are."
            )
        return ActivationMode.FLOAT
    if source == "w8a8":
        if explicit and option == "float32":
            raise ValueError(
                "quant_activations='float32' with quantization='w8a8': w8a8 quantizes activations to int8 by "
                "definition. For int8 weights with float32 activations use quantization='int8'."
            )
        if per_token:
            return ActivationMode(option) if option != "auto" else _AUTO_ACTIVATIONS["int8"]
        return ActivationMode.INT8
    if option != "auto":
        return ActivationMode(option)
    return _AUTO_ACTIVATIONS[source] if weight_dtype == torch.bfloat16 else ActivationMode.FLOAT


@dataclass(frozen=True)
class QuantizationConfig:
    method: str  # one of ALL_NAMES
    group_size: int = PER_CHANNEL  # -1: one scale per output channel
    symmetric: bool = True
    group_explicit: bool = False  # whether group_size came from the user
    activation_group_size: int = ACT_BLOCK  # w8a8 only: 32 per scale, or -1 (one scale per token)
    activation_group_explicit: bool = False  # whether activation_group_size came from the user
    calibration: str | None = None  # "default" or a text file (int4 asymmetric, nf4 without double
    # quantization); None: calibration-free
    calibration_tokens: int = DEFAULT_CALIBRATION_TOKENS
    calibration_explicit: bool = False  # whether `calibration` came from the user (else the default)
    mixed_precision: bool = False  # int4 / nf4: 8-bit down projections in half the layers (resolve: int4 on)
    double_quant: bool = True  # nf4: QLoRA's double-quantized absmax
    super_blocks: bool = False  # int4 asymmetric: two-level scales on rows of whole 256s (resolve: on)
    lm_head: bool = True  # the embedding table and the LM head as 8-bit codes (else float)
    head_bits: int = 8  # their code width under lm_head: 8 (Q8_0's form) or 6 (Q6_K's; int4's default)
    # a pre-quantized checkpoint's method: whether lm_head / head_bits came from the user (else the
    # loader's default for the checkpoint's format, `perfxlm.quant.loading.packed_head`)
    head_explicit: bool = False

    @property
    def quantizes(self) -> bool:
        """Whether float weights are quantized at load (int8 / int4 / nf4 / w8a8)."""
        return self.method in METHODS

    @property
    def bits(self) -> int:
        return 4 if self.method in ("int4", "nf4") else 8

    @property
    def per_token_activations(self) -> bool:
        """W8A8 with one activation scale per token (the integer-GEMM form)."""
        return self.method == "w8a8" and self.activation_group_size == PER_CHANNEL

    def for_runner(self, runner_kind: str) -> "QuantizationConfig":
        """This config as the runner serving the model takes it: W8A8 on the pooling runner quantizes
        activations per token unless the user chose blocks (the module docstring says why)."""
        if runner_kind == "pooling" and self.method == "w8a8" and not self.activation_group_explicit:
            return dataclasses.replace(self, activation_group_size=PER_CHANNEL)
        return self

    def describe(self) -> str:
        if not self.quantizes:
            return self.method
        group = "per channel" if self.group_size == PER_CHANNEL else f"group {self.group_size}"
        if not self.group_explicit and self.method in _DEFAULT_FALLS_BACK_PER_CHANNEL:
            group += " (per channel where it does not divide the input size)"
        kind = "" if self.method == "nf4" else (", symmetric" if self.symmetric else ", asymmetric")
        if self.method == "int4" and not self.symmetric:
            kind += ", searched scales"
            if self.super_blocks:
                kind += " (bytes x float16 per 256 where the input size is a multiple of 256)"
        if self.calibration is not None:
            text = "the built-in text" if self.calibration == DEFAULT_CALIBRATION else repr(self.calibration)
            kind += f", calibrated on {self.calibration_tokens} tokens of {text}"
        if self.method == "nf4":
            plain = ", float16 scales searched" if self.calibration is not None else ", float16 absmax"
            kind += ", double-quantized absmax" if self.double_quant else plain
        if self.mixed_precision:
            kind += ", 5- and 8-bit codes where llama.cpp's Q4_K_M widens or falls back to Q5_0 / Q8_0"
        kind += f", {self.head_bits}-bit embedding and LM head" if self.lm_head else ", float embedding and LM head"
        if self.method == "w8a8":
            per = "token" if self.activation_group_size == PER_CHANNEL else f"{self.activation_group_size} values"
            kind += f", activations: one scale per {per}"
        return f"{self.method} ({group}{kind})"

    def as_dict(self) -> dict[str, Any]:
        """The dict form `resolve` reads back (plain values: it travels inside the model's config)."""
        out: dict[str, Any] = {"method": self.method}
        if self.head_explicit:  # a pre-quantized checkpoint's float embedding and head, as the user chose
            out["lm_head"] = self.lm_head
            if self.lm_head:
                out["head_bits"] = self.head_bits
        if self.quantizes:
            out["symmetric"] = self.symmetric
            if self.group_explicit:  # else left to the method's default, as the user did
                out["group_size"] = self.group_size
            if self.method == "w8a8":
                out["activation_group_size"] = self.activation_group_size
            if self.method in ("int4", "nf4"):
                if self.calibration_explicit or self.calibration is None:  # else left to the default
                    out["calibration"] = self.calibration or False
                if self.calibration is not None:
                    out["calibration_tokens"] = self.calibration_tokens
            if self.method in ("int4", "nf4"):
                out["mixed_precision"] = self.mixed_precision
            if self.method == "nf4":
                out["double_quant"] = self.double_quant
            if self.method == "int4" and not self.symmetric:
                out["super_blocks"] = self.super_blocks
            if not self.lm_head:
                out["lm_head"] = False
            if self.head_bits != _DEFAULT_HEAD_BITS.get(self.method, 8):
                out["head_bits"] = self.head_bits
        return out

    def group_for(self, in_features: int) -> int:
        """Weights per scale for a weight with `in_features` inputs."""
        if self.group_size == PER_CHANNEL or self._falls_back_per_channel(in_features):
            return in_features
        return self.group_size

    def _falls_back_per_channel(self, in_features: int) -> bool:
        """int8's default group where it does not divide the input size: one scale per output channel
        (an explicit group that does not divide is an error instead)."""
        return (not self.group_explicit and self.method in _DEFAULT_FALLS_BACK_PER_CHANNEL
                and in_features % self.group_size != 0)  # fmt: skip

    def check_in_features(self, in_features: int, where: str) -> None:
        """ValueError unless a weight with `in_features` columns can take this format."""
        group = self.group_for(in_features)
        origin = "" if self.group_explicit else f" (the default for {self.method})"
        if in_features % group:
            raise ValueError(
                f"quantization_group_size={self.group_size}{origin} does not divide the input size "
                f"{in_features} of {where}; supported: a group size dividing every input size, or -1 "
                "(one scale per output channel)."
            )
        if self.bits == 4 and (in_features % BLOCK4 or group % BLOCK4):
            raise ValueError(
                f"quantization={self.method!r} needs input sizes and group sizes that are multiples of "
                f"{BLOCK4}; {where} has input size {in_features} with group {group}. Supported there: "
                "int8 or w8a8."
            )
        if self.method == "w8a8" and self.activation_group_size != PER_CHANNEL and in_features % ACT_BLOCK:
            raise ValueError(
                f"quantization='w8a8' quantizes activations in blocks of {ACT_BLOCK}, which do not divide "
                f"the input size {in_features} of {where}; supported there: activation_group_size=-1 (one "
                "scale per token)."
            )

    def quantizer(self) -> Callable[[torch.Tensor], QuantizedWeight]:
        """float [..., N, K] -> QuantizedWeight in this format (calibration-free, 4 bits where 4-bit)."""
        if not self.quantizes:
            raise ValueError(f"quantization={self.method!r} does not quantize weights")
        return lambda w: self.quantize_weight(w)

    def quantize_table(self, w: torch.Tensor) -> QuantizedWeight:
        """An embedding table or LM head [V, K] -> 8-bit codes, one symmetric scale per TABLE_GROUP values
        (per 32, or per row, where that does not divide K); under head_bits=6, 6-bit codes (`six_bit`) where
        K is whole blocks of 32. Weight-only under every method: the head's
        activations are rounded only as the engine's `quant_activations` says for weight-only formats
        (W8A8's per-token rounding moved greedy picks on the head where the layers' did not)."""
        k = w.shape[-1]
        if self.head_bits == 6 and w.dim() == 2 and k % BLOCK4 == 0:
            return six_bit.quantize(w)
        group = next((g for g in (TABLE_GROUP, 32) if k % g == 0), k)
        return quantizers.quantize_symmetric_int8(w, group, centred=True)

    def quantize_weight(
        self, w: torch.Tensor, importance: torch.Tensor | None = None, bits: int | None = None
    ) -> QuantizedWeight:
        """float [..., N, K] -> QuantizedWeight. `importance`: the mean square activation of each input
        channel [K] (int4's search weighs errors by it); `bits`: mixed precision's code width for this
        weight (5: 5-bit codes, a searched float16 scale per group of 32 or of the method's group where
        that is a multiple of 32; 4 or None: the method's own form)."""
        if not self.quantizes:
            raise ValueError(f"quantization={self.method!r} does not quantize weights")
        if bits == 8:  # Q8_0's form: centred codes, a float16 scale per 32
            group8 = BLOCK4 if w.shape[-1] % BLOCK4 == 0 else w.shape[-1]
            return quantizers.quantize_symmetric_int8(w, group8, centred=True, half=True)
        if bits == 5:
            group5 = self.group_for(w.shape[-1])
            group5 = group5 if group5 % BLOCK4 == 0 and group5 < w.shape[-1] else BLOCK4
            if importance is None and w.shape[-2] > LARGE_TABLE_ROWS:  # an embedding table: nothing to weigh
                return quantizers.quantize_symmetric_int5(w, group5)
            return quantizers.quantize_int5_search(w, group5, importance)
        group = self.group_for(w.shape[-1])
        if self.method == "int8":
            if self.symmetric:
                return quantizers.quantize_symmetric_int8(w, group)
            return quantizers.quantize_asymmetric_int8(w, group)
        if self.method == "w8a8":
            act = "int8" if self.activation_group_size == PER_CHANNEL else "int8_block"
            return quantizers.quantize_symmetric_int8(w, group, act=act)
        if self.method == "int4":
            if self.symmetric:
                return quantizers.quantize_symmetric_int4(w, group)
            if self.super_blocks and two_level.fits(w.shape[-1], group):
                q = two_level.quantize_int4(w, group, importance)
                if q is not None:  # else a factor beyond float16: the float form below
                    return q
            return quantizers.quantize_int4_search(w, group, importance)
        if self.calibration is not None and not self.double_quant:
            return quantizers.quantize_nf4_search(w, group, importance)
        return quantizers.quantize_nf4(w, group, self.double_quant)

    @staticmethod
    def resolve(
        quantization: Any, group_size: int | None = None, symmetric: bool | None = None
    ) -> "QuantizationConfig | None":
        """None when nothing was asked; ValueError naming the value and the choices otherwise."""
        if quantization is None:
            if group_size is not None or symmetric is not None:
                raise ValueError(
                    "quantization_group_size / quantization_symmetric need quantization= "
                    f"(one of {', '.join(METHODS)})."
                )
            return None
        options: dict[str, Any] = {}
        if isinstance(quantization, str) and quantization.strip().startswith("{"):
            try:
                quantization = json.loads(quantization)
            except json.JSONDecodeError as e:
                raise ValueError(f"quantization={quantization!r} is not valid JSON: {e}") from None
        if isinstance(quantization, dict):
            unknown = sorted(set(quantization) - set(_DICT_KEYS))
            if unknown or "method" not in quantization:
                raise ValueError(
                    f"quantization={quantization!r}: expected the keys {', '.join(_DICT_KEYS)} "
                    f"(method required){'; unknown: ' + ', '.join(unknown) if unknown else ''}."
                )
            options = {k: v for k, v in quantization.items() if k != "method"}
            quantization = quantization["method"]
        if isinstance(quantization, str):
            lowered = quantization.strip().lower()
            quantization = CHECKPOINT_ALIASES.get(lowered, lowered)
        if not isinstance(quantization, str) or quantization not in ALL_NAMES:
            raise ValueError(f"quantization={quantization!r} is not supported; supported: {_names()}.")
        method = quantization
        for key, value in (("group_size", group_size), ("symmetric", symmetric)):
            if value is not None:
                if key in options and options[key] != value:
                    raise ValueError(f"quantization {key} given twice with different values")
                options[key] = value
        if method in CHECKPOINT_METHODS:
            return _checkpoint_config(method, options)
        if method in (GGUF, NONE):
            if options:
                raise ValueError(f"quantization={method!r} takes no group size or symmetry options.")
            return QuantizationConfig(method)
        group = options.get("group_size")
        if group is not None:
            if isinstance(group, bool) or not isinstance(group, int) or (group < 1 and group != PER_CHANNEL):
                raise ValueError(
                    f"quantization_group_size={group!r}: expected a positive integer or -1 (per channel)."
                )
            step = BLOCK4 if method in ("int4", "nf4") else GROUP8
            if group != PER_CHANNEL and group % step:
                raise ValueError(
                    f"quantization_group_size={group} for {method}: supported: multiples of {step} "
                    f"({step}, {2 * step}, {4 * step}, ...) or -1 (per channel)."
                )
        sym = options.get("symmetric")
        if sym is not None and not isinstance(sym, bool):
            raise ValueError(f"quantization_symmetric={sym!r}: expected true or false.")
        if method == "nf4" and sym is False:
            raise ValueError("quantization_symmetric=False: nf4 is absmax-scaled; supported: symmetric only.")
        if method == "w8a8" and sym is False:
            raise ValueError(
                "quantization_symmetric=False: w8a8 weights are symmetric; supported: symmetric only."
            )
        act_group = options.get("activation_group_size")
        if act_group is not None and (method != "w8a8" or act_group not in ACTIVATION_GROUPS
                                      or isinstance(act_group, bool)):  # fmt: skip
            raise ValueError(
                f"activation_group_size={act_group!r} for {method}: supported: w8a8 only, with "
                f"{ACT_BLOCK} (one scale per {ACT_BLOCK} activations of a token) or -1 (one per token)."
            )
        symmetric = _DEFAULT_SYMMETRIC[method] if sym is None else sym
        extras = _extras(method, options, symmetric)
        if method == "nf4" and extras.get("calibration") is not None and extras.get("double_quant", True):
            raise ValueError(
                "quantization calibration with nf4: its double-quantized form is QLoRA's fixed rule, with "
                "nothing to weigh; supported: calibration with double_quant false (float16 scales searched "
                "per group)."
            )
        if method == "int4" and extras.get("calibration") is not None and symmetric:
            raise ValueError(
                "quantization calibration with symmetric int4: the symmetric form is Q4_0's fixed rule, "
                "with nothing to weigh; supported: calibration with asymmetric int4 (the default)."
            )
        return QuantizationConfig(
            method,
            group_size=_DEFAULT_GROUP[method] if group is None else group,
            symmetric=symmetric,
            group_explicit=group is not None,
            activation_group_size=ACT_BLOCK if act_group is None else act_group,
            activation_group_explicit=act_group is not None,
            **extras,
        )


# options a pre-quantized checkpoint's method takes: what becomes of its float embedding table and LM head
CHECKPOINT_OPTIONS = ("lm_head", "head_bits")


def _checkpoint_config(method: str, options: dict[str, Any]) -> QuantizationConfig:
    """`{"method": "awq", "lm_head": true, "head_bits": 6}`: a pre-quantized checkpoint's packed weights
    stay as they are; `lm_head` true quantizes the embedding table and LM head it stores in float at load
    as int4 does (`head_bits` 6: Q6_K's form, 8: Q8_0's), false keeps them float (vLLM's way). Without
    either, the loader's default for the checkpoint's format applies (`perfxlm.quant.loading`)."""
    unknown = sorted(set(options) - set(CHECKPOINT_OPTIONS))
    if unknown:
        raise ValueError(f"quantization={method!r} takes no {', '.join(unknown)} option; supported with a "
                         f"pre-quantized checkpoint's method: {', '.join(CHECKPOINT_OPTIONS)}.")
    if not options:
        return QuantizationConfig(method)
    lm_head = options.get("lm_head", True)
    if not isinstance(lm_head, bool):
        raise ValueError(f"quantization lm_head={lm_head!r} with {method}: expected true (quantize the "
                         "checkpoint's float embedding and LM head at load) or false (keep them float).")
    head_bits = options.get("head_bits")
    if head_bits is not None and (isinstance(head_bits, bool) or head_bits not in HEAD_BITS or not lm_head):
        raise ValueError(f"quantization head_bits={head_bits!r} with {method}: supported: "
                         f"{' or '.join(map(str, HEAD_BITS))}, with lm_head true.")
    bits = _DEFAULT_HEAD_BITS["int4"] if head_bits is None else head_bits
    return QuantizationConfig(method, lm_head=lm_head, head_bits=bits, head_explicit=True)


def _extras(method: str, options: dict[str, Any], symmetric: bool) -> dict[str, Any]:
    """The dict-only options (calibration, calibration_tokens, mixed_precision, double_quant), checked
    against the method; the method's defaults where not given."""
    out: dict[str, Any] = {}
    if method in _DEFAULT_CALIBRATION:
        explicit = options.get("calibration") is not None
        default = None if symmetric and method == "int4" else _DEFAULT_CALIBRATION[method]
        source = options.get("calibration", default)
        if source is False:
            source = None
        if source is not None:
            if not isinstance(source, str) or not source:
                raise ValueError(
                    f"quantization calibration={source!r}: expected the path of a UTF-8 text file, "
                    f"{DEFAULT_CALIBRATION!r} (the built-in text) or false."
                )
            if source != DEFAULT_CALIBRATION:
                if not os.path.isfile(source):
                    raise ValueError(
                        f"quantization calibration={source!r}: no such file. Supported: the path of a "
                        f"UTF-8 text file, {DEFAULT_CALIBRATION!r} (a built-in English text), or false "
                        "(calibration-free)."
                    )
                source = os.path.abspath(source)  # the same file for worker processes
        out["calibration"] = source
        out["calibration_explicit"] = explicit and source is not None
        tokens = options.get("calibration_tokens", DEFAULT_CALIBRATION_TOKENS)
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < MIN_CALIBRATION_TOKENS:
            raise ValueError(
                f"quantization calibration_tokens={tokens!r}: expected an integer >= "
                f"{MIN_CALIBRATION_TOKENS} "
                f"(default {DEFAULT_CALIBRATION_TOKENS})."
            )
        out["calibration_tokens"] = tokens
    else:
        for key in ("calibration", "calibration_tokens"):
            if options.get(key) not in (None, False):
                raise ValueError(
                    f"quantization {key} with {method}: supported with int4 and nf4 (their searched scales "
                    "weigh errors by the activations)."
                )
    if method in _DEFAULT_MIXED:
        q4_0 = method == "int4" and symmetric  # the symmetric form stays Q4_0's uniform rule
        mixed = options.get("mixed_precision", _DEFAULT_MIXED[method] and not q4_0)
        if not isinstance(mixed, bool):
            raise ValueError(f"quantization mixed_precision={mixed!r}: expected true or false.")
        out["mixed_precision"] = mixed
    elif options.get("mixed_precision"):
        raise ValueError(f"quantization mixed_precision with {method}: supported with int4 and nf4.")
    supers = options.get("super_blocks")
    if supers is not None and (method != "int4" or symmetric or not isinstance(supers, bool)):
        raise ValueError(f"quantization super_blocks={supers!r} with {method}"
                         f"{' (symmetric)' if symmetric and method == 'int4' else ''}: supported: true or false, "
                         "asymmetric int4 only (its searched scales and mins as bytes x float16 per 256).")
    if method == "int4" and not symmetric:
        out["super_blocks"] = True if supers is None else supers
    double = options.get("double_quant")
    if double is not None:
        if method != "nf4" or not isinstance(double, bool):
            raise ValueError(
                f"quantization double_quant={double!r} with {method}: supported: true or false, nf4 only."
            )
        out["double_quant"] = double
    lm_head = options.get("lm_head", True)
    if not isinstance(lm_head, bool):
        raise ValueError(f"quantization lm_head={lm_head!r}: expected true (8-bit embedding and LM head) or false.")
    out["lm_head"] = lm_head
    head_bits = options.get("head_bits")
    if head_bits is not None and (isinstance(head_bits, bool) or head_bits not in HEAD_BITS
                                  or method not in ("int4", "nf4")):  # fmt: skip
        raise ValueError(f"quantization head_bits={head_bits!r} with {method}: supported: 6 (Q6_K's form) or 8 "
                         "(Q8_0's), with int4 and nf4.")
    out["head_bits"] = _DEFAULT_HEAD_BITS.get(method, 8) if head_bits is None else head_bits
    return out
