"""``pyllama-headinfer build``: configure and compile the patched llama.cpp.

Steps (see docs/BUILD.md for the user's view):

1. plan: backend (CUDA when nvcc *and* a GPU are there, or when asked),
   CMake options, configuration key and build directory;
2. take ``<build_dir>/.lock`` (one build per directory at a time);
3. get the verified pinned tree and apply the patch series (both atomic);
4. configure with CMake + Ninja, only when the directory has not been
   configured with exactly these options and this source tree;
5. ``ninja <library targets>`` with a progress display; the full log is
   ``<build_dir>/build.log``;
6. compile the cffi bindings (when that module is present) and write
   ``<build_dir>/manifest.json``, which is how the bindings find the libraries.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from . import cmake as tc
from . import pin
from .errors import BuildError, HeadInferError
from .progress import NINJA_STATUS, Progress, classify_failure, tail

try:  # POSIX only; on Windows the lock is skipped.
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = 2
STATE_NAME = ".pyllama-configure.json"  # what the last successful configure used
LOCK_NAME = ".lock"
LOG_NAME = "build.log"
BUILD_DIR_ENV = "PYLLAMA_HEADINFER_BUILD_DIR"

SANITIZERS = {"address": "asan", "thread": "tsan"}
BUILD_TYPES = ("Release", "RelWithDebInfo", "Debug", "MinSizeRel")
TOOL_TARGETS = ("llama-cli", "llama-server", "llama-bench")

# Free space required before starting (measured: the CPU library build takes
# ~20 MB, with --tools ~300 MB; CUDA objects are far larger).
GIB = 1024 ** 3
SPACE_FRESH_CPU = 1 * GIB
SPACE_FRESH_CUDA = 4 * GIB
SPACE_INCREMENTAL = GIB // 4

TAIL_LINES = 30


class BuildInterrupted(BuildError):
    """Ctrl-C during a build; the next run resumes where ninja stopped."""


# --------------------------------------------------------------------------
# options and plan


def _base_options(tools: bool) -> Dict[str, str]:
    """What we pass on every configure (before backend, sanitizer and user options)."""
    on_if_tools = "ON" if tools else "OFF"
    return {
        "BUILD_SHARED_LIBS": "ON",
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
        "LLAMA_BUILD_NUMBER": pin.LLAMA_CPP_BUILD.lstrip("b"),
        "LLAMA_BUILD_COMMIT": pin.LLAMA_CPP_COMMIT[:7],
    }


def parse_define(arg: str) -> Tuple[str, Optional[str], str]:
    """``-DNAME[:TYPE]=VALUE`` (or ``NAME[:TYPE]=VALUE``) -> (name, type, value)."""
    arg = arg.strip()
    body = arg[2:].strip() if arg.startswith("-D") else arg
    m = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_.+-]*)(?::([A-Za-z]+))?=(.*)", body, re.S)
    if not m:
        raise BuildError(
            f"Cannot pass {arg!r} to CMake: only -DNAME=VALUE options are passed through "
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
                raise BuildError("-D at the end of the CMake arguments has no NAME=VALUE")
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
    if archs == tc.DEFAULT_CUDA_ARCHS:
        return ""
    if archs in ("native", "all", "all-major"):
        return archs
    parts = [a.strip() for a in archs.split(";") if a.strip()]
    return "sm" + "-".join(re.sub(r"[^0-9a-z]", "", p.replace("-virtual", "v").replace("-real", "")) for p in parts)


def config_key(backend: str = "cpu", cuda_arch: Optional[str] = None, sanitize: Optional[str] = None,
               build_type: Optional[str] = None) -> str:
    """Name of a configuration's build directory: ``cpu``, ``cuda-sm90``, ``cpu-asan``, ``cpu-debug``."""
    parts = [backend]
    if backend == "cuda" and cuda_arch:
        slug = _arch_slug(cuda_arch)
        if slug:
            parts.append(slug)
    if sanitize:
        parts.append(SANITIZERS[sanitize])
    default_type = "RelWithDebInfo" if sanitize else "Release"
    if build_type and build_type != default_type:
        parts.append(build_type.lower())
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
    notes: List[str] = field(default_factory=list)

    def defines(self) -> List[str]:
        out = []
        for name, value in self.options.items():
            typ = self.option_types.get(name)
            out.append(f"-D{name}:{typ}={value}" if typ else f"-D{name}={value}")
        return out


def _user_options(cmake_args: Sequence[str], env: Mapping[str, str]) -> Tuple[Dict[str, str], Dict[str, str]]:
    """-D options from $CMAKE_ARGS then --cmake-arg/-D (later ones win)."""
    try:
        from_env = shlex.split(env.get("CMAKE_ARGS", ""))
    except ValueError as exc:
        raise BuildError(f"Cannot parse $CMAKE_ARGS ({exc}): {env.get('CMAKE_ARGS')!r}") from None
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


def _choose_cuda(cuda: Optional[bool], user: Dict[str, str], probe_fn) -> Tuple[bool, Optional["tc.CudaProbe"], List[str]]:
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


def plan_build(*, cuda: Optional[bool] = None, cuda_arch: Optional[str] = None,
               cmake_args: Sequence[str] = (), sanitize: Optional[str] = None,
               build_type: Optional[str] = None, tools: bool = False,
               build_dir: Optional[os.PathLike] = None, env: Optional[Mapping[str, str]] = None,
               probe_fn=None) -> BuildPlan:
    """Decides backend, options, key and directory, without touching the disk."""
    env = os.environ if env is None else env
    probe_fn = probe_fn or tc.probe_cuda
    if sanitize is not None and sanitize not in SANITIZERS:
        raise BuildError(f"--sanitize must be one of {', '.join(SANITIZERS)}, not {sanitize!r}")
    user, user_types = _user_options(cmake_args, env)
    use_cuda, probe, notes = _choose_cuda(cuda, user, probe_fn)

    options = _base_options(tools)
    btype = build_type or user.get("CMAKE_BUILD_TYPE") or ("RelWithDebInfo" if sanitize else "Release")
    options["CMAKE_BUILD_TYPE"] = btype
    arch = None
    nvcc = None
    if use_cuda:
        assert probe is not None
        arch = cuda_arch or user.get("CMAKE_CUDA_ARCHITECTURES") or probe.local_archs() or tc.DEFAULT_CUDA_ARCHS
        nvcc = user.get("CMAKE_CUDA_COMPILER") or probe.nvcc
        options.update({"GGML_CUDA": "ON", "CMAKE_CUDA_ARCHITECTURES": arch, "CMAKE_CUDA_COMPILER": nvcc})
        if not (cuda_arch or "CMAKE_CUDA_ARCHITECTURES" in user):
            source = "the visible GPU(s)" if probe.local_archs() else "no GPU visible: a portable set"
            notes.append(f"CUDA architectures {arch} ({source}; --cuda-arch to choose).")
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
    key = config_key(backend, arch, sanitize, btype)
    directory = Path(build_dir).expanduser().resolve() if build_dir else build_root() / key
    return BuildPlan(backend=backend, key=key, build_dir=directory, options=options,
                     option_types={k: v for k, v in user_types.items() if k in options},
                     build_type=btype, cuda_arch=arch, nvcc=nvcc, sanitize=sanitize, tools=tools, notes=notes)


# --------------------------------------------------------------------------
# where builds live


def build_root() -> Path:
    """``<checkout>/build`` in a source checkout, else ``<cache>/build``."""
    from . import paths

    root = paths.project_root()
    return (root / "build") if root is not None else paths.cache_dir() / "build"


def default_build_dir(backend: str = "cpu", *, cuda_arch: Optional[str] = None,
                      sanitize: Optional[str] = None, build_type: Optional[str] = None) -> Path:
    """The directory ``build`` uses by default for a configuration.

    For ``cuda`` without ``cuda_arch`` it is the one ``build --cuda`` picks on
    this machine (the visible GPUs' architectures, else the portable set).
    """
    if backend not in ("cpu", "cuda"):
        raise ValueError(f"backend must be 'cpu' or 'cuda', not {backend!r}")
    if backend == "cuda" and cuda_arch is None:
        cuda_arch = tc.probe_cuda().local_archs() or tc.DEFAULT_CUDA_ARCHS
    return build_root() / config_key(backend, cuda_arch, sanitize, build_type)


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
    from . import patches

    current = patches.series_hash()
    if data.get("pin", {}).get("commit") != pin.LLAMA_CPP_COMMIT or data.get("series_hash") != current:
        raise BuildError(
            f"The build in {data.get('build_dir')} was made from llama.cpp {data.get('pin', {}).get('build')} "
            f"with patch series {str(data.get('series_hash'))[:12]}, but this checkout pins "
            f"{pin.LLAMA_CPP_BUILD} with series {current[:12]}. Run `python -m pyllama_headinfer build` again."
        )


# --------------------------------------------------------------------------
# lock


def _lock_holder_text() -> str:
    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    argv = list(sys.argv)
    if argv and argv[0].endswith("__main__.py"):
        argv[0] = "python -m " + (Path(argv[0]).parent.name or "pyllama_headinfer")
    cmd = " ".join([argv[0]] + [shlex.quote(a) for a in argv[1:]]) if argv else "python"
    return f"pid {os.getpid()} on {socket.gethostname()}, started {started}: {cmd}"


@contextmanager
def build_lock(build_dir: Path, *, wait: bool = True, say=print) -> Iterator[None]:
    """Exclusive ``flock`` on ``<build_dir>/.lock`` for the duration of a build.

    Released by the kernel when the process dies, so a crashed build never
    leaves a stale lock. ``wait=False`` fails at once when it is taken.
    """
    if fcntl is None:  # pragma: no cover - Windows
        yield
        return
    fd = os.open(build_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "another process"
            if not wait:
                raise BuildError(
                    f"Another build is using {build_dir} ({holder}). Wait for it to finish, "
                    "run without --no-wait to wait for it, or choose another --build-dir."
                ) from None
            say(f"Waiting for another build using {build_dir} to finish ({holder}) ...")
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, (_lock_holder_text() + "\n").encode(), 0)
        yield
    finally:
        os.close(fd)


# --------------------------------------------------------------------------
# running CMake and ninja


def _run_logged(argv: Sequence[str], log: IO[str], *, cwd: Path, progress: Optional[Progress] = None,
                echo: Optional[IO[str]] = None, env: Optional[Mapping[str, str]] = None) -> int:
    """Runs a command, appending its output to ``log`` (and ``echo``), feeding ``progress``."""
    log.write(f"$ {' '.join(shlex.quote(str(a)) for a in argv)}\n")
    log.flush()
    try:
        proc = subprocess.Popen([str(a) for a in argv], cwd=str(cwd), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=dict(env or os.environ),
                                text=True, encoding="utf-8", errors="replace", bufsize=1)
    except OSError as exc:
        raise BuildError(f"Cannot run {argv[0]}: {exc}") from None
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            if echo is not None:
                echo.write(line)
            elif progress is not None:
                progress.feed(line)
        return proc.wait()
    except KeyboardInterrupt:
        # With a terminal, ninja got the same Ctrl-C; send it anyway in case we
        # were interrupted on our own (it stops its compilers and exits).
        try:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
        raise
    finally:
        if progress is not None:
            progress.close()
        log.flush()


def _needs_configure(plan: BuildPlan, source_tree: Path, argv: List[str], fresh: bool) -> Optional[str]:
    """Why CMake must run now, or None when ninja alone is enough."""
    d = plan.build_dir
    if fresh:
        return "--fresh"
    if not (d / "build.ninja").is_file() or not (d / "CMakeCache.txt").is_file():
        return "first configure of this directory"
    state = _read_json(d / STATE_NAME)
    if state is None:
        return "no record of the last configure"
    if state.get("source_tree") != str(source_tree):
        return f"source tree changed (was {state.get('source_tree')})"
    old = state.get("argv") or []
    if old != argv:
        if old[:1] != argv[:1]:
            return f"another cmake: {argv[0]} (was {old[0] if old else 'unknown'})"
        added = [a for a in argv if a not in old]
        removed = [a for a in old if a not in argv]
        changes = ", ".join([f"+{a}" for a in added] + [f"-{a}" for a in removed])
        return f"CMake options changed: {changes}"
    return None


def _configure_argv(plan: BuildPlan, source_tree: Path, cmake: tc.Tool, ninja: tc.Tool) -> List[str]:
    """The configure command (without the -U of options dropped since last time)."""
    return [cmake.path, "-S", str(source_tree), "-B", str(plan.build_dir), "-G", "Ninja",
            f"-DCMAKE_MAKE_PROGRAM={ninja.path}", *plan.defines()]


def _unset_dropped(plan: BuildPlan, previous: Optional[dict]) -> List[str]:
    """``-UNAME`` for options passed last time but not now, so they return to their defaults."""
    old = (previous or {}).get("options", {})
    return [f"-U{name}" for name in old if name not in plan.options]


def _wipe_cmake_cache(build_dir: Path) -> None:
    (build_dir / "CMakeCache.txt").unlink(missing_ok=True)
    shutil.rmtree(build_dir / "CMakeFiles", ignore_errors=True)
    (build_dir / STATE_NAME).unlink(missing_ok=True)


def _fail(step: str, rc: int, log_path: Path, say, advice: str = "") -> BuildError:
    """Prints the log's tail and returns the error to raise."""
    lines = tail(log_path, TAIL_LINES)
    if rc in (-signal.SIGINT, 128 + signal.SIGINT) or any("interrupted by user" in line for line in lines[-3:]):
        return _interrupted()
    say(f"--- last {len(lines)} lines of {log_path} ---")
    for line in lines:
        say(line)
    say("---")
    try:
        whole = log_path.read_text(errors="replace").splitlines()
    except OSError:
        whole = lines
    cause = classify_failure(whole)
    reason = f": {cause[1]}" if cause else ""
    err = BuildError(f"{step} failed (exit status {rc}){reason}. {advice}Full log: {log_path}")
    err.log_tail = lines  # type: ignore[attr-defined]
    err.kind = cause[0] if cause else None  # type: ignore[attr-defined]
    return err


_PHONY_RE = re.compile(r"^build ([\w.+-]+): phony (\S+)$", re.M)


def phony_outputs(build_dir: Path) -> Dict[str, str]:
    """target -> output path (relative) of the phony target aliases in build.ninja."""
    try:
        text = (build_dir / "build.ninja").read_text(errors="replace")
    except OSError:
        return {}
    return {m.group(1): m.group(2) for m in _PHONY_RE.finditer(text)}


def library_targets(phonies: Mapping[str, str]) -> Dict[str, str]:
    """The llama and ggml* shared-library targets of a configured tree."""
    libs = {}
    for name, out in phonies.items():
        base = os.path.basename(out)
        if (name == "llama" or name.startswith("ggml")) and (base.startswith("lib") or base.endswith(".dll")):
            libs[name] = out
    return libs


# --------------------------------------------------------------------------
# the build


@dataclass
class BuildResult:
    build_dir: Path
    manifest: dict
    up_to_date: bool  # ninja had nothing to do and CMake did not run
    configured: bool  # CMake configure ran in this call
    steps: int  # ninja steps run
    seconds: float


def _prepare_source(llama_src, allow_unverified: bool, say=print) -> Tuple[Path, str]:
    """The verified tree with the current series applied, and the series hash.

    When the series changed since an earlier build patched this tree, the old
    series (recorded by that build) is reverted first, and files whose content
    comes out unchanged get their old mtimes back: ninja then recompiles only
    what the new series really changed.
    """
    from . import patches, source

    current = patches.series_hash()
    located = Path(source.locate_tree(llama_src)).resolve()
    kept = _revert_recorded_series(located, current, say)
    tree = Path(source.ensure_source(llama_src, allow_unverified=allow_unverified)).resolve()
    patches.apply(tree)
    if kept:
        _restore_unchanged_mtimes(tree, kept)
    _record_series(tree, current)
    return tree, current


def _series_record_dir(tree: Path) -> Path:
    """Copy of the series that build last applied to ``tree`` (in the cache, never in the tree)."""
    from . import paths

    return paths.cache_dir() / "applied-series" / hashlib.sha256(str(tree).encode()).hexdigest()[:16]


def _read_text(path: Path) -> Optional[str]:
    try:
        return path.read_text(encoding="utf-8").strip()
    except OSError:
        return None


def _record_series(tree: Path, series_hash: str) -> None:
    from . import patches, paths

    record = _series_record_dir(tree)
    if _read_text(record / "hash") == series_hash:
        return
    directory = paths.patches_dir()
    staged = record.with_name(f"{record.name}.tmp{os.getpid()}")
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir(parents=True)
    if (directory / "series").is_file():
        shutil.copy2(directory / "series", staged / "series")
    for name in patches.read_series_names(directory):
        (staged / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(directory / name, staged / name)
    (staged / "tree").write_text(str(tree) + "\n", encoding="utf-8")
    (staged / "hash").write_text(series_hash + "\n", encoding="utf-8")
    shutil.rmtree(record, ignore_errors=True)
    os.replace(staged, record)


def _file_digest(path: Path) -> Optional[str]:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def _revert_recorded_series(tree: Path, current: str, say) -> Dict[str, Tuple[str, int, int]]:
    """Reverts an older recorded series still applied to ``tree``; returns the
    touched files' (digest, atime_ns, mtime_ns) from before, or {}."""
    from . import patches

    record = _series_record_dir(tree)
    old = _read_text(record / "hash")
    if not old or old == current or not tree.is_dir():
        return {}
    try:
        if patches.status(tree, record).state != patches.State.APPLIED:
            return {}
        touched = patches.load_series(record).touched | patches.load_series().touched
    except HeadInferError:
        return {}
    kept = {}
    for rel in touched:
        path = tree / rel
        digest = _file_digest(path) if path.is_file() else None
        if digest:
            st = path.stat()
            kept[rel] = (digest, st.st_atime_ns, st.st_mtime_ns)
    say(f"The patch series changed since {tree} was patched (series {old[:12]} -> {current[:12]}): "
        "reverting the old series before applying the new one.")
    patches.revert(tree, record)
    return kept


def _restore_unchanged_mtimes(tree: Path, kept: Mapping[str, Tuple[str, int, int]]) -> None:
    for rel, (digest, atime, mtime) in kept.items():
        path = tree / rel
        if path.is_file() and _file_digest(path) == digest:
            os.utime(path, ns=(atime, mtime))


def _check_disk(build_dir: Path, fresh_build: bool, cuda: bool) -> None:
    need = (SPACE_FRESH_CUDA if cuda else SPACE_FRESH_CPU) if fresh_build else SPACE_INCREMENTAL
    probe = build_dir
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < need:
        raise BuildError(
            f"Not enough disk space for the build in {build_dir}: {free / GIB:.2f} GiB free, "
            f"about {need / GIB:.2f} GiB needed. Free some space or choose another --build-dir."
        )


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


def _bindings_fingerprint(source_tree: Path, series_hash: str) -> Optional[str]:
    """Hash of everything the cffi extension is compiled from, to skip recompiling it."""
    try:
        from . import _cffi_build
    except ImportError:
        return None
    h = hashlib.sha256(series_hash.encode())
    files = [Path(_cffi_build.__file__), source_tree / "include" / "llama.h"]
    decl = getattr(_cffi_build, "DECL_DIR", None)
    if decl is not None:
        files += sorted(Path(decl).glob("*"))
    for f in files:
        try:
            h.update(f.name.encode() + b"\0" + f.read_bytes())
        except OSError:
            h.update(f.name.encode() + b"\0missing")
    return h.hexdigest()


def _build_bindings(plan: BuildPlan, source_tree: Path, lib_dir: Path, previous: Optional[dict],
                    libs_rebuilt: bool, fingerprint: Optional[str], say) -> Optional[str]:
    try:
        from . import _cffi_build
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.endswith("_cffi_build"):
            return None
        raise
    old = (previous or {}).get("bindings")
    if (not libs_rebuilt and old and Path(old).is_file() and fingerprint
            and (previous or {}).get("bindings_fingerprint") == fingerprint):
        return old
    say("Compiling the cffi bindings ...")
    try:
        return str(_cffi_build.compile_extension(plan.build_dir, source_tree, lib_dir))
    except HeadInferError:
        raise
    except Exception as exc:  # noqa: BLE001 - a compiler failure must not become a traceback
        raise BuildError(f"Compiling the cffi bindings failed: {exc}") from exc


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


def _fmt_seconds(s: float) -> str:
    return f"{s:.1f} s" if s < 60 else f"{int(s // 60)} min {int(s % 60):02d} s"


def build(*, llama_src: Optional[os.PathLike] = None, allow_unverified: bool = False,
          build_dir: Optional[os.PathLike] = None, cuda: Optional[bool] = None, cuda_arch: Optional[str] = None,
          cmake_args: Sequence[str] = (), sanitize: Optional[str] = None, build_type: Optional[str] = None,
          tools: bool = False, jobs: Optional[int] = None, wait: bool = True, fresh: bool = False,
          bindings: bool = True, verbose: bool = False, out: Optional[IO[str]] = None,
          env: Optional[Mapping[str, str]] = None) -> BuildResult:
    """Builds the patched llama.cpp; returns where and what (see the module docstring).

    Raises :class:`BuildError` (or another :class:`HeadInferError`) with a
    one-paragraph message on every expected failure, :class:`BuildInterrupted`
    on Ctrl-C.
    """
    out = out or sys.stderr

    def say(msg: str = "") -> None:
        out.write(msg + "\n")
        out.flush()

    try:
        return _build(say, out, llama_src=llama_src, allow_unverified=allow_unverified, build_dir=build_dir,
                      cuda=cuda, cuda_arch=cuda_arch, cmake_args=cmake_args, sanitize=sanitize,
                      build_type=build_type, tools=tools, jobs=jobs, wait=wait, fresh=fresh,
                      bindings=bindings, verbose=verbose, env=env)
    except KeyboardInterrupt:
        raise _interrupted() from None


def _interrupted() -> BuildInterrupted:
    return BuildInterrupted(
        "Build interrupted. Nothing is lost: run the same command again and it resumes "
        "where it stopped (finished objects are kept)."
    )


def _build(say, out, *, llama_src, allow_unverified, build_dir, cuda, cuda_arch, cmake_args, sanitize,
           build_type, tools, jobs, wait, fresh, bindings, verbose, env) -> BuildResult:
    start = time.monotonic()
    plan = plan_build(cuda=cuda, cuda_arch=cuda_arch, cmake_args=cmake_args, sanitize=sanitize,
                      build_type=build_type, tools=tools, build_dir=build_dir, env=env)
    for note in plan.notes:
        say(note)
    d = plan.build_dir
    prefer_cmake, prefer_ninja = (None, None) if fresh else _configured_tools(d)
    cmake = tc.find_cmake(tc.CMAKE_MIN_CUDA if plan.backend == "cuda" else tc.CMAKE_MIN_CPU, prefer=prefer_cmake)
    ninja = tc.find_ninja(prefer=prefer_ninja)
    tc.check_compilers(plan.options)

    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BuildError(f"Cannot create the build directory {d}: {exc}") from None
    lock_start = time.monotonic()
    with build_lock(d, wait=wait, say=say):
        waited = time.monotonic() - lock_start
        start += waited  # report the work, not the wait for another build
        _check_disk(d, not (d / "build.ninja").exists(), plan.backend == "cuda")
        source_tree, series_hash = _prepare_source(llama_src, allow_unverified, say)
        say(f"llama.cpp {pin.LLAMA_CPP_BUILD} ({pin.LLAMA_CPP_COMMIT[:12]}) + HeadInfer series "
            f"{series_hash[:12]} -> {d} [{plan.key}, {plan.build_type}]")

        previous_manifest = _read_json(d / MANIFEST_NAME)
        (d / MANIFEST_NAME).unlink(missing_ok=True)  # a failed build leaves no manifest
        log_path = d / LOG_NAME
        run_env = dict(os.environ if env is None else env)
        run_env["NINJA_STATUS"] = NINJA_STATUS
        echo = out if verbose else None
        with open(log_path, "w", encoding="utf-8") as log:
            configured = _configure_if_needed(plan, source_tree, cmake, ninja, fresh, log, log_path, run_env,
                                              echo, say)
            state = _read_json(d / STATE_NAME) or {}
            phonies = phony_outputs(d)
            libs = library_targets(phonies)
            targets = _select_targets(d, phonies, libs, tools, log_path, say)
            steps, no_work = _compile(d, ninja, targets, jobs, log, log_path, run_env, echo, out, say)

        up_to_date = no_work and not configured
        manifest = _manifest(plan, source_tree, series_hash, cmake, ninja, state.get("argv", []), phonies, libs,
                             time.monotonic() - start, up_to_date, steps)
        if bindings:
            fingerprint = _bindings_fingerprint(source_tree, series_hash)
            manifest["bindings"] = _build_bindings(plan, source_tree, d / "bin", previous_manifest,
                                                   not no_work, fingerprint, say)
            manifest["bindings_fingerprint"] = fingerprint if manifest["bindings"] else None
        manifest["duration_s"] = round(time.monotonic() - start, 2)
        _write_json(d / MANIFEST_NAME, manifest)

    seconds = time.monotonic() - start
    _report(say, d, manifest, waited=waited, no_work=no_work, configured=configured, steps=steps, seconds=seconds)
    return BuildResult(d, manifest, up_to_date, configured, steps, seconds)


def _configured_tools(d: Path) -> Tuple[Optional[str], Optional[str]]:
    """The cmake and ninja the directory was configured with (kept while they work; see find_tool)."""
    state = _read_json(d / STATE_NAME) or {}
    argv = state.get("argv") or []
    ninja = next((a.split("=", 1)[1] for a in argv if a.startswith("-DCMAKE_MAKE_PROGRAM=")), None)
    return state.get("cmake") or (argv[0] if argv else None), state.get("ninja") or ninja


def _select_targets(d: Path, phonies: Mapping[str, str], libs: Mapping[str, str], tools: bool,
                    log_path: Path, say) -> List[str]:
    if "llama" not in libs:
        raise BuildError(f"CMake produced no `llama` library target in {d}/build.ninja; "
                         f"see {log_path}, or configure again from scratch with --fresh.")
    targets = list(libs)
    if tools:
        targets += [t for t in TOOL_TARGETS if t in phonies]
        missing = [t for t in TOOL_TARGETS if t not in phonies]
        if missing:
            say(f"warning: no target {', '.join(missing)} in this configuration; not built.")
    return targets


def _report(say, d: Path, manifest: dict, *, waited: float, no_work: bool, configured: bool, steps: int,
            seconds: float) -> None:
    if waited >= 1:
        say(f"(Waited {_fmt_seconds(waited)} for the other build of {d}.)")
    if no_work:
        again = " (CMake configured again)" if configured else ""
        say(f"Up to date: nothing to compile{again} ({_fmt_seconds(seconds)}). Manifest: {d / MANIFEST_NAME}")
    else:
        names = ", ".join(os.path.basename(p) for p in manifest["libraries"].values())
        say(f"Built {names} in {_fmt_seconds(seconds)} ({steps} steps). Manifest: {d / MANIFEST_NAME}")


def _configure_if_needed(plan, source_tree, cmake, ninja, fresh, log, log_path, run_env, echo, say) -> bool:
    d = plan.build_dir
    previous = _read_json(d / STATE_NAME)
    argv = _configure_argv(plan, source_tree, cmake, ninja)
    reason = _needs_configure(plan, source_tree, argv, fresh)
    if reason is None:
        return False
    if fresh or (previous and previous.get("source_tree") != str(source_tree)):
        _wipe_cmake_cache(d)
        previous = None
    (d / STATE_NAME).unlink(missing_ok=True)
    say(f"Configuring with CMake {tc.fmt_version(cmake.version)} ({reason}) ...")
    rc = _run_logged(argv + _unset_dropped(plan, previous), log, cwd=d, echo=echo, env=run_env)
    if rc != 0:
        raise _fail("Configuring llama.cpp with CMake", rc, log_path, say,
                    "Check the -D/--cmake-arg options and $CMAKE_ARGS; --fresh configures this "
                    "directory from scratch. ")
    _write_json(d / STATE_NAME, {"source_tree": str(source_tree), "argv": argv, "options": plan.options,
                                 "cmake": cmake.path, "ninja": ninja.path})
    return True


def _compile(d: Path, ninja: tc.Tool, targets: List[str], jobs: Optional[int], log, log_path, run_env, echo,
             out, say) -> Tuple[int, bool]:
    argv = [ninja.path, "-C", str(d)] + (["-j", str(jobs)] if jobs else []) + targets
    progress = Progress(out)
    steps = {"n": 0, "no_work": False}
    say(f"Compiling {', '.join(targets)} with ninja (log: {log_path}) ...")
    rc = _run_logged(argv, _Tee(log, steps), cwd=d, progress=progress, echo=echo, env=run_env)
    if rc != 0:
        raise _fail("Compiling llama.cpp", rc, log_path, say,
                    "Run build again after fixing the cause; finished objects are kept. ")
    return steps["n"], steps["no_work"]


class _Tee:
    """A log file that also counts ninja's steps and notices ``no work to do``."""

    def __init__(self, log: IO[str], counters: dict):
        self.log = log
        self.counters = counters

    def write(self, line: str) -> None:
        self.log.write(line)
        if line.startswith("[") and re.match(r"^\[\d+/\d+\]", line):
            self.counters["n"] += 1
        elif line.startswith("ninja: no work to do"):
            self.counters["no_work"] = True

    def flush(self) -> None:
        self.log.flush()


# --------------------------------------------------------------------------
# CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Configure and compile the pinned llama.cpp with the HeadInfer patch series "
                          "(CMake + Ninja, out of tree) and write <build-dir>/manifest.json.")
    src = parser.add_argument_group("source")
    src.add_argument("--llama-src", metavar="PATH", help="llama.cpp tree to build (default: the cached, "
                     "verified download; fetched when missing)")
    src.add_argument("--allow-unverified", action="store_true", help="accept a tree that is not the pin")
    cfg = parser.add_argument_group("configuration")
    backend = cfg.add_mutually_exclusive_group()
    backend.add_argument("--cuda", dest="cuda", action="store_true", default=None,
                         help="build the CUDA backend (default: when nvcc is found and a GPU is visible)")
    backend.add_argument("--no-cuda", dest="cuda", action="store_false", help="build for CPU only")
    cfg.add_argument("--cuda-arch", metavar="ARCHS",
                     help="CMAKE_CUDA_ARCHITECTURES, e.g. 90 or '86;90' (default: the visible GPUs', "
                          f"else {tc.DEFAULT_CUDA_ARCHS})")
    cfg.add_argument("-D", dest="defines", action="append", default=[], metavar="NAME=VALUE",
                     help="CMake option passed through, like cmake's own -D (repeatable)")
    # nargs="?": in `--cmake-arg -DX=Y` argparse hands "-DX=Y" to -D above
    # (an option-like word is never taken as a value); --cmake-arg=-DX=Y works too.
    cfg.add_argument("--cmake-arg", dest="cmake_args", action="append", nargs="?", default=[],
                     metavar="-DNAME=VALUE", help="same as -D (repeatable); $CMAKE_ARGS is read too")
    cfg.add_argument("--sanitize", choices=sorted(SANITIZERS),
                     help="address: ASan+UBSan, thread: TSan; its own build directory (cpu-asan, ...)")
    cfg.add_argument("--build-type", choices=BUILD_TYPES,
                     help="CMAKE_BUILD_TYPE (default Release; RelWithDebInfo with --sanitize)")
    cfg.add_argument("--tools", action="store_true", help="also build llama-cli, llama-server and llama-bench")
    cfg.add_argument("--build-dir", metavar="DIR",
                     help="build directory (default: build/<config> in a checkout, else <cache>/build/<config>)")
    run_g = parser.add_argument_group("running")
    run_g.add_argument("-j", "--jobs", type=int, metavar="N", help="parallel compile jobs (default: ninja's)")
    run_g.add_argument("--fresh", action="store_true",
                       help="forget the CMake cache (and the cmake/ninja this directory was configured with) and "
                            "configure again; objects whose compile command is unchanged are kept")
    run_g.add_argument("--no-wait", dest="wait", action="store_false",
                       help="fail instead of waiting when another build holds the build directory")
    run_g.add_argument("--no-bindings", dest="bindings", action="store_false",
                       help="do not compile the cffi bindings")
    run_g.add_argument("--show-output", action="store_true",
                       help="show CMake's and ninja's full output (also with the global -v)")
    run_g.add_argument("--dry-run", action="store_true",
                       help="print the configuration (directory, CMake options) and exit")


def run(args: argparse.Namespace) -> int:
    cmake_args = [a for a in getattr(args, "cmake_args", []) if a] + \
        [f"-D{d.strip()}" for d in getattr(args, "defines", [])]
    if args.dry_run:
        plan = plan_build(cuda=args.cuda, cuda_arch=args.cuda_arch, cmake_args=cmake_args,
                          sanitize=args.sanitize, build_type=args.build_type, tools=args.tools,
                          build_dir=args.build_dir)
        for note in plan.notes:
            print(note, file=sys.stderr)
        print(json.dumps({"config_key": plan.key, "backend": plan.backend, "build_dir": str(plan.build_dir),
                          "cmake_options": plan.options}, indent=2))
        return 0
    try:
        build(llama_src=args.llama_src, allow_unverified=args.allow_unverified, build_dir=args.build_dir,
              cuda=args.cuda, cuda_arch=args.cuda_arch, cmake_args=cmake_args, sanitize=args.sanitize,
              build_type=args.build_type, tools=args.tools, jobs=args.jobs, wait=args.wait, fresh=args.fresh,
              bindings=args.bindings,
              verbose=bool(getattr(args, "show_output", False) or getattr(args, "verbose", False)))
    except BuildInterrupted as exc:
        print(f"\n{exc}", file=sys.stderr)
        return 130
    return 0
