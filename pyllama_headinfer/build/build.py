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

Where the code lives (this module: the orchestration and the CLI):

- ``build.py``: :func:`build`, which runs the steps above in order, the
  free-space check, the closing report, and the CLI (``add_arguments``,
  ``run``);
- ``build_plan.py`` (step 1): :class:`BuildPlan`, :func:`plan_build`, ``-D``
  options, CUDA detection, configuration keys, and where build directories
  live (:func:`build_root`, :func:`default_build_dir`);
- ``build_lock.py`` (step 2): :func:`build_lock`;
- ``series_swap.py`` (step 3): the patched tree, swapping an older applied
  series for the current one;
- ``build_steps.py`` (steps 4-6): running CMake and ninja, when to configure
  again, the library targets, a failed step's error (:class:`BuildInterrupted`
  for Ctrl-C), the cffi bindings;
- ``manifest.py`` (step 6): ``manifest.json``, written and read back
  (:func:`load_manifest`);
- ``cmake.py``: finding cmake, ninja, the compilers, nvcc and the GPUs;
- ``progress.py``: the progress display and the causes of failures.

The names other modules, the tests and docs/BUILD.md use
(``build.load_manifest``, ``build.plan_build``, ``build.build_lock``, ...)
are all importable from this module.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Mapping, Optional, Sequence

from pyllama_headinfer.build import toolchain as tc
from pyllama_headinfer import pin
from pyllama_headinfer.build.lock import LOCK_NAME, build_lock
from pyllama_headinfer.build.plan import BUILD_TYPES, SANITIZERS, TOOL_TARGETS, BuildPlan, build_root, cmake_truthy, config_key, default_build_dir, parse_define, plan_build, split_cmake_args
from pyllama_headinfer.build.steps import STATE_NAME, TAIL_LINES, BuildInterrupted, _bindings_fingerprint, _build_bindings, _compile, _configure_argv, _configure_if_needed, _configured_tools, _interrupted, _needs_configure, _select_targets, _unset_dropped, library_targets, phony_outputs
from pyllama_headinfer.errors import BuildError
from pyllama_headinfer.build.record import BUILD_DIR_ENV, MANIFEST_FORMAT, MANIFEST_NAME, _manifest, _read_json, _write_json, load_manifest
from pyllama_headinfer.build.progress import NINJA_STATUS
# _build calls _prepare_source through this module's namespace, so replacing
# build._prepare_source (as the tests do) replaces the source step.
from pyllama_headinfer.build.series_swap import _prepare_source

__all__ = [
    # the build and its CLI
    "build", "BuildResult", "BuildInterrupted", "add_arguments", "run", "LOG_NAME",
    # build_plan
    "BuildPlan", "plan_build", "config_key", "parse_define", "split_cmake_args", "cmake_truthy",
    "build_root", "default_build_dir", "SANITIZERS", "BUILD_TYPES", "TOOL_TARGETS",
    # build_lock, build_steps
    "build_lock", "LOCK_NAME", "STATE_NAME", "TAIL_LINES", "phony_outputs", "library_targets",
    # manifest
    "load_manifest", "MANIFEST_NAME", "MANIFEST_FORMAT", "BUILD_DIR_ENV",
    # internals the tests reach through this module
    "_configure_argv", "_needs_configure", "_unset_dropped", "_configured_tools", "_prepare_source",
    "_write_json", "_check_disk",
]

LOG_NAME = "build.log"

# Free space required before starting (measured: the CPU library build takes
# ~20 MB, with --tools ~300 MB; CUDA objects are far larger).
GIB = 1024 ** 3
SPACE_FRESH_CPU = 1 * GIB
SPACE_FRESH_CUDA = 4 * GIB
SPACE_INCREMENTAL = GIB // 4


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


def _fmt_seconds(s: float) -> str:
    return f"{s:.1f} s" if s < 60 else f"{int(s // 60)} min {int(s % 60):02d} s"


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
