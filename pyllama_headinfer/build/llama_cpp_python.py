"""``build --llama-cpp-python``: make a Python environment's ``llama_cpp`` the patched one.

After the normal build, still holding its ``<build_dir>/.lock`` (so no
other build of the directory uses the scratch directories or relinks the
libraries while they are copied), from the pinned llama-cpp-python sdist on
PyPI (whose ``vendor/llama.cpp`` is the pin; used whichever way the C tree
was obtained: that sdist, GitHub's archive or ``--llama-src``) and with this
build's compiled libraries (no second C++ compile):

1. extract the sdist's Python layer (everything but ``vendor/``, verified
   file by file: :mod:`pyllama_headinfer.source.python_layer`) into
   ``<build_dir>/llama-cpp-python/src`` and apply the second series,
   ``patches/llama-cpp-python`` (the patch manager, with that layer as the
   pristine tree), so ``patch status --series llama-cpp-python --llama-src``
   that directory says APPLIED;
2. copy it to ``wheel-src/`` and set ``__version__`` to
   ``0.3.36+headinfer.<12 hex>`` (:func:`wheel_version`: a hash of both
   series, so a change of either shows);
3. build a pure wheel of it with its own build backend (scikit-build-core,
   through ``pip wheel --no-deps``, in pip's build isolation: pip's index
   settings apply, as for the sdist download), told to compile nothing
   (``CMAKE_ARGS=-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF``), with this build's
   cmake and ninja first on PATH so the isolated environment needs neither
   from PyPI;
4. add the libraries to the wheel's ``llama_cpp/lib/`` (:func:`add_libraries`:
   ``libllama.so`` and ``libggml.so``, the names llama_cpp loads, and
   ``libggml*.so.<N>``, the sonames the libraries name as NEEDED; they find
   each other through their ``$ORIGIN`` RUNPATH, which the build sets), tag
   it for this platform and write it to ``<build_dir>/dist/``;
5. ``pip install --force-reinstall --no-deps`` it into the target
   environment (by default the Python running this), then a plain ``pip
   install`` of the same wheel with its ``server`` extra
   (:func:`install_steps`), which installs any missing runtime dependency
   (numpy, jinja2, ...) and what ``python -m llama_cpp.server`` imports
   (uvicorn, fastapi, pydantic-settings, sse-starlette, starlette-context,
   PyYAML: pure Python), and nothing else. Always, not behind an option:
   README gives the server as part of what this installs, and without the
   extra its command fails at ``import uvicorn``.

The wheel's libraries are exactly the build's, so a CUDA build's wheel
carries ``libggml-cuda.so.<N>`` too. A sanitizer build (its libraries need
the sanitizer runtime preloaded) and a ``--portable`` one (ggml loads its
CPU variants from the executable's directory, not llama_cpp/lib) are
refused by :func:`check_build`. docs/LLAMA_CPP_PYTHON.md has the user's view.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import logging
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Tuple

from pyllama_headinfer import paths, pin
from pyllama_headinfer.errors import BuildError, UsageError
from pyllama_headinfer.patches.apply import apply
from pyllama_headinfer.series import series_hash
from pyllama_headinfer.source.python_layer import extract_python_layer

log = logging.getLogger(__name__)

SCRATCH = "llama-cpp-python"  # <build_dir>/llama-cpp-python: src/, wheel-src/, wheel-out/
DIST = "dist"  # <build_dir>/dist: the finished wheel
LOADED_BY_NAME = ("llama", "ggml")  # llama_cpp dlopens lib/libllama.so and lib/libggml.so
PIP_TIMEOUT_S = 900
SERVER_EXTRA = "server"  # llama-cpp-python's extra for `python -m llama_cpp.server` (its pyproject.toml)


@dataclass(frozen=True)
class LlamaCppPythonResult:
    wheel: Path
    version: str
    python: str
    seconds: Dict[str, float]  # per step: "prepare", "wheel", "install"


def wheel_version() -> str:
    """``<sdist version>+headinfer.<12 hex>``: the hex is a hash of the C series and the Python-layer
    series, so a wheel of another series has another version."""
    digest = hashlib.sha256(f"{series_hash()}\0{series_hash(paths.python_patches_dir())}".encode()).hexdigest()
    return f"{pin.PYTHON_LAYER_SDIST.version}+headinfer.{digest[:12]}"


def check_build(manifest: Mapping) -> None:
    """Refuse builds whose libraries cannot be loaded from a wheel's llama_cpp/lib (module docstring),
    or that another llama.cpp than the one llama-cpp-python's ctypes declarations describe."""
    built_pin = (manifest.get("pin") or {}).get("build")
    if built_pin != pin.PYTHON_LAYER_PIN:
        raise UsageError(f"--llama-cpp-python needs a build of llama.cpp {pin.PYTHON_LAYER_PIN}: "
                         f"{pin.PYTHON_LAYER_SDIST.requirement} declares llama.h's structs for that pin in ctypes, "
                         f"and this build is of {built_pin} (build without --pin {built_pin})")
    if manifest.get("sanitize"):
        raise UsageError("--llama-cpp-python cannot use a sanitizer build (its libraries need the sanitizer "
                         "runtime preloaded); build without --sanitize")
    if manifest.get("backend_dl"):
        raise UsageError("--llama-cpp-python cannot use a --portable build: ggml would look for its CPU "
                         "variants next to the python executable, not in llama_cpp/lib; build without --portable")


def library_files(lib_dir: Path) -> Dict[str, Path]:
    """Name in the wheel -> file of the build: see the module docstring (step 4)."""
    chosen: Dict[str, Path] = {}
    for entry in sorted(lib_dir.iterdir()):
        m = re.fullmatch(r"lib(llama|ggml(?:-[A-Za-z0-9_-]+)?)\.so(?:\.(\d+))?", entry.name)
        if not m or not entry.exists():
            continue
        base, soversion = m.group(1), m.group(2)
        if soversion is not None and base.startswith("ggml"):
            chosen[entry.name] = entry.resolve()
        elif soversion is None and base in LOADED_BY_NAME:
            chosen[entry.name] = entry.resolve()
    if "libllama.so" not in chosen:
        raise BuildError(f"no libllama.so in {lib_dir}: the build is incomplete")
    return chosen


# --------------------------------------------------------------------------
# the wheel


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def platform_tag() -> str:
    return re.sub(r"[^A-Za-z0-9]", "_", sysconfig.get_platform())


def add_libraries(wheel: Path, libraries: Mapping[str, Path], out_dir: Path) -> Path:
    """A copy of the pure ``wheel`` with ``libraries`` in ``llama_cpp/lib/``, tagged
    ``py3-none-<platform>`` and not purelib, its RECORD rewritten; written to ``out_dir``."""
    name, version = wheel.name.split("-")[:2]
    target = out_dir / f"{name}-{version}-py3-none-{platform_tag()}.whl"
    out_dir.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".part")
    records: List[List[str]] = []
    try:
        with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED) as dst:
            record_name = next((n for n in src.namelist() if n.endswith(".dist-info/RECORD")), None)
            if record_name is None:
                raise BuildError(f"{wheel} has no RECORD")
            dist_info = record_name.rsplit("/", 1)[0]

            def write(arcname: str, data: bytes, mode: int = 0o644) -> None:
                info = zipfile.ZipInfo(arcname, date_time=(1980, 1, 1, 0, 0, 0))
                info.external_attr = (0o100000 | mode) << 16
                info.compress_type = zipfile.ZIP_DEFLATED
                dst.writestr(info, data)
                records.append([arcname, _record_hash(data), str(len(data))])

            for item in src.infolist():
                if item.filename == record_name or item.filename.startswith("llama_cpp/lib/"):
                    continue
                data = src.read(item)
                if item.filename == f"{dist_info}/WHEEL":
                    text = re.sub(r"(?m)^Root-Is-Purelib:.*$", "Root-Is-Purelib: false", data.decode())
                    text = re.sub(r"(?m)^Tag:.*\n?", "", text).rstrip("\n") + f"\nTag: py3-none-{platform_tag()}\n"
                    data = text.encode()
                write(item.filename, data, (item.external_attr >> 16) & 0o777 or 0o644)
            for arcname, path in sorted(libraries.items()):
                write(f"llama_cpp/lib/{arcname}", path.read_bytes(), 0o755)
            buffer = io.StringIO()
            csv.writer(buffer, lineterminator="\n").writerows(records + [[record_name, "", ""]])
            info = zipfile.ZipInfo(record_name, date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = (0o100000 | 0o644) << 16
            dst.writestr(info, buffer.getvalue(), zipfile.ZIP_DEFLATED)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, target)
    return target


def _run_pip(python: str, args: List[str], what: str, env: Optional[Mapping[str, str]] = None) -> None:
    command = [python, "-m", "pip", *args]
    log.debug("running %s", " ".join(command))
    try:
        result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=dict(env) if env is not None else None, timeout=PIP_TIMEOUT_S)
    except FileNotFoundError as exc:
        raise BuildError(f"{what}: cannot run {python}: {exc}") from exc
    except subprocess.TimeoutExpired as exc:
        raise BuildError(f"{what}: pip did not finish in {PIP_TIMEOUT_S} s") from exc
    if result.returncode != 0:
        tail = "\n".join(result.stdout.strip().splitlines()[-12:])
        raise BuildError(f"{what} failed (pip exit {result.returncode}):\n{tail}")


def _tool_dirs(manifest: Mapping) -> List[str]:
    """Directories of the cmake and ninja this build used, for the wheel build's PATH."""
    configure = list(manifest.get("cmake_configure") or [])
    found = [configure[0]] if configure else []
    found += [a.split("=", 1)[1] for a in configure if a.startswith("-DCMAKE_MAKE_PROGRAM=")]
    return list(dict.fromkeys(str(Path(p).parent) for p in found if p and Path(p).is_file()))


def build_wheel(build_dir: Path, manifest: Mapping, python: str, say: Callable[[str], None]) -> tuple:
    """Steps 1-4 of the module docstring: (the wheel in <build_dir>/dist, version, seconds per step)."""
    scratch = build_dir / SCRATCH
    version = wheel_version()
    t0 = time.monotonic()
    src = extract_python_layer(scratch / "src")
    apply(src, paths.python_patches_dir(), pristine=pin.python_layer_files())
    wheel_src = scratch / "wheel-src"
    shutil.rmtree(wheel_src, ignore_errors=True)
    shutil.copytree(src, wheel_src, symlinks=True)
    init = wheel_src / "llama_cpp" / "__init__.py"
    text, count = re.subn(r'(?m)^__version__ = "[^"]*"$', f'__version__ = "{version}"', init.read_text("utf-8"))
    if count != 1:
        raise BuildError(f"cannot set __version__ in {init}")
    init.write_text(text, encoding="utf-8")
    t1 = time.monotonic()
    say(f"Building the llama-cpp-python {version} wheel (pure Python; this build's libraries) ...")
    out = scratch / "wheel-out"
    shutil.rmtree(out, ignore_errors=True)
    env = dict(os.environ)
    env["CMAKE_ARGS"] = "-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF"
    env.pop("PYLLAMA_HEADINFER_BUILD_DIR", None)
    env["PATH"] = os.pathsep.join([*_tool_dirs(manifest), env.get("PATH", "")])
    _run_pip(python, ["wheel", "--no-deps", "--disable-pip-version-check", "-w", str(out), str(wheel_src)],
             "building the llama-cpp-python wheel", env)
    built = sorted(out.glob("llama_cpp_python-*.whl"))
    if len(built) != 1:
        raise BuildError(f"pip wheel left {len(built)} llama_cpp_python wheels in {out}")
    wheel = add_libraries(built[0], library_files(Path(manifest["lib_dir"])), build_dir / DIST)
    for old in (build_dir / DIST).glob("llama_cpp_python-*.whl"):
        if old != wheel:
            old.unlink()
    t2 = time.monotonic()
    return wheel, version, {"prepare": t1 - t0, "wheel": t2 - t1}


def install_steps(wheel: Path) -> List[Tuple[List[str], str]]:
    """Step 5 as ``(pip arguments, what it does)``: the wheel itself, replacing any installed
    llama_cpp whatever its version, then its dependencies and the server's (the ``server`` extra)."""
    return [(["install", "--force-reinstall", "--no-deps", "--disable-pip-version-check", str(wheel)],
             f"installing {wheel.name}"),
            (["install", "--disable-pip-version-check", f"{wheel}[{SERVER_EXTRA}]"],
             f"installing the runtime and server dependencies of {wheel.name}")]


def install_llama_cpp_python(build_dir: Path, manifest: Mapping, *, python: Optional[str] = None,
                             say: Callable[[str], None] = print) -> LlamaCppPythonResult:
    """Build the wheel (:func:`build_wheel`) and install it into ``python``'s environment (step 5)."""
    check_build(manifest)
    python = python or sys.executable
    wheel, version, seconds = build_wheel(build_dir, manifest, python, say)
    t0 = time.monotonic()
    for args, what in install_steps(wheel):
        _run_pip(python, args, what)
    seconds["install"] = time.monotonic() - t0
    say(f"Installed llama-cpp-python {version} into {python} ({wheel}), with its server's dependencies; "
        f"`import llama_cpp` now uses this build's libraries, `python -m llama_cpp.server` serves with them.")
    return LlamaCppPythonResult(wheel, version, python, seconds)
