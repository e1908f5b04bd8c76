"""Loading the compiled cffi module ``_pyllama_headinfer_cffi``.

The module is compiled in cffi's API mode against the patched llama.h, so
struct layouts come from the C compiler and every declaration is checked
against the header (see :mod:`pyllama_headinfer._cffi_build` for why).

The module is built by ``python -m pyllama_headinfer build`` (which calls
:func:`pyllama_headinfer._cffi_build.compile_extension`) into the build
directory, next to the llama.cpp libraries it links against (by rpath).  It is
found through the build manifest: ``$PYLLAMA_HEADINFER_BUILD_DIR`` if set,
else the default build dir of :mod:`pyllama_headinfer.build`.

:func:`load` refuses a module that does not belong to this checkout:

- its stamp (pin commit + patch-series hash, compiled in) must equal the
  current one -- otherwise the patches changed since the build;
- ``llama_context_default_params()`` must look right through the compiled
  struct layout (catches a libllama rebuilt from different headers than the
  ones the module was compiled against).

Both raise :class:`StaleBuildError` telling the user to rebuild.

llama.cpp's log output goes to the Python logger ``pyllama_headinfer.llama``
(levels mapped: DEBUG, INFO, WARNING, ERROR), never straight to stderr; the
logger has a ``NullHandler``, so nothing is printed unless the application
configures logging.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

from pyllama_headinfer.build import extension as _cffi_build
from pyllama_headinfer.errors import BuildError

ENV_BUILD_DIR = "PYLLAMA_HEADINFER_BUILD_DIR"

logger = logging.getLogger("pyllama_headinfer.llama")
logger.addHandler(logging.NullHandler())

REBUILD_HINT = "run `python -m pyllama_headinfer build`"


class NotBuiltError(BuildError):
    """No build (manifest or compiled extension) was found."""


class StaleBuildError(BuildError):
    """The build does not match this checkout (pin, patch series or headers)."""


_lock = threading.Lock()
_loaded = None  # (ffi, lib)
_loaded_from: Path | None = None


# --------------------------------------------------------------------------- #
# finding the build
# --------------------------------------------------------------------------- #

def build_dir() -> Path | None:
    """``$PYLLAMA_HEADINFER_BUILD_DIR`` if set, else None (the build module's default search)."""
    env = os.environ.get(ENV_BUILD_DIR)
    return Path(env).expanduser() if env else None


def load_manifest() -> tuple[Path, dict]:
    """(build dir, manifest) of the build in use; :class:`NotBuiltError` when there is none."""
    from pyllama_headinfer.build import build

    bdir = build_dir()
    where = str(bdir) if bdir else "the default build directories"
    try:
        manifest = build.load_manifest(bdir)
    except NotBuiltError:
        raise
    except (BuildError, OSError, ValueError) as exc:
        raise NotBuiltError(f"no usable llama.cpp build in {where}: {exc} -- {REBUILD_HINT} "
                            f"(or set {ENV_BUILD_DIR} to a build directory)") from exc
    return Path(manifest.get("build_dir") or bdir), manifest


def extension_path(bdir: Path, manifest: dict) -> Path:
    """The compiled module named by the manifest (key ``bindings``)."""
    value = manifest.get("bindings")
    if not value:
        raise NotBuiltError(f"the build in {bdir} has no Python bindings (built with --no-bindings, or "
                            f"compiling them failed); {REBUILD_HINT}")
    p = Path(value)
    return p if p.is_absolute() else bdir / p


# --------------------------------------------------------------------------- #
# logging
# --------------------------------------------------------------------------- #

_LEVELS = {}  # filled in _install_logging: ggml level -> logging level


class _LogRouter:
    """Joins llama.cpp's partial log messages (GGML_LOG_LEVEL_CONT, text
    without a newline) into lines and hands them to ``logger``."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pending = ""
        self._level = logging.INFO
        self._captures: list[list[tuple[int, str]]] = []

    def feed(self, level: int, text: str) -> None:
        with self._lock:
            if level != _CONT_LEVEL:
                if self._pending:  # a new message: flush the unterminated one
                    self._emit(self._level, self._pending)
                    self._pending = ""
                self._level = _LEVELS.get(level, logging.INFO)
            self._pending += text
            if "\n" in self._pending:
                *lines, self._pending = self._pending.split("\n")
                for line in lines:
                    self._emit(self._level, line)

    def _emit(self, level: int, line: str) -> None:
        line = line.rstrip()
        if not line:
            return
        for cap in self._captures:
            cap.append((level, line))
        if logger.isEnabledFor(level):
            logger.log(level, "%s", line)

    def flush(self) -> None:
        with self._lock:
            if self._pending:
                self._emit(self._level, self._pending)
                self._pending = ""

    @contextmanager
    def capture(self):
        """Collect the (level, line) pairs logged inside the block."""
        cap: list[tuple[int, str]] = []
        with self._lock:
            self._captures.append(cap)
        try:
            yield cap
        finally:
            self.flush()
            with self._lock:
                # by identity: nested captures can hold equal lists, and list.remove() compares by value
                self._captures = [c for c in self._captures if c is not cap]


_router = _LogRouter()
_CONT_LEVEL = 5  # replaced by lib.GGML_LOG_LEVEL_CONT once loaded


@contextmanager
def capture_log():
    """``with capture_log() as lines:`` -- the llama.cpp log lines (level,
    text) emitted inside the block, e.g. to put into an exception message."""
    with _router.capture() as cap:
        yield cap


def _install_logging(ffi, lib) -> None:
    global _CONT_LEVEL
    _LEVELS.update({
        int(lib.GGML_LOG_LEVEL_NONE): logging.INFO,
        int(lib.GGML_LOG_LEVEL_DEBUG): logging.DEBUG,
        int(lib.GGML_LOG_LEVEL_INFO): logging.INFO,
        int(lib.GGML_LOG_LEVEL_WARN): logging.WARNING,
        int(lib.GGML_LOG_LEVEL_ERROR): logging.ERROR,
    })
    _CONT_LEVEL = int(lib.GGML_LOG_LEVEL_CONT)

    @ffi.def_extern(name="_pyllama_log_callback")
    def _log_callback(level, text, user_data):  # noqa: ARG001 - C signature
        try:
            _router.feed(int(level), ffi.string(text).decode("utf-8", "replace"))
        except Exception:  # never let an exception cross into C
            pass

    lib.llama_log_set(lib._pyllama_log_callback, ffi.NULL)


# --------------------------------------------------------------------------- #
# loading
# --------------------------------------------------------------------------- #

def _check_sanitizer_runtime(manifest: dict) -> None:
    """A sanitizer build aborts the interpreter when its runtime was not
    loaded first (ASan insists on coming first in the library list); say so
    instead of dying."""
    sanitizer = manifest.get("sanitize")
    if not sanitizer:
        return
    import ctypes

    if not hasattr(ctypes.CDLL(None), "__asan_init" if sanitizer == "address" else "__tsan_init"):
        preload = " ".join(manifest.get("sanitizer_preload") or []) or "the sanitizer runtime"
        raise BuildError(
            f"the build in {manifest.get('build_dir')} was made with --sanitize {sanitizer}: run Python with "
            f"LD_PRELOAD={preload} (see docs/SANITIZERS.md), or select another build with "
            f"${ENV_BUILD_DIR}")


def _preload_libstdcxx() -> None:
    """Make the C++ runtime's symbols global before libllama is loaded.

    A C++ program has libstdc++ in its global symbol scope, so libllama's
    references to libstdc++ templates resolve there. Python is a C program:
    the extension's dependencies are searched in load order instead, and a
    CUDA build's libggml-cuda.so exports its own instantiations of some of
    them (e.g. ``std::ostream::_M_insert<long>``), which libllama then calls
    -- and crashes in (seen on an H200 with CUDA 13: SIGSEGV in
    ``llama_model::print_info`` while loading any model; gone with
    libstdc++ preloaded). Loading libstdc++ with RTLD_GLOBAL first gives
    Python the symbol order of a C++ program.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("stdc++") or "libstdc++.so.6"
    try:
        ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
    except OSError:  # not a GNU toolchain (e.g. libc++): nothing to preload
        pass


def _import_extension(path: Path):
    name = _cffi_build.MODULE_NAME
    if name in sys.modules:
        mod = sys.modules[name]
        if Path(getattr(mod, "__file__", "")).resolve() != path.resolve():
            raise BuildError(f"{name} is already loaded from {mod.__file__}; cannot also load {path} "
                             "in the same process")
        return mod
    if sys.platform.startswith("linux"):
        _preload_libstdcxx()
    spec = importlib.util.spec_from_file_location(name, str(path))
    if spec is None or spec.loader is None:
        raise NotBuiltError(f"cannot load the extension module {path}; {REBUILD_HINT}")
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
    except ImportError as exc:  # e.g. a symbol missing from a libllama rebuilt differently
        raise StaleBuildError(f"the extension module {path} does not load ({exc}); the llama.cpp libraries "
                              f"changed since it was compiled -- {REBUILD_HINT}") from exc
    sys.modules[name] = mod
    return mod


def check_stamp(ffi, lib, path: Path | str = "the extension module") -> str:
    built = ffi.string(lib.pyllama_stamp()).decode()
    current = _cffi_build.current_stamp()
    if built != current:
        raise StaleBuildError(
            f"stale build: {path} was compiled for {built!r}, but this checkout is {current!r} "
            f"(pin commit + patch-series hash); {REBUILD_HINT}"
        )
    return built


def check_abi(ffi, lib) -> None:
    """The default context params, read through the compiled layout, must be
    llama.cpp's documented defaults; a libllama built from other headers shows
    up here as shifted fields."""
    p = lib.llama_context_default_params()
    ok = (int(p.type_k) == int(lib.GGML_TYPE_F16) and int(p.type_v) == int(lib.GGML_TYPE_F16)
          and p.headinfer_gpu_heads_frac == 1.0)
    if not ok:
        raise StaleBuildError(
            "libllama does not match the headers the extension was compiled against "
            f"(llama_context_default_params(): type_k={p.type_k}, type_v={p.type_v}, "
            f"headinfer_gpu_heads_frac={p.headinfer_gpu_heads_frac}; expected f16, f16, 1.0) -- "
            f"the libraries were rebuilt from a different llama.h; {REBUILD_HINT}"
        )


def load():
    """``(ffi, lib)`` of the checked extension module; loads it on first use."""
    global _loaded, _loaded_from
    if _loaded is not None:
        return _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        bdir, manifest = load_manifest()
        _check_sanitizer_runtime(manifest)
        path = extension_path(bdir, manifest)
        if not path.is_file():
            raise NotBuiltError(f"the cffi extension {path} is missing (incomplete build); {REBUILD_HINT}")
        mod = _import_extension(path)
        ffi, lib = mod.ffi, mod.lib
        check_stamp(ffi, lib, path)
        check_abi(ffi, lib)
        _install_logging(ffi, lib)
        lib.llama_backend_init()
        _loaded = (ffi, lib)
        _loaded_from = path
        return _loaded


def loaded_from() -> Path | None:
    return _loaded_from


def has_kv_residency() -> bool:
    """True when libllama exports ``llama_kv_residency_buffers``/``_layers``."""
    _, lib = load()
    return bool(lib.pyllama_has_kv_residency())


def system_info() -> str:
    ffi, lib = load()
    return ffi.string(lib.llama_print_system_info()).decode()
