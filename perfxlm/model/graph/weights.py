"""A graph file and its initializers as torch tensors. External data is read from its file at the offset
the tensor names (page-aligned by the exporter), one tensor at a time, so loading holds the model once."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import onnx
import torch
from onnx import TensorProto, numpy_helper

# ONNX element type -> (numpy dtype of its bytes, torch dtype of the tensor)
_ELEMENTS = {
    TensorProto.FLOAT: (np.float32, torch.float32),
    TensorProto.FLOAT16: (np.float16, torch.float16),
    TensorProto.BFLOAT16: (np.int16, torch.bfloat16),
    TensorProto.UINT8: (np.uint8, torch.uint8),
    TensorProto.INT8: (np.int8, torch.int8),  # Q6_K's signed sub-scales (quant/super_scales.py)
    TensorProto.INT32: (np.int32, torch.int32),
    TensorProto.INT64: (np.int64, torch.int64),
}


def load_graph(path: str) -> onnx.ModelProto:
    if not os.path.isfile(path):
        raise ValueError(f"ONNX graph {path!r} does not exist.")
    return onnx.load(path, load_external_data=False)


def read_initializers(model: onnx.ModelProto, folder: str) -> dict[str, torch.Tensor]:
    """Each initializer as a torch tensor of its own (torch's allocator: cache-line aligned, as the module
    path's weights; external data is read straight into it)."""
    out: dict[str, torch.Tensor] = {}
    files: dict[str, Any] = {}
    try:
        for t in model.graph.initializer:
            if t.data_type not in _ELEMENTS:
                raise ValueError(f"initializer {t.name!r} has ONNX element type "
                                 f"{TensorProto.DataType.Name(t.data_type)}, which the engine does not load.")
            np_dtype, torch_dtype = _ELEMENTS[t.data_type]
            if t.data_location == TensorProto.EXTERNAL:
                info = {e.key: e.value for e in t.external_data}
                tensor = torch.empty(tuple(t.dims), dtype=torch_dtype)
                raw = tensor.view(-1).view(torch.uint8).numpy()
                if int(info["length"]) != raw.nbytes:
                    raise ValueError(f"initializer {t.name!r}: {info['length']} bytes in the data file for "
                                     f"{tuple(t.dims)} {TensorProto.DataType.Name(t.data_type)}.")
                location = info["location"]
                if location not in files:
                    files[location] = open(os.path.join(folder, location), "rb")
                f = files[location]
                f.seek(int(info.get("offset", 0)))
                if f.readinto(memoryview(raw)) != raw.nbytes:
                    raise ValueError(f"initializer {t.name!r}: the data file {location!r} ends before it does.")
                out[t.name] = tensor
                continue
            if t.data_type == TensorProto.BFLOAT16:
                array = np.asarray(t.int32_data, np.int32).astype(np.int16).reshape(tuple(t.dims))
            else:
                array = np.array(numpy_helper.to_array(t))
            out[t.name] = torch.from_numpy(array).view(torch_dtype).clone()
    finally:
        for f in files.values():
            f.close()
    return out
