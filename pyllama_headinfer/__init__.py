"""pyllama-headinfer: HeadInfer for a pinned llama.cpp.

Each layer's KV heads are split between GPU and host memory. This package
carries the patch series (:mod:`.patches`), gets and verifies the pinned
llama.cpp source (:mod:`.source`), builds it and binds it with cffi.
Importing the package is cheap: submodules load on demand.
"""

from __future__ import annotations

from pyllama_headinfer.errors import BuildError, HeadInferError, PatchError, SourceError


def _version() -> str:
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover - Python < 3.8
        return "0.1.0"
    try:
        return version("pyllama-headinfer")
    except PackageNotFoundError:  # running from a checkout that is not installed
        return "0.1.0"


__version__ = _version()

__all__ = ["BuildError", "HeadInferError", "PatchError", "SourceError", "__version__"]
