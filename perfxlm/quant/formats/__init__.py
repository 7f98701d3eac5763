"""Pre-quantized Hugging Face checkpoints (AWQ, GPTQ, compressed-tensors, MXFP4, block FP8) kept packed: one
`CheckpointFormat` per quant_method (base.py explains the seam), `PackedCheckpoint` to read one."""

from perfxlm.quant.formats.base import CheckpointFormat
from perfxlm.quant.formats.loading import ALIASES, FORMATS, PackedCheckpoint, canonical_method, format_for

__all__ = ["ALIASES", "FORMATS", "CheckpointFormat", "PackedCheckpoint", "canonical_method", "format_for"]
