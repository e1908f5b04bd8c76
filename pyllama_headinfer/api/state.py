"""Saving and restoring a :class:`~.context.Context`'s state -- the whole
memory or one sequence's, as bytes or as a file (``llama_state_*``). A
mixin: :class:`StateIO` uses the context's ``_ptr()``, ``_ffi``, ``_lib``,
``_mem``, ``model``, ``n_ctx``, ``_check_seq`` and the outputs of
:mod:`.decoding` (``_forget_outputs``, ``_outputs_for_state``,
``_restore_outputs``). Every call holds the context's lock.

The logits. At this pin llama.cpp's state is the memory (KV cache) only:
upstream stopped writing the output buffer (output ids, logits, embeddings)
into it (llama.cpp PR 18862, session file version 10), so a loaded state
alone would leave no logits. :meth:`StateIO.save_state` and
:meth:`StateIO.save_state_file` therefore append a *logits block* when the
context has logits: every row :meth:`~.decoding.Decoding.logits` can return
then, with its batch index, and the pin of the llama.cpp that wrote it.
After a load, ``logits()`` and the samplers give exactly those logits (in
a fresh context too, at any ``headinfer_gpu_heads_frac``), so sampling and
generation continue as they would have in the saving context. The block
follows llama.cpp's data: ``llama_state_set_data`` reads its part and
ignores what follows, so the bytes still load with llama.cpp's own call
(not with llama-cpp-python's ``Llama.load_state``, which requires the
whole buffer read); a *file* with the block is refused by llama.cpp's
``llama_state_load_file`` (it must read the whole file): ``logits=False``
saves llama.cpp's file exactly, for llama.cpp's tools. A state without
the block (saved after ``decode(..., logits="none")``, with
``logits=False``, or by llama.cpp itself) loads as before and leaves no
logits: ``logits()`` says so and which call continues.

Per-sequence states (``*_seq_state*``) are llama.cpp's format exactly, also
read by llama-server's slot restore, and carry no logits (a context's
outputs belong to its last batch, not to one sequence): after such a load
``logits()`` raises a ValueError naming the call that continues (decode the
sequence's next token; or ``seq_rm`` its last position and decode its last
token again).

A failed load leaves the context (or the sequence) cleared, never half
restored; a state file is written to a temporary name beside the target and
renamed when complete, so a failed save (a full disk) leaves the target as
it was.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import struct
from typing import Sequence

import numpy as np

from pyllama_headinfer.api.atomic_file import atomic_output_path
from pyllama_headinfer.api.handle import serialized
from pyllama_headinfer.errors import StateError
from pyllama_headinfer.runtime.log import checked_call


def _nonzero(n) -> bool:
    return int(n) != 0


# --------------------------------------------------------------------------- #
# the logits block (module docstring)
#
#   indices   int32 x k          batch indices of the rows
#   rows      float32 x k x n_vocab
#   ident     n_ident bytes      the writing llama.cpp's pin (commit, or tree:<id>), UTF-8
#   footer    _FOOTER            version, mode, n (tokens of the last batch), n_vocab, k, n_ident, magic
#
# all little-endian, after llama.cpp's data; found by the magic at the very end.
# --------------------------------------------------------------------------- #

_MAGIC = b"PYHI-LGT"
_FOOTER = struct.Struct("<IIIIII8s")
_VERSION = 1
_MODES = ("last", "all", "batch")
SESSION_MAGIC = 0x6767736E  # llama.h's LLAMA_SESSION_MAGIC ('ggsn'), the first word of a state file
_SESSION_HEADER = struct.Struct("<III")  # a state file's start: SESSION_MAGIC, its version, its token count

# what logits() says after a load that brought none
NO_LOGITS_IN_STATE = ("the loaded state holds none (it was saved when the context had none, e.g. after "
                      "decode(..., logits='none'), with logits=False, or by llama.cpp itself, whose state is the "
                      "KV cache only): decode the next token; to continue from the state's last token, "
                      "seq_rm(seq_id, n - 1) and decode that token again")
NO_LOGITS_IN_SEQ_STATE = ("a sequence's state holds its KV cells only, not logits (llama.cpp's per-sequence "
                          "state): decode the sequence's next token; to continue from its last token, "
                          "seq_rm(seq_id, n - 1) and decode(tokens[-1:], seq_id=seq_id) with the sequence's tokens "
                          "(load_seq_state_file returns them)")


def _pack_outputs(outputs, n_vocab: int, ident: str) -> bytes:
    mode, n, indices, rows = outputs
    ident_b = ident.encode()
    rows = np.ascontiguousarray(rows, dtype="<f4")
    assert rows.shape == (len(indices), n_vocab)
    return b"".join((np.asarray(indices, dtype="<i4").tobytes(), rows.tobytes(), ident_b,
                     _FOOTER.pack(_VERSION, _MODES.index(mode), n, n_vocab, len(indices), len(ident_b), _MAGIC)))


def _block_length(footer: bytes) -> int | None:
    """The length of the logits block ending with ``footer`` (its last ``_FOOTER.size`` bytes),
    None when they are not a footer."""
    if len(footer) != _FOOTER.size or footer[-len(_MAGIC):] != _MAGIC:
        return None
    _, _, _, n_vocab, k, n_ident, _ = _FOOTER.unpack(footer)
    return 4 * k + 4 * k * n_vocab + n_ident + _FOOTER.size


def _unpack_outputs(block, n_vocab: int):
    """``(outputs, ident)`` of a whole block; StateError when it is not one this context can use."""
    version, mode_i, n, block_vocab, k, n_ident, _ = _FOOTER.unpack(block[-_FOOTER.size:])
    if version != _VERSION or mode_i >= len(_MODES):
        raise StateError(f"the state's logits block is of another version ({version}) or unknown (mode {mode_i})")
    if block_vocab != n_vocab:
        raise StateError(f"the state's logits are for {block_vocab} tokens; this model has {n_vocab}")
    mode = _MODES[mode_i]
    indices = np.frombuffer(block, dtype="<i4", count=k).tolist()
    rows = np.frombuffer(block, dtype="<f4", count=k * n_vocab, offset=4 * k).reshape(k, n_vocab)
    ident = bytes(block[4 * k + 4 * k * n_vocab:len(block) - _FOOTER.size]).decode(errors="replace")
    expected = {"last": [n - 1], "all": list(range(n))}.get(mode)
    if k < 1 or (expected is not None and indices != expected) \
            or (mode == "batch" and (len(set(indices)) != k or not all(0 <= i < n for i in indices))):
        raise StateError(f"the state's logits block is damaged ({mode} logits, {k} rows of a batch of {n})")
    return (mode, n, indices, rows), ident


class StateIO:
    """``save_state``/``load_state`` and their per-sequence and file variants."""

    # -- the calls, each checked the same way ------------------------------- #

    def _get_state(self, size: int, get, what: str, tail: bytes = b"") -> bytes:
        """``size`` bytes filled by ``get(buffer, size)`` (a llama_state_*_get_data call), then ``tail``."""
        buf = self._ffi.new("uint8_t[]", max(size, 1) + len(tail))
        n = int(get(buf, size))
        if n == 0 and size:
            raise StateError(f"{what} failed")
        self._ffi.buffer(buf, n + len(tail))[n:] = tail
        return self._ffi.buffer(buf, n + len(tail))[:]

    def _set_state(self, fn, *args, what: str, seq_id: int = -1, size: int | None = None, outputs=None,
                   no_logits: str = NO_LOGITS_IN_STATE) -> int:
        """A llama_state_*_set_data / _load_file call: StateError with llama.cpp's reason
        when it returns 0 (or, given ``size``, reads another number of bytes), and then the
        memory (``seq_id`` -1) or the sequence is emptied. The last decode's outputs are gone
        either way; after a load, ``outputs`` (from a logits block) take their place, or
        ``logits()`` says ``no_logits``."""
        self._forget_outputs(no_logits)
        try:
            n = int(checked_call(fn, *args, ok=_nonzero, error=lambda _, reason: StateError(f"{what}: {reason}")))
            if size is not None and n != size:
                raise StateError(f"{what}: llama.cpp read {n} of its {size} bytes (not one whole state)")
        except StateError:
            self._discard_failed_load(seq_id)
            raise
        if outputs is not None:
            self._restore_outputs(*outputs)
        return n

    def _refuse_load(self, message: str, seq_id: int = -1):
        """A load refused before llama.cpp read anything: cleared like a failed one (``_set_state``)."""
        self._forget_outputs()
        self._discard_failed_load(seq_id)
        raise StateError(message)

    def _llama_ident(self) -> str:
        """The pin of the llama.cpp in use (the first part of the bindings' stamp)."""
        return self._ffi.string(self._lib.pyllama_stamp()).decode().split("+", 1)[0]

    def _logits_block(self, logits: bool) -> bytes:
        """The logits block of the context's outputs now; empty without (or with ``logits`` False)."""
        outputs = self._outputs_for_state() if logits else None
        return b"" if outputs is None else _pack_outputs(outputs, self.n_vocab, self._llama_ident())

    def _split_block(self, data):
        """``(length of llama.cpp's part, outputs or None)`` of state bytes; refused when the block is damaged."""
        length = _block_length(bytes(data[-_FOOTER.size:]))
        if length is None:
            return len(data), None
        if length > len(data):
            self._refuse_load(f"the state's logits block claims {length} bytes of {len(data)}")
        try:
            outputs, _ = _unpack_outputs(data[len(data) - length:], self.n_vocab)
        except StateError as exc:
            self._refuse_load(str(exc))
        return len(data) - length, outputs

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
    def save_state(self, *, logits: bool = True) -> bytes:
        """The context's state as bytes: llama.cpp's (the KV cache contents), then
        the logits block when the context has logits (module docstring);
        ``logits=False``: llama.cpp's bytes only."""
        ptr, lib = self._ptr(), self._lib
        size = int(lib.llama_state_get_size(ptr))
        return self._get_state(size, lambda buf, n: lib.llama_state_get_data(ptr, buf, n), "llama_state_get_data",
                               self._logits_block(logits))

    @serialized
    def load_state(self, data: bytes) -> None:
        """Restore a state from :meth:`save_state` (same model and context setup;
        any ``headinfer_gpu_heads_frac``): its KV cache, and its logits when it
        has them -- :meth:`logits` then gives what it gave when the state was saved."""
        ptr = self._ptr()
        data = bytes(data)
        if not data:
            raise StateError("empty state data")
        size, outputs = self._split_block(data)
        with self._ffi.from_buffer("uint8_t[]", data) as buf:
            self._set_state(self._lib.llama_state_set_data, ptr, buf, size, size=size, outputs=outputs,
                            what="llama.cpp rejected the state data")

    @serialized
    def save_state_file(self, path: str | os.PathLike, tokens: Sequence[int], *, logits: bool = True) -> None:
        """Save the state and ``tokens`` (e.g. the prompt) to ``path``: llama.cpp's
        state file, then the logits block when the context has logits (module
        docstring; ``logits=False``: the file llama.cpp's tools read).

        Written to a temporary file beside ``path`` and renamed when complete:
        a failed save (full disk) leaves ``path`` as it was."""
        ptr = self._ptr()
        toks, n = self._tokens_arg(tokens)
        block = self._logits_block(logits)
        with self._state_file(path, "the state") as tmp:
            checked_call(self._lib.llama_state_save_file, ptr, os.fsencode(tmp), toks, n, ok=bool,
                         error=lambda _, reason: StateError(f"could not save the state to {path}: {reason}"))
            if block:
                with open(tmp, "ab") as f:
                    f.write(block)

    @serialized
    def load_state_file(self, path: str | os.PathLike) -> list[int]:
        """Restore a state saved by :meth:`save_state_file` (or llama.cpp's
        ``llama_state_save_file``); return its tokens. Its logits, when it has
        them, as :meth:`load_state`."""
        ptr, ffi = self._ptr(), self._ffi
        name = self._existing(path, "state file")
        what = f"could not load the state from {os.fspath(path)}"
        with open(name, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(size - _FOOTER.size, 0))
            length = _block_length(f.read())
            if length is not None:
                return self._load_file_with_block(f, size, length, what)
        out, n_out = ffi.new("llama_token[]", max(self.n_ctx, 1)), ffi.new("size_t *")
        self._set_state(self._lib.llama_state_load_file, ptr, name, out, self.n_ctx, n_out, what=what)
        return list(out[0:int(n_out[0])])

    def _load_file_with_block(self, f, size: int, length: int, what: str) -> list[int]:
        """A state file with a logits block: llama.cpp's ``llama_state_load_file`` would refuse the
        block, so this reads the file's header (magic, version, tokens) itself and gives llama.cpp
        the state part (mapped, not copied). The header's version is not checked here -- a file of
        another llama.cpp is refused by the pin the block names instead."""
        if size < length + _SESSION_HEADER.size:
            self._refuse_load(f"{what}: the logits block claims {length} of its {size} bytes")
        f.seek(size - length)
        try:
            outputs, ident = _unpack_outputs(f.read(length), self.n_vocab)
        except StateError as exc:
            self._refuse_load(f"{what}: {exc}")
        if ident != self._llama_ident():
            self._refuse_load(f"{what}: saved by llama.cpp {ident}, this is {self._llama_ident()} (a state "
                              f"file is read by the llama.cpp that wrote it)")
        f.seek(0)
        magic, _version, n_tokens = _SESSION_HEADER.unpack(f.read(_SESSION_HEADER.size))
        start, end = _SESSION_HEADER.size + 4 * n_tokens, size - length
        if magic != SESSION_MAGIC:
            self._refuse_load(f"{what}: not a state file (magic {magic:08x})")
        if n_tokens > self.n_ctx or start >= end:
            self._refuse_load(f"{what}: {n_tokens} tokens do not fit (n_ctx {self.n_ctx}, file of {size} bytes)")
        tokens = np.frombuffer(f.read(4 * n_tokens), dtype="<i4").tolist()
        with mmap.mmap(f.fileno(), end, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)[start:end]
            try:
                with self._ffi.from_buffer("uint8_t[]", view) as buf:
                    self._set_state(self._lib.llama_state_set_data, self._ptr(), buf, end - start, size=end - start,
                                    outputs=outputs, what=what)
            finally:
                view.release()
        return tokens

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
                        seq_id, what="llama.cpp rejected the sequence state", seq_id=seq_id,
                        no_logits=NO_LOGITS_IN_SEQ_STATE)

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
                        what=f"could not load sequence state from {os.fspath(path)}", seq_id=seq_id,
                        no_logits=NO_LOGITS_IN_SEQ_STATE)
        return list(out[0:int(n_out[0])])
