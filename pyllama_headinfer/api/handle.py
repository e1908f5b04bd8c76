""":class:`Handle`: the lifetime every API object over a llama.cpp pointer
shares -- ``close()`` frees it now, ``with`` closes it at the end of the
block, ``ffi.gc`` frees it when the object is collected (a safety net), and
any use after ``close()`` raises :class:`ClosedError`."""

from __future__ import annotations

import functools

from pyllama_headinfer.errors import ClosedError


def serialized(method):
    """Run ``method`` holding the object's ``_lock`` (see :class:`~.context.Context`, "Threads")."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return locked


class Handle:
    """Base of :class:`Model`, :class:`Context` and :class:`Sampler`.

    A subclass sets ``_handle`` to an ``ffi.gc`` pointer (and ``_ffi``) once
    llama.cpp has created the object, names itself in ``_kind`` ("model",
    ...) for the ClosedError message, and extends :meth:`_close_dependents`
    to free what must go before the pointer (a model's contexts, a context's
    batch)."""

    _kind = "object"
    _handle = None
    _ffi = None

    def _ptr(self):
        """The live pointer; :class:`ClosedError` once closed."""
        if self._handle is None:
            raise ClosedError(f"the {self._kind} is closed")
        return self._handle

    @property
    def closed(self) -> bool:
        return self._handle is None

    def _close_dependents(self) -> None:
        """Free what depends on the pointer; called by :meth:`close` before it is freed."""

    def close(self) -> None:
        """Free the llama.cpp object now (idempotent)."""
        if self._handle is None:
            return
        self._close_dependents()
        handle, self._handle = self._handle, None
        self._ffi.release(handle)  # runs the destructor ffi.gc was given, now

    def __enter__(self):
        self._ptr()
        return self

    def __exit__(self, *exc) -> None:
        self.close()
