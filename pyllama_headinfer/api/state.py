"""Saving and restoring a :class:`~.context.Context`'s state -- the whole
memory or one sequence's, as bytes or as a file (``llama_state_*``). A
mixin: :class:`StateIO` uses the context's ``_ptr()``, ``_ffi``, ``_lib``,
``_mem``, ``_lock``, ``model``, ``n_ctx``, ``_check_seq`` and
``_forget_outputs``. Every call holds the context's lock.

At this pin a state holds the memory (KV cache) only, not the logits: after
loading one, decode the next token to get logits (or save the state one
token early and decode the last prompt token after loading).

A failed load leaves the context (or the sequence) cleared, never half
restored; a state file is written to a temporary name beside the target and
renamed when complete, so a failed save (a full disk) leaves the target as
it was.
"""

from __future__ import annotations

import contextlib
import errno
import os
from typing import Sequence

from pyllama_headinfer.api.atomic_file import atomic_output_path
from pyllama_headinfer.api.handle import serialized
from pyllama_headinfer.errors import StateError
from pyllama_headinfer.runtime.log import checked_call


def _nonzero(n) -> bool:
    return int(n) != 0


class StateIO:
    """``save_state``/``load_state`` and their per-sequence and file variants."""

    # -- the calls, each checked the same way ------------------------------- #

    def _get_state(self, size: int, get, what: str) -> bytes:
        """``size`` bytes filled by ``get(buffer, size)`` (a llama_state_*_get_data call)."""
        buf = self._ffi.new("uint8_t[]", max(size, 1))
        n = int(get(buf, size))
        if n == 0 and size:
            raise StateError(f"{what} failed")
        return self._ffi.buffer(buf, n)[:]

    def _set_state(self, fn, *args, what: str, seq_id: int = -1) -> int:
        """A llama_state_*_set_data / _load_file call: StateError with llama.cpp's reason
        when it returns 0, and then the memory (``seq_id`` -1) or the sequence is
        emptied; the last decode's outputs are gone either way."""
        try:
            return int(checked_call(fn, *args, ok=_nonzero, error=lambda _, reason: StateError(f"{what}: {reason}")))
        except StateError:
            self._discard_failed_load(seq_id)
            raise
        finally:
            self._forget_outputs()

    def _discard_failed_load(self, seq_id: int) -> None:
        """After a failed load: empty the memory (seq_id -1) or the sequence.

        llama.cpp may stop reading a state part-way (a truncated file, a
        state from another model) with some cells already restored; what is
        left must not be mistaken for a valid cache, so the load ends as a
        cleared context (or sequence) would be.
        """
        if seq_id < 0:
            self._lib.llama_memory_clear(self._mem, True)
        else:
            self._lib.llama_memory_seq_rm(self._mem, seq_id, -1, -1)

    @staticmethod
    @contextlib.contextmanager
    def _state_file(path, what: str):
        """:func:`atomic_output_path`, with the file system's errors as :class:`StateError`."""
        try:
            with atomic_output_path(path) as tmp:
                yield tmp
        except OSError as exc:
            raise StateError(f"could not save {what} to {path}: {exc.strerror or exc}") from None

    def _tokens_arg(self, tokens: Sequence[int]):
        arr = self.model.check_tokens(tokens)
        return (self._ffi.from_buffer("llama_token[]", arr) if arr.size else self._ffi.NULL), len(arr)

    @staticmethod
    def _existing(path, what: str) -> bytes:
        path = os.fspath(path)
        if not os.path.exists(path):
            raise FileNotFoundError(errno.ENOENT, f"{what} not found", path)
        return os.fsencode(path)

    # -- the whole memory --------------------------------------------------- #

    @serialized
    def save_state(self) -> bytes:
        """The context's state (the KV cache contents; no logits) as bytes."""
        ptr, lib = self._ptr(), self._lib
        size = int(lib.llama_state_get_size(ptr))
        return self._get_state(size, lambda buf, n: lib.llama_state_get_data(ptr, buf, n), "llama_state_get_data")

    @serialized
    def load_state(self, data: bytes) -> None:
        """Restore a state from :meth:`save_state` (same model and context setup)."""
        ptr = self._ptr()
        data = bytes(data)
        if not data:
            raise StateError("empty state data")
        self._set_state(self._lib.llama_state_set_data, ptr, self._ffi.from_buffer("uint8_t[]", data), len(data),
                        what="llama.cpp rejected the state data")

    @serialized
    def save_state_file(self, path: str | os.PathLike, tokens: Sequence[int]) -> None:
        """Save the state and ``tokens`` (e.g. the prompt) to ``path``.

        Written to a temporary file beside ``path`` and renamed when complete:
        a failed save (full disk) leaves ``path`` as it was."""
        ptr = self._ptr()
        toks, n = self._tokens_arg(tokens)
        with self._state_file(path, "the state") as tmp:
            checked_call(self._lib.llama_state_save_file, ptr, os.fsencode(tmp), toks, n, ok=bool,
                         error=lambda _, reason: StateError(f"could not save the state to {path}: {reason}"))

    @serialized
    def load_state_file(self, path: str | os.PathLike) -> list[int]:
        """Restore a state saved by :meth:`save_state_file`; return its tokens."""
        ptr, ffi = self._ptr(), self._ffi
        name = self._existing(path, "state file")
        out, n_out = ffi.new("llama_token[]", max(self.n_ctx, 1)), ffi.new("size_t *")
        self._set_state(self._lib.llama_state_load_file, ptr, name, out, self.n_ctx, n_out,
                        what=f"could not load the state from {os.fspath(path)}")
        return list(out[0:int(n_out[0])])

    # -- one sequence ------------------------------------------------------- #

    @serialized
    def save_seq_state(self, seq_id: int = 0) -> bytes:
        ptr, lib = self._ptr(), self._lib
        seq_id = self._check_seq(seq_id)
        size = int(lib.llama_state_seq_get_size(ptr, seq_id))
        return self._get_state(size, lambda buf, n: lib.llama_state_seq_get_data(ptr, buf, n, seq_id),
                               "llama_state_seq_get_data")

    @serialized
    def load_seq_state(self, data: bytes, seq_id: int = 0) -> None:
        ptr = self._ptr()
        seq_id = self._check_seq(seq_id)
        data = bytes(data)
        if not data:
            raise StateError("empty state data")
        self._set_state(self._lib.llama_state_seq_set_data, ptr, self._ffi.from_buffer("uint8_t[]", data), len(data),
                        seq_id, what="llama.cpp rejected the sequence state", seq_id=seq_id)

    @serialized
    def save_seq_state_file(self, path: str | os.PathLike, seq_id: int = 0, tokens: Sequence[int] = ()) -> int:
        """Save sequence ``seq_id``'s state and ``tokens`` to ``path``
        (``llama_state_seq_save_file``); returns the bytes written."""
        ptr = self._ptr()
        seq_id = self._check_seq(seq_id)
        toks, n = self._tokens_arg(tokens)
        with self._state_file(path, f"sequence {seq_id}") as tmp:
            return int(checked_call(
                self._lib.llama_state_seq_save_file, ptr, os.fsencode(tmp), seq_id, toks, n, ok=_nonzero,
                error=lambda _, reason: StateError(f"could not save sequence {seq_id} to {path}: {reason}")))

    @serialized
    def load_seq_state_file(self, path: str | os.PathLike, seq_id: int = 0) -> list[int]:
        """Restore a sequence saved by :meth:`save_seq_state_file` into
        ``seq_id`` (replacing it); return its tokens."""
        ptr, ffi = self._ptr(), self._ffi
        seq_id = self._check_seq(seq_id)
        name = self._existing(path, "sequence state file")
        out, n_out = ffi.new("llama_token[]", max(self.n_ctx, 1)), ffi.new("size_t *")
        self._set_state(self._lib.llama_state_seq_load_file, ptr, name, seq_id, out, self.n_ctx, n_out,
                        what=f"could not load sequence state from {os.fspath(path)}", seq_id=seq_id)
        return list(out[0:int(n_out[0])])
