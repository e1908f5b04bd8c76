""":class:`Model`: a GGUF model loaded by llama.cpp -- its lifetime, its
properties and metadata, and its vocabulary (tokenize / detokenize)."""

from __future__ import annotations

import errno
import numbers
import os
import weakref
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from pyllama_headinfer.api.chat import apply_chat_template
from pyllama_headinfer.api.gguf_check import check_tensor_types
from pyllama_headinfer.api.handle import Handle
from pyllama_headinfer.errors import HeadInferError, ModelError, TokenError
from pyllama_headinfer.runtime import bindings
from pyllama_headinfer.runtime.log import checked_call
from pyllama_headinfer.vram.gguf import read_gguf

FLT_MAX = float(np.finfo(np.float32).max)  # the shares are C floats


class Model(Handle):
    """A GGUF model loaded by llama.cpp.

    ``n_gpu_layers``: layers to offload (-1 = all; 0 = CPU only).
    ``use_mmap``: map the file instead of reading it.
    ``devices``: names of the devices to offload to (see
    :func:`~pyllama_headinfer.api.devices.list_devices`; default: llama.cpp's
    choice, every GPU). ``split_mode``: "layer" (llama.cpp's default), "row"
    or "none" -- how the layers are spread over several devices;
    ``tensor_split``: the share of each device, as llama.cpp's ``--tensor-split``.
    ``use_extra_bufts``: let the CPU backend repack quantized weights for its
    fastest kernels (AMX, AVX-512/NEON repacking; llama.cpp's default); False
    keeps them in plain CPU buffers (``--no-repack`` of llama.cpp's tools).
    """

    def __init__(self, path: str | os.PathLike, n_gpu_layers: int = 0, use_mmap: bool = True, *,
                 vocab_only: bool = False, devices: Sequence[str] | None = None, split_mode: str = "layer",
                 tensor_split: Sequence[float] | None = None, use_extra_bufts: bool = True):
        self._handle = None
        self._contexts: weakref.WeakSet = weakref.WeakSet()
        path = Path(os.fspath(path))
        if not path.exists():
            raise FileNotFoundError(errno.ENOENT, "model file not found", str(path))
        if path.is_dir():
            raise IsADirectoryError(errno.EISDIR, "model path is a directory", str(path))
        if not isinstance(n_gpu_layers, numbers.Integral):
            raise TypeError(f"n_gpu_layers must be an int, got {n_gpu_layers!r}")
        self.gguf = read_gguf(path)  # the pre-flight check: a corrupt file is a ModelError, not a crash
        if not vocab_only:  # nor is a tensor type llama.cpp loads but cannot compute with
            check_tensor_types(self.gguf)
        self.path = path
        self.n_gpu_layers = int(n_gpu_layers)  # where the layers are: HeadInfer's VRAM budget plan needs it
        self.devices = list(devices) if devices is not None else None  # as given (None: every GPU, llama.cpp's default)
        ffi, lib = self._ffi, self._lib = bindings.load()
        params = lib.llama_model_default_params()
        params.n_gpu_layers = int(n_gpu_layers)
        params.load_mode = lib.LLAMA_LOAD_MODE_MMAP if (use_mmap and lib.llama_supports_mmap()) \
            else lib.LLAMA_LOAD_MODE_NONE
        params.vocab_only = bool(vocab_only)
        params.use_extra_bufts = bool(use_extra_bufts)
        keep = self._set_placement(params, devices, split_mode, tensor_split)  # alive until the load returns
        ptr = checked_call(lib.llama_model_load_from_file, os.fsencode(path), params, ok=lambda p: p != ffi.NULL,
                           error=lambda _, reason: ModelError(f"llama.cpp could not load {path}: {reason}"))
        del keep  # llama.cpp has copied what the device / split arrays said
        self._handle = ffi.gc(ptr, lib.llama_model_free)
        self._vocab = lib.llama_model_get_vocab(ptr)
        self.n_vocab: int = int(lib.llama_vocab_n_tokens(self._vocab))

    _SPLIT_MODES = {"none": "LLAMA_SPLIT_MODE_NONE", "layer": "LLAMA_SPLIT_MODE_LAYER", "row": "LLAMA_SPLIT_MODE_ROW"}

    def _set_placement(self, params, devices, split_mode: str, tensor_split) -> list:
        """Fill the devices / split mode / tensor split of ``params``; returns the
        cffi arrays they point to, which must outlive the load."""
        ffi, lib = self._ffi, self._lib
        if split_mode not in self._SPLIT_MODES:
            raise ValueError(f"split_mode must be one of {sorted(self._SPLIT_MODES)}, got {split_mode!r}")
        params.split_mode = getattr(lib, self._SPLIT_MODES[split_mode])
        if devices is not None and (isinstance(devices, str) or not devices):
            raise ValueError(f"devices must be a non-empty list of device names, got {devices!r}")
        keep = []
        if tensor_split is not None:
            if isinstance(tensor_split, (str, bytes)):
                raise ValueError(f"tensor_split must be a list of numbers, got {tensor_split!r}")
            shares = [float(x) for x in tensor_split]
            # llama.cpp reads one share per device it offloads to and ignores the rest: more is a mistake
            n_max = len(devices) if devices is not None else int(lib.llama_max_devices())
            if not shares or len(shares) > n_max or sum(shares) <= 0 or \
                    any(not (0 <= x <= FLT_MAX) for x in shares):
                raise ValueError(f"tensor_split must be 1 to {n_max} finite, non-negative shares, not all zero, "
                                 f"got {list(tensor_split)!r}")
            n_all = int(lib.llama_max_devices())  # the array llama.cpp indexes
            keep.append(ffi.new("float[]", shares + [0.0] * (n_all - len(shares))))
            params.tensor_split = keep[-1]
        if devices is not None:
            from pyllama_headinfer.api.devices import device_handles

            keep.append(device_handles(list(devices)))
            params.devices = keep[-1]
        return keep

    # -- lifetime (Handle) -------------------------------------------------- #

    def _close_dependents(self) -> None:
        """Closing a model closes every context still open on it first."""
        for ctx in list(self._contexts):
            ctx.close()
        self._vocab = None

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
    def headinfer_attn_chunk(self) -> int:
        """KV cells per chunk that ``headinfer_attn="chunked"`` uses when
        ``headinfer_attn_chunk`` is 0: 32 MiB of the largest layer's K and V
        rows in F16, a multiple of 256 (llama_model_headinfer_attn_chunk)."""
        return self._int("llama_model_headinfer_attn_chunk")

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

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, template: str | None = None) -> str:
        """The prompt for ``messages`` (``[{"role": "user", "content": "..."}, ...]``) in this
        model's chat format, by llama.cpp's ``llama_chat_apply_template``; ``template``: a
        known name ("chatml", "llama3", ...) or template text for models without one."""
        return apply_chat_template(self, messages, add_generation_prompt, template)

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
