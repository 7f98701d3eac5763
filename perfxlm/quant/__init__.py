"""Quantized weights: one storage form (`QuantizedWeight`) for GGUF blocks kept quantized and for float
checkpoints quantized at load (`quantization=`), multiplied by each layer's linear method
(model/layers/linear_methods/) through the native kernel or the plain-torch reference."""

from perfxlm.quant.config import METHODS, QuantizationConfig, resolve_activations
from perfxlm.quant.quantizers import NF4_LEVELS
from perfxlm.quant.reference import quantize_activations, reference_linear
from perfxlm.quant.weight import ActivationMode, QuantizedWeight, pack_nibbles, unpack_nibbles

__all__ = [
    "METHODS", "NF4_LEVELS", "ActivationMode", "QuantizationConfig", "QuantizedWeight", "pack_nibbles", "quantize_activations",
    "reference_linear", "resolve_activations", "unpack_nibbles",
]  # fmt: skip
