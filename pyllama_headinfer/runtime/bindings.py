"""Loading the compiled cffi module ``_pyllama_headinfer_cffi``.

The module is compiled in cffi's API mode against the patched llama.h, so
struct layouts come from the C compiler and every declaration is checked
against the header (see :mod:`pyllama_headinfer.build.extension` for why).

``python -m pyllama_headinfer build`` compiles it into the build directory,
next to the llama.cpp libraries it links against (by rpath), and names it in
the build's manifest; :func:`load` finds it through
:func:`pyllama_headinfer.runtime.manifest.find_manifest` (and logs which build
and why, one INFO line) and refuses a module that does not belong to this
checkout:

- its stamp (pin commit + patch-series hash, compiled in) must equal the
  one this checkout's series gives (:func:`pyllama_headinfer.series.build_stamp`)
  -- otherwise the patches changed since the build;
- ``llama_context_default_params()`` must look right through the compiled
  struct layout (catches a libllama rebuilt from different headers than the
  ones the module was compiled against).

Both raise :class:`StaleBuildError` telling the user to rebuild. Loading
imports nothing of the build tool and runs no subprocess.

A build with ``GGML_BACKEND_DL`` (``build --portable``) links no backend into
libggml: :func:`load_backends` loads them from the build's ``bin/``
(``ggml_backend_load_all_from_path``: the best CPU variant for this CPU, and
the CUDA/RPC modules when built) before anything else, and raises
:class:`NotBuiltError` when no CPU backend could be loaded -- llama.cpp
itself would search only the Python executable's directory and the current
one, and then fail to load any model.

llama.cpp's log output goes to the Python logger ``pyllama_headinfer.llama``
(see :mod:`.log`).
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Optional

from pyllama_headinfer import pin
from pyllama_headinfer.errors import NotBuiltError, StaleBuildError
from pyllama_headinfer.runtime.log import router
from pyllama_headinfer.runtime.manifest import BUILD_DIR_ENV, Manifest, announce, find_manifest, rebuild_hint
from pyllama_headinfer.series import build_stamp

MODULE_NAME = "_pyllama_headinfer_cffi"

_lock = threading.Lock()
_loaded = None  # (ffi, lib)


def extension_path(manifest: Manifest) -> Path:
    """The compiled module the manifest names; :class:`NotBuiltError` when it has none."""
    if manifest.bindings is None:
        raise NotBuiltError(f"the build in {manifest.build_dir} has no Python bindings (built with --no-bindings, "
                            f"or compiling them failed); {rebuild_hint()}")
    return manifest.bindings


def check_sanitizer_runtime(manifest: Manifest) -> None:
    """A sanitizer build aborts the interpreter when its runtime was not
    loaded first (ASan insists on coming first in the library list); say so
    instead of dying."""
    if not manifest.sanitize:
        return
    if not hasattr(ctypes.CDLL(None), "__asan_init" if manifest.sanitize == "address" else "__tsan_init"):
        preload = " ".join(manifest.sanitizer_preload) or "the sanitizer runtime"
        raise NotBuiltError(
            f"the build in {manifest.build_dir} was made with --sanitize {manifest.sanitize}: run Python with "
            f"LD_PRELOAD={preload} (see docs/SANITIZERS.md), or select another build with ${BUILD_DIR_ENV}")


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

    By its soname, which GNU's C++ runtime has kept since GCC 3.4: the
    dynamic loader finds it where libllama would. (Not through
    ``ctypes.util.find_library``, which runs ``ldconfig -p``: loading a model
    starts no process.)
    """
    try:
        ctypes.CDLL("libstdc++.so.6", mode=ctypes.RTLD_GLOBAL)
    except OSError:  # not a GNU toolchain (e.g. libc++): nothing to preload
        pass


def _import_extension(path: Path):
    if MODULE_NAME in sys.modules:
        mod = sys.modules[MODULE_NAME]
        if Path(getattr(mod, "__file__", "")).resolve() != path.resolve():
            raise NotBuiltError(f"{MODULE_NAME} is already loaded from {mod.__file__}; cannot also load {path} "
                                "in the same process")
        return mod
    if sys.platform.startswith("linux"):
        _preload_libstdcxx()
    spec = importlib.util.spec_from_file_location(MODULE_NAME, str(path))
    if spec is None or spec.loader is None:
        raise NotBuiltError(f"cannot load the extension module {path}; {rebuild_hint()}")
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
    except ImportError as exc:  # e.g. a symbol missing from a libllama rebuilt differently
        raise StaleBuildError(f"the extension module {path} does not load ({exc}); the llama.cpp libraries "
                              f"changed since it was compiled -- {rebuild_hint()}") from exc
    sys.modules[MODULE_NAME] = mod
    return mod


def check_stamp(ffi, lib, path: Path | str = "the extension module", pin_build: Optional[str] = None) -> str:
    """The module's stamp; :class:`StaleBuildError` unless it is this checkout's for the build's pin
    (``pin_build``, as its manifest records it; default: the active pin)."""
    built = ffi.string(lib.pyllama_stamp()).decode()
    current = build_stamp(pin.PINS.get(pin_build) if pin_build else None)
    if built != current:
        raise StaleBuildError(
            f"stale build: {path} was compiled for {built!r}, but this checkout is {current!r} "
            f"(pin commit + patch-series hash); {rebuild_hint()}"
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
            f"the libraries were rebuilt from a different llama.h; {rebuild_hint()}"
        )


def _install_logging(ffi, lib) -> None:
    router.set_levels({
        int(lib.GGML_LOG_LEVEL_NONE): logging.INFO,
        int(lib.GGML_LOG_LEVEL_DEBUG): logging.DEBUG,
        int(lib.GGML_LOG_LEVEL_INFO): logging.INFO,
        int(lib.GGML_LOG_LEVEL_WARN): logging.WARNING,
        int(lib.GGML_LOG_LEVEL_ERROR): logging.ERROR,
    }, int(lib.GGML_LOG_LEVEL_CONT))

    @ffi.def_extern(name="_pyllama_log_callback")
    def _log_callback(level, text, user_data):  # noqa: ARG001 - C signature
        try:
            router.feed(int(level), ffi.string(text).decode("utf-8", "replace"))
        except Exception:  # never let an exception cross into C
            pass

    lib.llama_log_set(lib._pyllama_log_callback, ffi.NULL)


def load_backends(ffi, lib, manifest: Manifest) -> None:
    """Loads the backend modules of a ``GGML_BACKEND_DL`` build from its lib dir
    (nothing to do for a build with its backends linked in); :class:`NotBuiltError`
    when that leaves no CPU device."""
    if not manifest.backend_dl and int(lib.ggml_backend_reg_count()) > 0:
        return  # backends linked into libggml registered themselves
    lib_dir = manifest.lib_dir
    lib.ggml_backend_load_all_from_path(os.fsencode(lib_dir))
    if lib.ggml_backend_dev_by_type(lib.GGML_BACKEND_DEVICE_TYPE_CPU) != ffi.NULL:
        return
    try:
        candidates = sorted(p.name for p in lib_dir.glob("*ggml-cpu*") if p.is_file())
    except OSError:
        candidates = []
    found = (f"none of {', '.join(candidates)} could be loaded or supports this CPU" if candidates
             else "there is no libggml-cpu*.so (CPU backend module) there")
    raise NotBuiltError(f"no CPU backend could be loaded from {lib_dir}: {found}; the build in "
                        f"{manifest.build_dir} is incomplete -- {rebuild_hint()} again")


def load():
    """``(ffi, lib)`` of the checked extension module; loads it on first use."""
    global _loaded
    if _loaded is not None:
        return _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        manifest = find_manifest()
        check_sanitizer_runtime(manifest)
        path = extension_path(manifest)
        if not path.is_file():
            raise NotBuiltError(f"the cffi extension {path} is missing (incomplete build); {rebuild_hint()}")
        mod = _import_extension(path)
        ffi, lib = mod.ffi, mod.lib
        check_stamp(ffi, lib, path, manifest.pin_build)
        check_abi(ffi, lib)
        _install_logging(ffi, lib)
        load_backends(ffi, lib, manifest)  # before llama_backend_init, which would search elsewhere
        lib.llama_backend_init()
        _loaded = (ffi, lib)
        announce(manifest)  # which build, and why: it changes when another build finishes
        return _loaded


def has_kv_residency() -> bool:
    """True when libllama exports ``llama_memory_get_kv_buffers``/``_layers``."""
    _, lib = load()
    return bool(lib.pyllama_has_kv_residency())
