"""The build toolchain: CMake, Ninja, C/C++ compilers and CUDA.

Finds the tools ``build`` needs (system ones first, then the PyPI ``cmake`` /
``ninja`` wheels that are dependencies of this package), checks their
versions, detects whether a CUDA build is possible, and reads back what CMake
chose (the compilers) for the manifest.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from pyllama_headinfer.errors import BuildError

# cmake_minimum_required(VERSION 3.14...3.28) in the pinned CMakeLists.txt;
# ggml-cuda needs 3.18 (CMAKE_CUDA_ARCHITECTURES).
CMAKE_MIN_CPU = (3, 14)
CMAKE_MIN_CUDA = (3, 18)
NINJA_MIN = (1, 10)

# Used when no GPU is visible and --cuda-arch is not given: llama.cpp's own
# portable choice (PTX for 75/80/90, SASS for the common 86/89 consumer cards).
DEFAULT_CUDA_ARCHS = "75-virtual;80-virtual;86-real;89-real;90-virtual"

Version = Tuple[int, ...]


def parse_version(text: str) -> Optional[Version]:
    m = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not m:
        return None
    return tuple(int(g) for g in m.groups() if g is not None)


def fmt_version(v: Optional[Version]) -> str:
    return ".".join(map(str, v)) if v else "unknown"


@dataclass(frozen=True)
class Tool:
    path: str
    version: Optional[Version]

    def as_dict(self) -> dict:
        return {"path": self.path, "version": fmt_version(self.version)}


def _run_version(path: str) -> Optional[Version]:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return parse_version(out.stdout + out.stderr)


def _pypi_bin(module: str, attr: str) -> Optional[str]:
    try:
        mod = __import__(module)
        return getattr(mod, attr, None)
    except Exception:  # noqa: BLE001 - a broken wheel just means "not available"
        return None


def _candidates(name: str, module: str, attr: str) -> List[str]:
    seen: List[str] = []
    exe = name + (".exe" if os.name == "nt" else "")
    for path in (shutil.which(name), _pypi_bin(module, attr)):
        if path and os.path.isdir(path):
            path = os.path.join(path, exe)
        if path and os.path.isfile(path) and path not in seen:
            seen.append(path)
    return seen


def find_tool(name: str, module: str, attr: str, minimum: Version, prefer: Optional[str] = None) -> Tool:
    """The first of ``prefer``, PATH's ``name`` and the PyPI wheel's that is new enough.

    ``prefer`` is the one a build directory was configured with: keeping it
    avoids a reconfigure (and, with another CMake version, a full rebuild)
    just because PATH differs between two runs (an activated venv or not).
    """
    found = []
    candidates = _candidates(name, module, attr)
    if prefer and os.path.isfile(prefer) and prefer not in candidates:
        candidates.insert(0, prefer)
    elif prefer in candidates:
        candidates.remove(prefer)
        candidates.insert(0, prefer)
    for path in candidates:
        version = _run_version(path)
        found.append((path, version))
        if version is not None and version >= minimum:
            return Tool(path, version)
    if not found:
        raise BuildError(
            f"{name} was not found: neither on PATH nor from the PyPI '{module}' package. "
            f"Install this package with pip (it depends on '{module}') or run `pip install {module}`."
        )
    seen = ", ".join(f"{p} ({fmt_version(v)})" for p, v in found)
    raise BuildError(
        f"{name} is too old: llama.cpp needs {name} >= {fmt_version(minimum)}, found {seen}. "
        f"`pip install -U {module}` installs a recent one; it is used when the one on PATH is too old."
    )


def find_cmake(minimum: Version = CMAKE_MIN_CPU, prefer: Optional[str] = None) -> Tool:
    return find_tool("cmake", "cmake", "CMAKE_BIN_DIR", minimum, prefer)


def find_ninja(minimum: Version = NINJA_MIN, prefer: Optional[str] = None) -> Tool:
    return find_tool("ninja", "ninja", "BIN_DIR", minimum, prefer)


def find_ccache() -> Optional[str]:
    return shutil.which("ccache") or shutil.which("sccache")


# --------------------------------------------------------------------------
# compilers


def _which_first(env_var: str, names: Sequence[str]) -> Optional[str]:
    env = os.environ.get(env_var, "").strip()
    if env:
        # CC may carry flags ("gcc -m64"); the program is the first word.
        prog = env.split()[0]
        return shutil.which(prog) or (prog if os.path.isfile(prog) else None)
    for n in names:
        p = shutil.which(n)
        if p:
            return p
    return None


def check_compilers(options: Dict[str, str]) -> Tuple[Optional[str], Optional[str]]:
    """Fails early, with advice, when there is no C or C++ compiler.

    Compilers named explicitly (``-DCMAKE_C_COMPILER=...``) are left for CMake
    to judge. Returns the (C, C++) compilers found, None where not checked.
    """
    cc = cxx = None
    missing = []
    if "CMAKE_C_COMPILER" not in options:
        cc = _which_first("CC", ("cc", "gcc", "clang"))
        if cc is None:
            missing.append("C (looked at $CC, cc, gcc, clang)")
    if "CMAKE_CXX_COMPILER" not in options:
        cxx = _which_first("CXX", ("c++", "g++", "clang++"))
        if cxx is None:
            missing.append("C++ (looked at $CXX, c++, g++, clang++)")
    if missing:
        raise BuildError(
            "No " + " or ".join(missing) + " compiler was found, and llama.cpp is C/C++. "
            "Install one (Debian/Ubuntu: `apt-get install build-essential`; Fedora: "
            "`dnf install gcc-c++`; macOS: `xcode-select --install`) or set CC/CXX."
        )
    return cc, cxx


def _parse_compiler_file(path: Path, lang: str) -> Dict[str, str]:
    info = {}
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return info
    for key, var in (("path", f"CMAKE_{lang}_COMPILER"), ("id", f"CMAKE_{lang}_COMPILER_ID"),
                     ("version", f"CMAKE_{lang}_COMPILER_VERSION")):
        m = re.search(rf'^set\({var} "([^"]*)"\)', text, re.M)
        if m and m.group(1):
            info[key] = m.group(1)
    return info


def compilers_used(build_dir: Path, cmake_version: Optional[Version] = None) -> Dict[str, Optional[dict]]:
    """{"c": {"path", "id", "version"}, "cxx": ..., "cuda": ... or None} from CMake's files."""
    files = Path(build_dir) / "CMakeFiles"
    dirs = sorted((d for d in files.glob("[0-9]*.*") if d.is_dir()),
                  key=lambda d: d.stat().st_mtime, reverse=True)
    if cmake_version:
        exact = [d for d in dirs if parse_version(d.name) == cmake_version]
        dirs = exact + [d for d in dirs if d not in exact]
    result: Dict[str, Optional[dict]] = {"c": None, "cxx": None, "cuda": None}
    for key, lang, fname in (("c", "C", "CMakeCCompiler.cmake"),
                             ("cxx", "CXX", "CMakeCXXCompiler.cmake"),
                             ("cuda", "CUDA", "CMakeCUDACompiler.cmake")):
        for d in dirs:
            info = _parse_compiler_file(d / fname, lang)
            if info:
                result[key] = info
                break
    return result


# --------------------------------------------------------------------------
# CUDA


@dataclass
class CudaProbe:
    """What this machine offers for a CUDA build."""

    nvcc: Optional[str] = None
    gpus: List[str] = field(default_factory=list)  # lines of `nvidia-smi -L`
    compute_caps: List[str] = field(default_factory=list)  # e.g. ["9.0"]

    @property
    def gpu_visible(self) -> bool:
        return bool(self.gpus)

    def local_archs(self) -> Optional[str]:
        """CMAKE_CUDA_ARCHITECTURES for the visible GPUs ("90", "86;90"), or None."""
        archs = sorted({cap.replace(".", "") for cap in self.compute_caps if re.fullmatch(r"\d+\.\d+", cap)},
                       key=int)
        return ";".join(archs) or None


def find_nvcc() -> Optional[str]:
    p = shutil.which("nvcc")
    if p:
        return p
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root:
            cand = Path(root) / "bin" / "nvcc"
            if cand.is_file() and os.access(cand, os.X_OK):
                return str(cand)
    return None


def _smi(args: Sequence[str]) -> Optional[str]:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    try:
        out = subprocess.run([smi, *args], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def probe_cuda() -> CudaProbe:
    probe = CudaProbe(nvcc=find_nvcc())
    listing = _smi(["-L"])
    if listing:
        probe.gpus = [line.strip() for line in listing.splitlines() if line.strip().startswith("GPU")]
    if probe.gpus:
        caps = _smi(["--query-gpu=compute_cap", "--format=csv,noheader"]) or ""
        probe.compute_caps = [c.strip() for c in caps.splitlines() if c.strip()]
    return probe
