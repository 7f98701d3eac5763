"""The graph under construction: nodes in order, initializers, typed inputs and outputs.

A thin layer over onnx's helpers that gives every value a unique name, so the ops that emit a
decoder layer (`graph_ops.py`) only say what they compute."""

from __future__ import annotations

import os
from typing import Any, Iterable, Protocol, Sequence, runtime_checkable

import numpy as np
import onnx
from onnx import helper, numpy_helper

OPSET = 17  # standard ops: ReduceMean's axes still an attribute, LayerNormalization present
MS_DOMAIN = "com.microsoft"  # ONNX Runtime's contrib ops
EXTERNAL_BYTES = 1024  # initializers this large go to the data file
ALIGN = 4096



class Graph:
    def __init__(self, name: str) -> None:
        self.name = name
        self.nodes: list[onnx.NodeProto] = []
        # (name, array or a function making it, element type or None: the array's own): arrays stay as they
        # are (views of the loaded model's weights where they can, made at save time where they cannot) until
        # `save` streams them into the data file, so the export never holds a second copy of the model
        self.initializers: list[tuple[str, Any, int | None]] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.domains: set[str] = set()
        self.versions: dict[str, int] = {}  # a custom domain's op-set version where it is not 1
        self._counts: dict[str, int] = {}
        self._consts: dict[tuple, str] = {}  # small constants shared by value
        self.metadata: dict[str, str] = {}  # the model's metadata_props: what a runtime reads beside the nodes
        # (kv heads, head dim) of every layer's past: onnxruntime-genai's layout has one for all layers
        self.kv_shape: tuple[int, int] | None = None

    def fresh(self, prefix: str) -> str:
        n = self._counts.get(prefix, 0)
        self._counts[prefix] = n + 1
        return prefix if n == 0 else f"{prefix}_{n}"

    def weight(self, name: str, array: Any, elem: int | None = None) -> str:
        """An initializer holding `array` (stored in the external data file when large), or made by calling
        it when the graph is saved; `elem`: the ONNX element type its bytes are, where numpy has no such
        dtype (bfloat16 as uint16)."""
        name = self.fresh(name)
        self.initializers.append((name, array, elem))
        return name

    def const(self, value: Any, dtype: type = np.int64) -> str:
        """A small constant (shape, axis, scalar), one initializer per distinct value."""
        array = np.asarray(value, dtype=dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self._consts:
            self._consts[key] = self.weight("const", array)
        return self._consts[key]

    def op(self, op_type: str, inputs: Sequence[str], num_outputs: int = 1, domain: str = "",
           name: str | None = None, **attrs: Any) -> Any:
        """Append one node; returns its output name (or the list of them when num_outputs > 1).
        An empty input name is an omitted optional input."""
        base = self.fresh(name or op_type)
        outs = [f"{base}/out{i}" for i in range(num_outputs)]
        node = helper.make_node(op_type, list(inputs), outs, name=base, domain=domain or None, **attrs)
        self.nodes.append(node)
        if domain:
            self.domains.add(domain)
        return outs[0] if num_outputs == 1 else outs

    def rename(self, value: str, name: str) -> str:
        """Give a computed value a graph-output name (an Identity: the value keeps its producer)."""
        self.nodes.append(helper.make_node("Identity", [value], [name], name=self.fresh(f"{name}/identity")))
        return name

    def add_input(self, name: str, elem: int, shape: Sequence[Any]) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem, list(shape)))
        return name

    def add_output(self, name: str, elem: int, shape: Sequence[Any]) -> None:
        self.outputs.append(helper.make_tensor_value_info(name, elem, list(shape)))

    def save(self, path: str) -> None:
        """model.onnx beside one external data file (`path` + ".data") holding every initializer of
        EXTERNAL_BYTES or more, each written straight from its array and page-aligned (ONNX Runtime may
        map the file). An initializer given as a `Streamed` is written block by block."""
        location = os.path.basename(path) + ".data"
        tensors = []
        with open(os.path.join(os.path.dirname(path), location), "wb") as data:
            for name, array, elem in self.initializers:
                if isinstance(array, Streamed):
                    shape, dtype, blocks = array.stream()
                    tensors.append(_external(name, shape, elem or helper.np_dtype_to_tensor_dtype(dtype), data,
                                             blocks, location))
                    continue
                array = np.asarray(array() if callable(array) else array)
                if not array.flags.c_contiguous:  # (np.ascontiguousarray would make a scalar 1-d)
                    array = np.ascontiguousarray(array)
                if array.nbytes < EXTERNAL_BYTES and elem is None:
                    tensors.append(numpy_helper.from_array(array, name))
                    continue
                tensors.append(_external(name, array.shape, elem or helper.np_dtype_to_tensor_dtype(array.dtype),
                                         data, [array], location))
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, tensors)
        opsets = [helper.make_opsetid("", OPSET)] + [helper.make_opsetid(d, self.versions.get(d, 1))
                                                         for d in sorted(self.domains)]
        model = helper.make_model(graph, opset_imports=opsets, producer_name="perfxlm")
        model.ir_version = 8  # readable by every ONNX Runtime since 1.10
        if self.metadata:
            helper.set_model_props(model, self.metadata)
        onnx.save_model(model, path)


@runtime_checkable
class Streamed(Protocol):
    """An initializer made while the graph is saved, in blocks along its first axis, so one converted on
    the way out (a bf16 matrix widened to float32) never exists whole beside the model."""

    shape: tuple[int, ...]

    def stream(self) -> tuple[tuple[int, ...], np.dtype, Iterable[np.ndarray]]:
        """(shape, element dtype, the blocks in order)."""


def _external(name: str, shape: Sequence[int], elem: int, data: Any, blocks: Iterable[np.ndarray],
              location: str) -> onnx.TensorProto:
    """Write `blocks` at the next page boundary of `data`; the tensor pointing at them."""
    offset = (data.tell() + ALIGN - 1) // ALIGN * ALIGN
    data.seek(offset)
    length = 0
    for block in blocks:
        block = np.ascontiguousarray(block)
        block.tofile(data)
        length += block.nbytes
    tensor = onnx.TensorProto(name=name, dims=list(shape), data_type=elem)
    for key, value in (("location", location), ("offset", offset), ("length", length)):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, str(value)
    tensor.data_location = onnx.TensorProto.EXTERNAL
    return tensor
