"""Every exception pyllama-headinfer raises on purpose, in one hierarchy.

Every failure we can foresee is a subclass of :class:`HeadInferError`; the
command line (:mod:`pyllama_headinfer.cli.main`) turns them into one-line
``error: ...`` messages and an exit status (see :data:`EXIT_CODES`);
anything else is a bug and keeps its traceback.

``HeadInferError``
  ``SourceError``       the pinned llama.cpp source: fetching, verifying
  ``CacheError``        the cache directory (``$PYLLAMA_HEADINFER_CACHE``) cannot be created or written
  ``PatchError``        the patch series: applying, reverting, a tree's state
  ``BuildError``        configuring or compiling llama.cpp
    ``BuildInterrupted``  Ctrl-C during a build
    ``NotBuiltError``     no usable build (manifest or extension) was found
    ``StaleBuildError``   the build does not match this checkout
  ``ModelError``        a file is not a loadable GGUF model
  ``ClosedError``       use of a closed Model/Context/Sampler (also a RuntimeError)
  ``ContextError``      llama.cpp could not create a context, or refused an operation
    ``ChatTemplateError``   no usable chat template, or messages it cannot format (also a ValueError)
  ``DecodeError``       ``llama_decode`` failed (``code``: its return value)
  ``StateError``        saving or restoring a context state failed
  ``ServeError``        ``serve``: llama-server could not be started (or died while starting)
  ``PlanError``         a VRAM plan that cannot be made (also a ValueError)
    ``UnsupportedModelError``  an architecture the planner does not know
    ``BudgetTooSmallError``    a budget below the offloaded weights
    ``NothingFitsError``       no head fraction fits the budget
  ``UsageError``        bad input from the caller (also a ValueError):
    ``TokenError``            a token id outside ``[0, n_vocab)``
    ``ContextOverflowError``  tokens that do not fit into the context

``HeadInferWarning`` (a ``UserWarning``, not an exception) says that a
HeadInfer request could not be honoured (a fraction < 1 that splits no layer).

The API also raises the built-in ``ValueError``/``TypeError`` for bad
arguments and ``FileNotFoundError``/``IsADirectoryError`` for missing paths,
as Python code is expected to.
"""

# Exit codes of every command (README, "Exit codes").
EXIT_OK = 0
EXIT_FAILURE = 1  # the operation failed (a HeadInferError that is not a UsageError)
EXIT_USAGE = 2  # bad usage or input: argparse's errors, UsageError, a plain ValueError, missing files
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT), as shells report it


class HeadInferError(Exception):
    """Base class of every expected failure."""


class SourceError(HeadInferError):
    """The pinned llama.cpp source could not be found, fetched or verified."""


class CacheError(HeadInferError):
    """The cache directory (``$PYLLAMA_HEADINFER_CACHE``, see :func:`paths.cache_dir`) cannot be
    created or written: read-only, not a directory, no permission. Raised by
    :func:`paths.writable_cache_dir`, where a command first writes into it."""


class PatchError(HeadInferError):
    """The patch series does not apply, or a tree is in an unexpected state."""


class BuildError(HeadInferError):
    """Configuring or compiling llama.cpp failed."""


class BuildInterrupted(BuildError):
    """Ctrl-C during a build; the next run resumes where ninja stopped."""


class NotBuiltError(BuildError):
    """No build (manifest or compiled extension) was found."""


class StaleBuildError(BuildError):
    """The build does not match this checkout (pin, patch series or headers)."""


class ModelError(HeadInferError):
    """A model file is not a loadable GGUF model."""


class ClosedError(HeadInferError, RuntimeError):
    """The object was closed (or its model was); it cannot be used any more."""


class ContextError(HeadInferError):
    """llama.cpp could not create the context, or an operation on it failed."""


class ChatTemplateError(ContextError, ValueError):
    """No usable chat template, or messages it cannot format."""


class DecodeError(HeadInferError):
    """``llama_decode`` failed; ``code`` is its return value."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


class StateError(HeadInferError):
    """Saving or restoring a context state failed."""


class ServeError(HeadInferError):
    """``serve``: the server could not be started (or died while starting)."""


class UsageError(HeadInferError, ValueError):
    """The caller's input is wrong (not the operation): exit status 2 at the CLI."""


class TokenError(UsageError):
    """A token id is outside ``[0, n_vocab)``."""


class ContextOverflowError(UsageError):
    """The tokens do not fit into the context (``n_ctx``)."""


class PlanError(HeadInferError, ValueError):
    """The plan cannot be made, or nothing fits the budget."""


class UnsupportedModelError(PlanError):
    """The model's architecture (or layout) is not one plan knows."""


class BudgetTooSmallError(PlanError):
    """The budget is smaller than the offloaded weights alone."""


class NothingFitsError(PlanError):
    """No head fraction fits the budget."""


class HeadInferWarning(UserWarning):
    """A HeadInfer request that llama.cpp could not honour (e.g. a fraction < 1
    that splits no layer); shown by Python's default warning filter."""
