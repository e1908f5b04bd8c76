"""The GGUF pre-flight check: :func:`check_gguf` reads a model file's header,
metadata and tensor index in Python, so a truncated or corrupt file raises
:class:`ModelError` instead of reaching (and crashing) llama.cpp; and
:func:`check_tensor_types` refuses tensors of a type llama.cpp loads but cannot
compute with (it would abort or crash the process in the first graph).

The walk itself is :func:`pyllama_headinfer.vram.gguf.read_gguf`, the
package's one GGUF reader (the VRAM plan reads its model facts with it too)."""

from __future__ import annotations

import os

from pyllama_headinfer.errors import ModelError
from pyllama_headinfer.vram.gguf import GGUFFile, read_gguf

# GGML types that no model's weights have and no backend computes with: the integer types and
# F64 (ggml-cpu has no matrix product, row lookup or multiplication for them) and Q8_1/Q8_K, the
# CPU's types for the *other* operand of a quantized dot product. llama.cpp at the pin loads
# such a file, then GGML_ASSERTs or segfaults when the context reserves its graph or at the
# first decode (issue 26), which would take the Python interpreter down.
UNRUNNABLE_TYPES = frozenset({"F64", "I8", "I16", "I32", "I64", "Q8_1", "Q8_K"})


def check_tensor_types(g: GGUFFile) -> None:
    """:class:`ModelError` when a tensor of ``g`` has a type llama.cpp cannot compute with
    (:data:`UNRUNNABLE_TYPES`), naming the first few."""
    from gguf import GGMLQuantizationType

    bad = [(t.name, GGMLQuantizationType(t.type).name) for t in g.tensors
           if GGMLQuantizationType(t.type).name in UNRUNNABLE_TYPES]
    if not bad:
        return
    shown = ", ".join(name for name, _ in bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
    types = ", ".join(sorted({typ for _, typ in bad}))
    raise ModelError(f"{g.path}: llama.cpp cannot compute with tensors of type {types}: {shown}; a model's "
                     "weights must be F32, F16, BF16 or a weight quantization such as Q8_0 or Q4_K "
                     "(convert or quantize it again)")


def check_gguf(path: str | os.PathLike) -> dict:
    """Check that ``path`` is a complete GGUF file before llama.cpp sees it:
    magic, version, the metadata and tensor index parse within the file,
    every tensor's data lies inside the file (a truncated download fails
    here), and every tensor has a type llama.cpp can compute with.

    Returns ``{"version", "n_tensors", "n_kv", "data_offset", "file_size"}``;
    raises :class:`ModelError` with the reason otherwise.
    """
    g = read_gguf(path)
    check_tensor_types(g)
    return {"version": g.version, "n_tensors": g.n_tensors, "n_kv": g.n_kv, "data_offset": g.data_offset,
            "file_size": g.file_size}
