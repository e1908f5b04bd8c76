"""The exceptions of pyllama-headinfer.

Every failure we can foresee (a wrong source tree, a patch that does not apply,
a failed build, a bad model) is a subclass of HeadInferError. The CLI prints
these as one-paragraph messages; anything else is a bug and keeps its traceback.
"""


class HeadInferError(Exception):
    """Base class of every expected failure."""


class SourceError(HeadInferError):
    """The pinned llama.cpp source could not be found, fetched or verified."""


class PatchError(HeadInferError):
    """The patch series does not apply, or a tree is in an unexpected state."""


class BuildError(HeadInferError):
    """Configuring or compiling llama.cpp failed."""
