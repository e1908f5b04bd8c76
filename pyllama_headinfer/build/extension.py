"""Compile the cffi extension module ``_pyllama_headinfer_cffi`` against the
patched llama.cpp tree.

Why cffi's API (out-of-line) mode and not ABI mode or ctypes
-----------------------------------------------------------
The patch series changes a public struct (``llama_context_params`` gains
``headinfer_gpu_heads_frac``) and adds new ones.  With ctypes or cffi's ABI
mode the Python side would restate every struct's layout by hand; one stale or
misordered field and every call passes garbage -- silent memory corruption,
and only for some fields, which is the worst kind of bug.  In API mode the
declarations in ``decl/*.h`` are compiled by a C compiler *together with the
real, patched llama.h*:

- structs are declared *partial* (``...;``): the compiler computes size,
  alignment and offsets, so layout drift is impossible by construction;
- every named field and every function prototype is checked against llama.h:
  a name that does not exist is a compile error, and :func:`type_checks`
  adds a ``_Static_assert`` per field, typedef and function so that a wrong
  *type* is a compile error too (not merely a warning);
- enum values come from the compiler (``...`` in the enums).

The price is a C compiler at build time -- which the build tool needs anyway
for llama.cpp itself.

The module carries a stamp (pin commit + patch-series hash, see
:func:`pyllama_headinfer.series.build_stamp`); :mod:`pyllama_headinfer.runtime.bindings` refuses to import a
module whose stamp differs from the checkout, i.e. a stale build.
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

from pyllama_headinfer.errors import BuildError
from pyllama_headinfer.runtime.bindings import MODULE_NAME
from pyllama_headinfer.series import build_stamp

DECL_DIR = Path(__file__).resolve().parent / "decl"
DECL_FILES = ("llama_decl.h", "pyllama_shim.h")

# The HeadInfer additions are referenced weakly so that an extension compiled
# against the patched header still *loads* with a libllama that does not have
# them yet (bindings then reports "no residency" instead of failing to import).
WEAK_FUNCTIONS = ("llama_memory_get_kv_buffers", "llama_memory_get_kv_layers")

SHIM_SOURCE = r"""
#include <stddef.h>
#include "llama.h"

{residency}

static const char PYLLAMA_STAMP[] = "{stamp}";

const char * pyllama_stamp(void) {{ return PYLLAMA_STAMP; }}

int pyllama_has_kv_residency(void) {{
    return {residency_check};
}}

size_t pyllama_sizeof_context_params(void) {{ return sizeof(struct llama_context_params); }}

/* ---- declaration checks generated from the cdef in decl/ ---- */
#define PYLLAMA_SAME_TYPE(a, b) __builtin_types_compatible_p(a, b)
{type_checks}
"""

# Turn the warnings that a mismatched declaration can produce into errors.
EXTRA_COMPILE_ARGS = [
    "-std=gnu11",
    "-Werror=incompatible-pointer-types",
    "-Werror=int-conversion",
    "-Werror=implicit-function-declaration",
    "-Werror=implicit-int",
    "-Wno-unused-function",
]


def cdef_source() -> str:
    """The cffi declarations, read from ``decl/``."""
    return "\n".join((DECL_DIR / name).read_text() for name in DECL_FILES)


def _c_string(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def type_checks(ffi) -> str:
    """``_Static_assert`` lines: each declared function, typedef and struct field
    has exactly the type the real header gives it."""
    from cffi import model

    lines = []
    decls = ffi._parser._declarations  # cffi's parsed cdef (stable since cffi 1.0)
    for key, (tp, _quals) in sorted(decls.items()):
        kind, _, name = key.partition(" ")
        if kind == "function":
            if isinstance(tp, model.FunctionPtrType) and not name.startswith(("pyllama_", "_pyllama_")):
                ctype = tp.get_c_name("")
                lines.append(
                    f'_Static_assert(PYLLAMA_SAME_TYPE(__typeof__(&{name}), {ctype}), '
                    f'"decl/llama_decl.h: {name} is not declared as in llama.h ({_c_string(ctype)})");'
                )
        elif kind == "typedef":
            if isinstance(tp, (model.PrimitiveType, model.PointerType)):
                ctype = tp.get_c_name("")
                lines.append(
                    f'_Static_assert(PYLLAMA_SAME_TYPE({name}, {ctype}), '
                    f'"decl/llama_decl.h: typedef {name} is not {_c_string(ctype)} in llama.h");'
                )
        elif kind == "struct" and isinstance(tp, model.StructType) and tp.fldnames is not None:
            for fname, ftype in zip(tp.fldnames, tp.fldtypes):
                ctype = ftype.get_c_name("")
                lines.append(
                    f"_Static_assert(PYLLAMA_SAME_TYPE(__typeof__(((struct {name} *)0)->{fname}), {ctype}), "
                    f'"decl/llama_decl.h: field {name}.{fname} is not {_c_string(ctype)} in llama.h");'
                )
    return "\n".join(lines)


def make_ffibuilder(include_dirs, lib_dir: Path, stamp: str, cdef: str | None = None):
    """The configured :class:`cffi.FFI` builder (not compiled yet).
    ``cdef``: declarations to use instead of ``decl/`` (tests)."""
    import cffi

    ffibuilder = cffi.FFI()
    ffibuilder.cdef(cdef_source() if cdef is None else cdef)
    residency = "\n".join(f"#pragma weak {name}" for name in WEAK_FUNCTIONS)
    residency_check = " && ".join(f"(&{name} != NULL)" for name in WEAK_FUNCTIONS)
    source = SHIM_SOURCE.format(
        residency=residency,
        residency_check=residency_check,
        stamp=_c_string(stamp),
        type_checks=type_checks(ffibuilder),
    )
    lib_dir = Path(lib_dir).resolve()
    ffibuilder.set_source(
        MODULE_NAME,
        source,
        include_dirs=[str(Path(d).resolve()) for d in include_dirs],
        library_dirs=[str(lib_dir)],
        libraries=["llama", "ggml", "ggml-base"],
        extra_compile_args=EXTRA_COMPILE_ARGS,
        extra_link_args=[f"-Wl,-rpath,{lib_dir}"],
    )
    return ffibuilder


def include_dirs_of(source_tree: Path) -> list[Path]:
    source_tree = Path(source_tree)
    dirs = [source_tree / "include", source_tree / "ggml" / "include"]
    for d in dirs:
        if not d.is_dir():
            raise BuildError(f"{d} does not exist: {source_tree} is not a llama.cpp source tree")
    return dirs


def extension_dir(build_dir: Path) -> Path:
    """Where :func:`compile_extension` puts the module inside a build dir."""
    return Path(build_dir) / "python"


def extension_filename() -> str:
    return MODULE_NAME + (sysconfig.get_config_var("EXT_SUFFIX") or ".so")


def compile_extension(build_dir: Path, source_tree: Path, lib_dir: Path, *, stamp: str | None = None,
                      verbose: bool = False, cdef: str | None = None) -> Path:
    """Compile the extension for the libraries in ``lib_dir`` against the
    (patched) headers of ``source_tree``; return the module's path
    (``<build_dir>/python/_pyllama_headinfer_cffi<EXT_SUFFIX>``).

    Raises :class:`~pyllama_headinfer.errors.BuildError` with the compiler's
    message when a declaration in ``decl/`` does not match llama.h.
    """
    build_dir = Path(build_dir).resolve()
    lib_dir = Path(lib_dir).resolve()
    if not any(lib_dir.glob("libllama.*")):
        raise BuildError(f"no libllama in {lib_dir}")
    stamp = build_stamp() if stamp is None else stamp
    ffibuilder = make_ffibuilder(include_dirs_of(source_tree), lib_dir, stamp, cdef)

    out_dir = extension_dir(build_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / extension_filename()
    with tempfile.TemporaryDirectory(prefix="cffi-", dir=out_dir) as tmp:
        try:
            built = ffibuilder.compile(tmpdir=tmp, target=extension_filename(), verbose=verbose)
        except Exception as exc:  # distutils/setuptools CompileError, LinkError, ...
            raise BuildError(
                f"compiling the cffi extension against {source_tree} failed: {exc}\n"
                "A declaration in pyllama_headinfer/build/decl/ does not match llama.h, or no C compiler "
                "is available (see the compiler output above)."
            ) from exc
        # Replace atomically so a running interpreter that has the old module
        # mapped keeps a valid file.
        staged = out_dir / (extension_filename() + ".new")
        shutil.copy2(built, staged)
        os.replace(staged, target)
    return target


def main(argv: list[str] | None = None) -> int:
    """``python -m pyllama_headinfer.build.extension BUILD_DIR SOURCE_TREE LIB_DIR`` (for development)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3:
        print(main.__doc__, file=sys.stderr)
        return 2
    print(compile_extension(Path(args[0]), Path(args[1]), Path(args[2]), verbose=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
