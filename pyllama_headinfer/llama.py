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
"""

from __future__ import annotations

import errno
import logging
import math
import mmap
import numbers
import os
import struct
import weakref
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

from . import bindings
from .errors import HeadInferError

logger = logging.getLogger("pyllama_headinfer.llama")

try:  # the shared errors module may grow these; use its classes when it does
    from .errors import ModelError  # type: ignore[attr-defined]
except ImportError:
    class ModelError(HeadInferError):
        """A model file is not a loadable GGUF model."""


class ClosedError(HeadInferError, RuntimeError):
    """The object was closed (or its model was); it cannot be used any more."""


class ContextError(HeadInferError):
    """llama.cpp could not create the context, or an operation on it failed."""


class DecodeError(HeadInferError):
    """``llama_decode`` failed; ``code`` is its return value."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


class TokenError(HeadInferError, ValueError):
    """A token id is outside ``[0, n_vocab)``."""


class ContextOverflowError(HeadInferError, ValueError):
    """The tokens do not fit into the context (``n_ctx``)."""


class StateError(HeadInferError):
    """Saving or restoring a context state failed."""


KV_CACHE_TYPES = {
    "f32": "GGML_TYPE_F32",
    "f16": "GGML_TYPE_F16",
    "bf16": "GGML_TYPE_BF16",
    "q8_0": "GGML_TYPE_Q8_0",
    "q4_0": "GGML_TYPE_Q4_0",
    "q4_1": "GGML_TYPE_Q4_1",
    "q5_0": "GGML_TYPE_Q5_0",
    "q5_1": "GGML_TYPE_Q5_1",
    "iq4_nl": "GGML_TYPE_IQ4_NL",
}

HEADINFER_HOST_SUFFIX = " (headinfer host)"


# --------------------------------------------------------------------------- #
# GGUF pre-flight check
# --------------------------------------------------------------------------- #

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


def _log_tail(lines, n: int = 3) -> str:
    errs = [t for lvl, t in lines if lvl >= logging.WARNING]
    picked = (errs or [t for _, t in lines])[-n:]
    return "; ".join(picked)


# --------------------------------------------------------------------------- #
# Model
# --------------------------------------------------------------------------- #

class Model:
    """A GGUF model loaded by llama.cpp.

    ``n_gpu_layers``: layers to offload (-1 = all; 0 = CPU only).
    ``use_mmap``: map the file instead of reading it.
    """

    def __init__(self, path: str | os.PathLike, n_gpu_layers: int = 0, use_mmap: bool = True, *,
                 vocab_only: bool = False):
        self._handle = None
        self._contexts: weakref.WeakSet = weakref.WeakSet()
        path = Path(os.fspath(path))
        if not path.exists():
            raise FileNotFoundError(errno.ENOENT, "model file not found", str(path))
        if path.is_dir():
            raise IsADirectoryError(errno.EISDIR, "model path is a directory", str(path))
        if not isinstance(n_gpu_layers, numbers.Integral):
            raise TypeError(f"n_gpu_layers must be an int, got {n_gpu_layers!r}")
        check_gguf(path)
        self.path = path
        ffi, lib = self._ffi, self._lib = bindings.load()
        params = lib.llama_model_default_params()
        params.n_gpu_layers = int(n_gpu_layers)
        params.load_mode = lib.LLAMA_LOAD_MODE_MMAP if (use_mmap and lib.llama_supports_mmap()) \
            else lib.LLAMA_LOAD_MODE_NONE
        params.vocab_only = bool(vocab_only)
        with bindings.capture_log() as log:
            ptr = lib.llama_model_load_from_file(os.fsencode(path), params)
        if ptr == ffi.NULL:
            raise ModelError(f"llama.cpp could not load {path}: {_log_tail(log) or 'no reason given'}")
        self._handle = ffi.gc(ptr, lib.llama_model_free)
        self._vocab = lib.llama_model_get_vocab(ptr)
        self.n_vocab: int = int(lib.llama_vocab_n_tokens(self._vocab))

    # -- lifetime ---------------------------------------------------------- #

    def _ptr(self):
        if self._handle is None:
            raise ClosedError("the model is closed")
        return self._handle

    @property
    def closed(self) -> bool:
        return self._handle is None

    def close(self) -> None:
        """Free the model (and first every context still open on it)."""
        if self._handle is None:
            return
        for ctx in list(self._contexts):
            ctx.close()
        handle, self._handle = self._handle, None
        self._vocab = None
        self._ffi.release(handle)  # runs llama_model_free now

    def __enter__(self) -> "Model":
        self._ptr()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"n_vocab={self.n_vocab}"
        return f"<Model {self.path.name} {state}>"

    # -- properties -------------------------------------------------------- #

    def _int(self, fn) -> int:
        return int(getattr(self._lib, fn)(self._ptr()))

    @property
    def n_ctx_train(self) -> int:
        return self._int("llama_model_n_ctx_train")

    @property
    def n_embd(self) -> int:
        return self._int("llama_model_n_embd")

    @property
    def n_layer(self) -> int:
        return self._int("llama_model_n_layer")

    @property
    def n_head(self) -> int:
        return self._int("llama_model_n_head")

    @property
    def n_head_kv(self) -> int:
        return self._int("llama_model_n_head_kv")

    @property
    def n_swa(self) -> int:
        return self._int("llama_model_n_swa")

    @property
    def size(self) -> int:
        return self._int("llama_model_size")

    @property
    def n_params(self) -> int:
        return self._int("llama_model_n_params")

    @property
    def description(self) -> str:
        buf = self._ffi.new("char[256]")
        self._lib.llama_model_desc(self._ptr(), buf, 256)
        return self._ffi.string(buf).decode("utf-8", "replace")

    def meta(self, key: str) -> str | None:
        """A GGUF metadata value as a string (None when absent)."""
        ptr, ffi = self._ptr(), self._ffi
        n = self._lib.llama_model_meta_val_str(ptr, key.encode(), ffi.NULL, 0)
        if n < 0:
            return None
        buf = ffi.new("char[]", n + 1)
        self._lib.llama_model_meta_val_str(ptr, key.encode(), buf, n + 1)
        return ffi.string(buf).decode("utf-8", "replace")

    @property
    def token_bos(self) -> int:
        self._ptr()
        return int(self._lib.llama_vocab_bos(self._vocab))

    @property
    def token_eos(self) -> int:
        self._ptr()
        return int(self._lib.llama_vocab_eos(self._vocab))

    def is_eog(self, token: int) -> bool:
        self._ptr()
        return bool(self._lib.llama_vocab_is_eog(self._vocab, int(token)))

    # -- tokens ------------------------------------------------------------ #

    def check_tokens(self, tokens: Iterable[int]) -> np.ndarray:
        """``tokens`` as an int32 array; :class:`TokenError` if any id is not in ``[0, n_vocab)``."""
        self._ptr()
        arr = np.asarray(list(tokens) if not isinstance(tokens, np.ndarray) else tokens)
        if arr.ndim != 1:
            raise TokenError(f"tokens must be a flat sequence of ints, got shape {arr.shape}")
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise TokenError(f"tokens must be ints, got {arr.dtype}")
        bad = np.flatnonzero((arr < 0) | (arr >= self.n_vocab))
        if bad.size:
            i = int(bad[0])
            raise TokenError(f"token id {int(arr[i])} at position {i} is out of range for this model "
                             f"(n_vocab={self.n_vocab})")
        return arr.astype(np.int32, copy=False)

    def tokenize(self, text: str | bytes, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of ``text``; ``add_special`` adds BOS (if the model wants it),
        ``parse_special`` lets text like ``<|im_end|>`` become control tokens."""
        self._ptr()  # raises ClosedError once the model is closed
        ffi, lib = self._ffi, self._lib
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        cap = len(data) + 8
        for _ in range(2):
            out = ffi.new("llama_token[]", cap)
            n = lib.llama_tokenize(self._vocab, data, len(data), out, cap, bool(add_special), bool(parse_special))
            if n >= 0:
                return list(out[0:n])
            if n == -(2**31):
                raise ValueError("text too long to tokenize")
            cap = -n
        raise HeadInferError("llama_tokenize kept asking for a larger buffer")

    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        """The bytes of one token (may be a partial UTF-8 sequence)."""
        self._ptr()
        tok = int(self.check_tokens([token])[0])
        ffi = self._ffi
        cap = 64
        for _ in range(2):
            buf = ffi.new("char[]", cap)
            n = self._lib.llama_token_to_piece(self._vocab, tok, buf, cap, 0, bool(special))
            if n >= 0:
                return ffi.buffer(buf, n)[:]
            cap = -n
        raise HeadInferError("llama_token_to_piece kept asking for a larger buffer")

    def detokenize_bytes(self, tokens: Sequence[int], special: bool = False) -> bytes:
        arr = self.check_tokens(tokens)
        ffi = self._ffi
        toks = ffi.from_buffer("llama_token[]", arr) if arr.size else ffi.NULL
        cap = max(64, 8 * len(arr))
        for _ in range(2):
            buf = ffi.new("char[]", cap)
            n = self._lib.llama_detokenize(self._vocab, toks, len(arr), buf, cap, not special, bool(special))
            if n >= 0:
                return ffi.buffer(buf, n)[:]
            cap = -n
        raise HeadInferError("llama_detokenize kept asking for a larger buffer")

    def detokenize(self, tokens: Sequence[int], special: bool = False) -> str:
        """Text of ``tokens`` (invalid UTF-8 replaced); ``special`` renders control tokens."""
        return self.detokenize_bytes(tokens, special).decode("utf-8", "replace")


# --------------------------------------------------------------------------- #
# Sampler
# --------------------------------------------------------------------------- #

class Sampler:
    """A llama.cpp sampler chain.

    ``Sampler.greedy()``, ``Sampler.random(temperature=.., top_k=.., top_p=..,
    min_p=.., seed=..)``, ``Sampler.from_params(...)`` (greedy when
    ``temperature <= 0``) or step by step:
    ``Sampler().add_top_k(40).add_temp(0.7).add_dist(seed=1)``.
    The chain must end with a selecting stage (greedy or dist) to sample.
    """

    _SELECTING = ("greedy", "dist")

    def __init__(self, *, no_perf: bool = True):
        ffi, lib = self._ffi, self._lib = bindings.load()
        params = lib.llama_sampler_chain_default_params()
        params.no_perf = bool(no_perf)
        ptr = lib.llama_sampler_chain_init(params)
        if ptr == ffi.NULL:
            raise HeadInferError("llama_sampler_chain_init failed")
        self._handle = ffi.gc(ptr, lib.llama_sampler_free)
        self.stages: list[str] = []
        self._seed: int | None = None

    @classmethod
    def greedy(cls) -> "Sampler":
        return cls().add_greedy()

    @classmethod
    def random(cls, temperature: float = 0.8, top_k: int | None = 40, top_p: float | None = 0.95,
               min_p: float | None = 0.05, seed: int | None = None) -> "Sampler":
        s = cls()
        if top_k:
            s.add_top_k(top_k)
        if top_p is not None and top_p < 1.0:
            s.add_top_p(top_p)
        if min_p:
            s.add_min_p(min_p)
        return s.add_temp(temperature).add_dist(seed)

    @classmethod
    def from_params(cls, temperature: float = 0.8, top_k: int | None = 40, top_p: float | None = 0.95,
                    min_p: float | None = 0.05, seed: int | None = None) -> "Sampler":
        if temperature is None or temperature <= 0:
            return cls.greedy()
        return cls.random(temperature, top_k, top_p, min_p, seed)

    def _ptr(self):
        if self._handle is None:
            raise ClosedError("the sampler is closed")
        return self._handle

    def _add(self, name: str, ptr) -> "Sampler":
        chain = self._ptr()
        if self.stages and self.stages[-1] in self._SELECTING:
            raise ValueError(f"cannot add {name!r} after the selecting stage {self.stages[-1]!r}")
        if ptr == self._ffi.NULL:
            raise ValueError(f"llama.cpp rejected the {name} sampler parameters")
        self._lib.llama_sampler_chain_add(chain, ptr)  # the chain owns it now
        self.stages.append(name)
        return self

    def add_greedy(self) -> "Sampler":
        return self._add("greedy", self._lib.llama_sampler_init_greedy())

    def add_dist(self, seed: int | None = None) -> "Sampler":
        lib = self._lib
        s = int(lib.LLAMA_DEFAULT_SEED) if seed is None else int(seed) & 0xFFFFFFFF
        self._add("dist", lib.llama_sampler_init_dist(s))
        self._seed = int(lib.llama_sampler_get_seed(self._ptr()))
        return self

    def add_temp(self, t: float) -> "Sampler":
        t = float(t)
        if math.isnan(t):
            raise ValueError("temperature must not be NaN")
        return self._add("temp", self._lib.llama_sampler_init_temp(t))

    def add_top_k(self, k: int) -> "Sampler":
        return self._add("top_k", self._lib.llama_sampler_init_top_k(int(k)))

    def add_top_p(self, p: float, min_keep: int = 1) -> "Sampler":
        if not 0.0 <= float(p) <= 1.0:
            raise ValueError(f"top_p must be in [0, 1], got {p!r}")
        return self._add("top_p", self._lib.llama_sampler_init_top_p(float(p), int(min_keep)))

    def add_min_p(self, p: float, min_keep: int = 1) -> "Sampler":
        if not 0.0 <= float(p) <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {p!r}")
        return self._add("min_p", self._lib.llama_sampler_init_min_p(float(p), int(min_keep)))

    @property
    def seed(self) -> int | None:
        """The seed the dist stage actually uses (None without one)."""
        return self._seed

    def sample(self, ctx: "Context", idx: int = -1) -> int:
        """Sample a token from ``ctx``'s logits at ``idx`` (and accept it)."""
        chain = self._ptr()
        if not self.stages or self.stages[-1] not in self._SELECTING:
            raise ValueError("the sampler chain does not end with a selecting stage (greedy or dist)")
        cptr = ctx._ptr()
        ctx._logits_ptr(idx)  # raises if there are no logits at idx (llama.cpp would abort)
        return int(self._lib.llama_sampler_sample(chain, cptr, int(idx)))

    def accept(self, token: int) -> None:
        self._lib.llama_sampler_accept(self._ptr(), int(token))

    def reset(self) -> None:
        self._lib.llama_sampler_reset(self._ptr())

    def close(self) -> None:
        if self._handle is not None:
            handle, self._handle = self._handle, None
            self._ffi.release(handle)

    def __enter__(self) -> "Sampler":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Sampler {' -> '.join(self.stages) or '(empty)'}{' closed' if self._handle is None else ''}>"


# --------------------------------------------------------------------------- #
# Context
# --------------------------------------------------------------------------- #

def check_headinfer_frac(frac) -> float:
    """``frac`` as a float in [0, 1]; ValueError naming the value otherwise (NaN, out of range, not a number)."""
    if isinstance(frac, bool) or not isinstance(frac, numbers.Real):
        raise ValueError(f"headinfer_gpu_heads_frac must be a number in [0, 1], got {frac!r}")
    f = float(frac)
    if math.isnan(f) or not 0.0 <= f <= 1.0:
        raise ValueError(f"headinfer_gpu_heads_frac must be in [0, 1], got {frac!r}")
    return f


def _check_count(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    if value > 2**31 - 1:
        raise ValueError(f"{name} is too large: {value!r}")
    return int(value)


class Context:
    """An inference context (KV cache, logits, threads) on a :class:`Model`.

    ``headinfer_gpu_heads_frac``: fraction of each layer's KV heads kept in
    the layer's (device) buffer; the rest live in host memory (HeadInfer).
    1.0 = off.  ``flash_attn``: True / False / None (= llama.cpp's auto).
    ``kv_unified``/``swa_full``: None keeps llama.cpp's default.
    """

    def __init__(self, model: Model, n_ctx: int = 512, n_batch: int = 512, n_ubatch: int = 512,
                 n_seq_max: int = 1, n_threads: int | None = None, n_threads_batch: int | None = None,
                 flash_attn: bool | None = True, type_k: str = "f16", type_v: str = "f16",
                 offload_kqv: bool = True, kv_unified: bool | None = None, swa_full: bool | None = None,
                 headinfer_gpu_heads_frac: float = 1.0):
        self._handle = None
        self._batch = None
        frac = check_headinfer_frac(headinfer_gpu_heads_frac)
        if not isinstance(model, Model):
            raise TypeError(f"model must be a Model, got {type(model).__name__}")
        mptr = model._ptr()
        ffi, lib = self._ffi, self._lib = model._ffi, model._lib
        n_ctx = _check_count("n_ctx", n_ctx, 0)
        n_batch = _check_count("n_batch", n_batch, 1)
        n_ubatch = _check_count("n_ubatch", n_ubatch, 1)
        n_seq_max = _check_count("n_seq_max", n_seq_max, 1)
        p = lib.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = n_ctx, n_batch, n_ubatch, n_seq_max
        if n_threads is not None:
            p.n_threads = _check_count("n_threads", n_threads, 1)
            p.n_threads_batch = p.n_threads
        if n_threads_batch is not None:
            p.n_threads_batch = _check_count("n_threads_batch", n_threads_batch, 1)
        p.flash_attn_type = {True: lib.LLAMA_FLASH_ATTN_TYPE_ENABLED, False: lib.LLAMA_FLASH_ATTN_TYPE_DISABLED,
                             None: lib.LLAMA_FLASH_ATTN_TYPE_AUTO}[flash_attn]
        p.type_k = self._kv_type("type_k", type_k)
        p.type_v = self._kv_type("type_v", type_v)
        p.offload_kqv = bool(offload_kqv)
        if kv_unified is not None:
            p.kv_unified = bool(kv_unified)
        if swa_full is not None:
            p.swa_full = bool(swa_full)
        p.headinfer_gpu_heads_frac = frac
        with bindings.capture_log() as log:
            ptr = lib.llama_init_from_model(mptr, p)
        if ptr == ffi.NULL:
            raise ContextError(f"llama.cpp could not create the context: {_log_tail(log) or 'no reason given'}")
        self._handle = ffi.gc(ptr, lib.llama_free)
        self.model = model
        model._contexts.add(self)
        self.headinfer_gpu_heads_frac = frac
        self._mem = lib.llama_get_memory(ptr)
        self.n_ctx = int(lib.llama_n_ctx(ptr))
        self.n_ctx_seq = int(lib.llama_n_ctx_seq(ptr))
        self.n_batch = int(lib.llama_n_batch(ptr))
        self.n_ubatch = int(lib.llama_n_ubatch(ptr))
        self.n_seq_max = int(lib.llama_n_seq_max(ptr))
        self.kv_unified = bool(p.kv_unified)  # False with n_seq_max > 1: one KV stream per sequence
        self.type_k, self.type_v = str(type_k).lower(), str(type_v).lower()
        self.n_vocab = model.n_vocab
        self._batch = lib.llama_batch_init(self.n_batch, 0, 1)
        self._batch_cap = self.n_batch
        # what the last decode left in llama.cpp's output buffer
        self._out_mode = None  # None | "last" | "all" | "none" | "batch"
        self._out_n = 0  # tokens in the last llama_decode call
        self._all_logits: np.ndarray | None = None  # "all" over several batches
        self._out_rows: set = set()  # batch indices with logits after decode_batch()

    def _kv_type(self, name: str, value: str):
        try:
            return getattr(self._lib, KV_CACHE_TYPES[str(value).lower()])
        except KeyError:
            raise ValueError(f"{name} must be one of {sorted(KV_CACHE_TYPES)}, got {value!r}") from None

    # -- lifetime ---------------------------------------------------------- #

    def _ptr(self):
        if self._handle is None:
            raise ClosedError("the context is closed")
        return self._handle

    @property
    def closed(self) -> bool:
        return self._handle is None

    def close(self) -> None:
        if self._handle is None:
            return
        handle, self._handle = self._handle, None
        if self._batch is not None:
            batch, self._batch = self._batch, None
            self._lib.llama_batch_free(batch)
        self._all_logits = None
        self._mem = None
        self._ffi.release(handle)  # runs llama_free now
        try:
            self.model._contexts.discard(self)
        except Exception:
            pass

    def __enter__(self) -> "Context":
        self._ptr()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        if self.closed:
            return "<Context closed>"
        return f"<Context n_ctx={self.n_ctx} headinfer_gpu_heads_frac={self.headinfer_gpu_heads_frac}>"

    # -- sequences --------------------------------------------------------- #

    def _check_seq(self, seq_id, allow_any: bool = False) -> int:
        if isinstance(seq_id, bool) or not isinstance(seq_id, numbers.Integral):
            raise ValueError(f"seq_id must be an int, got {seq_id!r}")
        if allow_any and seq_id < 0:
            return -1
        if not 0 <= seq_id < self.n_seq_max:
            raise ValueError(f"seq_id {seq_id} is out of range: this context has n_seq_max={self.n_seq_max}")
        return int(seq_id)

    def seq_pos_max(self, seq_id: int = 0) -> int:
        """Largest position stored for ``seq_id`` (-1 when empty)."""
        self._ptr()
        return int(self._lib.llama_memory_seq_pos_max(self._mem, self._check_seq(seq_id)))

    def seq_pos_min(self, seq_id: int = 0) -> int:
        self._ptr()
        return int(self._lib.llama_memory_seq_pos_min(self._mem, self._check_seq(seq_id)))

    def n_tokens(self, seq_id: int = 0) -> int:
        """Next position of ``seq_id`` (= tokens decoded so far, without gaps)."""
        return self.seq_pos_max(seq_id) + 1

    # -- decoding ---------------------------------------------------------- #

    def decode(self, tokens: Sequence[int], seq_id: int = 0, logits: str = "last") -> None:
        """Append ``tokens`` to sequence ``seq_id`` and evaluate them, in chunks
        of ``n_batch``.  ``logits``: "last" (for the last token), "all" (every
        token; read with :meth:`logits`) or "none"."""
        ptr = self._ptr()
        if logits not in ("last", "all", "none"):
            raise ValueError(f"logits must be 'last', 'all' or 'none', got {logits!r}")
        seq_id = self._check_seq(seq_id)
        arr = self.model.check_tokens(tokens)
        n = len(arr)
        if n == 0:
            raise ValueError("decode() needs at least one token")
        pos0 = self.n_tokens(seq_id)
        if pos0 + n > self.n_ctx_seq:
            raise ContextOverflowError(
                f"{n} tokens at position {pos0} do not fit into the context (n_ctx={self.n_ctx}"
                + (f", {self.n_ctx_seq} per sequence" if self.n_ctx_seq != self.n_ctx else "") + ")")
        ffi, lib, batch = self._ffi, self._lib, self._batch
        self._out_mode, self._out_n, self._all_logits = None, 0, None
        chunks = range(0, n, self.n_batch)
        collect = logits == "all" and n > self.n_batch
        if collect:
            self._all_logits = np.empty((n, self.n_vocab), dtype=np.float32)
        for start in chunks:
            m = min(self.n_batch, n - start)
            last_chunk = start + m == n
            np.frombuffer(ffi.buffer(batch.token, m * 4), dtype=np.int32)[:] = arr[start:start + m]
            np.frombuffer(ffi.buffer(batch.pos, m * 4), dtype=np.int32)[:] = np.arange(
                pos0 + start, pos0 + start + m, dtype=np.int32)
            np.frombuffer(ffi.buffer(batch.n_seq_id, m * 4), dtype=np.int32)[:] = 1
            out = np.frombuffer(ffi.buffer(batch.logits, m), dtype=np.int8)
            if logits == "all":
                out[:] = 1
            else:
                out[:] = 0
                if logits == "last" and last_chunk:
                    out[m - 1] = 1
            for i in range(m):
                batch.seq_id[i][0] = seq_id
            batch.n_tokens = m
            with bindings.capture_log() as log:
                rc = int(lib.llama_decode(ptr, batch))
            if rc != 0:
                self._out_mode, self._all_logits = None, None
                raise DecodeError(self._decode_message(rc, start, log), rc)
            if collect:
                src = lib.llama_get_logits(ptr)
                self._all_logits[start:start + m] = np.frombuffer(
                    ffi.buffer(src, m * self.n_vocab * 4), dtype=np.float32).reshape(m, self.n_vocab)
            self._out_n = m
        self._out_mode = logits

    def decode_batch(self, seqs) -> dict[int, int]:
        """Evaluate tokens of several sequences in one ``llama_batch`` (one
        ``llama_decode`` call), e.g. parallel generation for several prompts.

        ``seqs``: ``{seq_id: tokens}`` (or ``(seq_id, tokens)`` pairs); each
        sequence's tokens are appended after its current end.  All tokens
        together must fit into ``n_batch``.  The last token of every sequence
        gets logits; returns ``{seq_id: batch index}`` for :meth:`logits` and
        :meth:`Sampler.sample`.
        """
        ptr = self._ptr()
        items = list(seqs.items()) if hasattr(seqs, "items") else list(seqs)
        if not items:
            raise ValueError("decode_batch() needs at least one sequence")
        plan, seen, total = [], set(), 0
        for seq_id, tokens in items:
            seq_id = self._check_seq(seq_id)
            if seq_id in seen:
                raise ValueError(f"sequence {seq_id} appears twice in the batch")
            seen.add(seq_id)
            arr = self.model.check_tokens(tokens)
            if len(arr) == 0:
                raise ValueError(f"decode_batch(): no tokens for sequence {seq_id}")
            pos0 = self.n_tokens(seq_id)
            if pos0 + len(arr) > self.n_ctx_seq:
                raise ContextOverflowError(
                    f"{len(arr)} tokens at position {pos0} of sequence {seq_id} do not fit into the context "
                    f"(n_ctx={self.n_ctx}" + (f", {self.n_ctx_seq} per sequence" if self.n_ctx_seq != self.n_ctx
                                             else "") + ")")
            plan.append((seq_id, arr, pos0))
            total += len(arr)
        if total > self._batch_cap:
            raise ValueError(f"decode_batch(): {total} tokens do not fit into one batch (n_batch={self._batch_cap})")
        ffi, lib, batch = self._ffi, self._lib, self._batch
        self._out_mode, self._out_n, self._all_logits = None, 0, None
        tok = np.frombuffer(ffi.buffer(batch.token, total * 4), dtype=np.int32)
        pos = np.frombuffer(ffi.buffer(batch.pos, total * 4), dtype=np.int32)
        np.frombuffer(ffi.buffer(batch.n_seq_id, total * 4), dtype=np.int32)[:] = 1
        out = np.frombuffer(ffi.buffer(batch.logits, total), dtype=np.int8)
        out[:] = 0
        rows, i = {}, 0
        for seq_id, arr, pos0 in plan:
            m = len(arr)
            tok[i:i + m] = arr
            pos[i:i + m] = np.arange(pos0, pos0 + m, dtype=np.int32)
            for j in range(i, i + m):
                batch.seq_id[j][0] = seq_id
            out[i + m - 1] = 1
            rows[seq_id] = i + m - 1
            i += m
        batch.n_tokens = total
        with bindings.capture_log() as log:
            rc = int(lib.llama_decode(ptr, batch))
        if rc != 0:
            raise DecodeError(self._decode_message(rc, 0, log), rc)
        self._out_n = total
        self._out_rows = set(rows.values())
        self._out_mode = "batch"
        return rows

    @staticmethod
    def _decode_message(rc: int, start: int, log) -> str:
        what = {1: "no KV cache slot for the batch (context full)", 2: "aborted",
                -1: "invalid input batch"}.get(rc, "llama.cpp error")
        tail = _log_tail(log)
        return f"llama_decode returned {rc} ({what}) for the batch at token {start}" + (f": {tail}" if tail else "")

    def _logits_ptr(self, i: int):
        """Pointer to llama.cpp's logits for batch index ``i`` of the last
        decode (checked: llama.cpp aborts on some invalid indices)."""
        ptr = self._ptr()
        mode = self._out_mode
        if mode is None or mode == "none":
            raise ValueError("no logits available: decode tokens with logits='last' or 'all' first")
        if mode == "last" and i not in (-1, self._out_n - 1):
            raise IndexError(f"only the last token has logits (decode with logits='all' for more); got index {i}")
        if mode == "all" and not -self._out_n <= i < self._out_n:
            raise IndexError(f"logits index {i} out of range for the last batch of {self._out_n} tokens")
        if mode == "batch" and i not in self._out_rows:
            raise IndexError(f"no logits for batch index {i}: the last decode_batch() computed logits for "
                             f"indices {sorted(self._out_rows)}")
        with bindings.capture_log() as log:
            p = self._lib.llama_get_logits_ith(ptr, int(i))
        if p == self._ffi.NULL:
            raise IndexError(f"no logits for index {i}: {_log_tail(log)}")
        return p

    def logits(self, i: int = -1, copy: bool = True) -> np.ndarray:
        """Logits (float32, ``n_vocab``) of token ``i`` of the last :meth:`decode`
        (-1 = last).

        Default: a copy.  ``copy=False`` returns a zero-copy view into
        llama.cpp's output buffer, which the next decode/state load overwrites
        and ``close()`` frees -- read it right away, keep the context open.
        After a ``logits="all"`` decode longer than ``n_batch`` the logits were
        collected into a Python array and are always returned as copies of it.
        """
        if self._all_logits is not None:
            self._ptr()
            n = len(self._all_logits)
            if not -n <= i < n:
                raise IndexError(f"logits index {i} out of range for the last decode of {n} tokens")
            return self._all_logits[i].copy()
        p = self._logits_ptr(i)
        view = np.frombuffer(self._ffi.buffer(p, self.n_vocab * 4), dtype=np.float32)
        return view.copy() if copy else view

    def sample(self, sampler: Sampler, i: int = -1) -> int:
        return sampler.sample(self, i)

    def generate(self, prompt_tokens: Sequence[int], max_tokens: int, sampler: Sampler | None = None, *,
                 seq_id: int = 0, reset: bool = True, stop_at_eog: bool = True) -> Iterator[int]:
        """Yield up to ``max_tokens`` tokens following ``prompt_tokens`` in ``seq_id``.

        ``reset``: clear the sequence first (default); False appends to it.
        Stops at an end-of-generation token (yielded) unless ``stop_at_eog`` is
        False, and when the context is full.  ``sampler`` defaults to greedy.
        """
        max_tokens = _check_count("max_tokens", max_tokens, 0)
        seq_id = self._check_seq(seq_id)
        prompt = self.model.check_tokens(prompt_tokens)
        if len(prompt) == 0:
            raise ValueError("generate() needs a non-empty prompt")
        own = sampler is None
        sampler = Sampler.greedy() if own else sampler
        try:
            if reset:
                self.seq_rm(seq_id)
            self.decode(prompt, seq_id=seq_id, logits="last")
            for k in range(max_tokens):
                tok = sampler.sample(self, -1)
                yield tok
                if stop_at_eog and self.model.is_eog(tok):
                    return
                if k + 1 == max_tokens:
                    return
                if self.n_tokens(seq_id) >= self.n_ctx_seq:
                    logger.warning("generate: context full (n_ctx=%d), stopping", self.n_ctx)
                    return
                self.decode([tok], seq_id=seq_id, logits="last")
        finally:
            if own:
                sampler.close()

    def complete(self, text: str, max_tokens: int = 64, sampler: Sampler | None = None,
                 add_special: bool = True) -> str:
        """Generate a continuation of ``text`` and return it as a string."""
        prompt = self.model.tokenize(text, add_special=add_special)
        out = [t for t in self.generate(prompt, max_tokens, sampler) if not self.model.is_eog(t)]
        return self.model.detokenize(out)

    # -- memory (KV cache) ------------------------------------------------- #

    def clear(self, data: bool = True) -> None:
        """Empty the memory (``data``: also zero the buffers)."""
        self._ptr()
        self._lib.llama_memory_clear(self._mem, bool(data))
        self._out_mode, self._all_logits = None, None

    def seq_rm(self, seq_id: int = -1, p0: int = -1, p1: int = -1) -> bool:
        """Remove positions [p0, p1) of ``seq_id`` (-1: any sequence / open
        range). False if a partial removal is not possible."""
        self._ptr()
        return bool(self._lib.llama_memory_seq_rm(self._mem, self._check_seq(seq_id, allow_any=True),
                                                  int(p0), int(p1)))

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Copy positions [p0, p1) of ``src`` into ``dst`` (-1: open range).
        With one KV stream per sequence (``kv_unified=False``) only whole
        sequences can be copied (llama.cpp aborts otherwise): ValueError."""
        self._ptr()
        src, dst = self._check_seq(src), self._check_seq(dst)
        if not self.kv_unified and self.n_seq_max > 1 and src != dst and (
                0 < int(p0) < self.n_ctx_seq - 1 or 0 < int(p1) < self.n_ctx_seq - 1):
            raise ValueError(f"seq_cp({src}, {dst}, {p0}, {p1}): with kv_unified=False a sequence can only be "
                             "copied whole (p0 = p1 = -1)")
        self._lib.llama_memory_seq_cp(self._mem, src, dst, int(p0), int(p1))

    def seq_keep(self, seq_id: int) -> None:
        self._ptr()
        self._lib.llama_memory_seq_keep(self._mem, self._check_seq(seq_id))

    def _check_shift(self, what: str) -> None:
        if not self._lib.llama_memory_can_shift(self._mem):
            raise ContextError(f"{what}: this context's memory does not support position shifts")
        if self.type_k == "bf16":
            # the K-shift applies RoPE to the cache in place; ggml's RoPE has no BF16 kernel (it aborts)
            raise ContextError(f"{what}: a K-shift of a bf16 K cache is not supported by llama.cpp at this "
                               "version (RoPE has no BF16 kernel); use type_k='f16'")

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        """Add ``delta`` to the positions in [p0, p1) of ``seq_id``."""
        self._ptr()
        seq_id = self._check_seq(seq_id)
        self._check_shift("seq_add")
        self._lib.llama_memory_seq_add(self._mem, seq_id, int(p0), int(p1), int(delta))

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        """Integer-divide the positions in [p0, p1) of ``seq_id`` by ``d`` (>= 1)."""
        self._ptr()
        seq_id = self._check_seq(seq_id)
        if isinstance(d, bool) or not isinstance(d, numbers.Integral) or d < 1:
            raise ValueError(f"seq_div: d must be an int >= 1, got {d!r}")
        if d == 1:
            return
        self._check_shift("seq_div")
        self._lib.llama_memory_seq_div(self._mem, seq_id, int(p0), int(p1), int(d))

    # -- state ------------------------------------------------------------- #

    # At this pin a state holds the memory (KV cache) only, not the logits: after
    # loading one, decode the next token to get logits (or save the state one
    # token early and decode the last prompt token after loading).

    def save_state(self) -> bytes:
        """The context's state (the KV cache contents; no logits) as bytes."""
        ptr, ffi, lib = self._ptr(), self._ffi, self._lib
        size = int(lib.llama_state_get_size(ptr))
        buf = ffi.new("uint8_t[]", max(size, 1))
        n = int(lib.llama_state_get_data(ptr, buf, size))
        if n == 0 and size:
            raise StateError("llama_state_get_data failed")
        return ffi.buffer(buf, n)[:]

    def load_state(self, data: bytes) -> None:
        """Restore a state from :meth:`save_state` (same model and context setup)."""
        ptr, ffi = self._ptr(), self._ffi
        data = bytes(data)
        if not data:
            raise StateError("empty state data")
        with bindings.capture_log() as log:
            n = int(self._lib.llama_state_set_data(ptr, ffi.from_buffer("uint8_t[]", data), len(data)))
        self._out_mode, self._all_logits, self._out_n = None, None, 0
        if n == 0:
            raise StateError(f"llama.cpp rejected the state data: {_log_tail(log) or 'no reason given'}")

    def save_seq_state(self, seq_id: int = 0) -> bytes:
        ptr, ffi, lib = self._ptr(), self._ffi, self._lib
        seq_id = self._check_seq(seq_id)
        size = int(lib.llama_state_seq_get_size(ptr, seq_id))
        buf = ffi.new("uint8_t[]", max(size, 1))
        n = int(lib.llama_state_seq_get_data(ptr, buf, size, seq_id))
        return ffi.buffer(buf, n)[:]

    def load_seq_state(self, data: bytes, seq_id: int = 0) -> None:
        ptr, ffi = self._ptr(), self._ffi
        seq_id = self._check_seq(seq_id)
        data = bytes(data)
        if not data:
            raise StateError("empty state data")
        with bindings.capture_log() as log:
            n = int(self._lib.llama_state_seq_set_data(ptr, ffi.from_buffer("uint8_t[]", data), len(data), seq_id))
        self._out_mode, self._all_logits = None, None
        if n == 0:
            raise StateError(f"llama.cpp rejected the sequence state: {_log_tail(log) or 'no reason given'}")

    def save_state_file(self, path: str | os.PathLike, tokens: Sequence[int]) -> None:
        """Save the state and ``tokens`` (e.g. the prompt) to ``path``."""
        ptr, ffi = self._ptr(), self._ffi
        arr = self.model.check_tokens(tokens)
        toks = ffi.from_buffer("llama_token[]", arr) if arr.size else ffi.NULL
        with bindings.capture_log() as log:
            ok = self._lib.llama_state_save_file(ptr, os.fsencode(os.fspath(path)), toks, len(arr))
        if not ok:
            raise StateError(f"could not save the state to {path}: {_log_tail(log) or 'no reason given'}")

    def load_state_file(self, path: str | os.PathLike) -> list[int]:
        """Restore a state saved by :meth:`save_state_file`; return its tokens."""
        ptr, ffi = self._ptr(), self._ffi
        path = os.fspath(path)
        if not os.path.exists(path):
            raise FileNotFoundError(errno.ENOENT, "state file not found", path)
        cap = self.n_ctx
        out = ffi.new("llama_token[]", max(cap, 1))
        n_out = ffi.new("size_t *")
        with bindings.capture_log() as log:
            ok = self._lib.llama_state_load_file(ptr, os.fsencode(path), out, cap, n_out)
        self._out_mode, self._all_logits, self._out_n = None, None, 0
        if not ok:
            raise StateError(f"could not load the state from {path}: {_log_tail(log) or 'no reason given'}")
        return list(out[0:int(n_out[0])])

    def save_seq_state_file(self, path: str | os.PathLike, seq_id: int = 0, tokens: Sequence[int] = ()) -> int:
        """Save sequence ``seq_id``'s state and ``tokens`` to ``path``
        (``llama_state_seq_save_file``); returns the bytes written."""
        ptr, ffi = self._ptr(), self._ffi
        seq_id = self._check_seq(seq_id)
        arr = self.model.check_tokens(tokens)
        toks = ffi.from_buffer("llama_token[]", arr) if arr.size else ffi.NULL
        with bindings.capture_log() as log:
            n = int(self._lib.llama_state_seq_save_file(ptr, os.fsencode(os.fspath(path)), seq_id, toks, len(arr)))
        if n == 0:
            raise StateError(f"could not save sequence {seq_id} to {path}: {_log_tail(log) or 'no reason given'}")
        return n

    def load_seq_state_file(self, path: str | os.PathLike, seq_id: int = 0) -> list[int]:
        """Restore a sequence saved by :meth:`save_seq_state_file` into
        ``seq_id`` (replacing it); return its tokens."""
        ptr, ffi = self._ptr(), self._ffi
        seq_id = self._check_seq(seq_id)
        path = os.fspath(path)
        if not os.path.exists(path):
            raise FileNotFoundError(errno.ENOENT, "sequence state file not found", path)
        cap = self.n_ctx
        out = ffi.new("llama_token[]", max(cap, 1))
        n_out = ffi.new("size_t *")
        with bindings.capture_log() as log:
            n = int(self._lib.llama_state_seq_load_file(ptr, os.fsencode(path), seq_id, out, cap, n_out))
        self._out_mode, self._all_logits, self._out_n = None, None, 0
        if n == 0:
            raise StateError(f"could not load sequence state from {path}: {_log_tail(log) or 'no reason given'}")
        return list(out[0:int(n_out[0])])

    # -- HeadInfer --------------------------------------------------------- #

    def kv_residency(self) -> dict | None:
        """Where the KV cache's bytes live, as allocated by llama.cpp
        (``llama_kv_residency_buffers`` / ``_layers``; nothing is recomputed here)::

            {"buffers": {"CPU": {"k": 98304, "v": 98304, "headinfer_host": False},
                         "CPU (headinfer host)": {"k": ..., "v": ..., "headinfer_host": True}},
             "layers": [{"il": 0, "n_head_kv": 4, "n_head_resident": 2, "is_swa": False}, ...]}

        Buffers are keyed by buffer type name, with " (headinfer host)"
        appended for the separately allocated host halves of split layers.
        None when the context has no attention KV cache.  Raises
        :class:`HeadInferError` if libllama lacks the residency functions.
        """
        ptr, ffi, lib = self._ptr(), self._ffi, self._lib
        if not lib.pyllama_has_kv_residency():
            raise HeadInferError("this libllama has no llama_kv_residency_buffers (built without the "
                                 "HeadInfer patch series?); " + bindings.REBUILD_HINT)
        n = int(lib.llama_kv_residency_buffers(ptr, ffi.NULL, 0))
        if n < 0:
            return None
        bufs = ffi.new("struct llama_kv_residency_buffer[]", max(n, 1))
        n = min(n, int(lib.llama_kv_residency_buffers(ptr, bufs, n)))
        buffers: dict[str, dict] = {}
        for b in bufs[0:n]:
            name = ffi.string(b.buft_name).decode("utf-8", "replace") if b.buft_name != ffi.NULL else "?"
            host = bool(b.headinfer_host)
            key = name + (HEADINFER_HOST_SUFFIX if host else "")
            entry = buffers.setdefault(key, {"k": 0, "v": 0, "headinfer_host": host})
            entry["k"] += int(b.k_bytes)
            entry["v"] += int(b.v_bytes)
        nl = int(lib.llama_kv_residency_layers(ptr, ffi.NULL, 0))
        layers = []
        if nl > 0:
            arr = ffi.new("struct llama_kv_residency_layer[]", nl)
            nl = min(nl, int(lib.llama_kv_residency_layers(ptr, arr, nl)))
            layers = [{"il": int(x.il), "n_head_kv": int(x.n_head_kv), "n_head_resident": int(x.n_head_resident),
                       "is_swa": bool(x.is_swa)} for x in arr[0:nl]]
            layers.sort(key=lambda x: (x["il"], x["is_swa"]))
        return {"buffers": buffers, "layers": layers}


def format_kv_residency(report: dict | None) -> str:
    """A human-readable table of :meth:`Context.kv_residency`."""
    if report is None:
        return "KV residency: no attention KV cache"

    def mib(n: int) -> str:
        return f"{n / 2**20:9.2f} MiB"

    lines = ["KV residency (as allocated by llama.cpp):"]
    total_k = total_v = 0
    for name, b in report["buffers"].items():
        lines.append(f"  {name:28s} K {mib(b['k'])}  V {mib(b['v'])}")
        total_k += b["k"]
        total_v += b["v"]
    lines.append(f"  {'total':28s} K {mib(total_k)}  V {mib(total_v)}")
    layers = report["layers"]
    if layers:
        split = [x for x in layers if x["n_head_resident"] < x["n_head_kv"]]
        lines.append(f"  layers: {len(layers)}, split: {len(split)}")
        for x in layers:
            tag = " swa" if x["is_swa"] else ""
            lines.append(f"    layer {x['il']:3d}: {x['n_head_resident']}/{x['n_head_kv']} heads resident{tag}")
    return "\n".join(lines)
