"""``build --portable`` and the record of a build's CPU kernels.

Fast (nothing compiled): the options and directory of ``--portable``
(``--dry-run``), what :mod:`pyllama_headinfer.build.cpu_kernels` reads from a
configured directory, and the bindings' error when a portable build has no
loadable CPU backend. The manifest of the suite's native build is checked in
tests/test_build.py (``test_manifest_records_the_cpu_kernels``).

Opt-in (``slow``): the real portable build, made once in the cache
(``<cache>/test-builds/cpu-portable``, never in the checkout), a ``generate``
with it, and the error of a portable build whose variants are gone. Building
all 14 x86 variants of the CPU backend (325 ninja steps) took 17.5 min on
the busy 2-core development machine (~3 times the native build's work) -- too
long for the default run (docs/BUILD.md):
``PYLLAMA_HEADINFER_SLOW=1 python -m pytest tests/test_portable.py`` or
``-m slow``.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pyllama_headinfer import paths
from pyllama_headinfer.build import cpu_kernels, toolchain
from pyllama_headinfer.build.plan import PORTABLE_OPTIONS, config_key, plan_build
from pyllama_headinfer.cli import main as cli
from pyllama_headinfer.errors import BuildError, NotBuiltError
from pyllama_headinfer.runtime import bindings
from pyllama_headinfer.runtime.manifest import BUILD_DIR_ENV, Manifest, read_manifest

ROOT = Path(__file__).resolve().parents[1]
SLOW_ENV = "PYLLAMA_HEADINFER_SLOW"


def _no_gpu():
    return toolchain.CudaProbe(nvcc=None, gpus=[], compute_caps=[])


def _h200():
    return toolchain.CudaProbe(nvcc="/usr/local/cuda/bin/nvcc", gpus=["GPU 0: NVIDIA H200 (UUID: GPU-x)"],
                               compute_caps=["9.0"])


# --------------------------------------------------------------------------
# options, keys, directories


def test_portable_dry_run(capsys, monkeypatch, restore_logging):
    monkeypatch.setattr(toolchain, "probe_cuda", _no_gpu)
    monkeypatch.delenv("CMAKE_ARGS", raising=False)
    assert cli.main(["build", "--portable", "--dry-run"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config_key"] == "cpu-portable" and out["portable"] is True
    assert Path(out["build_dir"]) == paths.build_root() / "cpu-portable"
    options = out["cmake_options"]
    assert options["GGML_NATIVE"] == "OFF"
    assert options["GGML_CPU_ALL_VARIANTS"] == "ON"
    assert options["GGML_BACKEND_DL"] == "ON"
    assert options["BUILD_SHARED_LIBS"] == "ON"  # GGML_BACKEND_DL requires it


def test_plain_build_is_native(monkeypatch):
    monkeypatch.delenv("CMAKE_ARGS", raising=False)
    plan = plan_build(cuda=False, env={})
    assert plan.key == "cpu" and not plan.portable
    assert not set(PORTABLE_OPTIONS) & set(plan.options)  # llama.cpp's default: GGML_NATIVE=ON


@pytest.mark.parametrize("define", ["-DGGML_NATIVE=ON", "-DGGML_BACKEND_DL=OFF", "-DGGML_CPU_ALL_VARIANTS=OFF",
                                    "-DBUILD_SHARED_LIBS=OFF"])
def test_portable_refuses_options_that_undo_it(define):
    with pytest.raises(BuildError, match="--portable"):
        plan_build(cuda=False, portable=True, cmake_args=[define], env={})


def test_portable_agrees_with_the_same_options_given():
    plan = plan_build(cuda=False, portable=True, cmake_args=["-DGGML_NATIVE=OFF", "-DGGML_BACKEND_DL=1"], env={})
    assert plan.options["GGML_BACKEND_DL"] == "1" and plan.key == "cpu-portable"


def test_portable_keys():
    assert config_key("cpu", portable=True) == "cpu-portable"
    assert config_key("cpu", sanitize="address", portable=True) == "cpu-portable-asan"
    assert config_key("cuda", "90", portable=True) == "cuda-sm90-portable"
    assert config_key("cpu", build_type="Debug", portable=True) == "cpu-portable-debug"


def test_portable_cuda_takes_the_portable_gpu_architectures():
    plan = plan_build(portable=True, env={}, probe_fn=_h200)
    assert plan.backend == "cuda" and plan.options["GGML_CUDA"] == "ON"
    assert plan.cuda_arch == toolchain.DEFAULT_CUDA_ARCHS  # not the visible H200's 90
    assert plan.key == "cuda-portable"
    assert plan.options["GGML_BACKEND_DL"] == "ON"  # the CUDA backend is a module too
    chosen = plan_build(portable=True, cuda_arch="90", env={}, probe_fn=_h200)
    assert chosen.key == "cuda-sm90-portable" and chosen.cuda_arch == "90"


# --------------------------------------------------------------------------
# what cpu_kernels reads from a configured directory


def _ninja_entry(target: str, flags: str, defines: str) -> str:
    return (f"build ggml/src/CMakeFiles/{target}.dir/ggml-cpu/ggml-cpu.c.o: C_COMPILER__{target}_unscanned_Release "
            f"/src/ggml/src/ggml-cpu/ggml-cpu.c || cmake_object_order_depends_target_{target}\n"
            f"  CONFIG = Release\n  DEFINES = -DGGML_BACKEND_BUILD {defines}\n"
            f"  FLAGS = -O3 -DNDEBUG -std=gnu11 -fPIC -Wall {flags} -fopenmp\n"
            f"  OBJECT_DIR = ggml/src/CMakeFiles/{target}.dir\n\n"
            # another object of the same target: not read
            f"build ggml/src/CMakeFiles/{target}.dir/ggml-cpu/ops.cpp.o: CXX_COMPILER__{target}_unscanned_Release "
            f"/src/ggml/src/ggml-cpu/ops.cpp\n  FLAGS = -O3 -mno-such-flag\n\n")


def _configured(tmp_path: Path, cache: str, entries: str) -> Path:
    (tmp_path / "CMakeCache.txt").write_text(cache)
    (tmp_path / "build.ninja").write_text("# ninja\n\n" + entries)
    return tmp_path


def test_cpu_kernels_of_a_portable_directory_without_a_compiler(tmp_path):
    d = _configured(tmp_path, "GGML_NATIVE:BOOL=OFF\nGGML_BACKEND_DL:BOOL=ON\nGGML_CPU_ALL_VARIANTS:BOOL=ON\n",
                    _ninja_entry("ggml-cpu-x64", "", "")
                    + _ninja_entry("ggml-cpu-haswell", "-msse4.2 -mf16c -mfma -mbmi2 -mavx -mavx2",
                                   "-DGGML_SSE42 -DGGML_F16C -DGGML_FMA -DGGML_BMI2 -DGGML_AVX -DGGML_AVX2")
                    + _ninja_entry("ggml-cpu-sapphirerapids", "-mavx2 -mavx512f -mavx512vnni -mamx-tile -mamx-int8",
                                   "-DGGML_AVX2 -DGGML_AVX512 -DGGML_AVX512_VNNI -DGGML_AMX_TILE -DGGML_AMX_INT8"))
    rec = cpu_kernels.cpu_kernels(d, None, {"ggml-cpu-haswell": "/b/bin/libggml-cpu-haswell.so"})
    assert rec["kind"] == "portable" and rec["backend_dl"] is True and rec["amx"] is True
    by_tag = {v["tag"]: v for v in rec["variants"]}
    assert list(by_tag) == ["x64", "haswell", "sapphirerapids"]  # CMake's order
    assert by_tag["x64"]["features"] == [] and by_tag["x64"]["amx"] is False
    assert by_tag["haswell"]["features"] == ["SSE42", "AVX", "AVX2", "F16C", "FMA", "BMI2"]
    assert by_tag["haswell"]["flags"] == ["-msse4.2", "-mf16c", "-mfma", "-mbmi2", "-mavx", "-mavx2"]
    assert by_tag["haswell"]["library"] == "/b/bin/libggml-cpu-haswell.so"
    assert by_tag["sapphirerapids"]["amx"] is True
    line = cpu_kernels.summary(rec)
    assert line.startswith("CPU kernels: portable, 3 variants (x64 haswell sapphirerapids)")
    assert "AMX in sapphirerapids" in line


def test_cpu_kernels_of_a_native_directory(tmp_path):
    d = _configured(tmp_path, "GGML_NATIVE:BOOL=ON\nGGML_BACKEND_DL:BOOL=OFF\n",
                    _ninja_entry("ggml-cpu", "-march=native", ""))
    unknown = cpu_kernels.cpu_kernels(d, None, {})  # -march=native and no compiler to ask
    assert unknown["kind"] == "native" and unknown["amx"] is None
    assert unknown["variants"][0]["features"] is None and unknown["variants"][0]["flags"] == ["-march=native"]
    assert cpu_kernels.summary(unknown) == ("CPU kernels: native (-march=native): instruction sets unknown; "
                                            "AMX unknown.")


def test_cpu_kernels_asks_the_compiler(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc:
        pytest.skip("no C compiler")
    d = _configured(tmp_path, "GGML_NATIVE:BOOL=OFF\n",
                    _ninja_entry("ggml-cpu", "-mavx2 -mfma -mno-red-zone", "-DGGML_AVX2 -DGGML_FMA"))
    rec = cpu_kernels.cpu_kernels(d, cc, {})
    assert rec["kind"] == "fixed" and rec["backend_dl"] is False and rec["amx"] is False
    # -mavx2 implies AVX, SSE4.2, ... : the compiler knows, ggml's definitions do not say
    assert {"AVX", "AVX2", "FMA", "SSE42"} <= set(rec["variants"][0]["features"])
    assert "AVX512" not in rec["variants"][0]["features"]
    assert rec["variants"][0]["flags"] == ["-mavx2", "-mfma"]


def test_no_cpu_backend_in_an_unconfigured_directory(tmp_path):
    rec = cpu_kernels.cpu_kernels(tmp_path, None, {})
    assert rec["variants"] == [] and rec["amx"] is None
    assert cpu_kernels.summary(rec) is None


# --------------------------------------------------------------------------
# the bindings and a portable build without loadable CPU variants


class _FakeLib:
    """The four ggml calls of bindings.load_backends, over a registry that gets nothing."""

    GGML_BACKEND_DEVICE_TYPE_CPU = 0

    def __init__(self, registered: int = 0):
        self.registered = registered
        self.loaded_from = []

    def ggml_backend_reg_count(self):
        return self.registered

    def ggml_backend_load_all_from_path(self, path):
        self.loaded_from.append(path)

    def ggml_backend_dev_by_type(self, kind):
        return _FakeFFI.NULL


class _FakeFFI:
    NULL = None


def _manifest(tmp_path: Path, backend_dl: bool) -> Manifest:
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    return Manifest.from_dict({"build_dir": str(tmp_path), "lib_dir": str(bindir), "backend_dl": backend_dl,
                               "libraries": {}}, tmp_path)


def test_portable_build_without_cpu_variants_is_an_error(tmp_path, monkeypatch):
    monkeypatch.delenv(BUILD_DIR_ENV, raising=False)
    manifest = _manifest(tmp_path, backend_dl=True)
    lib = _FakeLib(registered=0)
    with pytest.raises(NotBuiltError, match=r"no CPU backend could be loaded from .*/bin: there is no "
                                            r"libggml-cpu\*\.so"):
        bindings.load_backends(_FakeFFI, lib, manifest)
    assert lib.loaded_from == [str(tmp_path / "bin").encode()]
    (tmp_path / "bin" / "libggml-cpu-haswell.so").write_bytes(b"not a library")
    with pytest.raises(NotBuiltError, match="none of libggml-cpu-haswell.so could be loaded or supports this CPU"):
        bindings.load_backends(_FakeFFI, _FakeLib(registered=0), manifest)


def test_a_build_with_linked_backends_loads_no_modules(tmp_path):
    lib = _FakeLib(registered=1)
    bindings.load_backends(_FakeFFI, lib, _manifest(tmp_path, backend_dl=False))
    assert lib.loaded_from == []


def test_manifest_says_whether_a_build_is_dl(tmp_path):
    assert _manifest(tmp_path, backend_dl=True).backend_dl is True
    old = Manifest.from_dict({"build_dir": str(tmp_path), "libraries": {}}, tmp_path)  # recorded before the field
    assert old.backend_dl is False


# --------------------------------------------------------------------------
# the real portable build (opt-in)


def _slow_selected(config) -> bool:
    if os.environ.get(SLOW_ENV, "") not in ("", "0"):
        return True
    markexpr = getattr(config.option, "markexpr", "") or ""
    return "slow" in markexpr and "not slow" not in markexpr


@pytest.fixture(scope="session")
def portable_build(request) -> Path:
    """``build --portable`` in the cache (built if missing or stale; incremental afterwards)."""
    if not _slow_selected(request.config):
        pytest.skip(f"slow: builds all 14 CPU variants (~6-18 min on 2 cores); set {SLOW_ENV}=1 or run with -m slow")
    directory = paths.cache_dir() / "test-builds" / "cpu-portable"
    run = subprocess.run([sys.executable, "-m", "pyllama_headinfer", "build", "--no-cuda", "--portable",
                          "--build-dir", str(directory)], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, f"the portable build failed:\n{run.stderr[-3000:]}"
    assert paths.project_root() not in directory.parents  # the checkout stays clean
    assert "CPU kernels: portable" in run.stderr
    return directory


def _env(build_dir: Path) -> dict:
    return dict(os.environ, PYLLAMA_HEADINFER_BUILD_DIR=str(build_dir), PYTHONPATH=str(ROOT))


@pytest.mark.slow
def test_portable_manifest(portable_build):
    m = read_manifest(portable_build)
    assert m.backend_dl is True
    assert set(m.libraries) == {"llama", "ggml", "ggml-base"}  # the backends are modules, not linked
    modules = m.data["backend_modules"]
    assert "ggml-cpu-x64" in modules and len(modules) >= 2
    assert all(Path(p).is_file() and Path(p).parent == m.lib_dir for p in modules.values())
    kernels = m.data["cpu_kernels"]
    assert kernels["kind"] == "portable" and kernels["backend_dl"] is True
    assert sorted(v["target"] for v in kernels["variants"]) == sorted(modules)
    assert all(v["library"] == modules[v["target"]] for v in kernels["variants"])
    if platform.machine() in ("x86_64", "AMD64"):
        amx = [v["tag"] for v in kernels["variants"] if v["amx"]]
        assert amx == ["sapphirerapids"] and kernels["amx"] is True


@pytest.mark.slow
def test_generate_with_the_portable_build(portable_build, gguf_models):
    run = subprocess.run([sys.executable, "-m", "pyllama_headinfer", "-v", "generate", "--model",
                          str(gguf_models["llama-gqa"]), "--prompt", "hi", "-n", "4"],
                         cwd=ROOT, capture_output=True, text=True, env=_env(portable_build), timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip()
    # ggml says which variant it picked for this CPU
    loaded = [line for line in run.stderr.splitlines() if "loaded CPU backend from" in line]
    assert loaded and str(read_manifest(portable_build).lib_dir / "libggml-cpu-") in loaded[0], run.stderr[-3000:]


@pytest.mark.slow
def test_portable_build_without_its_variants_is_a_clear_error(portable_build, gguf_models, tmp_path):
    """The variants deleted (here: a copy of the manifest whose bin/ has none) -> an error, not a crash."""
    data = json.loads((portable_build / "manifest.json").read_text())
    (tmp_path / "bin").mkdir()
    data["lib_dir"] = str(tmp_path / "bin")
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    run = subprocess.run([sys.executable, "-m", "pyllama_headinfer", "generate", "--model",
                          str(gguf_models["llama-gqa"]), "--prompt", "hi", "-n", "4"],
                         cwd=ROOT, capture_output=True, text=True, env=_env(tmp_path), timeout=600)
    assert run.returncode == 1, run.stderr[-3000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: no CPU backend could be loaded from {tmp_path / 'bin'}: there is no "
                           "libggml-cpu*.so"), run.stderr[-3000:]
    assert "Traceback" not in run.stderr
