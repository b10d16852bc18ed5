"""A GGUF container reader: metadata, tensor table, and tensors as numpy views of a memmap.

Why not gguf.GGUFReader: it materialises every element of the tokenizer arrays as its own
numpy object, about 7 s for a Qwen vocabulary before a single weight is read. Here string
arrays are skipped unless asked for (~0.1 s); dequantization still uses gguf.quants.
"""

from __future__ import annotations

import struct
from collections.abc import Container
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from kamado.models.errors import ModelLoadError

# GGUF value types -> struct format (little-endian); 8 = string, 9 = array.
_SCALAR = {
    0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d",
}  # fmt: skip
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # PyTorch order (GGUF's ne reversed): a matrix is [out, in]
    ggml_type: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int


class GGUFFile:
    """Parsed header of a GGUF file; tensor data is read lazily from a memmap."""

    def __init__(self, path: str | Path, string_arrays: Container[str] = ()) -> None:
        self.path = Path(path)
        try:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot read GGUF file {self.path}: {e}") from e
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, TensorInfo] = {}
        try:
            self._parse(string_arrays)
        except (struct.error, UnicodeDecodeError, IndexError, KeyError, ValueError) as e:
            raise ModelLoadError(f"{self.path} is not a valid GGUF file ({e})") from e

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def raw(self, name: str) -> np.ndarray:
        """The stored bytes of a tensor, shaped (*rows, bytes_per_row) as gguf.quants expects."""
        t = self.tensors[name]
        data = self._mm[t.offset : t.offset + t.nbytes]
        return data.reshape(*t.shape[:-1], -1)

    def dequantize(self, name: str) -> np.ndarray:
        """A float32 copy of a tensor in PyTorch order."""
        t = self.tensors[name]
        out = dequantize(self.raw(name), t.ggml_type).reshape(t.shape)
        # F32 tensors come back as views of the read-only map; torch wants owned memory.
        return out if out.flags.writeable else out.copy()

    def _parse(self, string_arrays: Container[str]) -> None:
        buf = self._mm
        if bytes(buf[:4]) != b"GGUF":
            raise ModelLoadError(f"{self.path} is not a GGUF file (bad magic)")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ModelLoadError(f"{self.path}: GGUF version {version} is not supported (2, 3 are)")
        pos = 24
        for _ in range(n_kv):
            key, pos = _read_string(buf, pos)
            (vtype,) = struct.unpack_from("<I", buf, pos)
            value, pos = _read_value(buf, pos + 4, vtype, keep_strings=key in string_arrays)
            if value is not _SKIPPED:
                self.metadata[key] = value
        infos = []
        for _ in range(n_tensors):
            name, pos = _read_string(buf, pos)
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            ne = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            ggml_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            infos.append((name, ne, GGMLQuantizationType(ggml_type), offset))
        align = int(self.metadata.get("general.alignment", 32))
        data_start = (pos + align - 1) // align * align
        for name, ne, qtype, offset in infos:
            block, type_size = GGML_QUANT_SIZES[qtype]
            n = int(np.prod(ne)) if ne else 1
            info = TensorInfo(
                name, tuple(int(x) for x in reversed(ne)), qtype, data_start + offset,
                n // block * type_size,
            )  # fmt: skip
            if info.offset + info.nbytes > len(buf):
                raise ModelLoadError(
                    f"{self.path} is truncated: tensor {name} ends past the end of the file"
                )
            self.tensors[name] = info


_SKIPPED = object()


def _read_string(buf: np.ndarray, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, pos)
    return bytes(buf[pos + 8 : pos + 8 + n]).decode("utf-8"), pos + 8 + n


def _read_value(buf: np.ndarray, pos: int, vtype: int, keep_strings: bool) -> tuple[Any, int]:
    if vtype in _SCALAR:
        fmt = "<" + _SCALAR[vtype]
        return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
    if vtype == _STRING:
        return _read_string(buf, pos)
    if vtype != _ARRAY:
        raise ValueError(f"unknown GGUF value type {vtype}")
    item_type, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if item_type in _SCALAR:
        dtype = np.dtype("<" + _SCALAR[item_type])
        end = pos + count * dtype.itemsize
        return np.frombuffer(buf[pos:end].tobytes(), dtype=dtype), end
    if item_type == _STRING:
        if keep_strings or count <= 64:  # small lists (languages, tags) cost nothing
            items = []
            for _ in range(count):
                s, pos = _read_string(buf, pos)
                items.append(s)
            return items, pos
        for _ in range(count):  # skip: walk the length prefixes only
            pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
        return _SKIPPED, pos
    items = []
    for _ in range(count):  # nested arrays: rare, never large
        v, pos = _read_value(buf, pos, item_type, keep_strings)
        items.append(v)
    return items, pos
