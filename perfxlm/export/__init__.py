"""Graph export: a loaded model written as an ONNX decoder graph (`perfxlm export onnx`).

- `graph.py`: the graph under construction (nodes, initializers, inputs and outputs), saved with the
  weights as external data.
- `graph_ops.py`: the `GraphOps` seam. A decoder layer is written once against it (norms, rotary,
  attention over a past, linear of each weight format); each flavor emits those ops its own way:
  `standard` with standard ONNX ops only, `ort` with ONNX Runtime's contrib ops.
- `features.py`: what a family needs beyond the Llama block, by name (read from the loaded model before a
  node is written); each flavor lists those it writes, and the others are refused by name.
- `graph_values.py`: the values passed across the seam (rotary tables, attention shapes, weights).
- `graph_moe.py`, `graph_mla.py`: a mixture of experts (routing, each expert on its routed rows) and
  DeepSeek's latent attention over a latent cache, in standard ops, mixed into `GraphOps`.
- `perfxlm_ops.py`: the `perfxlm` flavor, the engine's own fused ops over a paged KV cache (the engine
  runs it: perfxlm/model/graph/). `flavors.py`: flavor names -> their GraphOps.
- `matmul_nbits.py`: quantized weights packed the way ONNX Runtime's MatMulNBits reads them.
- `lora_record.py`: what a LoRA adapter may target in a perfxlm-flavor graph, recorded in its metadata
  (the engine binds adapters to those nodes at run time: perfxlm/model/graph/lora.py).
- `lora_merge.py`: `--lora PATH`, one adapter merged into the float weights before they are written.
- `decoder.py`: reads the engine's loaded model (any weight format it loads, any decoder family it runs)
  into the graph.
- `package.py`: the output folder (model.onnx + data, genai_config.json, config, tokenizer files),
  written beside it and moved in place whole, so a failed export leaves nothing behind.
- `command.py`: the CLI subcommand.
"""
