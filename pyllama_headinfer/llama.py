"""A small Python API over the patched llama.cpp, in the spirit of
llama-cpp-python: :class:`Model`, :class:`Context`, :class:`Sampler`.

    from pyllama_headinfer.llama import Model, Context, Sampler

    with Model("model.gguf", n_gpu_layers=-1) as model, \\
         Context(model, n_ctx=4096, headinfer_gpu_heads_frac=0.5) as ctx:
        print(ctx.complete("Once upon a time", max_tokens=32))
        print(ctx.kv_residency())

Lifetimes: handles are freed deterministically by ``close()`` or ``with``
(``ffi.gc`` frees them too, as a safety net, when an object is collected).
Closing a model closes its contexts first.  Any use after ``close()`` raises
:class:`ClosedError`.  Objects are not thread-safe.

Everything that would make llama.cpp abort or misbehave is checked in Python
first (missing or corrupt GGUF, token ids out of range, prompts longer than
the context, bad ``headinfer_gpu_heads_frac``, unknown sequence ids, sampling
without logits) and raised as an exception, so the interpreter survives.

This module is the public facade for users: the names below are importable
from here (and from their home modules, where the package itself and the
tests import them):

- :mod:`pyllama_headinfer.api.model`: :class:`Model`
- :mod:`pyllama_headinfer.api.context`: :class:`Context` (its jobs in
  ``api/decoding.py``, ``api/sequences.py``, ``api/state.py``)
- :mod:`pyllama_headinfer.api.sampler`: :class:`Sampler`
- :mod:`pyllama_headinfer.api.residency`: :func:`format_kv_residency`,
  :data:`HEADINFER_HOST_SUFFIX`
- :mod:`pyllama_headinfer.api.devices`: :func:`list_devices`,
  :class:`DeviceInfo`, :func:`rpc_add_server`, :func:`rpc_serve`
- :mod:`pyllama_headinfer.api.gguf_check`: :func:`check_gguf`
- :mod:`pyllama_headinfer.api.quantize`: :func:`quantize_model`, :data:`QUANT_FTYPES`
- :mod:`pyllama_headinfer.params`: :class:`ContextParams`,
  :data:`KV_CACHE_TYPES`, :func:`check_headinfer_frac`
- :mod:`pyllama_headinfer.errors`: the exceptions
- :mod:`pyllama_headinfer.runtime.log`: ``logger``, where llama.cpp's log goes
"""

from __future__ import annotations

from pyllama_headinfer.api.context import Context
from pyllama_headinfer.api.devices import DeviceInfo, list_devices, rpc_add_server, rpc_serve
from pyllama_headinfer.api.gguf_check import check_gguf
from pyllama_headinfer.api.model import Model
from pyllama_headinfer.api.quantize import QUANT_FTYPES, quantize_model
from pyllama_headinfer.api.residency import HEADINFER_HOST_SUFFIX, format_kv_residency
from pyllama_headinfer.api.sampler import Sampler
from pyllama_headinfer.errors import (ClosedError, ContextError, ContextOverflowError, DecodeError, HeadInferError,
                                      HeadInferWarning, ModelError, StateError, TokenError)
from pyllama_headinfer.params import KV_CACHE_TYPES, ContextParams, check_headinfer_frac
from pyllama_headinfer.runtime.log import logger

__all__ = [
    # the objects
    "Model", "Context", "ContextParams", "Sampler",
    # helpers
    "check_gguf", "check_headinfer_frac", "format_kv_residency", "quantize_model", "QUANT_FTYPES",
    "DeviceInfo", "list_devices", "rpc_add_server", "rpc_serve",
    "KV_CACHE_TYPES", "HEADINFER_HOST_SUFFIX", "logger",
    # exceptions
    "HeadInferError", "ModelError", "ClosedError", "ContextError", "DecodeError", "TokenError",
    "ContextOverflowError", "StateError", "HeadInferWarning",
]
