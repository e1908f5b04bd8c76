"""``<build_dir>/manifest.json``: what a finished build records, and finding it again.

``build`` writes it last (:func:`_manifest` assembles it; a failed build
leaves none); the bindings read it through :func:`load_manifest`, which also
chooses the build when no directory is given and checks that it is complete
(and, when asked, made from this checkout's pin and patch series). Its fields
are described in docs/BUILD.md. :func:`_read_json` and :func:`_write_json`
(atomic) serve the build directory's other JSON file (the configure state) too.
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

from pyllama_headinfer.build import toolchain as tc
from pyllama_headinfer import pin
from pyllama_headinfer.build.plan import TOOL_TARGETS, BuildPlan, build_root, cmake_truthy, plan_build
from pyllama_headinfer.errors import BuildError, HeadInferError

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = 2
BUILD_DIR_ENV = "PYLLAMA_HEADINFER_BUILD_DIR"


# --------------------------------------------------------------------------
# JSON files of a build directory


def _read_json(path: Path) -> Optional[dict]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=False)
        f.write("\n")
    os.replace(tmp, path)


# --------------------------------------------------------------------------
# reading: the manifest of a finished build


def _checked_manifest(build_dir: Path) -> dict:
    path = Path(build_dir) / MANIFEST_NAME
    data = _read_json(path)
    if data is None:
        raise BuildError(
            f"No llama.cpp build in {build_dir} (no readable {MANIFEST_NAME}). "
            "Run `python -m pyllama_headinfer build` first."
        )
    if data.get("format") != MANIFEST_FORMAT:
        raise BuildError(f"{path} has format {data.get('format')!r}, expected {MANIFEST_FORMAT}: run build again.")
    missing = [p for p in data.get("libraries", {}).values() if not Path(p).exists()]
    if missing or "llama" not in data.get("libraries", {}):
        raise BuildError(f"The build in {build_dir} is incomplete (missing {', '.join(missing) or 'libllama'}); "
                         "run `python -m pyllama_headinfer build` again.")
    return data


def load_manifest(build_dir: Optional[os.PathLike] = None, *, require_current: bool = False) -> dict:
    """The manifest of a finished build (see docs/BUILD.md for its fields).

    ``build_dir`` None: ``$PYLLAMA_HEADINFER_BUILD_DIR``, else the directory a
    plain ``build`` would use on this machine, else the most recently built
    configuration under :func:`build_root`. ``require_current``: raise if the
    build was made from another pin or patch series than this checkout's.
    """
    if build_dir is None and os.environ.get(BUILD_DIR_ENV):
        build_dir = os.environ[BUILD_DIR_ENV]
    if build_dir is not None:
        data = _checked_manifest(Path(build_dir).expanduser().resolve())
    else:
        data = _find_manifest()
    if require_current:
        _check_current(data)
    return data


def _find_manifest() -> dict:
    root = build_root()
    try:
        preferred = plan_build().build_dir
    except HeadInferError:
        preferred = root / "cpu"
    if (preferred / MANIFEST_NAME).is_file():
        return _checked_manifest(preferred)
    found = sorted(root.glob(f"*/{MANIFEST_NAME}"), key=lambda p: p.stat().st_mtime, reverse=True)
    for path in found:
        try:
            data = _checked_manifest(path.parent)
        except BuildError:
            continue
        # a sanitizer build only loads with its runtime preloaded: never pick one implicitly
        if not data.get("sanitize"):
            return data
    raise BuildError(f"No llama.cpp build found under {root}. Run `python -m pyllama_headinfer build` first.")


def _check_current(data: dict) -> None:
    from pyllama_headinfer.patches import apply as patches

    current = patches.series_hash()
    if data.get("pin", {}).get("commit") != pin.LLAMA_CPP_COMMIT or data.get("series_hash") != current:
        raise BuildError(
            f"The build in {data.get('build_dir')} was made from llama.cpp {data.get('pin', {}).get('build')} "
            f"with patch series {str(data.get('series_hash'))[:12]}, but this checkout pins "
            f"{pin.LLAMA_CPP_BUILD} with series {current[:12]}. Run `python -m pyllama_headinfer build` again."
        )


# --------------------------------------------------------------------------
# writing: what a build records


def _sanitizer_preload(cc: Optional[str], sanitize: Optional[str]) -> List[str]:
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


def _manifest(plan: BuildPlan, source_tree: Path, series_hash: str, cmake: tc.Tool, ninja: tc.Tool,
              configure_argv: List[str], targets: Mapping[str, str], libs: Mapping[str, str],
              seconds: float, up_to_date: bool, steps: int) -> dict:
    d = plan.build_dir
    compilers = tc.compilers_used(d, cmake.version)
    cc = (compilers.get("c") or {}).get("path")
    return {
        "format": MANIFEST_FORMAT,
        "pin": {"build": pin.LLAMA_CPP_BUILD, "commit": pin.LLAMA_CPP_COMMIT},
        "series_hash": series_hash,
        "config_key": plan.key,
        "backend": plan.backend,
        "cuda_architectures": plan.cuda_arch,
        "sanitize": plan.sanitize,
        "sanitizer_preload": _sanitizer_preload(cc, plan.sanitize),
        "build_type": plan.build_type,
        "cmake_options": dict(plan.options),
        "cmake_configure": configure_argv,
        "compilers": compilers,
        "build_tools": {
            "cmake": cmake.as_dict(),
            "ninja": ninja.as_dict(),
            "ccache": tc.find_ccache() if cmake_truthy(plan.options.get("GGML_CCACHE", "ON")) else None,
        },
        "source_tree": str(source_tree),
        "include_dir": str(source_tree / "include"),
        "include_dirs": [str(source_tree / "include"), str(source_tree / "ggml" / "include")],
        "build_dir": str(d),
        "lib_dir": str(d / "bin"),
        "libraries": {name: str(d / rel) for name, rel in libs.items()},
        "executables": {name: str(d / targets[name]) for name in TOOL_TARGETS
                        if plan.tools and name in targets and (d / targets[name]).exists()},
        "bindings": None,
        "host": {"system": platform.system(), "machine": platform.machine(), "python": sys.version.split()[0]},
        "built_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "duration_s": round(seconds, 2),
        "up_to_date": up_to_date,
        "steps": steps,
    }
