"""A small, fast GGUF reader (any process; torch-free): metadata, tensor infos and raw tensor bytes.

`gguf.GGUFReader` parses every array element into its own numpy view, which takes seconds
for a 49k-token vocabulary; this reader reads the header once with `struct`, memory-maps
the data, and checks that every tensor lies inside the file, so a truncated or corrupt
file fails here with an error that names it.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# GGUF value types -> struct format of one scalar (8 = string, 9 = array: read apart).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}


class GGUFError(ValueError):
    """The file is not a readable GGUF file (bad magic, truncated, corrupt header)."""


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order: the reverse of GGUF's ne[] (rows first)
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    num_bytes: int


class GGUFFile:
    """One GGUF file: `metadata` (key -> Python value) and `tensors` (name -> info)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as handle:
            try:
                self._buffer: Any = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as exc:  # an empty file cannot be mapped
                raise GGUFError(f"{self.path} is not a GGUF file: it is empty") from exc
        self._pos = 0
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, GGUFTensorInfo] = {}
        try:
            self._read_header()
        except (struct.error, UnicodeDecodeError, OverflowError, MemoryError) as exc:
            raise GGUFError(f"{self.path} is truncated or corrupt: its GGUF header cannot "
                            f"be read ({exc})") from exc

    # ------------------------------------------------------------------ public
    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def raw(self, info: GGUFTensorInfo) -> np.ndarray:
        """The tensor's bytes (uint8, a read-only view of the memory map)."""
        return np.frombuffer(self._buffer, dtype=np.uint8, count=info.num_bytes,
                             offset=info.offset)

    def dequantize(self, info: GGUFTensorInfo) -> np.ndarray:
        """The tensor as float32 numpy, in `info.shape` (quantized types are expanded)."""
        raw = self.raw(info)
        rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
        values = gguf_quants.dequantize(raw.reshape(rows, -1), info.qtype)
        return values.reshape(info.shape)

    # ------------------------------------------------------------------ parsing
    def _read_header(self) -> None:
        if self._take(4) != _MAGIC:
            raise GGUFError(f"{self.path} is not a GGUF file (bad magic number)")
        version = self._scalar("<I")
        if version not in (2, 3):
            raise GGUFError(f"{self.path}: GGUF version {version} is not supported (2 or 3)")
        num_tensors, num_kv = self._scalar("<Q"), self._scalar("<Q")
        for _ in range(num_kv):
            key = self._string()
            self.metadata[key] = self._value(self._scalar("<I"))
        infos = [self._tensor_info() for _ in range(num_tensors)]
        alignment = int(self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        data_start = -(-self._pos // alignment) * alignment
        size = len(self._buffer)
        for name, shape, qtype, offset in infos:
            block_size, type_size = GGML_QUANT_SIZES[qtype]
            num_bytes = int(np.prod(shape)) // block_size * type_size
            start = data_start + offset
            if start + num_bytes > size:
                raise GGUFError(f"{self.path} is truncated: tensor {name!r} needs bytes "
                                f"{start}..{start + num_bytes} but the file has {size}")
            self.tensors[name] = GGUFTensorInfo(name, shape, qtype, start, num_bytes)

    def _tensor_info(self) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = self._string()
        num_dims = self._scalar("<I")
        if num_dims > 8:
            raise GGUFError(f"{self.path} is corrupt: tensor {name!r} has {num_dims} dims")
        dims = [self._scalar("<Q") for _ in range(num_dims)]
        type_id = self._scalar("<I")
        try:
            qtype = GGMLQuantizationType(type_id)
        except ValueError as exc:
            raise GGUFError(f"{self.path}: tensor {name!r} has unknown type {type_id}") from exc
        return name, tuple(reversed(dims)), qtype, self._scalar("<Q")

    def _value(self, type_id: int) -> Any:
        if type_id in _SCALARS:
            return self._scalar(_SCALARS[type_id])
        if type_id == 8:
            return self._string()
        if type_id == 9:
            item_type, count = self._scalar("<I"), self._scalar("<Q")
            if item_type in _NUMPY:
                dtype = np.dtype(_NUMPY[item_type])
                data = np.frombuffer(self._take(count * dtype.itemsize), dtype=dtype)
                return data.tolist()
            if item_type == 8:
                return self._string_array(count)
            return [self._value(item_type) for _ in range(count)]
        raise GGUFError(f"{self.path} is corrupt: unknown metadata value type {type_id}")

    def _string_array(self, count: int) -> list[str]:
        # The vocabulary: ~50k strings, so one tight loop instead of a call per item.
        buffer, pos, unpack = self._buffer, self._pos, struct.Struct("<Q").unpack_from
        items = []
        for _ in range(count):
            (length,) = unpack(buffer, pos)
            end = pos + 8 + length
            if end > len(buffer):
                raise struct.error(f"a string runs past the end of the file at {pos}")
            items.append(buffer[pos + 8:end].decode("utf-8"))
            pos = end
        self._pos = pos
        return items

    def _take(self, num_bytes: int) -> bytes:
        end = self._pos + num_bytes
        if num_bytes < 0 or end > len(self._buffer):
            raise struct.error(f"needs {num_bytes} bytes at offset {self._pos}")
        data = self._buffer[self._pos:end]
        self._pos = end
        return bytes(data)

    def _scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self._take(struct.calcsize(fmt)))[0]

    def _string(self) -> str:
        return self._take(self._scalar("<Q")).decode("utf-8")
