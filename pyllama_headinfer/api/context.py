""":class:`Context`: an inference context on a :class:`Model` -- its
parameters (:data:`KV_CACHE_TYPES`, :func:`check_headinfer_frac`), decoding
and logits, ``generate``/``complete``, sequence (KV cache) operations, state
save/load, and the HeadInfer KV residency report (read in
:mod:`.residency`)."""

from __future__ import annotations

import errno
import logging
import math
import numbers
import os
from typing import Iterator, Sequence

import numpy as np

from pyllama_headinfer.runtime import bindings
from pyllama_headinfer.api.exceptions import ClosedError, ContextError, ContextOverflowError, DecodeError, StateError, _log_tail
from pyllama_headinfer.api.model import Model
from pyllama_headinfer.api.residency import read_kv_residency
from pyllama_headinfer.api.sampler import Sampler

# The API's logger keeps the name of the public module (documented, and what
# bindings routes llama.cpp's own log to).
logger = logging.getLogger("pyllama_headinfer.llama")

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
    1.0 = off.  ``headinfer_vram_budget`` (bytes or e.g. "24GiB", instead
    of a fraction): the fraction is derived from the budget at load time --
    the largest g whose estimated device total fits (``pyllama_headinfer.plan``; the plan
    is kept as ``headinfer_plan``).  ``flash_attn``: True / False / None (= llama.cpp's auto).
    ``kv_unified``/``swa_full``: None keeps llama.cpp's default.
    """

    def __init__(self, model: Model, n_ctx: int = 512, n_batch: int = 512, n_ubatch: int = 512,
                 n_seq_max: int = 1, n_threads: int | None = None, n_threads_batch: int | None = None,
                 flash_attn: bool | None = True, type_k: str = "f16", type_v: str = "f16",
                 offload_kqv: bool = True, kv_unified: bool | None = None, swa_full: bool | None = None,
                 headinfer_gpu_heads_frac: float = 1.0, headinfer_vram_budget=None):
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
        self.headinfer_plan = None
        if headinfer_vram_budget is not None:
            frac = self._frac_for_budget(model, headinfer_vram_budget, frac, n_ctx=n_ctx, n_batch=n_batch,
                                         n_ubatch=n_ubatch, n_seq_max=n_seq_max, type_k=str(type_k).lower(),
                                         type_v=str(type_v).lower(), flash_attn=flash_attn, offload_kqv=offload_kqv,
                                         kv_unified=kv_unified, swa_full=swa_full)
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

    def _frac_for_budget(self, model: Model, budget, frac: float, **params) -> float:
        """The fraction for ``headinfer_vram_budget`` (see ``pyllama_headinfer.plan.plan_for_context``)."""
        from pyllama_headinfer.vram.plan import format_bytes, plan_for_context

        if frac != 1.0:
            raise ValueError(f"give headinfer_gpu_heads_frac ({frac}) or headinfer_vram_budget ({budget!r}), not both")
        plan = plan_for_context(model.path, budget, n_gpu_layers=model.n_gpu_layers,
                                gpu_offload=bool(self._lib.llama_supports_gpu_offload()), **params)
        if plan is None:
            logger.warning("headinfer_vram_budget %r ignored: this build has no GPU offload (nothing to budget); "
                           "headinfer_gpu_heads_frac = 1.0", budget)
            return 1.0
        self.headinfer_plan = plan
        r = plan.chosen
        logger.info("headinfer_vram_budget %s: g = %d of %d KV heads on the device, headinfer_gpu_heads_frac = %.6g "
                    "(estimated device total %s, %s of KV in host memory)", format_bytes(plan.budget), r.g,
                    plan.n_head_kv, r.frac, format_bytes(r.device_total), format_bytes(r.host_kv))
        return r.frac

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

    def synchronize(self) -> None:
        """Wait until the device has finished the work of the last decode
        (llama.cpp may return from ``llama_decode`` before; for timing)."""
        self._lib.llama_synchronize(self._ptr())

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
        return read_kv_residency(self._ptr(), self._ffi, self._lib)
