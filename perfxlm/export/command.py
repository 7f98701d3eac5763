"""`perfxlm export onnx MODEL OUT_DIR`: the CLI face of `package.export_onnx`."""

from __future__ import annotations

import argparse
import sys


def add_export_parser(sub: argparse._SubParsersAction) -> None:
    export = sub.add_parser("export", help="write a model in another format: onnx")
    esub = export.add_subparsers(dest="export_command", required=True)
    onnx = esub.add_parser("onnx", help="an ONNX decoder graph with past/present KV, genai_config.json and "
                                        "the tokenizer, as ONNX Runtime and onnxruntime-genai run it")
    onnx.add_argument("model", help="Hugging Face model folder, .gguf file or model id")
    onnx.add_argument("out_dir", nargs="?", default=None, help="output folder (or -o)")
    onnx.add_argument("-o", "--output", dest="output", default=None, help="output folder")
    onnx.add_argument("--flavor", default="ort", choices=["ort", "standard", "perfxlm"],
                      help="ort: ONNX Runtime's contrib ops (GroupQueryAttention, RotaryEmbedding, "
                           "SkipSimplifiedLayerNormalization, MatMulNBits: quantized weights kept packed); "
                           "standard: standard ONNX ops only (quantized weights dequantized); perfxlm: the "
                           "engine's own fused ops (perfxlm domain) over a paged KV cache, which the engine runs")
    onnx.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16"],
                      help="the engine's dtype the model is loaded with, its float weights stored as held. "
                           "perfxlm flavor: auto (default: what the engine chooses for the model on this CPU, "
                           "recorded so the engine runs the folder as it runs the model), float32 or bfloat16; "
                           "ort and standard: float32")
    onnx.add_argument("--quantization", "-q", default=None,
                      help="weights exported quantized: int4 | int8 quantize a float checkpoint; a .gguf "
                           "file's quantized tensors are kept (none dequantizes them)")
    onnx.add_argument("--quantization-group-size", type=int, default=None, help="weights per scale")
    onnx.add_argument("--quantization-symmetric", action=argparse.BooleanOptionalAction, default=None,
                      help="symmetric codes, or a zero point per group")
    onnx.add_argument("--lora", default=None, metavar="PATH",
                      help="a PEFT LoRA adapter folder merged into the exported weights (W + scale * B A, as "
                           "peft's merge_and_unload): how the ort and standard flavors run an adapter; float "
                           "weights only (no --quantization)")
    onnx.add_argument("--tokenizer", default=None, help="tokenizer folder, if not the model's")
    onnx.add_argument("--overwrite", action="store_true", help="replace an output folder that holds files")
    onnx.add_argument("--revision", default=None, help="commit, branch or tag of a model id")
    onnx.add_argument("--download-dir", default=None, help="Hugging Face cache for model ids")
    onnx.set_defaults(func=_export_onnx)


def _export_onnx(args: argparse.Namespace) -> int:
    from perfxlm.export.package import export_onnx

    out = args.output or args.out_dir
    if out is None or (args.output and args.out_dir and args.output != args.out_dir):
        raise ValueError("give the output folder once: OUT_DIR or -o OUT_DIR.")
    result = export_onnx(args.model, out, flavor=args.flavor, quantization=args.quantization,
                         quantization_group_size=args.quantization_group_size,
                         quantization_symmetric=args.quantization_symmetric, tokenizer=args.tokenizer,
                         overwrite=args.overwrite, revision=args.revision, download_dir=args.download_dir,
                         dtype=args.dtype, lora=args.lora)
    ops = ", ".join(f"{op} {n}" for op, n in sorted(result.op_census.items(), key=lambda kv: -kv[1]))
    print(f"wrote {result.out_dir} ({result.model_type}, {result.flavor} flavor; "
          f"{len(result.op_census)} op types: {ops})", file=sys.stderr)
    return 0
