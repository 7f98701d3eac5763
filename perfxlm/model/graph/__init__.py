"""The engine running a `perfxlm`-flavor ONNX graph (`perfxlm export onnx --flavor perfxlm`): no model file
of the family, the graph is the model.

- `weights.py`: the graph file and its initializers (external data read straight into tensors).
- `kernels.py`: each op of the `perfxlm` domain mapped to the engine's kernel, the one the module path calls
  (RMSNorm's native kernels, rotary, the attention layer over the paged cache, ops.linear for every
  weight format); unknown ops and versions are refused by name.
- `layers.py`: the decoder layers found again among the nodes, for the fused decode layer.
- `model.py`: `GraphModel`, the nodes as a module the ordinary `ModelRunner` runs under the scheduler.
- `lora.py`: LoRA adapters bound at run time to the Linear nodes the export recorded as targets, through
  the module path's own LoRA wrapper.
"""
