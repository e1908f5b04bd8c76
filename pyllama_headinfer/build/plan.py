"""Step 1 of ``build``: what to build and where, decided without touching the disk.

:func:`plan_build` turns the command line and ``$CMAKE_ARGS`` into a
:class:`BuildPlan`: the backend (CUDA when nvcc *and* a GPU are there, or when
asked: :func:`_choose_cuda`), the CUDA architectures, the CMake options (ours,
then ``--portable``'s and the sanitizer's, then the user's ``-D`` ones, parsed
by :func:`parse_define`), the configuration key (:func:`config_key`: ``cpu``,
``cuda-sm90``, ``cpu-portable``, ``cpu-asan``, ...) and the build directory,
``<build_root()>/<key>`` unless one is given (:func:`default_build_dir` names
it for a configuration).
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Collection, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from pyllama_headinfer.build import toolchain
from pyllama_headinfer import paths, pin
from pyllama_headinfer.errors import BuildError, UsageError

SANITIZERS = {"address": "asan", "thread": "tsan"}
BUILD_TYPES = ("Release", "RelWithDebInfo", "Debug", "MinSizeRel")
TOOL_TARGETS = ("llama-cli", "llama-server", "llama-bench", "llama-fit-params")

# `build --portable`: upstream's release recipe. Every CPU generation's kernels as a loadable
# module (libggml-cpu-<variant>.so), the best one picked at run time; GGML_NATIVE must be off
# (ggml refuses it with GGML_BACKEND_DL) and GGML_BACKEND_DL needs BUILD_SHARED_LIBS (always ON).
PORTABLE_OPTIONS = {"GGML_NATIVE": "OFF", "GGML_CPU_ALL_VARIANTS": "ON", "GGML_BACKEND_DL": "ON"}


# --------------------------------------------------------------------------
# options and plan


def _base_options(tools: bool) -> Dict[str, str]:
    """What we pass on every configure (before backend, sanitizer and user options)."""
    on_if_tools = "ON" if tools else "OFF"
    return {
        "BUILD_SHARED_LIBS": "ON",
        # The libraries find each other through $ORIGIN, not this directory's absolute path, so
        # they still load when copied elsewhere (`build --llama-cpp-python` puts them in a wheel).
        "CMAKE_BUILD_RPATH_USE_ORIGIN": "ON",
        "LLAMA_BUILD_TESTS": "OFF",
        "LLAMA_BUILD_EXAMPLES": "OFF",
        "LLAMA_BUILD_COMMON": on_if_tools,
        "LLAMA_BUILD_TOOLS": on_if_tools,
        "LLAMA_BUILD_SERVER": on_if_tools,
        # The unified `llama` binary fails without build-info.h in this layout.
        "LLAMA_BUILD_APP": "OFF",
        # The server's web UI would be downloaded from Hugging Face at build time.
        "LLAMA_USE_PREBUILT_UI": "OFF",
        # The tree from a tarball/sdist has no .git: give build-info the pin.
        "LLAMA_BUILD_NUMBER": pin.active().build.lstrip("b"),
        "LLAMA_BUILD_COMMIT": (pin.active().commit or "unknown")[:7],
    }


_NAME_RE = r"[A-Za-z_][A-Za-z0-9_.+-]*"


def tool_option_names() -> Set[str]:
    """The CMake options the build tool sets itself (in any configuration); the others are the user's."""
    names = set(_base_options(True)) | {"CMAKE_BUILD_TYPE", "GGML_CUDA", "CMAKE_CUDA_ARCHITECTURES",
                                        "CMAKE_CUDA_COMPILER", "CMAKE_MAKE_PROGRAM"}
    return names | {f"{prefix}_SANITIZE_{kind}" for prefix in ("LLAMA", "GGML")
                    for kind in ("ADDRESS", "UNDEFINED", "THREAD")}


def parse_define(arg: str) -> Tuple[str, Optional[str], str]:
    """``-DNAME[:TYPE]=VALUE`` (or ``NAME[:TYPE]=VALUE``) -> (name, type, value).

    Anything else is bad usage (:class:`UsageError`, exit status 2): it is
    checked by :func:`plan_build`, before any work."""
    arg = arg.strip()
    body = arg[2:].strip() if arg.startswith("-D") else arg
    m = re.fullmatch(rf"({_NAME_RE})(?::([A-Za-z]+))?=(.*)", body, re.S)
    if not m:
        missing = (f" ({arg!r} has no value: write -D{body}=VALUE, e.g. -D{body}=ON)"
                   if re.fullmatch(rf"{_NAME_RE}(?::[A-Za-z]+)?", body) else "")
        raise UsageError(
            f"Cannot pass {arg!r} to CMake: only -DNAME=VALUE options are passed through{missing} "
            "(the generator, source and build directories are chosen by the build tool)."
        )
    return m.group(1), (m.group(2).upper() if m.group(2) else None), m.group(3)


def split_cmake_args(args: Sequence[str]) -> List[str]:
    """Joins ``-D NAME=VALUE`` pairs (as shlex splits $CMAKE_ARGS) into one item."""
    out: List[str] = []
    it = iter(args)
    for a in it:
        if a == "-D":
            nxt = next(it, None)
            if nxt is None:
                raise UsageError("-D at the end of the CMake arguments has no NAME=VALUE")
            a = "-D" + nxt
        out.append(a)
    return out


def cmake_truthy(value: str) -> bool:
    v = value.strip().upper()
    if v in ("1", "ON", "YES", "TRUE", "Y"):
        return True
    try:
        return float(v) != 0
    except ValueError:
        return False


def _arch_slug(archs: str) -> str:
    if archs == toolchain.DEFAULT_CUDA_ARCHS:
        return ""
    if archs in ("native", "all", "all-major"):
        return archs
    parts = [a.strip() for a in archs.split(";") if a.strip()]
    return "sm" + "-".join(re.sub(r"[^0-9a-z]", "", p.replace("-virtual", "v").replace("-real", "")) for p in parts)


def config_key(backend: str = "cpu", cuda_arch: Optional[str] = None, sanitize: Optional[str] = None,
               build_type: Optional[str] = None, portable: bool = False) -> str:
    """Name of a configuration's build directory: ``cpu``, ``cuda-sm90``, ``cpu-portable``, ``cpu-asan``,
    ``cpu-debug``; for a pin other than the default, its build number is appended (``cpu-b11549``)."""
    parts = [backend]
    if backend == "cuda" and cuda_arch:
        slug = _arch_slug(cuda_arch)
        if slug:
            parts.append(slug)
    if portable:
        parts.append("portable")
    if sanitize:
        parts.append(SANITIZERS[sanitize])
    default_type = "RelWithDebInfo" if sanitize else "Release"
    if build_type and build_type != default_type:
        parts.append(build_type.lower())
    if pin.active().build != pin.DEFAULT_PIN:
        parts.append(pin.active().build)
    return "-".join(parts)


@dataclass
class BuildPlan:
    backend: str  # "cpu" or "cuda"
    key: str
    build_dir: Path
    options: Dict[str, str]
    option_types: Dict[str, str]
    build_type: str
    cuda_arch: Optional[str] = None
    nvcc: Optional[str] = None
    sanitize: Optional[str] = None
    tools: bool = False
    portable: bool = False  # --portable: every CPU variant as a loadable backend (PORTABLE_OPTIONS)
    notes: List[str] = field(default_factory=list)
    user_options: Dict[str, str] = field(default_factory=dict)  # the -D options from the user ($CMAKE_ARGS too)

    def _define(self, name: str, value: str) -> str:
        typ = self.option_types.get(name)
        return f"-D{name}:{typ}={value}" if typ else f"-D{name}={value}"

    def defines(self) -> List[str]:
        return [self._define(name, value) for name, value in self.options.items()]

    def user_defines(self) -> List[str]:
        """The user's -D options, as given (what a build directory remembers: see steps.configured_user_defines)."""
        return [self._define(name, value) for name, value in self.user_options.items()]


def _user_options(cmake_args: Sequence[str], env: Mapping[str, str]) -> Tuple[Dict[str, str], Dict[str, str]]:
    """-D options from $CMAKE_ARGS then --cmake-arg/-D (later ones win)."""
    try:
        from_env = shlex.split(env.get("CMAKE_ARGS", ""))
    except ValueError as exc:
        raise UsageError(f"Cannot parse $CMAKE_ARGS ({exc}): {env.get('CMAKE_ARGS')!r}") from None
    options: Dict[str, str] = {}
    types: Dict[str, str] = {}
    for arg in split_cmake_args([*from_env, *cmake_args]):
        name, typ, value = parse_define(arg)
        options[name] = value
        if typ:
            types[name] = typ
        else:
            types.pop(name, None)
    return options, types


def _choose_cuda(cuda: Optional[bool], user: Dict[str, str],
                 probe_fn) -> Tuple[bool, Optional["toolchain.CudaProbe"], List[str]]:
    notes: List[str] = []
    if "GGML_CUDA" in user:
        wanted = cmake_truthy(user["GGML_CUDA"])
        if cuda is not None and cuda != wanted:
            flag = "--cuda" if cuda else "--no-cuda"
            raise BuildError(f"{flag} contradicts -DGGML_CUDA={user['GGML_CUDA']} (from --cmake-arg or $CMAKE_ARGS).")
        cuda = wanted
    if cuda is False:
        return False, None, notes
    probe = probe_fn()
    if cuda is None:
        if probe.nvcc and probe.gpu_visible:
            notes.append(f"CUDA: nvcc ({probe.nvcc}) and {len(probe.gpus)} GPU(s) found; building the CUDA backend "
                         "(--no-cuda for a CPU build).")
            cuda = True
        elif probe.nvcc:
            notes.append(f"nvcc found ({probe.nvcc}) but no CUDA GPU is visible (`nvidia-smi -L` failed or "
                         "listed none): building for CPU. Pass --cuda to build the CUDA backend anyway.")
            cuda = False
        else:
            cuda = False
    if cuda and not probe.nvcc:
        raise BuildError(
            "--cuda needs the CUDA toolkit's compiler nvcc, which is not on PATH, in $CUDA_HOME/bin or in "
            "/usr/local/cuda/bin. Install the CUDA toolkit (or put its bin/ on PATH), or build for CPU "
            "with --no-cuda."
        )
    return bool(cuda), probe, notes


def _check_portable(user: Mapping[str, str], remembered: Collection[str] = ()) -> None:
    """--portable with a -D option that undoes it is an error (CMake would fail or build something else).
    ``remembered``: the names whose -D came from the build directory's remembered options."""
    def given(name: str) -> str:
        if name in remembered:
            return "remembered by this build directory; --reset-options drops it"
        return "from --cmake-arg or $CMAKE_ARGS"

    for name, value in PORTABLE_OPTIONS.items():
        if name in user and cmake_truthy(user[name]) != cmake_truthy(value):
            raise BuildError(f"--portable sets -D{name}={value}, but -D{name}={user[name]} was given "
                             f"({given(name)}); drop one of them.")
    if "BUILD_SHARED_LIBS" in user and not cmake_truthy(user["BUILD_SHARED_LIBS"]):
        raise BuildError("--portable loads the CPU variants as shared modules (GGML_BACKEND_DL), which needs "
                         f"BUILD_SHARED_LIBS=ON, but -DBUILD_SHARED_LIBS={user['BUILD_SHARED_LIBS']} was given "
                         f"({given('BUILD_SHARED_LIBS')}).")


def plan_build(*, cuda: Optional[bool] = None, cuda_arch: Optional[str] = None,
               cmake_args: Sequence[str] = (), sanitize: Optional[str] = None,
               build_type: Optional[str] = None, tools: bool = False, portable: bool = False,
               build_dir: Optional[os.PathLike] = None, env: Optional[Mapping[str, str]] = None,
               probe_fn=None, remembered: Collection[str] = ()) -> BuildPlan:
    """Decides backend, options, key and directory, without touching the disk.

    ``portable``: kernels for every CPU generation, picked at run time
    (:data:`PORTABLE_OPTIONS`); with CUDA, and no ``cuda_arch``, also
    llama.cpp's portable set of GPU architectures instead of the visible GPUs'.
    ``remembered``: the names of the ``cmake_args`` that the build directory remembered (for messages).
    """
    env = os.environ if env is None else env
    probe_fn = probe_fn or toolchain.probe_cuda
    if sanitize is not None and sanitize not in SANITIZERS:
        raise BuildError(f"--sanitize must be one of {', '.join(SANITIZERS)}, not {sanitize!r}")
    user, user_types = _user_options(cmake_args, env)
    if portable:
        _check_portable(user, remembered)
    use_cuda, probe, notes = _choose_cuda(cuda, user, probe_fn)

    options = _base_options(tools)
    btype = build_type or user.get("CMAKE_BUILD_TYPE") or ("RelWithDebInfo" if sanitize else "Release")
    options["CMAKE_BUILD_TYPE"] = btype
    arch = None
    nvcc = None
    if use_cuda:
        assert probe is not None
        local = None if portable else probe.local_archs()
        arch = cuda_arch or user.get("CMAKE_CUDA_ARCHITECTURES") or local or toolchain.DEFAULT_CUDA_ARCHS
        nvcc = user.get("CMAKE_CUDA_COMPILER") or probe.nvcc
        options.update({"GGML_CUDA": "ON", "CMAKE_CUDA_ARCHITECTURES": arch, "CMAKE_CUDA_COMPILER": nvcc})
        if not (cuda_arch or "CMAKE_CUDA_ARCHITECTURES" in user):
            source = ("the visible GPU(s)" if local else
                      "--portable: a portable set" if portable else "no GPU visible: a portable set")
            notes.append(f"CUDA architectures {arch} ({source}; --cuda-arch to choose).")
    if portable:
        options.update(PORTABLE_OPTIONS)
    if sanitize:
        flavour = "ADDRESS" if sanitize == "address" else "THREAD"
        for prefix in ("LLAMA", "GGML"):
            options[f"{prefix}_SANITIZE_{flavour}"] = "ON"
            if sanitize == "address":
                options[f"{prefix}_SANITIZE_UNDEFINED"] = "ON"
    for name, value in user.items():
        if name == "CMAKE_CUDA_ARCHITECTURES" and cuda_arch:
            continue  # --cuda-arch wins over $CMAKE_ARGS
        options[name] = value
    options["CMAKE_BUILD_TYPE"] = btype

    backend = "cuda" if use_cuda else "cpu"
    key = config_key(backend, arch, sanitize, btype, portable)
    directory = Path(build_dir).expanduser().resolve() if build_dir else paths.build_root() / key
    return BuildPlan(backend=backend, key=key, build_dir=directory, options=options,
                     option_types={k: v for k, v in user_types.items() if k in options},
                     build_type=btype, cuda_arch=arch, nvcc=nvcc, sanitize=sanitize, tools=tools, portable=portable, notes=notes,
                     user_options={k: v for k, v in user.items() if options.get(k) == v})  # those in effect


# --------------------------------------------------------------------------
# where builds live


def default_build_dir(backend: str = "cpu", *, cuda_arch: Optional[str] = None,
                      sanitize: Optional[str] = None, build_type: Optional[str] = None,
                      portable: bool = False) -> Path:
    """The directory ``build`` uses by default for a configuration.

    For ``cuda`` without ``cuda_arch`` it is the one ``build --cuda`` picks on
    this machine (the visible GPUs' architectures, else the portable set;
    always the portable set with ``portable``).
    """
    if backend not in ("cpu", "cuda"):
        raise ValueError(f"backend must be 'cpu' or 'cuda', not {backend!r}")
    if backend == "cuda" and cuda_arch is None:
        local = None if portable else toolchain.probe_cuda().local_archs()
        cuda_arch = local or toolchain.DEFAULT_CUDA_ARCHS
    return paths.build_root() / config_key(backend, cuda_arch, sanitize, build_type, portable)
