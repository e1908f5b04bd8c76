"""The GGUF pre-flight check: :func:`check_gguf` reads a model file's header,
metadata and tensor index in Python, so a truncated or corrupt file raises
:class:`ModelError` instead of reaching (and crashing) llama.cpp."""

from __future__ import annotations

import math
import mmap
import os
import struct
from pathlib import Path

from .exceptions import ModelError

_GGUF_MAGIC = b"GGUF"
# GGUF value types -> fixed size (None: string / array)
_GGUF_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY, _GGUF_UINT32 = 8, 9, 4


def check_gguf(path: str | os.PathLike) -> dict:
    """Check that ``path`` is a complete GGUF file before llama.cpp sees it:
    magic, version, the metadata and tensor index parse within the file, and
    every tensor's data lies inside the file (a truncated download fails here).

    Returns ``{"version", "n_tensors", "n_kv", "data_offset", "file_size"}``;
    raises :class:`ModelError` with the reason otherwise.
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    size = path.stat().st_size
    if size < 24:
        raise ModelError(f"{path} is not a GGUF model: the file is only {size} bytes")
    with open(path, "rb") as f:
        if f.read(4) != _GGUF_MAGIC:
            raise ModelError(f"{path} is not a GGUF model (bad magic; expected 'GGUF')")
        if size == 0:
            raise ModelError(f"{path} is empty")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            pos = 4

            def need(n: int, what: str) -> None:
                if n < 0 or pos + n > size:
                    raise ModelError(f"{path} is truncated or corrupt: {what} at byte {pos} runs past the end "
                                     f"of the file ({size} bytes)")

            def u32(what: str) -> int:
                nonlocal pos
                need(4, what)
                (v,) = struct.unpack_from("<I", mm, pos)
                pos += 4
                return v

            def u64(what: str) -> int:
                nonlocal pos
                need(8, what)
                (v,) = struct.unpack_from("<Q", mm, pos)
                pos += 8
                return v

            def string(what: str) -> bytes:
                nonlocal pos
                n = u64(what + " length")
                need(n, what)
                s = mm[pos:pos + n]
                pos += n
                return s

            def skip_value(vtype: int, what: str) -> None:
                nonlocal pos
                if vtype in _GGUF_SCALAR_SIZES:
                    need(_GGUF_SCALAR_SIZES[vtype], what)
                    pos += _GGUF_SCALAR_SIZES[vtype]
                elif vtype == _GGUF_STRING:
                    n = u64(what + " length")
                    need(n, what)
                    pos += n
                elif vtype == _GGUF_ARRAY:
                    etype = u32(what + " element type")
                    count = u64(what + " element count")
                    if etype in _GGUF_SCALAR_SIZES:
                        need(count * _GGUF_SCALAR_SIZES[etype], what)
                        pos += count * _GGUF_SCALAR_SIZES[etype]
                    elif etype == _GGUF_STRING:
                        if count > size:
                            need(count, what)
                        for _ in range(count):
                            n = u64(what + " element length")
                            need(n, what)
                            pos += n
                    else:
                        raise ModelError(f"{path} is corrupt: {what} has unsupported array element type {etype}")
                else:
                    raise ModelError(f"{path} is corrupt: {what} has unknown value type {vtype}")

            version = u32("version")
            if version not in (2, 3):
                raise ModelError(f"{path}: unsupported GGUF version {version} (llama.cpp reads 2 and 3)")
            n_tensors = u64("tensor count")
            n_kv = u64("metadata count")
            if n_tensors > size or n_kv > size:
                raise ModelError(f"{path} is corrupt: header claims {n_tensors} tensors and {n_kv} metadata keys")
            alignment = 32
            for i in range(n_kv):
                key = string(f"metadata key #{i}")
                vtype = u32(f"metadata {key!r} type")
                if key == b"general.alignment" and vtype == _GGUF_UINT32:
                    alignment = u32("general.alignment")
                    if alignment == 0 or alignment & (alignment - 1):
                        raise ModelError(f"{path} is corrupt: general.alignment={alignment}")
                else:
                    skip_value(vtype, f"metadata {key.decode('utf-8', 'replace')!r}")
            tensors = []
            for i in range(n_tensors):
                name = string(f"tensor #{i} name").decode("utf-8", "replace")
                n_dims = u32(f"tensor {name!r} rank")
                if n_dims > 8:
                    raise ModelError(f"{path} is corrupt: tensor {name!r} has {n_dims} dimensions")
                dims = [u64(f"tensor {name!r} shape") for _ in range(n_dims)]
                ttype = u32(f"tensor {name!r} type")
                offset = u64(f"tensor {name!r} offset")
                try:
                    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
                except (ValueError, KeyError):
                    raise ModelError(f"{path}: tensor {name!r} has unknown type {ttype}") from None
                n_el = math.prod(dims) if dims else 1
                if n_el % block:
                    raise ModelError(f"{path} is corrupt: tensor {name!r} has {n_el} elements, not a multiple "
                                     f"of its block size {block}")
                tensors.append((name, offset, n_el // block * type_size))
            data_offset = (pos + alignment - 1) // alignment * alignment
            for name, offset, nbytes in tensors:
                end = data_offset + offset + nbytes
                if end > size:
                    raise ModelError(f"{path} is truncated: tensor {name!r} needs bytes up to {end}, "
                                     f"the file has {size}")
    return {"version": version, "n_tensors": n_tensors, "n_kv": n_kv, "data_offset": data_offset,
            "file_size": size}
