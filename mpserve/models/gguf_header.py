"""A GGUF file's header: its metadata and tensor table, read without touching the tensor data.

    file ──mmap──► magic, version, counts
                   key/values ─► scalars and strings kept; numeric arrays kept (one numpy read each);
                                 string arrays (a vocabulary, merges) skipped, each string by its length,
                                 unless named in ``strings`` (a draft model's vocabulary check)
                   tensor infos ─► name, shape, type ─► bytes on disk (gguf's block sizes)

``gguf.GGUFReader`` builds an object per field part, so a real model's vocabulary (hundreds of thousands
of strings) costs seconds; the memory estimate (``mpserve.gpu.placement``) needs a handful of keys and the
tensor sizes, which this reads in a single pass over the header. String arrays are left out of
``metadata`` unless asked for: nothing that reads the header for sizes needs a token list.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from os import PathLike
from typing import Any, Literal

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

MAGIC = b"GGUF"

_SCALARS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    type: GGMLQuantizationType
    n_bytes: int


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    metadata: dict[str, Any]  # str, int, float, bool, or a list of numbers; string arrays only if asked for
    tensors: tuple[TensorInfo, ...]


def read_header(path: str | PathLike[str], strings: tuple[str, ...] = ()) -> GGUFHeader:
    """The header of the GGUF file at ``path``, with the string arrays named in ``strings`` as lists of str.
    Raises ValueError when it is not a GGUF file (or is cut short), OSError when it cannot be read."""
    with open(path, "rb") as file:
        try:
            data = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as exc:  # an empty file cannot be mapped
            raise ValueError("not a GGUF file (empty)") from exc
    try:
        return _Cursor(data, strings).header()
    except struct.error as exc:
        raise ValueError(f"GGUF header cut short ({exc})") from exc
    finally:
        data.close()


class _Cursor:
    """Reads the header front to back; ``order`` is the file's byte order, told by its version field."""

    def __init__(self, data: mmap.mmap, strings: tuple[str, ...] = ()) -> None:
        self.data = data
        self.strings = strings
        self.at = 0
        self.order: Literal["<", ">"] = "<"

    def header(self) -> GGUFHeader:
        if self.data[:4] != MAGIC:
            raise ValueError("not a GGUF file (no GGUF magic)")
        self.at = 4
        version = self.scalar("I")
        if version & 0xFFFF == 0:  # written big-endian
            self.order = ">"
            self.at = 4
            version = self.scalar("I")
        if version < 2:
            raise ValueError(f"GGUF version {version} is not supported (2 and later are)")
        n_tensors, n_kv = self.scalar("Q"), self.scalar("Q")
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self.string()
            value = self.value(GGUFValueType(self.scalar("I")), key in self.strings)
            if value is not _SKIPPED:
                metadata[key] = value
        tensors = tuple(self.tensor() for _ in range(n_tensors))
        return GGUFHeader(version, metadata, tensors)

    def scalar(self, code: str) -> Any:
        (value,) = struct.unpack_from(self.order + code, self.data, self.at)
        self.at += struct.calcsize(code)
        return value

    def string(self) -> str:
        n = self.scalar("Q")
        raw = self.data[self.at:self.at + n]
        if len(raw) != n:
            raise struct.error("a string runs past the end of the file")
        self.at += n
        return raw.decode("utf-8", errors="replace")

    def value(self, kind: GGUFValueType, keep_strings: bool = False) -> Any:
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind != GGUFValueType.ARRAY:
            return self.scalar(_SCALARS[kind])
        item, count = GGUFValueType(self.scalar("I")), self.scalar("Q")
        if item in _SCALARS:
            dtype = np.dtype(_SCALARS[item]).newbyteorder(self.order)
            values = np.frombuffer(self.data, dtype, count, self.at)
            self.at += count * dtype.itemsize
            return values.tolist()
        if item == GGUFValueType.STRING and keep_strings:
            return [self.string() for _ in range(count)]
        self.skip_items(item, count)
        return _SKIPPED

    def skip_items(self, kind: GGUFValueType, count: int) -> None:
        """Step over ``count`` values of ``kind``: fixed-size ones at once, a string by its length, an
        array by its own type and count."""
        if kind in _SCALARS:
            self.at += count * struct.calcsize(_SCALARS[kind])
        elif kind == GGUFValueType.STRING:
            length = struct.Struct(self.order + "Q").unpack_from
            data, at = self.data, self.at
            for _ in range(count):
                at += 8 + length(data, at)[0]
            self.at = at
        else:
            for _ in range(count):
                item, n = GGUFValueType(self.scalar("I")), self.scalar("Q")
                self.skip_items(item, n)

    def tensor(self) -> TensorInfo:
        name = self.string()
        shape = tuple(self.scalar("Q") for _ in range(self.scalar("I")))
        kind = GGMLQuantizationType(self.scalar("I"))
        self.scalar("Q")  # the offset of its data: not needed for sizes
        block, block_bytes = GGML_QUANT_SIZES[kind]
        n_elements = int(np.prod(shape, dtype=np.int64)) if shape else 1
        return TensorInfo(name, shape, kind, n_elements // block * block_bytes)


_SKIPPED = object()
