#!/usr/bin/env python3
"""Carry a CUDA build compiled on a machine without a GPU to the machine with one.

The device tool's GPU machine has no network, is released after 30 s idle and
so builds the series afresh in most calls: about 6 of its 10 minutes. nvcc
compiles for sm_90 without a GPU, so the build can be made here and carried:

  # here (nvcc, cuBLAS's headers and libraries, a libcuda stub: docs/GPU.md "A build carried to the GPU")
  python -m pyllama_headinfer build --cuda --cuda-arch 90 --tools --no-bindings --build-dir /tmp/cubuild ...
  <the build tool's ninja> -C /tmp/cubuild llama-batched-bench test-backend-ops test-llama-archs  # not an older one
  python scripts/prebuilt_cuda.py pack /tmp/cubuild .gpu-prebuilt/cuda-sm90.tar.xz

  # there (the former scripts/h200_session.sh OUT build did this when HI_PREBUILT named the archive)
  python3 scripts/prebuilt_cuda.py unpack .gpu-prebuilt/cuda-sm90.tar.xz build/cuda-sm90

The archive holds the libraries and tools of ``bin/``, the patched public headers
and the scheduler test's source (what the Python bindings and
the GPU scripts compile against), and the build's manifest.
``unpack`` rewrites the manifest's paths for the new directory and compiles the
bindings for the Python that runs it, so the runtime's stale-build check
(pin + series hash) still guards the result. Nothing of llama.cpp is committed:
the archive lives in an ignored directory, made from the fetched pin.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pyllama_headinfer.build.extension import compile_extension, include_dirs_of  # noqa: E402
from pyllama_headinfer.build.record import write_json  # noqa: E402
from pyllama_headinfer.runtime.manifest import MANIFEST_NAME, check_current, read_manifest  # noqa: E402

# the tools the GPU sessions run (those the build made; test-* only with -DLLAMA_BUILD_TESTS=ON)
TOOLS = ("llama-bench", "llama-batched-bench", "llama-cli", "llama-server", "test-backend-ops", "test-llama-archs")
# what the bindings and the scheduler test compile against, relative to the source tree
SOURCES = ("include", "ggml/include", "tests/test-backend-sched.cpp")


def needed_libraries(lib_dir: Path, roots: list[Path]) -> list[Path]:
    """The libraries of ``lib_dir`` that ``roots`` load, directly or not (their ELF NEEDED entries,
    as ``readelf -d`` lists them), each with its symlinks."""
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        out = subprocess.run(["readelf", "-d", str(todo.pop())], capture_output=True, text=True, check=True).stdout
        for name in re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out):
            if name not in seen and (lib_dir / name).exists():
                seen.add(name)
                todo.append((lib_dir / name).resolve())
    files = {(lib_dir / name).resolve().name for name in seen}
    # every name that resolves to a needed library: its soname, its other links, the file
    return sorted(lib for lib in lib_dir.glob("lib*.so*") if lib.name in seen or lib.resolve().name in files)


def pack(build_dir: Path, archive: Path, *, tools: tuple[str, ...] = TOOLS, require_cuda: bool = True) -> None:
    manifest = read_manifest(build_dir)
    check_current(manifest)  # an archive of a stale build would only fail there
    if require_cuda and not any(manifest.lib_dir.glob("libggml-cuda.so*")):
        raise SystemExit(f"{build_dir} has no libggml-cuda: build with --cuda")
    executables = [manifest.lib_dir / tool for tool in tools if (manifest.lib_dir / tool).exists()]
    # the tools' libraries and those of the bindings (the manifest's), with what they load in turn
    libraries = needed_libraries(manifest.lib_dir, executables + [p.resolve() for p in manifest.libraries.values()])
    libraries = sorted(set(libraries) | {p for lib in manifest.libraries.values()
                                         for p in manifest.lib_dir.glob(Path(lib).name + "*")})
    archive.parent.mkdir(parents=True, exist_ok=True)
    staged = archive.with_name(archive.name + ".part")
    with tarfile.open(staged, "w:xz") as tar:
        tar.add(build_dir / MANIFEST_NAME, MANIFEST_NAME)
        for lib in libraries:
            tar.add(lib, f"bin/{lib.name}")  # symlinks stay symlinks
        for exe in executables:
            tar.add(exe, f"bin/{exe.name}")
        for rel in SOURCES:
            tar.add(manifest.source_tree / rel, f"src/{rel}")
    os.replace(staged, archive)
    print(f"{archive}: {archive.stat().st_size / 2**20:.1f} MiB ({manifest.stamp[:20]}...)")


def relocate(data: dict, build_dir: Path) -> dict:
    """The manifest ``data`` with its paths moved into ``build_dir`` (bin/, src/)."""
    lib_dir = build_dir / "bin"
    src = build_dir / "src"
    data = dict(data)
    data["relocated_from"] = data.get("build_dir")
    data["build_dir"] = str(build_dir)
    data["lib_dir"] = str(lib_dir)
    data["libraries"] = {name: str(lib_dir / Path(p).name) for name, p in (data.get("libraries") or {}).items()}
    data["executables"] = {name: str(lib_dir / name) for name in (data.get("executables") or {})
                           if (lib_dir / name).exists()}
    data["source_tree"] = str(src)
    data["include_dirs"] = [str(d) for d in include_dirs_of(src)]
    data["bindings"] = None
    return data


def unpack(archive: Path, build_dir: Path) -> None:
    build_dir = build_dir.resolve()
    build_dir.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive) as tar:
        tar.extractall(build_dir, filter="tar" if hasattr(tarfile, "tar_filter") else None)
    path = build_dir / MANIFEST_NAME
    data = relocate(json.loads(path.read_text()), build_dir)
    write_json(path, data)
    manifest = read_manifest(build_dir)
    check_current(manifest)
    data["bindings"] = str(compile_extension(build_dir, manifest.source_tree, manifest.lib_dir))
    write_json(path, data)
    print(f"{build_dir}: {manifest.stamp[:20]}..., bindings {Path(data['bindings']).name}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    p = sub.add_parser("pack", help="archive a finished CUDA build")
    p.add_argument("build_dir", type=Path)
    p.add_argument("archive", type=Path)
    p.add_argument("--tools", default=",".join(TOOLS),
                   help="the executables of bin/ to carry, with the libraries they load (default: %(default)s)")
    u = sub.add_parser("unpack", help="install an archive as a build directory, with bindings for this Python")
    u.add_argument("archive", type=Path)
    u.add_argument("build_dir", type=Path)
    args = parser.parse_args(argv)
    if args.action == "pack":
        pack(args.build_dir, args.archive, tools=tuple(t for t in args.tools.split(",") if t))
    else:
        unpack(args.archive, args.build_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
