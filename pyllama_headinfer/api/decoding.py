"""Decoding on a :class:`~.context.Context`: filling the ``llama_batch``,
``decode`` (one sequence, in chunks of ``n_batch``) and ``decode_batch``
(several sequences in one call), the logits they leave, sampling and
``generate``/``complete``. A mixin: :class:`Decoding` uses the context's
``_ptr()``, ``_ffi``, ``_lib``, ``_batch``, ``model``, the sizes
(``n_ctx``, ``n_ctx_seq``, ``n_batch``, ``n_vocab``) and ``_check_seq`` /
``n_tokens`` / ``seq_rm`` of :class:`~.sequences.Sequences`. Every call holds
the context's lock; a ``generate`` generator holds it until it ends.

The logits :meth:`logits` and the samplers read are llama.cpp's output
buffer of the last decode, or -- after a state load that carried them
(:mod:`.state`) -- the rows that state held, kept here in Python (llama.cpp's
state at this pin holds no logits; they cannot go back into its buffer)."""

from __future__ import annotations

import logging
from typing import Iterator, Sequence

import numpy as np

from pyllama_headinfer.api.handle import serialized
from pyllama_headinfer.api.sampler import Sampler
from pyllama_headinfer.api.shared_prefix import generate_shared
from pyllama_headinfer.errors import ContextOverflowError, DecodeError
from pyllama_headinfer.params import check_count
from pyllama_headinfer.runtime.log import checked_call

logger = logging.getLogger("pyllama_headinfer.llama")

DECODE_RESULTS = {1: "no KV cache slot for the batch (context full)", 2: "aborted", -1: "invalid input batch"}

# why logits() has nothing, when nothing more specific is known (a load says more: see .state)
NO_LOGITS = "decode tokens with logits='last' or 'all' first"


class Decoding:
    """What the last decode left in llama.cpp's output buffer, and how to read it."""

    _out_mode = None  # None | "last" | "all" | "none" | "batch"
    _out_n = 0  # tokens in the last llama_decode call
    _all_logits: np.ndarray | None = None  # "all" over several batches
    _out_rows: frozenset = frozenset()  # batch indices with logits after decode_batch()
    _held_logits: dict | None = None  # batch index -> row, restored from a state (not in llama.cpp's buffer)
    _no_logits_why = NO_LOGITS  # the end of logits()'s error while there are none

    def _forget_outputs(self, why: str = NO_LOGITS) -> None:
        """The outputs of the last decode are gone (cleared memory, a loaded state, a failed decode);
        ``why``: what :meth:`logits` says about it until the next decode."""
        self._out_mode, self._out_n, self._all_logits, self._held_logits = None, 0, None, None
        self._no_logits_why = why

    # -- the outputs as a state carries them (see .state) -------------------- #

    def _outputs_for_state(self):
        """``(mode, n, indices, rows)``: every row :meth:`logits` can return now, with its batch
        index (``rows[j]`` is ``logits(indices[j])``), or None without logits."""
        mode, n = self._out_mode, self._out_n
        if mode in (None, "none"):
            return None
        if self._held_logits is not None:
            indices = sorted(self._held_logits)
            return mode, n, indices, np.stack([self._held_logits[i] for i in indices])
        if self._all_logits is not None:  # logits="all" over several batches: indexed over the whole decode
            return "all", len(self._all_logits), list(range(len(self._all_logits))), self._all_logits
        indices = {"last": [n - 1], "all": list(range(n)), "batch": sorted(self._out_rows)}[mode]
        return mode, n, indices, np.stack([self.logits(i) for i in indices])

    def _restore_outputs(self, mode: str, n: int, indices, rows: np.ndarray) -> None:
        """Make ``rows`` (as :meth:`_outputs_for_state` gave them) the last decode's logits."""
        rows = np.array(rows, dtype=np.float32)
        rows.flags.writeable = False
        self._out_mode, self._out_n, self._all_logits = mode, int(n), None
        self._out_rows = frozenset(int(i) for i in indices) if mode == "batch" else frozenset()
        self._held_logits = {int(i): rows[j] for j, i in enumerate(indices)}

    # -- the batch ---------------------------------------------------------- #

    def _describe_n_ctx(self) -> str:
        """n_ctx for messages, with why it is not what was asked for."""
        text = f"n_ctx={self.n_ctx}"
        if self.n_ctx != self.n_ctx_requested and self.n_ctx_requested:
            text += f": llama.cpp rounds the requested {self.n_ctx_requested} up to a multiple of its padding"
        if self.n_ctx_seq != self.n_ctx:
            text += f"; {self.n_ctx_seq} per sequence"
        return text

    def _overflow(self, n: int, pos0: int, seq_id: int | None = None) -> ContextOverflowError:
        of = "" if seq_id is None else f" of sequence {seq_id}"
        return ContextOverflowError(f"{n} tokens at position {pos0}{of} do not fit into the context "
                                    f"({self._describe_n_ctx()})")

    def _fill_batch(self, tokens: np.ndarray, pos: np.ndarray, seq_ids: Sequence[int], logits: np.ndarray) -> None:
        """Write ``len(tokens)`` entries into the context's ``llama_batch``."""
        ffi, batch, m = self._ffi, self._batch, len(tokens)
        np.frombuffer(ffi.buffer(batch.token, m * 4), dtype=np.int32)[:] = tokens
        np.frombuffer(ffi.buffer(batch.pos, m * 4), dtype=np.int32)[:] = pos
        np.frombuffer(ffi.buffer(batch.n_seq_id, m * 4), dtype=np.int32)[:] = 1
        np.frombuffer(ffi.buffer(batch.logits, m), dtype=np.int8)[:] = logits
        for i, seq_id in enumerate(seq_ids):
            batch.seq_id[i][0] = seq_id
        batch.n_tokens = m

    def _run_batch(self, ptr, start: int) -> None:
        """``llama_decode`` of the filled batch; :class:`DecodeError` with llama.cpp's reason."""
        def error(rc, reason):
            what = DECODE_RESULTS.get(rc, "llama.cpp error")
            return DecodeError(f"llama_decode returned {rc} ({what}) for the batch at token {start}: {reason}", rc)

        try:
            checked_call(lambda: int(self._lib.llama_decode(ptr, self._batch)), ok=lambda rc: rc == 0, error=error)
        except DecodeError:
            self._forget_outputs()
            raise

    # -- decoding ----------------------------------------------------------- #

    @serialized
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
            raise self._overflow(n, pos0)
        self._forget_outputs()
        collect = logits == "all" and n > self.n_batch
        if collect:
            self._all_logits = np.empty((n, self.n_vocab), dtype=np.float32)
        for start in range(0, n, self.n_batch):
            m = min(self.n_batch, n - start)
            want = np.full(m, 1 if logits == "all" else 0, dtype=np.int8)
            if logits == "last" and start + m == n:
                want[m - 1] = 1
            self._fill_batch(arr[start:start + m], np.arange(pos0 + start, pos0 + start + m, dtype=np.int32),
                             [seq_id] * m, want)
            self._run_batch(ptr, start)
            if collect:
                src = self._lib.llama_get_logits(ptr)
                self._all_logits[start:start + m] = np.frombuffer(
                    self._ffi.buffer(src, m * self.n_vocab * 4), dtype=np.float32).reshape(m, self.n_vocab)
            self._out_n = m
        self._out_mode = logits

    @serialized
    def synchronize(self) -> None:
        """Wait until the device has finished the work of the last decode
        (llama.cpp may return from ``llama_decode`` before; for timing)."""
        self._lib.llama_synchronize(self._ptr())

    @serialized
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
        tokens, pos, seq_ids, rows = [], [], [], {}
        for seq_id, toks in items:
            seq_id = self._check_seq(seq_id)
            if seq_id in rows:
                raise ValueError(f"sequence {seq_id} appears twice in the batch")
            arr = self.model.check_tokens(toks)
            if len(arr) == 0:
                raise ValueError(f"decode_batch(): no tokens for sequence {seq_id}")
            pos0 = self.n_tokens(seq_id)
            if pos0 + len(arr) > self.n_ctx_seq:
                raise self._overflow(len(arr), pos0, seq_id)
            tokens.append(arr)
            pos.append(np.arange(pos0, pos0 + len(arr), dtype=np.int32))
            seq_ids += [seq_id] * len(arr)
            rows[seq_id] = len(seq_ids) - 1
        total = len(seq_ids)
        if total > self.n_batch:
            raise ValueError(f"decode_batch(): {total} tokens do not fit into one batch (n_batch={self.n_batch})")
        self._forget_outputs()
        want = np.zeros(total, dtype=np.int8)
        want[list(rows.values())] = 1
        self._fill_batch(np.concatenate(tokens), np.concatenate(pos), seq_ids, want)
        self._run_batch(ptr, 0)
        self._out_n = total
        self._out_rows = frozenset(rows.values())
        self._out_mode = "batch"
        return rows

    # -- logits and sampling ------------------------------------------------ #

    def _output_index(self, i: int) -> int:
        """Batch index ``i`` of the last decode (-1 = last) as a row index >= 0; ValueError
        without logits, IndexError for an index without them."""
        mode = self._out_mode
        if mode is None or mode == "none":
            raise ValueError(f"no logits available: {self._no_logits_why}")
        if mode == "last" and i not in (-1, self._out_n - 1):
            raise IndexError(f"only the last token has logits (decode with logits='all' for more); got index {i}")
        if mode == "all" and not -self._out_n <= i < self._out_n:
            raise IndexError(f"logits index {i} out of range for the last batch of {self._out_n} tokens")
        if mode == "batch" and i not in self._out_rows:
            raise IndexError(f"no logits for batch index {i}: the last decode_batch() computed logits for "
                             f"indices {sorted(self._out_rows)}")
        return i + self._out_n if i < 0 else i

    def _held_row(self, i: int) -> np.ndarray | None:
        """The logits of batch index ``i`` when a loaded state brought them (read-only), else None:
        they are in llama.cpp's output buffer (:meth:`_logits_ptr`)."""
        self._ptr()
        if self._held_logits is None:
            return None
        return self._held_logits[self._output_index(i)]

    def _logits_ptr(self, i: int):
        """Pointer to llama.cpp's logits for batch index ``i`` of the last
        decode (checked: llama.cpp aborts on some invalid indices)."""
        ptr = self._ptr()
        self._output_index(i)
        return checked_call(self._lib.llama_get_logits_ith, ptr, int(i), ok=lambda p: p != self._ffi.NULL,
                            error=lambda _, reason: IndexError(f"no logits for index {i}: {reason}"))

    @serialized
    def logits(self, i: int = -1, copy: bool = True) -> np.ndarray:
        """Logits (float32, ``n_vocab``) of token ``i`` of the last :meth:`decode`
        (-1 = last).

        Default: a copy.  ``copy=False`` returns a zero-copy view into
        llama.cpp's output buffer, which the next decode/state load overwrites
        and ``close()`` frees -- read it right away, keep the context open.
        After a ``logits="all"`` decode longer than ``n_batch`` the logits were
        collected into a Python array and are always returned as copies of it.
        After a state load they are the logits the context had when the state
        was saved (:meth:`save_state`), bit for bit; ``copy=False`` gives a
        read-only view of them.
        """
        if self._all_logits is not None:
            self._ptr()
            n = len(self._all_logits)
            if not -n <= i < n:
                raise IndexError(f"logits index {i} out of range for the last decode of {n} tokens")
            return self._all_logits[i].copy()
        row = self._held_row(i)
        if row is not None:
            return row.copy() if copy else row
        p = self._logits_ptr(i)
        view = np.frombuffer(self._ffi.buffer(p, self.n_vocab * 4), dtype=np.float32)
        return view.copy() if copy else view

    @serialized
    def sample(self, sampler: Sampler, i: int = -1) -> int:
        return sampler.sample(self, i)

    def generate(self, prompt_tokens: Sequence[int], max_tokens: int, sampler: Sampler | None = None, *,
                 seq_id: int = 0, reset: bool = True, stop_at_eog: bool = True) -> Iterator[int]:
        """Yield up to ``max_tokens`` tokens following ``prompt_tokens`` in ``seq_id``.

        ``reset``: clear the sequence first (default); False appends to it.
        Stops at an end-of-generation token (yielded) unless ``stop_at_eog`` is
        False, and when the context is full.  ``sampler`` defaults to greedy.
        """
        max_tokens = check_count("max_tokens", max_tokens, 0)
        seq_id = self._check_seq(seq_id)
        prompt = self.model.check_tokens(prompt_tokens)
        if len(prompt) == 0:
            raise ValueError("generate() needs a non-empty prompt")
        own = sampler is None
        sampler = Sampler.greedy() if own else sampler
        self._lock.acquire()  # held until the generator ends (see Context, "Threads")
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
            self._lock.release()
            if own:
                sampler.close()

    @serialized
    def complete(self, text: str, max_tokens: int = 64, sampler: Sampler | None = None,
                 add_special: bool = True) -> str:
        """Generate a continuation of ``text`` and return it as a string."""
        prompt = self.model.tokenize(text, add_special=add_special)
        out = [t for t in self.generate(prompt, max_tokens, sampler) if not self.model.is_eog(t)]
        return self.model.detokenize(out)

    def chat(self, messages, max_tokens: int = 256, sampler: Sampler | None = None,
             template: str | None = None) -> str:
        """The assistant's reply to ``messages`` (a chat, formatted by
        :meth:`Model.apply_chat_template`; the context's sequence 0 is reset)."""
        prompt = self.model.apply_chat_template(messages, add_generation_prompt=True, template=template)
        tokens = self.model.tokenize(prompt, add_special=True, parse_special=True)
        out = [t for t in self.generate(tokens, max_tokens, sampler) if not self.model.is_eog(t)]
        return self.model.detokenize(out)

    @serialized
    def generate_shared(self, prompt_tokens: Sequence[int], n: int, max_tokens: int,
                        samplers: Sequence[Sampler] | None = None, *, stop_at_eog: bool = True) -> list[list[int]]:
        """``n`` continuations of one prompt, decoded together.

        The prompt is evaluated once, in sequence 0; sequences 1..n-1 share
        its KV cells (``seq_cp`` -- no copy in a unified cache), and every
        step decodes the next token of all unfinished sequences in one batch,
        so each step's attention reads the shared prefix once for all of them
        (with HeadInfer: one upload of the host heads per step, not n).

        Needs ``n_seq_max >= n`` and ``kv_unified=True``; ``samplers``: one
        per sequence (default: greedy for all -- then every continuation is
        the same, which makes the result easy to check against one sequence).
        Returns the n token lists; clears sequences 0..n-1 first.
        """
        return generate_shared(self, prompt_tokens, n, max_tokens, samplers, stop_at_eog=stop_at_eog)
