"""The exceptions the Python API raises (all :class:`HeadInferError`
subclasses), and :func:`_log_tail`, which quotes llama.cpp's captured log as
the reason in their messages."""

from __future__ import annotations

import logging

from pyllama_headinfer.errors import HeadInferError

try:  # the shared errors module may grow these; use its classes when it does
    from pyllama_headinfer.errors import ModelError
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


def _log_tail(lines, n: int = 3) -> str:
    errs = [t for lvl, t in lines if lvl >= logging.WARNING]
    picked = (errs or [t for _, t in lines])[-n:]
    return "; ".join(picked)
