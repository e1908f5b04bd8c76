"""``pyllama-headinfer build``: configure and compile the patched llama.cpp
(:func:`pyllama_headinfer.build.build.build`; docs/BUILD.md), and with
``--llama-cpp-python`` a patched llama-cpp-python on top of it
(:mod:`pyllama_headinfer.build.llama_cpp_python`; docs/LLAMA_CPP_PYTHON.md)."""

from __future__ import annotations

import argparse
import json
import sys

from pyllama_headinfer.build import toolchain
from pyllama_headinfer.build.build import build, plan_for_directory
from pyllama_headinfer.build.plan import BUILD_TYPES, SANITIZERS, TOOL_TARGETS
from pyllama_headinfer.build.llama_cpp_python import install_llama_cpp_python
from pyllama_headinfer.errors import EXIT_OK, UsageError


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
                          f"else {toolchain.DEFAULT_CUDA_ARCHS})")
    cfg.add_argument("-D", dest="defines", action="append", default=[], metavar="NAME=VALUE",
                     help="CMake option passed through, like cmake's own -D (repeatable)")
    # nargs="?": in `--cmake-arg -DX=Y` argparse hands "-DX=Y" to -D above
    # (an option-like word is never taken as a value); --cmake-arg=-DX=Y works too.
    cfg.add_argument("--cmake-arg", dest="cmake_args", action="append", nargs="?", default=[],
                     metavar="-DNAME=VALUE", help="same as -D (repeatable); $CMAKE_ARGS is read too")
    cfg.add_argument("--sanitize", choices=sorted(SANITIZERS),
                     help="address: ASan+UBSan, thread: TSan; its own build directory (cpu-asan, ...)")
    cfg.add_argument("--portable", action="store_true",
                     help="CPU kernels for every x86 generation as loadable modules, the best one picked at "
                          "run time (GGML_NATIVE=OFF, GGML_CPU_ALL_VARIANTS=ON, GGML_BACKEND_DL=ON; CUDA: the "
                          "portable GPU architectures unless --cuda-arch); its own build directory (cpu-portable, ...)")
    cfg.add_argument("--build-type", choices=BUILD_TYPES,
                     help="CMAKE_BUILD_TYPE (default Release; RelWithDebInfo with --sanitize)")
    cfg.add_argument("--tools", action=argparse.BooleanOptionalAction, default=None,
                     help=f"also build {', '.join(TOOL_TARGETS)} (into <build dir>/bin); "
                          "without either flag, a directory keeps what it was built with")
    cfg.add_argument("--reset-options", action="store_true",
                     help="forget the -D options (from -D, --cmake-arg, $CMAKE_ARGS) this directory was configured "
                          "with; without it, a directory keeps them, and a new -D of the same name overrides one")
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
    lcp = parser.add_argument_group("llama-cpp-python")
    lcp.add_argument("--llama-cpp-python", action="store_true",
                     help="after the build, make this environment's llama_cpp the patched one: a wheel of the "
                          "pinned llama-cpp-python sdist with the patches/llama-cpp-python series and this "
                          "build's libraries, in <build dir>/dist, installed with pip with its server extra, so "
                          "`python -m llama_cpp.server` runs too (docs/LLAMA_CPP_PYTHON.md)")
    lcp.add_argument("--python", metavar="PYTHON",
                     help="with --llama-cpp-python: the Python whose environment gets it (default: this one, "
                          f"{sys.executable})")


def run(args: argparse.Namespace) -> int:
    if args.python and not args.llama_cpp_python:
        raise UsageError("--python is for --llama-cpp-python")
    if args.llama_cpp_python and (args.sanitize or args.portable):
        raise UsageError("--llama-cpp-python needs a plain build: its libraries go into llama_cpp/lib, which "
                         f"{'a sanitizer' if args.sanitize else 'a --portable'} build's cannot be loaded from")
    cmake_args = [a for a in getattr(args, "cmake_args", []) if a] + \
        [f"-D{d.strip()}" for d in getattr(args, "defines", [])]
    if args.dry_run:
        plan = plan_for_directory(cuda=args.cuda, cuda_arch=args.cuda_arch, cmake_args=cmake_args,
                                  sanitize=args.sanitize, build_type=args.build_type, tools=args.tools,
                                  reset_options=args.reset_options, portable=args.portable,
                                  build_dir=args.build_dir,
                                  say=lambda msg: print(msg, file=sys.stderr))
        for note in plan.notes:
            print(note, file=sys.stderr)
        print(json.dumps({"config_key": plan.key, "backend": plan.backend, "portable": plan.portable,
                          "build_dir": str(plan.build_dir), "cmake_options": plan.options}, indent=2))
        return EXIT_OK
    def llama_cpp_python(build_dir, manifest) -> None:
        # inside the build's lock: no other build of the directory touches llama-cpp-python/, dist/
        # or relinks the libraries while the wheel copies them
        install_llama_cpp_python(build_dir, manifest, python=args.python,
                                 say=lambda msg: print(msg, file=sys.stderr, flush=True))

    build(llama_src=args.llama_src, allow_unverified=args.allow_unverified, build_dir=args.build_dir,
          cuda=args.cuda, cuda_arch=args.cuda_arch, cmake_args=cmake_args, sanitize=args.sanitize,
          build_type=args.build_type, tools=args.tools, reset_options=args.reset_options,
          portable=args.portable, jobs=args.jobs,
          wait=args.wait, fresh=args.fresh, bindings=args.bindings, verbose=bool(args.show_output or args.verbose),
          then=llama_cpp_python if args.llama_cpp_python else None)
    return EXIT_OK
