"""A GGUF file's header: its metadata and tensor table, read without touching the tensor data.

    file ──mmap──► magic, version, counts (each bounded by the bytes left: a count no file could hold is refused)
                   key/values ─► the keys ``keep`` accepts: scalars, strings, arrays (numbers: one unpack)
                                 every other key stepped over without building its value (a string by its
                                 length, an array of fixed-size values at once)
                   tensor infos ─► name, shape, type ─► bytes on disk (ggml's block sizes: ``BLOCKS``)

``gguf.GGUFReader`` builds an object per field part, so a real model's vocabulary (hundreds of thousands
of strings) costs seconds; the memory estimate (``mpserve.gpu.placement``) needs a handful of keys and the
tensor sizes, which this reads in a single pass over the header. Each reader names the keys it needs
(``keep``), so a file's other metadata, however large, is never built in the server: a model file is the
operator's choice but not always the operator's making. A kept array has at most ``MAX_KEPT_ITEMS`` values.
It imports neither numpy nor gguf: a server's start reads headers, and those two imports would cost it more than
its own.
"""

from __future__ import annotations

import math
import mmap
import struct
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from os import PathLike
from typing import Any, Literal

MAGIC = b"GGUF"
MAX_KEPT_ITEMS = 1 << 20  # values of one kept array: past any vocabulary's size
_MAX_DIMS = 4  # GGML_MAX_DIMS
_KV_BYTES = 8 + 4 + 1  # the least a key/value takes: an empty key, its type, a one-byte value
_TENSOR_BYTES = 8 + 4 + 4 + 8  # an empty name, no dimensions, its type and its data's offset
_ITEM_BYTES = {"string": 8, "array": 12}  # the least a string or an array inside an array takes



class GGUFValueType(IntEnum):
    """The types of a GGUF metadata value (GGUF's specification)."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


BLOCKS: dict[int, tuple[int, int]] = {
    0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 9: (32, 40),
    10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210), 15: (256, 292), 16: (256, 66),
    17: (256, 74), 18: (256, 98), 19: (256, 50), 20: (32, 18), 21: (256, 110), 22: (256, 82), 23: (256, 136),
    24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8), 28: (1, 8), 29: (256, 56), 30: (1, 2), 34: (256, 54),
    35: (256, 66), 39: (32, 17), 40: (64, 36), 41: (128, 18),
}
"""A ggml tensor type's id -> (values per block, bytes per block): ggml's type traits (F32 0, F16 1, Q4_0 2, ...,
Q4_K 12, Q6_K 14, BF16 30, MXFP4 39), as gguf's GGML_QUANT_SIZES holds them."""

_SCALARS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    type: int  # ggml's type id (``BLOCKS``)
    n_bytes: int


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    metadata: dict[str, Any]  # the kept keys: str, int, float, bool, or a list of them
    tensors: tuple[TensorInfo, ...]


def read_header(path: str | PathLike[str], keep: Callable[[str], bool]) -> GGUFHeader:
    """The header of the GGUF file at ``path``, with the metadata keys ``keep`` accepts. Raises ValueError when it
    is not a GGUF file (or is cut short, or a kept array is longer than ``MAX_KEPT_ITEMS``), OSError when it
    cannot be read."""
    with open(path, "rb") as file:
        try:
            data = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as exc:  # an empty file cannot be mapped
            raise ValueError("not a GGUF file (empty)") from exc
    try:
        return _Cursor(data, keep).header()
    except struct.error as exc:
        raise ValueError(f"GGUF header cut short ({exc})") from exc
    except RecursionError:
        raise ValueError("GGUF metadata nests arrays too deep") from None
    finally:
        data.close()


class _Cursor:
    """Reads the header front to back; ``order`` is the file's byte order, told by its version field."""

    def __init__(self, data: mmap.mmap, keep: Callable[[str], bool]) -> None:
        self.data = data
        self.keep = keep
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
        self.fits(n_kv, _KV_BYTES, "key/values")
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self.string()
            kind = GGUFValueType(self.scalar("I"))
            value = self.value(kind, key) if self.keep(key) else self.skip_items(kind, 1)
            if value is not _SKIPPED:
                metadata[key] = value
        self.fits(n_tensors, _TENSOR_BYTES, "tensors")
        tensors = tuple(self.tensor() for _ in range(n_tensors))
        return GGUFHeader(version, metadata, tensors)

    def fits(self, count: int, least: int, what: str) -> None:
        """Refuse ``count`` items of at least ``least`` bytes each when the bytes left cannot hold them."""
        if count * least > len(self.data) - self.at:
            raise struct.error(f"{count} {what} cannot fit in the {len(self.data) - self.at} bytes left")

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

    def value(self, kind: GGUFValueType, key: str) -> Any:
        """The value of kept ``key``: a scalar, a string, or an array of either, of at most ``MAX_KEPT_ITEMS``
        values (an array of arrays, which no reader needs, is skipped)."""
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind != GGUFValueType.ARRAY:
            return self.scalar(_SCALARS[kind])
        item, count = GGUFValueType(self.scalar("I")), self.scalar("Q")
        if count > MAX_KEPT_ITEMS:
            raise ValueError(f"GGUF metadata {key!r} is an array of {count} values, more than the "
                             f"{MAX_KEPT_ITEMS} mpserve reads")
        if item in _SCALARS:
            values = struct.Struct(f"{self.order}{count}{_SCALARS[item]}")
            self.fits(count, struct.calcsize(_SCALARS[item]), "array values")
            kept = list(values.unpack_from(self.data, self.at))
            self.at += values.size
            return kept
        if item == GGUFValueType.STRING:
            self.fits(count, _ITEM_BYTES["string"], "strings")
            return [self.string() for _ in range(count)]
        return self.skip_items(item, count)

    def skip_items(self, kind: GGUFValueType, count: int) -> object:
        """Step over ``count`` values of ``kind``: fixed-size ones at once, a string by its length, an
        array by its own type and count; none is built (``_SKIPPED``)."""
        if kind in _SCALARS:
            self.fits(count, struct.calcsize(_SCALARS[kind]), "values")
            self.at += count * struct.calcsize(_SCALARS[kind])
        elif kind == GGUFValueType.STRING:
            self.fits(count, _ITEM_BYTES["string"], "strings")
            length = struct.Struct(self.order + "Q").unpack_from
            data, at = self.data, self.at
            for _ in range(count):
                at += 8 + length(data, at)[0]
            self.at = at
        else:
            self.fits(count, _ITEM_BYTES["array"], "arrays")
            for _ in range(count):
                item, n = GGUFValueType(self.scalar("I")), self.scalar("Q")
                self.skip_items(item, n)
        return _SKIPPED

    def tensor(self) -> TensorInfo:
        name = self.string()
        n_dims = self.scalar("I")
        if n_dims > _MAX_DIMS:
            raise ValueError(f"GGUF tensor {name!r} has {n_dims} dimensions, more than GGML's {_MAX_DIMS}")
        shape = tuple(self.scalar("Q") for _ in range(n_dims))
        kind = self.scalar("I")
        self.scalar("Q")  # the offset of its data: not needed for sizes
        if kind not in BLOCKS:
            raise ValueError(f"GGUF tensor {name!r} has ggml type {kind}, whose size mpserve does not know")
        block, block_bytes = BLOCKS[kind]
        return TensorInfo(name, shape, kind, math.prod(shape) // block * block_bytes)


_SKIPPED = object()
