"""The package's one GGUF reader: a file's header, metadata and tensor index,
read by walking the mapped file once (no weight is read).

    from pyllama_headinfer.vram.gguf import read_gguf

    g = read_gguf("model.gguf")
    g.metadata["general.architecture"]      # "llama"
    g.metadata["tokenizer.ggml.tokens"]     # GGUFArray(etype=8, count=128256, values=None)
    g.tensors[0]                            # GGUFTensor(name, type, ne, offset, n_bytes)

Used by :func:`pyllama_headinfer.api.gguf_check.check_gguf` (the pre-flight
check before llama.cpp sees a file) and by
:func:`pyllama_headinfer.vram.model.read_model_info` (the plan's model facts).

* Fast: ``gguf.GGUFReader`` builds numpy views of every token and needs
  seconds for a 128k vocabulary; this skips over string arrays (the
  vocabulary, the merges), keeping their length, and unpacks number arrays
  in one call -- milliseconds.
* Truncation-safe: every read is bounds-checked against the file size, and
  every tensor's data must lie inside the file, so a truncated or corrupt
  file raises :class:`ModelError` naming the field and the byte offset
  instead of reading past the end (or reaching, and crashing, llama.cpp).
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from pyllama_headinfer.errors import ModelError

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)  # what llama.cpp reads
GGUF_DEFAULT_ALIGNMENT = 32

# GGUF value types: the fixed-size ones -> struct format; 8 string, 9 array
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_SIZES = {t: struct.calcsize(fmt) for t, fmt in _SCALARS.items()}
_STRING, _ARRAY, _UINT32 = 8, 9, 4

MAX_ARRAY_VALUES = 1 << 20  # number arrays longer than this keep only their count
MAX_DIMS = 8


@dataclass(frozen=True)
class GGUFArray:
    """A metadata array: its element type and length, and its values when
    they are numbers (None for strings, and for more than MAX_ARRAY_VALUES)."""
    etype: int  # GGUF value type of the elements
    count: int
    values: tuple | None


class GGUFTensor(NamedTuple):
    name: str
    type: int  # GGML type id (gguf.GGMLQuantizationType)
    ne: list  # shape, ne[0] first
    offset: int  # of its data, from data_offset
    n_bytes: int


@dataclass(frozen=True)
class GGUFFile:
    """What :func:`read_gguf` found: header, metadata (key -> int, float,
    bool, str or :class:`GGUFArray`) and the tensor index."""
    path: Path
    version: int
    n_tensors: int
    n_kv: int
    alignment: int
    data_offset: int  # where the tensor data starts
    file_size: int
    metadata: dict
    tensors: tuple  # of GGUFTensor, in file order


class _Cursor:
    """A position in the mapped file; every read says what it reads, so a
    short or corrupt file fails with the field and the byte offset."""

    def __init__(self, mm, path: Path, size: int, pos: int):
        self.mm, self.path, self.size, self.pos = mm, path, size, pos

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise ModelError(f"{self.path} is truncated or corrupt: {what} at byte {self.pos} runs past the end "
                             f"of the file ({self.size} bytes)")

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = struct.unpack_from("<I", self.mm, self.pos)
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = struct.unpack_from("<Q", self.mm, self.pos)
        self.pos += 8
        return v

    def string(self, what: str) -> bytes:
        n = self.u64(what + " length")
        self.need(n, what)
        s = self.mm[self.pos:self.pos + n]
        self.pos += n
        return s

    def value(self, vtype: int, what: str):
        if vtype in _SCALARS:
            self.need(_SIZES[vtype], what)
            (v,) = struct.unpack_from(_SCALARS[vtype], self.mm, self.pos)
            self.pos += _SIZES[vtype]
            return v
        if vtype == _STRING:
            return self.string(what).decode("utf-8", "replace")
        if vtype == _ARRAY:
            return self.array(what)
        raise ModelError(f"{self.path} is corrupt: {what} has unknown value type {vtype}")

    def array(self, what: str) -> GGUFArray:
        etype = self.u32(what + " element type")
        count = self.u64(what + " element count")
        if etype in _SCALARS:
            n = count * _SIZES[etype]
            self.need(n, what)
            values = struct.unpack_from(f"<{count}{_SCALARS[etype][1]}", self.mm, self.pos) \
                if count <= MAX_ARRAY_VALUES else None
            self.pos += n
            return GGUFArray(etype, count, values)
        if etype == _STRING:
            if count > self.size:
                self.need(count, what)
            self.skip_strings(count, what)
            return GGUFArray(etype, count, None)
        raise ModelError(f"{self.path} is corrupt: {what} has unsupported array element type {etype}")

    def skip_strings(self, count: int, what: str) -> None:
        """Step over ``count`` strings (the hot loop: a vocabulary and its merges)."""
        mm, size, pos = self.mm, self.size, self.pos
        unpack_from = struct.unpack_from
        for _ in range(count):
            if pos + 8 > size:
                self.pos = pos
                self.need(8, what + " element length")
            (n,) = unpack_from("<Q", mm, pos)
            pos += 8
            if pos + n > size:
                self.pos = pos
                self.need(n, what)
            pos += n
        self.pos = pos


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Read the header, metadata and tensor index of the GGUF file ``path``,
    checking as it goes: the magic, the version (2 or 3), every field within
    the file, known value and tensor types, and every tensor's data inside
    the file. Raises :class:`ModelError` with the reason (OSError when the
    file cannot be opened)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    size = path.stat().st_size
    if size < 24:
        raise ModelError(f"{path} is not a GGUF model: the file is only {size} bytes")
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ModelError(f"{path} is not a GGUF model (bad magic; expected 'GGUF')")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            c = _Cursor(mm, path, size, 4)
            version = c.u32("version")
            if version not in GGUF_VERSIONS:
                raise ModelError(f"{path}: unsupported GGUF version {version} (llama.cpp reads 2 and 3)")
            n_tensors = c.u64("tensor count")
            n_kv = c.u64("metadata count")
            if n_tensors > size or n_kv > size:
                raise ModelError(f"{path} is corrupt: header claims {n_tensors} tensors and {n_kv} metadata keys")

            alignment = GGUF_DEFAULT_ALIGNMENT
            metadata = {}
            for i in range(n_kv):
                raw = c.string(f"metadata key #{i}")
                key = raw.decode("utf-8", "replace")
                vtype = c.u32(f"metadata {raw!r} type")
                if key == "general.alignment" and vtype == _UINT32:
                    alignment = c.u32("general.alignment")
                    if alignment == 0 or alignment & (alignment - 1):
                        raise ModelError(f"{path} is corrupt: general.alignment={alignment}")
                    metadata[key] = alignment
                else:
                    metadata[key] = c.value(vtype, f"metadata {key!r}")

            tensors = []
            for i in range(n_tensors):
                name = c.string(f"tensor #{i} name").decode("utf-8", "replace")
                n_dims = c.u32(f"tensor {name!r} rank")
                if n_dims > MAX_DIMS:
                    raise ModelError(f"{path} is corrupt: tensor {name!r} has {n_dims} dimensions")
                ne = [c.u64(f"tensor {name!r} shape") for _ in range(n_dims)]
                ttype = c.u32(f"tensor {name!r} type")
                offset = c.u64(f"tensor {name!r} offset")
                try:
                    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
                except (ValueError, KeyError):
                    raise ModelError(f"{path}: tensor {name!r} has unknown type {ttype}") from None
                n_el = math.prod(ne)
                if n_el % block:
                    raise ModelError(f"{path} is corrupt: tensor {name!r} has {n_el} elements, not a multiple "
                                     f"of its block size {block}")
                tensors.append(GGUFTensor(name, ttype, ne, offset, n_el // block * type_size))
            data_offset = (c.pos + alignment - 1) // alignment * alignment

    for t in tensors:
        end = data_offset + t.offset + t.n_bytes
        if end > size:
            raise ModelError(f"{path} is truncated: tensor {t.name!r} needs bytes up to {end}, the file has {size}")
    return GGUFFile(path=path, version=version, n_tensors=n_tensors, n_kv=n_kv, alignment=alignment,
                    data_offset=data_offset, file_size=size, metadata=metadata, tensors=tuple(tensors))


__all__ = ["read_gguf", "GGUFFile", "GGUFArray", "GGUFTensor", "GGUF_MAGIC", "GGUF_VERSIONS", "MAX_ARRAY_VALUES"]
