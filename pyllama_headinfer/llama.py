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

This module is the public facade: everything above is importable from here,
while the code lives in :mod:`pyllama_headinfer.api`, one job per module:

- ``api/exceptions.py``  the exception types raised below (and the helper that
  quotes llama.cpp's log in their messages)
- ``api/gguf_check.py``  :func:`check_gguf`, the GGUF pre-flight check
- ``api/model.py``       :class:`Model` (loading, properties, tokenizer)
- ``api/sampler.py``     :class:`Sampler` (llama.cpp sampler chains)
- ``api/context.py``     :class:`Context` (decode, logits, generate, sequence
  ops, state), :data:`KV_CACHE_TYPES`, :func:`check_headinfer_frac`
- ``api/residency.py``   the HeadInfer KV residency report: reading it,
  :func:`format_kv_residency`, :data:`HEADINFER_HOST_SUFFIX`
- ``api/devices.py``     the devices (:func:`list_devices`) a model can be
  spread over (``Model(devices=..., split_mode=..., tensor_split=...)``), and
  RPC servers (:func:`rpc_add_server`, :func:`rpc_serve`)
"""

from __future__ import annotations

from pyllama_headinfer.api.context import KV_CACHE_TYPES, Context, check_headinfer_frac, logger
from pyllama_headinfer.api.devices import DeviceInfo, list_devices, rpc_add_server, rpc_serve
from pyllama_headinfer.api.exceptions import ClosedError, ContextError, ContextOverflowError, DecodeError, ModelError, StateError, TokenError
from pyllama_headinfer.api.gguf_check import check_gguf
from pyllama_headinfer.api.model import Model
from pyllama_headinfer.api.residency import HEADINFER_HOST_SUFFIX, format_kv_residency
from pyllama_headinfer.api.sampler import Sampler
from pyllama_headinfer.errors import HeadInferError

__all__ = [
    # the objects
    "Model", "Context", "Sampler",
    # helpers
    "check_gguf", "check_headinfer_frac", "format_kv_residency",
    "DeviceInfo", "list_devices", "rpc_add_server", "rpc_serve",
    "KV_CACHE_TYPES", "HEADINFER_HOST_SUFFIX", "logger",
    # exceptions
    "HeadInferError", "ModelError", "ClosedError", "ContextError", "DecodeError", "TokenError",
    "ContextOverflowError", "StateError",
]

# The classes keep this module's name, as before the split: in tracebacks
# ("pyllama_headinfer.llama.ModelError: ..."), reprs of the types and pickles.
for _name in __all__:
    _obj = globals()[_name]
    if isinstance(_obj, type) and _obj.__module__.startswith(__package__ + ".api."):
        _obj.__module__ = __name__
del _name, _obj
