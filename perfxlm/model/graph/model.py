"""`GraphModel`: a `perfxlm`-flavor graph as the module the ordinary `ModelRunner` runs, so the graph gets
the scheduler, paged KV cache, prefix caching, chunked prefill and sampling of the module path unchanged.

The nodes are checked and bound to their kernels once, at load (`kernels.py`); a step then calls them in
the graph's order over a table of values, freeing each value after its last use. The graph's step-layout
inputs (slot_mapping, block_tables, seq_lens, query_start_loc) are the runner's attention metadata, which
the attention kernels read from the forward context; `logits_indices` is where the runner's seam lies:
`forward` returns the rows the head's Gather reads (the final hidden states) and `compute_logits` runs
the nodes after that Gather on the rows the runner picked, as a family model's LM head does."""

from __future__ import annotations

import os
from typing import Any

import onnx
import torch
from onnx import helper
from torch import nn

from perfxlm.export.manifest import GRAPH_FILE, PERFXLM_DOMAIN, PERFXLM_OPSET, PLANES_OPSET
from perfxlm.model.forward_context import get_forward_context
from perfxlm.model.fused_decode import FusedDecode
from perfxlm.model.graph.kernels import (
    AS_STORED, CACHE_INPUTS, KERNELS, OP_SINCE, ROPE_INPUTS, STEP_INPUTS, HeldAs, Kernel, LatentAttention,
    PagedAttention, RopeTable,
)  # fmt: skip
from perfxlm.model.graph.layers import LayerRun, find_layers
from perfxlm.model.graph.steps import Step, run_steps, schedule
from perfxlm.model.graph.weights import load_graph, read_initializers
from perfxlm.model.loader.weight_arena import move_to_arena, release_freed_memory


class GraphModel(nn.Module):
    def __init__(self, folder: str, graph_file: str = GRAPH_FILE, held: HeldAs = AS_STORED) -> None:
        super().__init__()
        path = os.path.join(folder, graph_file)
        proto = load_graph(path)
        self.opset = _check_opsets(proto, path)
        weights = read_initializers(proto, folder)
        if held.weight_dtype is not None:
            _cast_float_matrices(proto.graph.node, weights, held.weight_dtype)
        self.held = held
        self.path = path
        # what the export recorded beside the nodes (export/lora_record.py's LoRA targets)
        self.metadata = {p.key: p.value for p in proto.metadata_props}
        self.named: dict[str, Kernel] = {}  # node name -> its kernel (LoRA binds adapters to Linear nodes by name)
        graph_inputs = {i.name for i in proto.graph.input}
        self.kernels = nn.ModuleList()
        tables: dict[tuple[str, str], RopeTable] = {}
        caches: set[str] = set()
        nodes = list(proto.graph.node)
        split = _head_split(nodes, path)
        self.hidden_name, self.rows_name = nodes[split].input[0], nodes[split].output[0]
        built: list[tuple[Kernel | None, list[str], list[str]]] = []
        for index, node in enumerate(nodes):
            if index == split:
                continue
            built.append(self._build(node, path, weights, graph_inputs, tables, caches))
        self.body = schedule(built[:split], keep={self.hidden_name})
        self.head = schedule(built[split:], keep={"logits"})
        self.attention_layers = [k.attn for k in self.kernels if isinstance(k, (PagedAttention, LatentAttention))]
        # all-decode steps: one native call per layer, as the module path (None: interpreted every step)
        self.layer_run: LayerRun | None = _self_contained(find_layers(self.body), self.body)
        self.decoder_layers = nn.ModuleList(self.layer_run.layers if self.layer_run else [])
        self.fused_decode = FusedDecode(self.decoder_layers)
        if not self.attention_layers:
            raise ValueError(f"{path}: the graph has no perfxlm::PagedAttention (or LatentAttention) node; it is "
                             "not a decoder.")
        # the loader's last step for a module model: the weights in one huge-page block, in the order a step
        # reads them, each cache-line aligned (read from the file they sat on 4 KiB pages at 16-byte offsets:
        # batch-1 decode measured 0.92-0.95x the module path's before)
        weights.clear()  # the kernels hold each weight now, so each original goes as it moves
        move_to_arena(self)
        release_freed_memory()
        self.eval()  # an inference module, as the loader hands a family's model over

    def _build(self, node: onnx.NodeProto, path: str, weights: dict[str, torch.Tensor], graph_inputs: set[str],
               tables: dict, caches: set[str]) -> tuple[Kernel | None, list[str], list[str]]:
        name = node.name or node.output[0]
        if (node.domain or "") == "" and node.op_type == "Identity":
            return None, list(node.input), list(node.output)
        entry = KERNELS.get(node.op_type) if node.domain == PERFXLM_DOMAIN else None
        if entry is None:
            domain = node.domain or "ai.onnx"
            raise ValueError(f"{path}: node {name!r} is op {domain}::{node.op_type}, which the engine does not "
                             f"run (the perfxlm flavor's ops: {', '.join(sorted(KERNELS))}).")
        builder, weight_slots, value_slots = entry
        inputs = list(node.input)
        for slot, want in STEP_INPUTS.get(node.op_type, {}).items():
            if slot >= len(inputs) or inputs[slot] != want:
                raise ValueError(f"{path}: node {name!r} ({node.op_type}) must take the graph input {want!r} "
                                 f"as input {slot}.")
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        attrs = {k: v.decode() if isinstance(v, bytes) else v for k, v in attrs.items()}
        since = _since(node.op_type, attrs, inputs)
        if since > self.opset:
            raise ValueError(f"{path}: node {name!r} ({node.op_type}) needs the {PERFXLM_DOMAIN} op set at version "
                             f"{since} or later; the graph imports version {self.opset} (export the model again "
                             "with this version of perfxlm).")
        args = []
        for slot in weight_slots:
            value = inputs[slot] if slot < len(inputs) else ""
            if value and value not in weights:
                raise ValueError(f"{path}: node {name!r} ({node.op_type}) input {slot} ({value!r}) must be a "
                                 "weight stored in the graph.")
            args.append(weights.get(value) if value else None)
        if node.op_type in ROPE_INPUTS:  # its cos / sin: the first two weights, one table per pair
            key = tuple(inputs[slot] for slot in ROPE_INPUTS[node.op_type])
            if key not in tables:
                tables[key] = RopeTable(*args[:2])
            args = [tables[key], *args[2:]]
        if node.op_type in CACHE_INPUTS:
            for slot in CACHE_INPUTS[node.op_type]:  # this layer's cache: a graph input of its own, allocated by the runner
                if inputs[slot] not in graph_inputs or inputs[slot] in caches:
                    raise ValueError(f"{path}: node {name!r} input {slot} ({inputs[slot]!r}) must be a KV cache "
                                     "graph input used by no other attention node.")
                caches.add(inputs[slot])
        try:
            kernel = builder(name, attrs, self.held, *args)
        except KeyError as exc:
            raise ValueError(f"{path}: node {name!r} ({node.op_type}) lacks attribute {exc}.") from None
        if isinstance(kernel, PagedAttention) and kernel.attn.num_heads % kernel.attn.num_kv_heads:
            raise ValueError(f"{path}: node {name!r}: num_heads is not a multiple of num_kv_heads.")
        self.kernels.append(kernel)
        self.named[name] = kernel
        return kernel, [inputs[s] for s in value_slots], list(node.output)

    def replace_kernel(self, old: Kernel, new: nn.Module) -> None:
        """Run `new` wherever the graph ran `old` (its node's step, and the decoder layer the fused decode
        layer reads): how a wrapper (a LoRA projection) takes a node's place. Before the first step."""
        for step in (*self.body, *self.head):
            if step.kernel is old:
                step.kernel = new
        for layer in self.decoder_layers:
            for key, child in list(layer.named_children()):
                if child is old:
                    setattr(layer, key, new)
            if layer.mlp is not None:  # a mixture's module runs its steps (updated above): its kernels too
                layer.mlp.kernels = nn.ModuleList(s.kernel for s in layer.mlp.steps if s.kernel is not None)

    # ---- the runner's seam ------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        values = {"input_ids": input_ids, "positions": positions}
        run = self.layer_run
        if run is None:
            run_steps(self.body, values)
            return values[self.hidden_name]
        run_steps(self.body[: run.first], values)
        x = values[run.input_name]
        meta = get_forward_context()
        if self.fused_decode.applies(x, meta):
            rope = run.rotary.table.at(positions)
            out, residual = self.fused_decode.run(x.contiguous(), rope, meta, layer_ropes=run.ropes(positions))
            if run.sandwich:  # the stream whole in `out`: the final AddRMSNorm adds a zero residual to it
                residual = torch.zeros_like(out)
            values[run.x_name], values[run.residual_name] = out, residual
        else:
            run_steps(self.body[run.first : run.end], values)
        run_steps(self.body[run.end :], values)
        return values[self.hidden_name]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        values = {self.rows_name: hidden}
        run_steps(self.head, values)
        return values["logits"].float()


def _self_contained(run: LayerRun | None, steps: list[Step]) -> LayerRun | None:
    """`run` where nothing after the layers reads a value made inside them but their output and residual."""
    if run is None:
        return None
    inside = {n for s in steps[run.first : run.end] for n in s.outputs} - {run.x_name, run.residual_name}
    later = {n for s in steps[run.end :] for n in s.inputs}
    return None if inside & later else run


# op type -> (input slot of a weight, the attribute saying its bits: 0 for a float matrix)
_MATRICES = {"Linear": ((1, "bits"),), "Embedding": ((1, "bits"),),
             "MoE": ((2, "gate_up_bits"), (3, "down_bits")), "Experts": ((3, "gate_up_bits"), (4, "down_bits"))}


def _cast_float_matrices(nodes: Any, weights: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """Float matrices in the run's weight dtype, each once (a tied head shares the table's initializer), as
    the loader rounds a checkpoint's into a bf16 model; norms, biases and rotary tables keep theirs."""
    for node in nodes:
        for slot, bits_attr in _MATRICES.get(node.op_type, ()) if node.domain == PERFXLM_DOMAIN else ():
            bits = next((a.i for a in node.attribute if a.name == bits_attr), 0)
            name = node.input[slot] if slot < len(node.input) else ""
            w = weights.get(name)
            if bits == 0 and w is not None and w.is_floating_point() and w.dtype != dtype:
                weights[name] = w.to(dtype)


def _check_opsets(proto: onnx.ModelProto, path: str) -> int:
    """The graph's perfxlm op-set version; ValueError where this engine does not run it."""
    versions = {o.domain: o.version for o in proto.opset_import}
    if versions.get(PERFXLM_DOMAIN) not in range(1, PERFXLM_OPSET + 1):  # each version runs its predecessors' graphs
        raise ValueError(f"{path}: the graph imports the {PERFXLM_DOMAIN} op set at version "
                         f"{versions.get(PERFXLM_DOMAIN)!r}; this engine runs versions 1 to {PERFXLM_OPSET} (export "
                         "the model again with this version of perfxlm).")
    return versions[PERFXLM_DOMAIN]


def _since(op_type: str, attrs: dict[str, Any], inputs: list[str]) -> int:
    """The op-set version a node needs: its op's, or that of an attribute or input added to it later
    (PagedAttention's logit_soft_cap at 2, its sinks and query_scale at 3; 5- and 6-bit codes at 4, the
    version whose bit planes are in the order the kernels read)."""
    if attrs.get("bits") in (5, 6):
        return max(PLANES_OPSET, OP_SINCE.get(op_type, 1))
    if op_type == "PagedAttention":
        if "query_scale" in attrs or (len(inputs) > 7 and inputs[7]):
            return 3
        return 2 if "logit_soft_cap" in attrs else 1
    return OP_SINCE.get(op_type, 1)


def _head_split(nodes: list[onnx.NodeProto], path: str) -> int:
    """The index of the Gather that picks the rows whose logits are wanted."""
    for i, node in enumerate(nodes):
        if "logits_indices" in node.input:
            ok = (node.op_type == "Gather" and (node.domain or "") == ""
                  and list(node.input)[1:] == ["logits_indices"])
            axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
            if not ok or axis != 0:
                raise ValueError(f"{path}: logits_indices must be read by one Gather over axis 0 of the final "
                                 f"hidden states; node {node.name!r} is {node.op_type}.")
            return i
    raise ValueError(f"{path}: no node reads logits_indices; the graph has no LM head the engine can find.")
