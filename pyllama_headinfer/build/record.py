"""``<build_dir>/manifest.json``: what a finished build records.

``build`` writes it last (:func:`manifest_record` assembles it; a failed
build leaves none); the runtime reads it back with
:func:`pyllama_headinfer.runtime.manifest.find_manifest`. Its fields are
described in docs/BUILD.md (``cpu_kernels``: :mod:`.cpu_kernels`).
:func:`write_json` (atomic) serves the build directory's other JSON file (the
configure state) too.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import List, Mapping, Optional

from pyllama_headinfer import pin
from pyllama_headinfer.build import cpu_kernels, toolchain
from pyllama_headinfer.build.plan import TOOL_TARGETS, BuildPlan, cmake_truthy
from pyllama_headinfer.runtime.manifest import MANIFEST_FORMAT


def write_json(path: Path, data: dict) -> None:
    """Write ``data`` to ``path`` atomically (a temporary file renamed over it)."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=False)
        f.write("\n")
    os.replace(tmp, path)


# --------------------------------------------------------------------------
# writing: what a build records


def sanitizer_preload(cc: Optional[str], sanitize: Optional[str]) -> List[str]:
    """The runtime to LD_PRELOAD when loading a sanitized libllama into Python."""
    if not sanitize or not cc:
        return []
    lib = {"address": "libasan.so", "thread": "libtsan.so"}[sanitize]
    try:
        out = subprocess.run([cc, f"-print-file-name={lib}"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    path = out.stdout.strip()
    return [os.path.realpath(path)] if os.path.isabs(path) and os.path.exists(path) else []


# always linked into libllama's process; in a GGML_BACKEND_DL build every other ggml* library
# is a backend module that ggml loads at run time (ggml_backend_load_all_from_path)
LINKED_LIBRARIES = ("llama", "ggml", "ggml-base")


def split_modules(libs: Mapping[str, str], backend_dl: bool):
    """(linked libraries, backend modules), target -> relative path."""
    if not backend_dl:
        return dict(libs), {}
    return ({n: p for n, p in libs.items() if n in LINKED_LIBRARIES},
            {n: p for n, p in libs.items() if n not in LINKED_LIBRARIES})


def manifest_record(plan: BuildPlan, source_tree: Path, series_hash: str, cmake: toolchain.Tool, ninja: toolchain.Tool,
              configure_argv: List[str], targets: Mapping[str, str], libs: Mapping[str, str],
              seconds: float, up_to_date: bool, steps: int) -> dict:
    d = plan.build_dir
    compilers = toolchain.compilers_used(d, cmake.version)
    cc = (compilers.get("c") or {}).get("path")
    backend_dl = cpu_kernels.backend_dl(d)
    linked, modules = split_modules(libs, backend_dl)
    modules_abs = {name: str(d / rel) for name, rel in modules.items()}
    return {
        "format": MANIFEST_FORMAT,
        "pin": {"build": pin.active().build, "commit": pin.active().ident},
        "series_hash": series_hash,
        "config_key": plan.key,
        "backend": plan.backend,
        "cuda_architectures": plan.cuda_arch,
        "sanitize": plan.sanitize,
        "sanitizer_preload": sanitizer_preload(cc, plan.sanitize),
        "build_type": plan.build_type,
        "cmake_options": dict(plan.options),
        "cmake_configure": configure_argv,
        "compilers": compilers,
        "build_tools": {
            "cmake": cmake.as_dict(),
            "ninja": ninja.as_dict(),
            "ccache": toolchain.find_ccache() if cmake_truthy(plan.options.get("GGML_CCACHE", "ON")) else None,
        },
        "source_tree": str(source_tree),
        "include_dirs": [str(source_tree / "include"), str(source_tree / "ggml" / "include")],
        "build_dir": str(d),
        "lib_dir": str(d / "bin"),
        "libraries": {name: str(d / rel) for name, rel in linked.items()},
        "backend_dl": backend_dl,
        "backend_modules": modules_abs,
        "cpu_kernels": cpu_kernels.cpu_kernels(d, cc, modules_abs),
        "executables": {name: str(d / targets[name]) for name in TOOL_TARGETS
                        if plan.tools and name in targets and (d / targets[name]).exists()},
        "bindings": None,
        "host": {"system": platform.system(), "machine": platform.machine(), "python": sys.version.split()[0]},
        "built_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "duration_s": round(seconds, 2),
        "up_to_date": up_to_date,
        "steps": steps,
    }
