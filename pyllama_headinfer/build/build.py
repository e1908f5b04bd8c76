"""``pyllama-headinfer build``: configure and compile the patched llama.cpp.

Steps (see docs/BUILD.md for the user's view):

1. plan: backend (CUDA when nvcc *and* a GPU are there, or when asked),
   CMake options, configuration key and build directory; a directory keeps
   the tools and the ``-D`` options it was configured with
   (:func:`plan_for_directory`);
2. take ``<build_dir>/.lock`` (one build per directory at a time);
3. get the verified pinned tree and apply the patch series (both atomic);
4. configure with CMake + Ninja, only when the directory has not been
   configured with exactly these options and this source tree;
5. ``ninja <library targets>`` with a progress display; the full log is
   ``<build_dir>/build.log``;
6. compile the cffi bindings and write
   ``<build_dir>/manifest.json``, which is how the bindings find the libraries.

Where the code lives (this module: :func:`build`, which runs the steps in
order, the free-space check and the closing report):

- :mod:`.plan` (step 1): :class:`~.plan.BuildPlan`, :func:`~.plan.plan_build`,
  ``-D`` options, CUDA detection, configuration keys, build directories;
- :mod:`.lock` (step 2): :func:`~.lock.build_lock`;
- :mod:`.series_swap` (step 3): the patched tree, swapping an older applied
  series for the current one;
- :mod:`.steps` (steps 4-6): running CMake and ninja, when to configure
  again, the library targets, a failed step's error, the cffi bindings;
- :mod:`.extension` (step 6): compiling the cffi module against llama.h
  (declarations in ``decl/``);
- :mod:`.record` (step 6): what ``manifest.json`` records (the runtime reads
  it with :mod:`pyllama_headinfer.runtime.manifest`);
- :mod:`.cpu_kernels` (step 6): which CPU kernels were compiled (native or
  portable, AVX2/AVX-512/AMX), for the manifest and the closing line;
- :mod:`.toolchain`: finding cmake, ninja, the compilers, nvcc and the GPUs;
- :mod:`.progress`: the progress display and the causes of failures.

The ``build`` command is :mod:`pyllama_headinfer.cli.build`.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Callable, Mapping, Optional, Sequence

from pyllama_headinfer.build import cpu_kernels, toolchain
from pyllama_headinfer import pin
from pyllama_headinfer.build.lock import build_lock, removal_is_one_error
from pyllama_headinfer.build.plan import TOOL_TARGETS, BuildPlan, parse_define, plan_build
from pyllama_headinfer.build.steps import (STATE_NAME, bindings_fingerprint, build_bindings, configure_if_needed,
                                           configured_tools, configured_user_defines, configured_with_tools,
                                           interrupted_error, library_targets,
                                           phony_outputs, run_ninja, select_targets)
from pyllama_headinfer.errors import BuildError
from pyllama_headinfer.build.record import manifest_record, write_json
from pyllama_headinfer.runtime.manifest import MANIFEST_NAME, read_json
from pyllama_headinfer.build.progress import NINJA_STATUS
# _build calls prepare_source through this module's namespace, so replacing
# build.prepare_source (as the tests do) replaces the source step.
from pyllama_headinfer.build.series_swap import prepare_source

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
          tools: Optional[bool] = None, reset_options: bool = False, portable: bool = False,
          jobs: Optional[int] = None, wait: bool = True, fresh: bool = False, bindings: bool = True,
          verbose: bool = False, out: Optional[IO[str]] = None,
          env: Optional[Mapping[str, str]] = None,
          then: Optional[Callable[[Path, dict], None]] = None) -> BuildResult:
    """Builds the patched llama.cpp; returns where and what (see the module docstring).

    The directory keeps the tools and the ``-D`` options it was configured with unless told
    otherwise (``tools=False``, a new ``-D`` of the name, ``reset_options``): see
    :func:`plan_for_directory`.

    ``then(build_dir, manifest)``, when given, runs after the closing report while the build
    still holds ``<build_dir>/.lock`` (``build --llama-cpp-python`` makes and installs its wheel
    there, so no other build of the directory relinks the libraries it copies).

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
                      build_type=build_type, tools=tools, reset_options=reset_options, portable=portable,
                      jobs=jobs, wait=wait, fresh=fresh, bindings=bindings, verbose=verbose, env=env, then=then)
    except KeyboardInterrupt:
        raise interrupted_error() from None


def plan_for_directory(*, cuda: Optional[bool] = None, cuda_arch: Optional[str] = None,
                       cmake_args: Sequence[str] = (), sanitize: Optional[str] = None,
                       build_type: Optional[str] = None, tools: Optional[bool] = None, reset_options: bool = False,
                       portable: bool = False,
                       build_dir: Optional[os.PathLike] = None, env: Optional[Mapping[str, str]] = None,
                       say=lambda msg: None) -> BuildPlan:
    """Step 1 with what the directory remembers (nothing is written).

    A build directory keeps what it was configured with, so that a plain ``build`` of it
    neither drops a part nor recompiles everything: the tools (``tools`` None keeps them,
    False removes them) and the user's ``-D`` options (a new ``-D`` of the same name, or
    ``--cuda``/``--no-cuda`` for ``GGML_CUDA``, overrides one; ``reset_options`` drops them
    all; ``build_type`` and ``cuda_arch`` override a remembered ``CMAKE_BUILD_TYPE`` and
    ``CMAKE_CUDA_ARCHITECTURES``). Each thing kept or dropped is one line through ``say``.
    """
    plan = plan_build(cuda=cuda, cuda_arch=cuda_arch, cmake_args=cmake_args, sanitize=sanitize,
                      build_type=build_type, tools=bool(tools), portable=portable, build_dir=build_dir, env=env)
    d = plan.build_dir
    overridden = set(plan.user_options)  # a -D of the same name, or the option that sets it
    if cuda is not None:
        overridden.add("GGML_CUDA")
    if build_type is not None:
        overridden.add("CMAKE_BUILD_TYPE")
    if cuda_arch is not None:
        overridden.add("CMAKE_CUDA_ARCHITECTURES")
    remembered = [a for a in configured_user_defines(d) if parse_define(a)[0] not in overridden]
    kept: Sequence[str] = ()
    if remembered and reset_options:
        say(f"Dropping the -D options this directory was configured with (--reset-options): {' '.join(remembered)}")
    elif remembered:
        kept = remembered
        say(f"Keeping the -D options this directory was configured with: {' '.join(kept)} "
            "(a new -D of the same name overrides one; --reset-options drops them).")
    keep_tools = tools is None and configured_with_tools(d)
    if keep_tools:
        # a plain `build` keeps what the directory was asked to build before (dropping the tools
        # would make the next `build --tools` recompile them all)
        say(f"Keeping {', '.join(TOOL_TARGETS)}: this directory was built with --tools "
            "(--no-tools removes them).")
    elif tools is False and configured_with_tools(d):
        say(f"Removing {', '.join(TOOL_TARGETS)} from this directory's configuration (--no-tools).")
    if kept or keep_tools:
        plan = plan_build(cuda=cuda, cuda_arch=cuda_arch, cmake_args=[*kept, *cmake_args], sanitize=sanitize,
                          build_type=build_type, tools=bool(tools) or keep_tools, portable=portable, build_dir=d,
                          env=env, remembered={parse_define(a)[0] for a in kept})
    return plan


def _build(say, out, *, llama_src, allow_unverified, build_dir, cuda, cuda_arch, cmake_args, sanitize,
           build_type, tools, reset_options, portable, jobs, wait, fresh, bindings, verbose, env,
           then=None) -> BuildResult:
    start = time.monotonic()
    plan = plan_for_directory(cuda=cuda, cuda_arch=cuda_arch, cmake_args=cmake_args, sanitize=sanitize,
                              build_type=build_type, tools=tools, reset_options=reset_options, portable=portable,
                              build_dir=build_dir, env=env, say=say)
    for note in plan.notes:
        say(note)
    d = plan.build_dir
    prefer_cmake, prefer_ninja = (None, None) if fresh else configured_tools(d)
    minimum = toolchain.CMAKE_MIN_CUDA if plan.backend == "cuda" else toolchain.CMAKE_MIN_CPU
    cmake = toolchain.find_cmake(minimum, prefer=prefer_cmake)
    ninja = toolchain.find_ninja(prefer=prefer_ninja)
    toolchain.check_compilers(plan.options)

    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BuildError(f"Cannot create the build directory {d}: {exc}") from None
    lock_start = time.monotonic()
    with build_lock(d, wait=wait, say=say) as lock, removal_is_one_error(lock):
        waited = time.monotonic() - lock_start
        start += waited  # report the work, not the wait for another build
        check_disk(d, not (d / "build.ninja").exists(), plan.backend == "cuda")
        source_tree, series_hash = prepare_source(llama_src, allow_unverified, say)
        say(f"llama.cpp {pin.active().short} + HeadInfer series "
            f"{series_hash[:12]} -> {d} [{plan.key}, {plan.build_type}]")

        previous_manifest = read_json(d / MANIFEST_NAME)
        (d / MANIFEST_NAME).unlink(missing_ok=True)  # a failed build leaves no manifest
        log_path = d / LOG_NAME
        run_env = dict(os.environ if env is None else env)
        run_env["NINJA_STATUS"] = NINJA_STATUS
        echo = out if verbose else None
        with open(log_path, "w", encoding="utf-8") as log:
            configured = configure_if_needed(plan, source_tree, cmake, ninja, fresh, log, log_path, run_env,
                                              echo, say)
            state = read_json(d / STATE_NAME) or {}
            phonies = phony_outputs(d)
            libs = library_targets(phonies)
            targets = select_targets(d, phonies, libs, plan.tools, log_path, say)
            steps, no_work = run_ninja(d, ninja, targets, jobs, log, log_path, run_env, echo, out, say)

        up_to_date = no_work and not configured
        manifest = manifest_record(plan, source_tree, series_hash, cmake, ninja, state.get("argv", []), phonies, libs,
                             time.monotonic() - start, up_to_date, steps)
        if bindings:
            fingerprint = bindings_fingerprint(source_tree, series_hash)
            manifest["bindings"] = build_bindings(plan, source_tree, d / "bin", previous_manifest,
                                                   not no_work, fingerprint, say)
            manifest["bindings_fingerprint"] = fingerprint if manifest["bindings"] else None
        manifest["duration_s"] = round(time.monotonic() - start, 2)
        write_json(d / MANIFEST_NAME, manifest)

        seconds = time.monotonic() - start
        _report(say, d, manifest, waited=waited, no_work=no_work, configured=configured, steps=steps,
                seconds=seconds)
        if then is not None:
            then(d, manifest)
    return BuildResult(d, manifest, up_to_date, configured, steps, seconds)


def check_disk(build_dir: Path, fresh_build: bool, cuda: bool) -> None:
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
        modules = manifest.get("backend_modules") or {}
        more = f" and {len(modules)} backend modules" if modules else ""
        say(f"Built {names}{more} in {_fmt_seconds(seconds)} ({steps} steps). Manifest: {d / MANIFEST_NAME}")
    line = cpu_kernels.summary(manifest.get("cpu_kernels"))
    if line:
        say(line)


def _fmt_seconds(s: float) -> str:
    return f"{s:.1f} s" if s < 60 else f"{int(s // 60)} min {int(s % 60):02d} s"
