"""The GGUF pre-flight check: :func:`check_gguf` reads a model file's header,
metadata and tensor index in Python, so a truncated or corrupt file raises
:class:`ModelError` instead of reaching (and crashing) llama.cpp.

The walk itself is :func:`pyllama_headinfer.vram.gguf.read_gguf`, the
package's one GGUF reader (the VRAM plan reads its model facts with it too)."""

from __future__ import annotations

import os

from pyllama_headinfer.vram.gguf import read_gguf


def check_gguf(path: str | os.PathLike) -> dict:
    """Check that ``path`` is a complete GGUF file before llama.cpp sees it:
    magic, version, the metadata and tensor index parse within the file, and
    every tensor's data lies inside the file (a truncated download fails here).

    Returns ``{"version", "n_tensors", "n_kv", "data_offset", "file_size"}``;
    raises :class:`ModelError` with the reason otherwise.
    """
    g = read_gguf(path)
    return {"version": g.version, "n_tensors": g.n_tensors, "n_kv": g.n_kv, "data_offset": g.data_offset,
            "file_size": g.file_size}
