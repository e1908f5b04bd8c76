"""The sequence (KV cache) operations of a :class:`~.context.Context`:
positions of a sequence, clearing, removing, copying, keeping and shifting
ranges. A mixin: :class:`Sequences` uses the context's ``_ptr()``, ``_lib``,
``_mem``, ``_lock``, ``n_seq_max``, ``n_ctx_seq``, ``kv_unified`` and
``type_k``. Every call holds the context's lock."""

from __future__ import annotations

import numbers

from pyllama_headinfer.api.handle import serialized
from pyllama_headinfer.errors import ContextError


class Sequences:
    """Sequence ids, positions and the memory of a context (see the module docstring)."""

    def _check_seq(self, seq_id, allow_any: bool = False) -> int:
        if isinstance(seq_id, bool) or not isinstance(seq_id, numbers.Integral):
            raise ValueError(f"seq_id must be an int, got {seq_id!r}")
        if allow_any and seq_id < 0:
            return -1
        if not 0 <= seq_id < self.n_seq_max:
            raise ValueError(f"seq_id {seq_id} is out of range: this context has n_seq_max={self.n_seq_max}")
        return int(seq_id)

    @serialized
    def seq_pos_max(self, seq_id: int = 0) -> int:
        """Largest position stored for ``seq_id`` (-1 when empty)."""
        self._ptr()
        return int(self._lib.llama_memory_seq_pos_max(self._mem, self._check_seq(seq_id)))

    @serialized
    def seq_pos_min(self, seq_id: int = 0) -> int:
        self._ptr()
        return int(self._lib.llama_memory_seq_pos_min(self._mem, self._check_seq(seq_id)))

    def n_tokens(self, seq_id: int = 0) -> int:
        """Next position of ``seq_id`` (= tokens decoded so far, without gaps)."""
        return self.seq_pos_max(seq_id) + 1

    @serialized
    def clear(self, data: bool = True) -> None:
        """Empty the memory (``data``: also zero the buffers)."""
        self._ptr()
        self._lib.llama_memory_clear(self._mem, bool(data))
        self._forget_outputs()

    @serialized
    def seq_rm(self, seq_id: int = -1, p0: int = -1, p1: int = -1) -> bool:
        """Remove positions [p0, p1) of ``seq_id`` (-1: any sequence / open
        range). False if a partial removal is not possible."""
        self._ptr()
        return bool(self._lib.llama_memory_seq_rm(self._mem, self._check_seq(seq_id, allow_any=True),
                                                  int(p0), int(p1)))

    @serialized
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

    @serialized
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

    @serialized
    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        """Add ``delta`` to the positions in [p0, p1) of ``seq_id``."""
        self._ptr()
        seq_id = self._check_seq(seq_id)
        self._check_shift("seq_add")
        self._lib.llama_memory_seq_add(self._mem, seq_id, int(p0), int(p1), int(delta))

    @serialized
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
