"""The GGUF header (metadata and tensor table) parsed with `struct`, the tensor data memory-mapped.

`gguf.GGUFReader` builds a numpy view per vocabulary string and takes seconds on a 50k-token vocabulary;
this parser takes milliseconds. `open_gguf` reuses a parsed file while it is unchanged on disk.
"""

from __future__ import annotations

import contextlib
import functools
import math
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any, Sequence

import gguf
import numpy as np
import torch

from perfxlm.ops.gguf_dequant import dequantize

Q = gguf.GGMLQuantizationType

# ---------------------------------------------------------------------------------------------------------
# Header parsing
# ---------------------------------------------------------------------------------------------------------

_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY_TYPES = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
                6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}  # fmt: skip
_STRING, _ARRAY, _FLOAT32 = 8, 9, 6
_SUPPORTED_VERSIONS = (2, 3)


class _StringArray(Sequence[str]):
    """A metadata string array (a vocabulary, a merge list) decoded only when first indexed."""

    def __init__(self, buf: memoryview, offset: int, count: int):
        self._buf, self._offset, self._count = buf, offset, count
        self._items: list[str] | None = None

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index):  # type: ignore[override]
        if self._items is None:
            items, buf, pos = [], self._buf, self._offset
            for _ in range(self._count):
                (length,) = struct.unpack_from("<Q", buf, pos)
                items.append(bytes(buf[pos + 8 : pos + 8 + length]).decode("utf-8", errors="replace"))
                pos += 8 + length
            self._items = items
        return self._items[index]

    def __repr__(self) -> str:
        return f"<{self._count} strings>"


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order (reverse of ggml's ne)
    ggml_type: Q
    offset: int  # absolute offset in the file
    nbytes: int


class GGUFFile:
    """Parsed GGUF header (metadata and tensor table) over a read-only memory map of the file."""

    def __init__(self, path: str):
        self.path = path
        self._map = np.memmap(path, mode="r", dtype=np.uint8)
        buf = memoryview(self._map)
        if bytes(buf[:4]) != b"GGUF":
            raise ValueError(f"{path!r} is not a GGUF file (bad magic).")
        (version,) = struct.unpack_from("<I", buf, 4)
        if version & 0xFFFF == 0:
            raise ValueError(f"{path!r} is a big-endian GGUF file, which is not supported.")
        if version not in _SUPPORTED_VERSIONS:
            raise ValueError(f"{path!r} is GGUF version {version}; supported: {_SUPPORTED_VERSIONS}.")
        self.version = version
        tensor_count, kv_count = struct.unpack_from("<QQ", buf, 8)
        pos = 24

        self.metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key, pos = self._string(buf, pos)
            (vtype,) = struct.unpack_from("<I", buf, pos)
            self.metadata[key], pos = self._value(buf, pos + 4, vtype)

        infos = []
        for _ in range(tensor_count):
            name, pos = self._string(buf, pos)
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            ne = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            pos += 4 + 8 * n_dims
            raw_type, offset = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            infos.append((name, tuple(reversed(ne)), raw_type, offset))

        alignment = int(self.metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT))
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"{path!r} has an invalid alignment {alignment}.")
        data_start = (pos + alignment - 1) // alignment * alignment

        self.tensors: dict[str, GGUFTensorInfo] = {}
        for name, shape, raw_type, offset in infos:
            try:
                qtype = Q(raw_type)
                block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                raise ValueError(f"Tensor {name!r} in {path!r} has unknown GGML type {raw_type}.") from None
            nbytes = math.prod(shape) // block_elems * block_bytes
            start = data_start + offset
            if start + nbytes > self._map.size:
                raise ValueError(f"Tensor {name!r} runs past the end of {path!r} (truncated file?).")
            self.tensors[name] = GGUFTensorInfo(name, shape, qtype, start, nbytes)

    @staticmethod
    def _string(buf: memoryview, pos: int) -> tuple[str, int]:
        (length,) = struct.unpack_from("<Q", buf, pos)
        return bytes(buf[pos + 8 : pos + 8 + length]).decode("utf-8"), pos + 8 + length

    def _value(self, buf: memoryview, pos: int, vtype: int) -> tuple[Any, int]:
        if vtype in _SCALAR_FORMATS:
            fmt = "<" + _SCALAR_FORMATS[vtype]
            (value,) = struct.unpack_from(fmt, buf, pos)
            if vtype == _FLOAT32:
                # shortest decimal that is the same float32: 1e-05 rather than 9.999999747378752e-06
                value = float(str(np.float32(value)))
            return value, pos + struct.calcsize(fmt)
        if vtype == _STRING:
            return self._string(buf, pos)
        if vtype == _ARRAY:
            etype, count = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            if etype in _NUMPY_TYPES:
                dtype = np.dtype(_NUMPY_TYPES[etype]).newbyteorder("<")
                values = np.frombuffer(buf, dtype=dtype, count=count, offset=pos)
                return values.tolist(), pos + count * dtype.itemsize
            if etype == _STRING:
                start = pos
                for _ in range(count):
                    (length,) = struct.unpack_from("<Q", buf, pos)
                    pos += 8 + length
                return _StringArray(buf, start, count), pos
            if etype == _ARRAY:
                values = []
                for _ in range(count):
                    value, pos = self._value(buf, pos, _ARRAY)
                    values.append(value)
                return values, pos
        raise ValueError(f"{self.path!r} has metadata of unknown GGUF value type {vtype}.")

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ValueError(f"{self.path!r} has no general.architecture metadata.")
        return arch

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as `GGUFReader` shows them: typed for F32/F16, else (..., row bytes) uint8."""
        info = self.tensors[name]
        data = self._map[info.offset : info.offset + info.nbytes]
        if info.ggml_type == Q.F32:
            return data.view(np.float32).reshape(info.shape)
        if info.ggml_type == Q.F16:
            return data.view(np.float16).reshape(info.shape)
        block_elems, block_bytes = gguf.GGML_QUANT_SIZES[info.ggml_type]
        cols = info.shape[-1] if info.shape else 1
        return data.reshape(*info.shape[:-1], cols // block_elems * block_bytes)

    def release_pages(self) -> None:
        """Drop this process's resident pages of the mapping (read again from the file if touched)."""
        mm = getattr(self._map, "_mmap", None)
        if mm is not None and hasattr(mmap, "MADV_DONTNEED"):
            with contextlib.suppress(OSError, ValueError):
                mm.madvise(mmap.MADV_DONTNEED)

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor dequantized to float32, in its torch shape."""
        info = self.tensors[name]
        return dequantize(self.raw(name), info.ggml_type, info.shape)


def file_key(path: str) -> tuple[str, int, int]:
    path = os.path.abspath(path)
    st = os.stat(path)
    return path, st.st_size, st.st_mtime_ns


@functools.lru_cache(maxsize=4)
def _open_cached(path: str, size: int, mtime_ns: int) -> GGUFFile:
    return GGUFFile(path)


def open_gguf(path: str) -> GGUFFile:
    """Parse a GGUF file's header; reused across calls while the file is unchanged."""
    return _open_cached(*file_key(path))
