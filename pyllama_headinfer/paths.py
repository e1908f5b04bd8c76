"""Where things live: the cache, the source checkout, the patch series.

Nothing here creates directories, except :func:`writable_cache_dir`: every
writer of the cache (the source fetch, the build's record of the applied
series, calibrations) takes its directory from it, so an unusable cache --
read-only, a file, no permission -- is one :class:`CacheError` naming the
directory and ``$PYLLAMA_HEADINFER_CACHE`` (exit 1), wherever it is first
written, and never before: commands that only read the cache (``generate``,
``plan``) keep working with a read-only one.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Optional

from pyllama_headinfer import pin
from pyllama_headinfer.errors import CacheError

PACKAGE_DIR = Path(__file__).resolve().parent

CACHE_ENV = "PYLLAMA_HEADINFER_CACHE"
PATCHES_ENV = "PYLLAMA_HEADINFER_PATCHES"


def cache_dir() -> Path:
    """Root of everything we download or generate outside the project.

    ``$PYLLAMA_HEADINFER_CACHE``, else ``$XDG_CACHE_HOME/pyllama-headinfer``,
    else ``~/.cache/pyllama-headinfer``. Read at every call so tests (and
    users) can redirect it with the environment.
    """
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit).expanduser().resolve()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return (base / "pyllama-headinfer").resolve()


def writable_cache_dir(*parts: str) -> Path:
    """``cache_dir()/<parts>``, created (with its parents) and shown to be writable (a file is made
    in it and removed), for a caller about to write there; else a :class:`CacheError` that names
    the cache directory and the variable choosing it."""
    directory = cache_dir().joinpath(*parts)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _cache_error(exc, exc.filename or directory) from exc
    try:
        handle, probe = tempfile.mkstemp(dir=directory, prefix=".write-test-")
        os.close(handle)
        os.unlink(probe)
    except OSError as exc:
        raise _cache_error(exc, directory) from exc
    return directory


def _cache_error(exc: OSError, where) -> CacheError:
    root = cache_dir()
    reason = "it is not a directory" if root.exists() and not root.is_dir() else f"{exc.strerror or exc}: {where}"
    chosen = f"from ${CACHE_ENV}" if os.environ.get(CACHE_ENV) else f"the default; ${CACHE_ENV} chooses another"
    return CacheError(f"cannot write to the cache directory {root} ({chosen}): {reason}; "
                      f"set {CACHE_ENV} to a writable directory")


def project_root() -> Optional[Path]:
    """The source checkout this package runs from, or None for a wheel install.

    A checkout is recognised by a ``pyproject.toml`` naming this project next
    to the package directory (``patches/`` may be absent: git does not keep an
    empty directory). In a wheel the package sits in site-packages, which has
    no such file.
    """
    candidate = PACKAGE_DIR.parent
    pyproject = candidate / "pyproject.toml"
    if not pyproject.is_file():
        return None
    try:
        text = pyproject.read_text(encoding="utf-8")
    except OSError:
        return None
    return candidate if 'name = "pyllama-headinfer"' in text else None


def patches_root() -> Path:
    """The directory of every series: ``<build>/`` per pin (``series`` and the
    patch files) and ``llama-cpp-python/`` for the Python layer.

    The checkout's ``patches/``, else the copy a wheel carries as
    ``pyllama_headinfer/_patches`` (pyproject force-includes it).
    """
    root = project_root()
    if root is not None:
        return root / "patches"
    return PACKAGE_DIR / "_patches"


def patches_dir(chosen: Optional[pin.Pin] = None) -> Path:
    """The directory holding a pin's ``series`` and patch files: ``$PYLLAMA_HEADINFER_PATCHES``
    when set (for maintainers trying a series elsewhere), else ``<patches_root()>/<pin build>``
    for ``chosen`` (default: the active pin). The path may not exist: an absent directory
    means an empty series."""
    explicit = os.environ.get(PATCHES_ENV)
    if explicit:
        return Path(explicit).expanduser().resolve()
    return patches_root() / (chosen or pin.active()).build


PYTHON_SERIES = "llama-cpp-python"


def python_patches_dir() -> Path:
    """The second series, for the Python layer of the llama-cpp-python sdist
    (``build --llama-cpp-python``): ``<patches_root()>/llama-cpp-python``."""
    return patches_root() / PYTHON_SERIES


def build_root() -> Path:
    """Where build directories live: ``<checkout>/build`` in a source
    checkout, else ``<cache>/build``. The build tool creates them here and the
    runtime looks for a finished one here."""
    root = project_root()
    return (root / "build") if root is not None else cache_dir() / "build"
