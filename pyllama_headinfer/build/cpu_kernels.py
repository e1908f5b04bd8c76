"""Which CPU kernels a build has: native or portable, and the instruction sets in it.

ggml compiles its CPU backend once (``ggml-cpu``) or, with
``GGML_CPU_ALL_VARIANTS`` (``build --portable``), once per x86 generation
(``ggml-cpu-haswell``, ``ggml-cpu-sapphirerapids``, ... loadable modules, of
which ggml picks the best one for the CPU it runs on). What each of them
contains is decided by the ``-m`` flags CMake put on its compile line in
``build.ninja``: ``-march=native`` for a native build (llama.cpp's default,
``GGML_NATIVE``), ``-mavx2 -mfma ...`` otherwise. :func:`cpu_kernels` reads
those flags for every CPU backend of a configured build directory and asks the
C compiler which instruction-set macros they define (``cc <flags> -dM -E``),
which is the only way to know what ``-march=native`` means on this machine;
when the compiler cannot be asked, ggml's own ``-DGGML_AVX2``-style
definitions on the same line are used.

The record goes into ``manifest.json`` as ``cpu_kernels`` (docs/BUILD.md) and
:func:`summary` is the line ``build`` prints at the end.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Tuple

from pyllama_headinfer.build.plan import cmake_truthy

# compiler macro -> ggml's name for the feature (the names ggml_backend_cpu_get_features
# and llama_print_system_info use), in ggml's order
FEATURE_MACROS: Tuple[Tuple[str, str], ...] = (
    ("__SSE3__", "SSE3"),
    ("__SSSE3__", "SSSE3"),
    ("__SSE4_2__", "SSE42"),
    ("__AVX__", "AVX"),
    ("__AVXVNNI__", "AVX_VNNI"),
    ("__AVX2__", "AVX2"),
    ("__F16C__", "F16C"),
    ("__FMA__", "FMA"),
    ("__BMI2__", "BMI2"),
    ("__AVX512F__", "AVX512"),
    ("__AVX512VBMI__", "AVX512_VBMI"),
    ("__AVX512VNNI__", "AVX512_VNNI"),
    ("__AVX512BF16__", "AVX512_BF16"),
    ("__AMX_TILE__", "AMX_TILE"),
    ("__AMX_INT8__", "AMX_INT8"),
    ("__AMX_BF16__", "AMX_BF16"),
    ("__ARM_NEON", "NEON"),
    ("__ARM_FEATURE_DOTPROD", "DOTPROD"),
    ("__ARM_FEATURE_MATMUL_INT8", "MATMUL_INT8"),
    ("__ARM_FEATURE_SVE", "SVE"),
)
FEATURE_NAMES = tuple(name for _, name in FEATURE_MACROS)

# ggml's AMX kernels (ggml-cpu/amx) are compiled only when both are on
AMX_NEEDS = ("AMX_INT8", "AVX512_VNNI")

_CPU_OBJECT_RE = re.compile(
    r"^build \S*CMakeFiles/(ggml-cpu(?:-[\w.+]+)?)\.dir/ggml-cpu/ggml-cpu\.c\.o(?:\.obj)?:[^\n]*\n"
    r"((?:[ \t]+[^\n]*\n)*)", re.M)


@dataclass(frozen=True)
class CpuVariant:
    """One compiled CPU backend (``ggml-cpu`` or ``ggml-cpu-<tag>``)."""

    target: str  # "ggml-cpu", "ggml-cpu-haswell", ...
    flags: Tuple[str, ...]  # the -m flags of its compile line ("-march=native", "-mavx2", ...)
    features: Optional[Tuple[str, ...]]  # FEATURE_NAMES it is compiled with; None: could not be told

    @property
    def tag(self) -> str:
        """``haswell`` for ``ggml-cpu-haswell``; ``""`` for the one backend of a non-portable build."""
        return self.target[len("ggml-cpu-"):] if self.target.startswith("ggml-cpu-") else ""

    @property
    def amx(self) -> Optional[bool]:
        """Whether ggml's AMX matrix kernels are in it (None: unknown)."""
        if self.features is None:
            return None
        return all(f in self.features for f in AMX_NEEDS)

    def as_dict(self) -> dict:
        return {"target": self.target, "tag": self.tag, "flags": list(self.flags),
                "features": list(self.features) if self.features is not None else None, "amx": self.amx}


def compile_lines(build_dir: Path) -> Dict[str, Tuple[List[str], List[str]]]:
    """target -> (FLAGS, DEFINES) of the compile of ``ggml-cpu/ggml-cpu.c`` in each CPU backend,
    read from ``build.ninja`` (empty when there is none)."""
    try:
        text = (Path(build_dir) / "build.ninja").read_text(errors="replace")
    except OSError:
        return {}
    out: Dict[str, Tuple[List[str], List[str]]] = {}
    for m in _CPU_OBJECT_RE.finditer(text):
        variables = {}
        for line in m.group(2).splitlines():
            name, sep, value = line.strip().partition(" = ")
            if sep:
                variables[name] = value
        try:
            flags = shlex.split(variables.get("FLAGS", ""))
            defines = shlex.split(variables.get("DEFINES", ""))
        except ValueError:
            flags, defines = variables.get("FLAGS", "").split(), variables.get("DEFINES", "").split()
        out[m.group(1)] = (flags, defines)
    return out


def arch_flags(flags: List[str]) -> Tuple[str, ...]:
    """The flags that choose instructions: ``-march=``, ``-mcpu=``, ``-mavx2``, ``/arch:AVX2``, ..."""
    return tuple(f for f in flags if (f.startswith("-m") and not f.startswith(("-mtune", "-mno-red-zone")))
                 or f.startswith("/arch:"))


def compiler_macros(cc: str, flags: Tuple[str, ...]) -> Optional[set]:
    """The macros ``cc`` predefines with ``flags`` (GCC/Clang ``-dM -E``); None when it cannot be asked."""
    try:
        proc = subprocess.run([cc, *flags, "-dM", "-E", "-x", "c", "-"], input="", capture_output=True,
                              text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        return None
    return {parts[1] for parts in (line.split() for line in proc.stdout.splitlines())
            if len(parts) >= 2 and parts[0] == "#define"}


def features_from_macros(macros: set) -> Tuple[str, ...]:
    return tuple(name for macro, name in FEATURE_MACROS if macro in macros)


def features_from_defines(defines: List[str]) -> Optional[Tuple[str, ...]]:
    """ggml's ``-DGGML_AVX2``-style definitions (set for explicit flags, not for -march=native)."""
    names = {d[len("-DGGML_"):] for d in defines if d.startswith("-DGGML_")}
    found = tuple(name for name in FEATURE_NAMES if name in names)
    return found or None


def probe_variants(build_dir: Path, cc: Optional[str]) -> List[CpuVariant]:
    """The CPU backends of a configured build directory and what each is compiled with."""
    variants = []
    cache: Dict[Tuple[str, ...], Optional[set]] = {}
    for target, (flags, defines) in compile_lines(build_dir).items():  # in CMake's order
        march = arch_flags(flags)
        macros = None
        if cc:
            if march not in cache:
                cache[march] = compiler_macros(cc, march)
            macros = cache[march]
        features = features_from_macros(macros) if macros is not None else features_from_defines(defines)
        if macros is None and features is None and not any(f.startswith(("-march=native", "-mcpu=native"))
                                                           for f in march):
            features = ()  # no flags and no definitions: the baseline of the architecture
        variants.append(CpuVariant(target, march, features))
    return variants


def cmake_cache_values(build_dir: Path, names: Tuple[str, ...]) -> Dict[str, str]:
    """``NAME:TYPE=VALUE`` entries of ``CMakeCache.txt`` (only those asked for and present)."""
    out: Dict[str, str] = {}
    try:
        text = (Path(build_dir) / "CMakeCache.txt").read_text(errors="replace")
    except OSError:
        return out
    for line in text.splitlines():
        m = re.match(r"^([A-Za-z_][A-Za-z0-9_]*)(?::[A-Za-z]+)?=(.*)$", line)
        if m and m.group(1) in names:
            out[m.group(1)] = m.group(2)
    return out


def _cache_on(cache: Mapping[str, str], name: str) -> bool:
    return cmake_truthy(cache.get(name, "OFF"))


def backend_dl(build_dir: Path) -> bool:
    """Whether the build loads its backends as modules (``GGML_BACKEND_DL`` in its CMake cache):
    the manifest's ``backend_dl`` and ``cpu_kernels.backend_dl``."""
    return _cache_on(cmake_cache_values(build_dir, ("GGML_BACKEND_DL",)), "GGML_BACKEND_DL")


def cpu_kernels(build_dir: Path, cc: Optional[str], modules: Mapping[str, str]) -> dict:
    """The manifest's ``cpu_kernels`` record of a configured and compiled build directory.

    ``kind``: ``"native"`` (compiled for this machine's CPU, ``-march=native``),
    ``"portable"`` (loadable variants for several CPU generations, the best
    one picked at run time), or ``"fixed"`` (``GGML_NATIVE=OFF``: the
    instruction sets the ``GGML_*`` options chose). ``modules``: target ->
    path of the build's dynamically loaded backends.
    """
    cache = cmake_cache_values(build_dir, ("GGML_NATIVE", "GGML_CPU_ALL_VARIANTS"))
    variants = probe_variants(build_dir, cc)
    native = any(f in ("-march=native", "-mcpu=native") for v in variants for f in v.flags)
    if _cache_on(cache, "GGML_CPU_ALL_VARIANTS") or len(variants) > 1:
        kind = "portable"
    elif native or _cache_on(cache, "GGML_NATIVE"):
        kind = "native"
    else:
        kind = "fixed"
    amx_known = [v.amx for v in variants if v.amx is not None]
    return {
        "kind": kind,
        "backend_dl": backend_dl(build_dir),
        "amx": any(amx_known) if amx_known else None,
        "variants": [dict(v.as_dict(), library=modules.get(v.target)) for v in variants],
    }


def summary(record: Optional[Mapping]) -> Optional[str]:
    """One line for the end of ``build``: what CPU kernels the build has."""
    if not record or not record.get("variants"):
        return None
    variants = record["variants"]
    amx = record.get("amx")
    amx_text = "AMX on" if amx else ("AMX off" if amx is False else "AMX unknown")
    if record.get("kind") == "portable":
        tags = [v.get("tag") or v.get("target") for v in variants]
        with_amx = [v.get("tag") or v.get("target") for v in variants if v.get("amx")]
        amx_text = f"AMX in {', '.join(with_amx)}" if with_amx else amx_text
        return (f"CPU kernels: portable, {len(variants)} variants ({' '.join(tags)}), the best one for the CPU "
                f"is loaded at run time; {amx_text}.")
    v = variants[0]
    features = v.get("features")
    what = " ".join(features) if features else ("baseline" if features == [] else "instruction sets unknown")
    how = " ".join(v.get("flags") or []) or "no -m flags"
    return f"CPU kernels: {record.get('kind')} ({how}): {what}; {amx_text}."
