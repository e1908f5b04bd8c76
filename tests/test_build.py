"""Tests of ``build``: unit tests of its parts (fast, nothing compiled) and
tests of the real CPU build.

The real build is the one ``.ci/run`` makes (``build/cpu`` in the checkout);
the session fixture ``cpu_build_dir`` reuses it, and only builds (incrementally) when
its manifest is missing or stale. A fresh CPU build takes ~2-4 min on 2 cores.
"""

from __future__ import annotations

import ctypes
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pyllama_headinfer import paths, pin
from pyllama_headinfer.build import build as B
from pyllama_headinfer.build import steps
from pyllama_headinfer.build import toolchain
from pyllama_headinfer.build.lock import LOCK_NAME, build_lock
from pyllama_headinfer.build.plan import config_key, default_build_dir, parse_define, plan_build, split_cmake_args
from pyllama_headinfer.build.progress import Progress, classify_failure, parse_progress
from pyllama_headinfer.build.record import write_json
from pyllama_headinfer.build.series_swap import prepare_source
from pyllama_headinfer.cli import main as cli
from pyllama_headinfer.errors import BuildError, NotBuiltError, UsageError
from pyllama_headinfer.patches.status import State, status
from pyllama_headinfer.runtime.manifest import MANIFEST_FORMAT, find_manifest, read_manifest
from pyllama_headinfer.series import read_series_names, series_hash

ROOT = Path(__file__).resolve().parents[1]

# Captured at import (collection), before the autouse fixture isolates the
# cache: the real build uses the real cached source tree.
REAL_CACHE = paths.cache_dir()


def _no_gpu():
    return toolchain.CudaProbe(nvcc="/usr/local/bin/nvcc", gpus=[], compute_caps=[])


def _h200():
    return toolchain.CudaProbe(nvcc="/usr/local/cuda/bin/nvcc", gpus=["GPU 0: NVIDIA H200 (UUID: GPU-x)"],
                        compute_caps=["9.0"])


def _nothing():
    return toolchain.CudaProbe()


# --------------------------------------------------------------------------
# progress


def test_parse_progress():
    assert parse_progress("[12/78] Building C object ggml/src/ggml.c.o\n") == (12, 78, "Building C object ggml/src/ggml.c.o")
    assert parse_progress("[1/1] Re-running CMake...") == (1, 1, "Re-running CMake...")
    assert parse_progress("ninja: no work to do.") is None
    assert parse_progress("/src/x.c:3:1: warning: [12/78] not a status line") is None
    assert parse_progress("[0/0] ") is None
    assert parse_progress("[9/8] impossible") is None


def test_progress_plain_prints_about_every_ten_percent():
    out = io.StringIO()
    p = Progress(out, tty=False)
    for i in range(1, 79):
        assert p.feed(f"[{i}/78] Building CXX object x{i}.o\n")
    assert not p.feed("In file included from foo.h:1:\n")
    p.close()
    lines = out.getvalue().splitlines()
    assert 9 <= len(lines) <= 11, lines
    assert "100% (78/78" in lines[-1]
    assert "\r" not in out.getvalue()


def test_progress_tty_rewrites_one_line():
    out = io.StringIO()
    p = Progress(out, tty=True)
    for i in range(1, 6):
        p.feed(f"[{i}/5] Linking x\n")
    text = out.getvalue()
    assert text.count("\r") == 5 and "\n" not in text
    assert "[100%] 5/5 Linking x" in text
    p.close()
    assert out.getvalue().endswith("\n")


def test_progress_restarts_after_cmake_rerun():
    out = io.StringIO()
    p = Progress(out, tty=False)
    p.feed("[1/1] Re-running CMake...\n")
    for i in range(1, 11):
        p.feed(f"[{i}/10] step\n")
    text = out.getvalue()
    assert "Re-running CMake" in text
    assert text.count("%") == 10  # every step of the real run crosses another 10 %


# --------------------------------------------------------------------------
# failure classification


@pytest.mark.parametrize("text, kind", [
    ("FAILED: x.o\n/usr/bin/ld: final link failed: No space left on device\n", "disk_full"),
    ("c++: fatal error: Killed signal terminated program cc1plus\n", "out_of_memory"),
    ("CMake Error at CMakeLists.txt:2 (project):\n  The CMAKE_C_COMPILER:\n\n    /nonexistent\n\n"
     "  is not a full path to an existing compiler tool.\n", "no_compiler"),
    ("CMake Error: No CMAKE_CXX_COMPILER could be found.\n", "no_compiler"),
    ("CMake Error at CMakeLists.txt:1:\n  CMake 3.14 or higher is required.  You are running version 3.10.2\n",
     "cmake_too_old"),
    ("nvcc fatal   : Unsupported gpu architecture 'compute_35'\n", "cuda_arch"),
    ("ninja: build stopped: interrupted by user.\n", "interrupted"),
])
def test_classify_failure(text, kind):
    found = classify_failure(text.splitlines())
    assert found is not None and found[0] == kind
    assert found[1]  # a sentence of advice


def test_classify_failure_unknown():
    assert classify_failure(["src/llama.cpp:12:3: error: 'foo' was not declared in this scope"]) is None


# --------------------------------------------------------------------------
# options, plan, configuration key


def test_parse_define():
    assert parse_define("-DGGML_AVX512=ON") == ("GGML_AVX512", None, "ON")
    assert parse_define("-DCMAKE_C_COMPILER:FILEPATH=/usr/bin/gcc") == ("CMAKE_C_COMPILER", "FILEPATH", "/usr/bin/gcc")
    assert parse_define("-D CMAKE_CUDA_ARCHITECTURES=86;90") == ("CMAKE_CUDA_ARCHITECTURES", None, "86;90")
    assert split_cmake_args(["-D", "A=1", "-DB=2"]) == ["-DA=1", "-DB=2"]
    for bad in ("-G", "-GNinja", "--fresh", "-DNOVALUE", "-S/tmp"):
        with pytest.raises(UsageError, match="only -DNAME=VALUE"):
            parse_define(bad)


@pytest.mark.parametrize("argv, said", [
    (["-DFOO"], "'-DFOO' has no value: write -DFOO=VALUE"),
    (["-D", "GGML_NATIVE:BOOL"], "has no value: write -DGGML_NATIVE:BOOL=VALUE"),
    (["--cmake-arg=-GNinja"], "only -DNAME=VALUE options are passed through"),
])
def test_a_malformed_define_is_bad_usage_before_any_work(argv, said, tmp_path, capsys, monkeypatch,
                                                         restore_logging):
    """`build -DFOO` exited 1 (a failed build) although README's table says bad usage is 2 (issue 26.5)."""
    monkeypatch.delenv("CMAKE_ARGS", raising=False)
    d = tmp_path / "b"
    assert cli.main(["build", "--no-cuda", "--build-dir", str(d), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: Cannot pass") and said in err[0], err
    assert not d.exists()  # nothing was done
    monkeypatch.setenv("CMAKE_ARGS", "-DGGML_NATIVE")
    assert cli.main(["build", "--no-cuda", "--build-dir", str(d), "--dry-run"]) == 2
    assert "'-DGGML_NATIVE' has no value" in capsys.readouterr().err


def test_config_keys():
    assert config_key() == "cpu"
    assert config_key("cuda", "90") == "cuda-sm90"
    assert config_key("cuda", "86;90") == "cuda-sm86-90"
    assert config_key("cuda", toolchain.DEFAULT_CUDA_ARCHS) == "cuda"
    assert config_key("cpu", sanitize="address", build_type="RelWithDebInfo") == "cpu-asan"
    assert config_key("cpu", build_type="Debug") == "cpu-debug"
    assert config_key("cuda", "90", "thread", "Debug") == "cuda-sm90-tsan-debug"


def test_plan_nvcc_without_gpu_builds_cpu_and_says_why(tmp_path):
    plan = plan_build(build_dir=tmp_path, env={}, probe_fn=_no_gpu)
    assert plan.backend == "cpu" and plan.key == "cpu"
    assert any("no CUDA GPU is visible" in n and "--cuda" in n for n in plan.notes)
    o = plan.options
    assert o["CMAKE_BUILD_TYPE"] == "Release" and o["BUILD_SHARED_LIBS"] == "ON"
    assert o["LLAMA_BUILD_TESTS"] == o["LLAMA_BUILD_TOOLS"] == o["LLAMA_BUILD_APP"] == "OFF"
    assert "GGML_CUDA" not in o and "GGML_NATIVE" not in o  # llama.cpp's defaults stay
    assert o["LLAMA_BUILD_NUMBER"] == pin.active().build[1:]


def test_plan_gpu_visible_builds_cuda_for_its_arch(tmp_path):
    plan = plan_build(env={}, probe_fn=_h200)
    assert plan.backend == "cuda" and plan.key == "cuda-sm90"
    assert plan.options["GGML_CUDA"] == "ON"
    assert plan.options["CMAKE_CUDA_ARCHITECTURES"] == "90"
    assert plan.build_dir == paths.build_root() / "cuda-sm90"
    assert plan_build(env={}, probe_fn=_h200, cuda=False).key == "cpu"


def test_plan_forced_cuda(tmp_path):
    plan = plan_build(env={}, probe_fn=_no_gpu, cuda=True)
    assert plan.key == "cuda" and plan.options["CMAKE_CUDA_ARCHITECTURES"] == toolchain.DEFAULT_CUDA_ARCHS
    assert plan.options["CMAKE_CUDA_COMPILER"] == "/usr/local/bin/nvcc"
    plan = plan_build(env={}, probe_fn=_no_gpu, cuda=True, cuda_arch="86;90")
    assert plan.key == "cuda-sm86-90" and plan.options["CMAKE_CUDA_ARCHITECTURES"] == "86;90"
    with pytest.raises(BuildError, match="nvcc"):
        plan_build(env={}, probe_fn=_nothing, cuda=True)


def test_plan_no_cuda_does_not_probe():
    def boom():
        raise AssertionError("probed")
    assert plan_build(env={}, probe_fn=boom, cuda=False).backend == "cpu"


def test_plan_cmake_args_env_and_cli():
    env = {"CMAKE_ARGS": "-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=86 -DGGML_AVX512=ON"}
    plan = plan_build(env=env, probe_fn=_no_gpu, cmake_args=["-DGGML_AVX512=OFF"])
    assert plan.backend == "cuda" and plan.key == "cuda-sm86"
    assert plan.options["GGML_AVX512"] == "OFF"  # the command line wins over $CMAKE_ARGS
    assert plan_build(env=env, probe_fn=_no_gpu, cuda_arch="90").key == "cuda-sm90"
    with pytest.raises(BuildError, match="contradicts"):
        plan_build(env=env, probe_fn=_no_gpu, cuda=False)


def test_a_directory_remembers_only_the_defines_in_effect():
    """--cuda-arch and --build-type win over a -D of theirs: such a -D is not what the directory was built with."""
    env = {"CMAKE_ARGS": "-DCMAKE_CUDA_ARCHITECTURES=86 -DCMAKE_BUILD_TYPE=Debug -DGGML_LTO=ON"}
    plan = plan_build(env=env, probe_fn=_no_gpu, cuda=True, cuda_arch="90", build_type="Release")
    assert plan.user_defines() == ["-DGGML_LTO=ON"]


def test_plan_sanitize():
    plan = plan_build(env={}, probe_fn=_no_gpu, sanitize="address")
    assert plan.key == "cpu-asan" and plan.build_type == "RelWithDebInfo"
    for name in ("LLAMA_SANITIZE_ADDRESS", "LLAMA_SANITIZE_UNDEFINED", "GGML_SANITIZE_ADDRESS",
                 "GGML_SANITIZE_UNDEFINED"):
        assert plan.options[name] == "ON"
    tools = plan_build(env={}, probe_fn=_no_gpu, tools=True)
    assert tools.key == "cpu" and tools.options["LLAMA_BUILD_TOOLS"] == tools.options["LLAMA_BUILD_COMMON"] == "ON"


def test_default_build_dir_in_checkout():
    root = paths.project_root()
    assert root is not None  # the tests run from a checkout
    assert default_build_dir("cpu") == root / "build" / "cpu"
    assert default_build_dir("cuda", cuda_arch="90") == root / "build" / "cuda-sm90"
    assert default_build_dir("cpu", sanitize="address") == root / "build" / "cpu-asan"


def test_reconfigure_only_when_options_change(tmp_path):
    plan = plan_build(build_dir=tmp_path, env={}, probe_fn=_no_gpu, cmake_args=["-DGGML_AVX512=ON"])
    cmake, ninja = toolchain.Tool("/x/cmake", (3, 28)), toolchain.Tool("/x/ninja", (1, 11))
    src = tmp_path / "src"
    argv = steps.configure_argv(plan, src, cmake, ninja)
    assert steps.needs_configure(plan, src, argv, fresh=False) == "first configure of this directory"
    (tmp_path / "build.ninja").write_text("")
    (tmp_path / "CMakeCache.txt").write_text("")
    write_json(tmp_path / steps.STATE_NAME, {"source_tree": str(src), "argv": argv, "options": plan.options})
    assert steps.needs_configure(plan, src, argv, fresh=False) is None
    assert steps.needs_configure(plan, src, argv, fresh=True) == "--fresh"
    assert "source tree changed" in steps.needs_configure(plan, tmp_path / "other", argv, fresh=False)
    plain = plan_build(build_dir=tmp_path, env={}, probe_fn=_no_gpu)
    assert steps.needs_configure(plain, src, steps.configure_argv(plain, src, cmake, ninja), False) == \
        "CMake options changed: --DGGML_AVX512=ON"
    other = steps.configure_argv(plan, src, toolchain.Tool("/y/cmake", (3, 31)), ninja)
    assert steps.needs_configure(plan, src, other, False).startswith("another cmake: /y/cmake")
    # an option given last time and not now goes back to its default
    assert steps.unset_dropped(plain, {"options": plan.options}) == ["-UGGML_AVX512"]


# --------------------------------------------------------------------------
# toolchain and environment checks


def _script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


def test_cmake_too_old(tmp_path, monkeypatch):
    _script(tmp_path / "cmake", 'echo "cmake version 3.10.2"\n')
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(toolchain, "_pypi_bin", lambda module, attr: None)
    with pytest.raises(BuildError, match=r"too old.*3\.14.*3\.10\.2.*pip install -U cmake"):
        toolchain.find_cmake()


def test_old_cmake_on_path_falls_back_to_pypi(tmp_path, monkeypatch):
    (tmp_path / "path").mkdir()
    (tmp_path / "wheel").mkdir()
    _script(tmp_path / "path" / "cmake", 'echo "cmake version 3.10.2"\n')
    new = _script(tmp_path / "wheel" / "cmake", 'echo "cmake version 3.31.6"\n')
    monkeypatch.setenv("PATH", str(tmp_path / "path"))
    monkeypatch.setattr(toolchain, "_pypi_bin", lambda module, attr: str(tmp_path / "wheel"))
    assert toolchain.find_cmake() == toolchain.Tool(str(new), (3, 31, 6))


def test_the_cmake_a_directory_was_configured_with_is_kept(tmp_path, monkeypatch):
    (tmp_path / "path").mkdir()
    (tmp_path / "venv").mkdir()
    on_path = _script(tmp_path / "path" / "cmake", 'echo "cmake version 3.25.1"\n')
    configured = _script(tmp_path / "venv" / "cmake", 'echo "cmake version 4.4.5"\n')
    monkeypatch.setenv("PATH", str(tmp_path / "path"))
    monkeypatch.setattr(toolchain, "_pypi_bin", lambda module, attr: None)
    assert toolchain.find_cmake().path == str(on_path)
    assert toolchain.find_cmake(prefer=str(configured)).path == str(configured)
    assert toolchain.find_cmake(prefer=str(tmp_path / "gone" / "cmake")).path == str(on_path)
    _script(configured, 'echo "cmake version 3.10.0"\n')  # too old now: not kept
    assert toolchain.find_cmake(prefer=str(configured)).path == str(on_path)


def test_configured_tools_read_from_the_state(tmp_path):
    assert steps.configured_tools(tmp_path) == (None, None)
    write_json(tmp_path / steps.STATE_NAME, {"argv": ["/v/cmake", "-S", "s", "-DCMAKE_MAKE_PROGRAM=/v/ninja"]})
    assert steps.configured_tools(tmp_path) == ("/v/cmake", "/v/ninja")
    write_json(tmp_path / steps.STATE_NAME, {"argv": ["/v/cmake"], "cmake": "/w/cmake", "ninja": "/w/ninja"})
    assert steps.configured_tools(tmp_path) == ("/w/cmake", "/w/ninja")


def test_no_compiler(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(BuildError, match="No C .*C\\+\\+.*compiler was found.*build-essential"):
        toolchain.check_compilers({})
    assert toolchain.check_compilers({"CMAKE_C_COMPILER": "/a/cc", "CMAKE_CXX_COMPILER": "/a/c++"}) == (None, None)


def test_disk_space_checked_up_front(tmp_path, monkeypatch):
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(B.shutil, "disk_usage", lambda p: usage._replace(free=100 * 1024 ** 2))
    with pytest.raises(BuildError, match="Not enough disk space.*0.10 GiB free"):
        B.check_disk(tmp_path / "new" / "cpu", fresh_build=True, cuda=False)
    monkeypatch.setattr(B.shutil, "disk_usage", lambda p: usage._replace(free=B.SPACE_FRESH_CPU))
    B.check_disk(tmp_path / "new" / "cpu", fresh_build=True, cuda=False)


def test_lock_no_wait_names_the_holder(tmp_path):
    with build_lock(tmp_path):
        assert str(os.getpid()) in (tmp_path / LOCK_NAME).read_text()
        with pytest.raises(BuildError, match=rf"Another build is using .*pid {os.getpid()}"):
            with build_lock(tmp_path, wait=False):
                pass
    with build_lock(tmp_path, wait=False):  # released
        pass


def test_lock_waits_for_the_holder(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            sys.path.insert(0, {str(paths.PACKAGE_DIR.parent)!r})
            from pathlib import Path
            from pyllama_headinfer.build.lock import build_lock
            with build_lock(Path({str(tmp_path)!r})):
                print("locked", flush=True)
                time.sleep(1.5)
        """)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    said = []
    start = time.monotonic()
    with build_lock(tmp_path, say=said.append):
        waited = time.monotonic() - start
    holder.wait()
    assert waited > 0.5 and said and "Waiting for another build" in said[0] and f"pid {holder.pid}" in said[0]


ORPHAN_CHILD = """
import sys
from pathlib import Path
from pyllama_headinfer.build.lock import build_lock
from pyllama_headinfer.build.steps import run_logged
d = Path(sys.argv[1])
with build_lock(d), open(d / "log", "w") as log:
    # stands in for ninja: says it started, then works for a while
    run_logged(["sh", "-c", f"echo $$ > {d}/ninja.pid; exec sleep 60"], log, cwd=d)
"""


def test_lock_outlives_a_killed_build_while_its_ninja_runs(tmp_path):
    """kill -9 of the build's Python must not let a second build start next to
    its orphaned ninja (issue 16.4): the lock goes with the child processes."""
    child = subprocess.Popen([sys.executable, "-c", ORPHAN_CHILD, str(tmp_path)],
                             env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + sys.path)))
    pid_file = tmp_path / "ninja.pid"
    deadline = time.monotonic() + 60
    while not (pid_file.is_file() and pid_file.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.05)
    orphan = int(pid_file.read_text())
    try:
        child.kill()
        child.wait()
        with pytest.raises(BuildError, match="has exited, but the compilers it started"):
            with build_lock(tmp_path, wait=False):
                pass
    finally:
        os.kill(orphan, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the orphan is gone: the directory is free again
        try:
            with build_lock(tmp_path, wait=False):
                break
        except BuildError:
            time.sleep(0.05)
    else:
        pytest.fail("the lock was not released after the orphan exited")


def test_load_manifest_without_build(tmp_path):
    with pytest.raises(NotBuiltError, match="run `python -m pyllama_headinfer build`"):
        read_manifest(tmp_path)


def _fake_finished_build(d: Path, mtime: float, pin_build: str = pin.DEFAULT_PIN) -> Path:
    (d / "bin").mkdir(parents=True)
    (d / "bin" / "libllama.so").write_bytes(b"")
    write_json(d / "manifest.json", {"format": MANIFEST_FORMAT, "build_dir": str(d), "pin": {"build": pin_build},
                                     "libraries": {"llama": str(d / "bin" / "libllama.so")}})
    os.utime(d / "manifest.json", (mtime, mtime))
    return d


def test_the_runtime_says_which_build_it_uses_and_why(tmp_path, monkeypatch, caplog):
    """"The most recently finished build wins" switched builds silently (issue 26)."""
    import logging

    from pyllama_headinfer.runtime import manifest as M

    monkeypatch.setattr(paths, "build_root", lambda: tmp_path)
    monkeypatch.delenv(M.BUILD_DIR_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(pin.PIN_ENV, raising=False)
    older = _fake_finished_build(tmp_path / "cpu", 1_700_000_000)
    newer = _fake_finished_build(tmp_path / "noamx", 1_700_000_100)
    other_pin = _fake_finished_build(tmp_path / "cpu-b11549", 1_700_000_200, "b11549")  # newest, another pin
    caplog.set_level(logging.INFO, logger="pyllama_headinfer.runtime")
    M.announce(find_manifest())
    assert caplog.messages == ["using noamx (most recently finished; set PYLLAMA_HEADINFER_BUILD_DIR to choose)"]
    monkeypatch.setenv(pin.PIN_ENV, "b11549")  # the newest build of the active pin
    assert find_manifest().build_dir == other_pin
    monkeypatch.delenv(pin.PIN_ENV)
    monkeypatch.setenv(M.BUILD_DIR_ENV, str(older))
    assert M.describe_choice(find_manifest()) == "using cpu (from $PYLLAMA_HEADINFER_BUILD_DIR)"
    monkeypatch.chdir(ROOT)  # a build outside the current directory: its whole path
    assert M.describe_choice(find_manifest(newer)) == f"using {newer} (named by the caller)"


def test_cli_dry_run(capsys, monkeypatch, restore_logging):
    monkeypatch.setattr(toolchain, "probe_cuda", _no_gpu)
    monkeypatch.delenv("CMAKE_ARGS", raising=False)
    assert cli.main(["build", "--dry-run", "--cmake-arg", "-DGGML_AVX512=ON", "-DGGML_LTO=ON"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config_key"] == "cpu" and out["backend"] == "cpu"
    assert out["cmake_options"]["GGML_AVX512"] == "ON" and out["cmake_options"]["GGML_LTO"] == "ON"


# --------------------------------------------------------------------------
# the whole flow with a fake CMake and ninja (fast; exercises the error paths)


FAKE_CMAKE = """\
case "$1" in --version) echo "cmake version 3.28.3"; exit 0;; esac
ARGS=" $* "
while [ $# -gt 0 ]; do [ "$1" = "-B" ] && B="$2"; shift; done
echo "-- The C compiler identification is GNU 12.2.0"
mkdir -p "$B/bin" "$B/CMakeFiles/3.28.3"
echo 'set(CMAKE_C_COMPILER "/usr/bin/cc")' > "$B/CMakeFiles/3.28.3/CMakeCCompiler.cmake"
echo 'set(CMAKE_C_COMPILER_ID "GNU")' >> "$B/CMakeFiles/3.28.3/CMakeCCompiler.cmake"
echo 'set(CMAKE_C_COMPILER_VERSION "12.2.0")' >> "$B/CMakeFiles/3.28.3/CMakeCCompiler.cmake"
echo "CMAKE_BUILD_TYPE:STRING=Release" > "$B/CMakeCache.txt"
printf 'build ggml: phony bin/libggml.so\\nbuild llama: phony bin/libllama.so\\n' > "$B/build.ninja"
case "$ARGS" in *" -DLLAMA_BUILD_TOOLS=ON "*) printf 'build llama-server: phony bin/llama-server\\n' >> "$B/build.ninja";; esac
"""

FAKE_NINJA = """\
case "$1" in --version) echo "1.11.1"; exit 0;; esac
B="$2"
echo "$@" >> "$B/ninja-argv.log"
case "$FAKE_NINJA_MODE" in
  ok) for i in 1 2 3 4; do echo "[$i/4] Building CXX object x$i.o"; done
      touch "$B/bin/libggml.so" "$B/bin/libllama.so"; exit 0;;
  rmdir) echo "[1/4] Building CXX object a.o"; rm -rf "$B"; echo "FAILED: b.o"; exit 1;;
  full) echo "[1/4] Building CXX object a.o"; echo "FAILED: b.o"
        echo "/usr/bin/as: b.o: No space left on device"; echo "ninja: build stopped: subcommand failed."; exit 1;;
esac
"""


@pytest.fixture
def fake_toolchain(tmp_path, monkeypatch):
    bindir = tmp_path / "fakebin"
    bindir.mkdir()
    _script(bindir / "cmake", FAKE_CMAKE)
    _script(bindir / "ninja", FAKE_NINJA)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(toolchain, "_pypi_bin", lambda module, attr: None)
    monkeypatch.setattr(toolchain, "probe_cuda", _no_gpu)
    monkeypatch.delenv("CMAKE_ARGS", raising=False)
    src = tmp_path / "llama.cpp"
    (src / "include").mkdir(parents=True)
    monkeypatch.setattr(B, "prepare_source", lambda llama_src, allow, say=None: (src, "f" * 64))
    return tmp_path


def test_fake_build_then_up_to_date(fake_toolchain, monkeypatch):
    monkeypatch.setenv("FAKE_NINJA_MODE", "ok")
    out = io.StringIO()
    d = fake_toolchain / "b"
    first = B.build(build_dir=d, bindings=False, out=out)
    assert first.configured and not first.up_to_date and first.steps == 4
    m = read_manifest(d).data
    assert m["series_hash"] == "f" * 64 and m["libraries"] == {"ggml": str(d / "bin/libggml.so"),
                                                               "llama": str(d / "bin/libllama.so")}
    assert m["compilers"]["c"] == {"path": "/usr/bin/cc", "id": "GNU", "version": "12.2.0"}
    assert "no CUDA GPU is visible" in out.getvalue()
    # second run: no configure (state matches); the fake ninja still "builds", so
    # check only that CMake did not run
    second = B.build(build_dir=d, bindings=False, out=io.StringIO())
    assert not second.configured
    third = B.build(build_dir=d, bindings=False, out=io.StringIO(), cmake_args=["-DGGML_LTO=ON"])
    assert third.configured


def test_then_runs_while_the_build_still_holds_the_directory(fake_toolchain, monkeypatch):
    """`build --llama-cpp-python` makes its wheel in `then`: a concurrent build of the directory
    must wait for it (it copies the libraries and writes llama-cpp-python/ and dist/)."""
    monkeypatch.setenv("FAKE_NINJA_MODE", "ok")
    d = fake_toolchain / "b"
    seen = []

    def then(build_dir, manifest):
        with pytest.raises(BuildError, match="Another build is using"):
            with build_lock(build_dir, wait=False):
                pass
        seen.append((build_dir, manifest["series_hash"]))

    B.build(build_dir=d, bindings=False, out=io.StringIO(), then=then)
    assert seen == [(d, "f" * 64)]
    with build_lock(d, wait=False):  # released afterwards
        pass


def test_a_plain_build_keeps_the_tools_of_the_directory(fake_toolchain, monkeypatch):
    """`build` after `build --tools` used to drop the tools from the configuration, so
    the next `build --tools` recompiled them all (139 steps); issue 16.4."""
    monkeypatch.setenv("FAKE_NINJA_MODE", "ok")
    d = fake_toolchain / "b"
    first = B.build(build_dir=d, bindings=False, out=io.StringIO(), tools=True)
    assert first.configured
    out = io.StringIO()
    plain = B.build(build_dir=d, bindings=False, out=out)
    assert not plain.configured and "Keeping llama-cli, llama-server, llama-bench, llama-fit-params" in out.getvalue()
    assert read_manifest(d).data["cmake_options"]["LLAMA_BUILD_TOOLS"] == "ON"
    assert (d / "ninja-argv.log").read_text().splitlines()[-1].endswith("llama-server")  # and they are rebuilt
    again = B.build(build_dir=d, bindings=False, out=io.StringIO(), tools=True)
    assert not again.configured
    out = io.StringIO()
    removed = B.build(build_dir=d, bindings=False, out=out, tools=False)
    assert removed.configured and "Removing llama-cli" in out.getvalue()
    assert read_manifest(d).data["cmake_options"]["LLAMA_BUILD_TOOLS"] == "OFF"
    plain = B.build(build_dir=d, bindings=False, out=io.StringIO())
    assert not plain.configured


def test_a_later_build_keeps_the_defines_of_the_directory(fake_toolchain, monkeypatch, capsys, restore_logging):
    """README's workaround (`build --build-dir build/noamx -DGGML_NATIVE=OFF ...`) lost its -D options
    at the next `build --build-dir build/noamx --tools`, which compiled natively again (issue 26)."""
    monkeypatch.setenv("FAKE_NINJA_MODE", "ok")
    d = fake_toolchain / "noamx"
    B.build(build_dir=d, bindings=False, out=io.StringIO(), cmake_args=["-DGGML_NATIVE=OFF", "-DGGML_AVX2:BOOL=ON"])
    out = io.StringIO()
    with_tools = B.build(build_dir=d, bindings=False, out=out, tools=True)
    m = read_manifest(d).data
    assert m["cmake_options"]["GGML_NATIVE"] == "OFF" and m["cmake_options"]["LLAMA_BUILD_TOOLS"] == "ON"
    assert "-DGGML_AVX2:BOOL=ON" in m["cmake_configure"]  # with its type
    said = [line for line in out.getvalue().splitlines() if "-D options" in line]
    assert said == ["Keeping the -D options this directory was configured with: -DGGML_NATIVE=OFF "
                    "-DGGML_AVX2:BOOL=ON (a new -D of the same name overrides one; --reset-options drops them)."]
    assert with_tools.configured and "GGML_NATIVE" not in out.getvalue().split("Configuring")[1].splitlines()[0]
    assert not B.build(build_dir=d, bindings=False, out=io.StringIO()).configured  # tools and -D kept

    # --dry-run shows what a build would pass
    assert cli.main(["build", "--dry-run", "--build-dir", str(d)]) == 0
    shown = capsys.readouterr()
    assert json.loads(shown.out)["cmake_options"]["GGML_NATIVE"] == "OFF" and "Keeping the -D options" in shown.err

    out = io.StringIO()
    B.build(build_dir=d, bindings=False, out=out, cmake_args=["-DGGML_NATIVE=ON"])  # a new value wins
    assert read_manifest(d).data["cmake_options"]["GGML_NATIVE"] == "ON"
    assert "configured with: -DGGML_AVX2:BOOL=ON (" in out.getvalue()
    assert read_manifest(d).data["cmake_options"]["GGML_AVX2"] == "ON"

    out = io.StringIO()
    reset = B.build(build_dir=d, bindings=False, out=out, reset_options=True)
    assert reset.configured and "Dropping the -D options this directory was configured with (--reset-options): " \
        "-DGGML_AVX2:BOOL=ON -DGGML_NATIVE=ON" in out.getvalue()
    options = read_manifest(d).data["cmake_options"]
    assert "GGML_NATIVE" not in options and "GGML_AVX2" not in options and options["LLAMA_BUILD_TOOLS"] == "ON"
    out = io.StringIO()
    assert not B.build(build_dir=d, bindings=False, out=out).configured and "-D options" not in out.getvalue()


def test_build_type_and_cuda_arch_override_the_remembered_defines(tmp_path, monkeypatch):
    """--build-type and --cuda-arch win over a remembered -DCMAKE_BUILD_TYPE / -DCMAKE_CUDA_ARCHITECTURES,
    so the "Keeping ..." line must not list them; a remembered -D that undoes --portable says where it
    came from."""
    monkeypatch.setattr(toolchain, "probe_cuda", _h200)
    d = tmp_path / "b"
    d.mkdir()
    write_json(d / steps.STATE_NAME, {"argv": [], "user_defines": [
        "-DCMAKE_BUILD_TYPE=Debug", "-DCMAKE_CUDA_ARCHITECTURES=80", "-DGGML_LTO=ON"]})
    said = []
    plan = B.plan_for_directory(cuda=True, cuda_arch="90", build_type="Release", build_dir=d, env={},
                                say=said.append)
    assert plan.build_type == "Release" and plan.cuda_arch == "90" and plan.options["GGML_LTO"] == "ON"
    assert said == ["Keeping the -D options this directory was configured with: -DGGML_LTO=ON "
                    "(a new -D of the same name overrides one; --reset-options drops them)."]
    said.clear()
    plan = B.plan_for_directory(cuda=True, build_dir=d, env={}, say=said.append)  # nothing overrides them
    assert plan.build_type == "Debug" and plan.cuda_arch == "80"
    assert said == ["Keeping the -D options this directory was configured with: -DCMAKE_BUILD_TYPE=Debug "
                    "-DCMAKE_CUDA_ARCHITECTURES=80 -DGGML_LTO=ON (a new -D of the same name overrides one; "
                    "--reset-options drops them)."]

    write_json(d / steps.STATE_NAME, {"argv": [], "user_defines": ["-DGGML_BACKEND_DL=OFF"]})
    with pytest.raises(BuildError) as err:
        B.plan_for_directory(cuda=False, portable=True, build_dir=d, env={})
    assert "-DGGML_BACKEND_DL=OFF was given (remembered by this build directory; --reset-options drops it)" \
        in str(err.value)
    with pytest.raises(BuildError, match=r"was given \(from --cmake-arg or \$CMAKE_ARGS\)"):
        B.plan_for_directory(cuda=False, portable=True, build_dir=d, env={}, cmake_args=["-DGGML_NATIVE=ON"])
    assert B.plan_for_directory(cuda=False, portable=True, build_dir=d, env={}, reset_options=True).portable


def test_defines_of_a_directory_configured_before_they_were_recorded(tmp_path):
    """A configure state written before `user_defines` existed: the user's options are the -D of its
    command line that the tool does not set itself."""
    write_json(tmp_path / steps.STATE_NAME, {"argv": [
        "/x/cmake", "-S", "/src", "-B", str(tmp_path), "-G", "Ninja", "-DCMAKE_MAKE_PROGRAM=/x/ninja",
        "-DBUILD_SHARED_LIBS=ON", "-DLLAMA_BUILD_TOOLS=OFF", "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF",
        "-DGGML_AVX:BOOL=ON"]})
    assert steps.configured_user_defines(tmp_path) == ["-DGGML_NATIVE=OFF", "-DGGML_AVX:BOOL=ON"]
    write_json(tmp_path / steps.STATE_NAME, {"argv": ["/x/cmake", "-DGGML_NATIVE=OFF"], "user_defines": []})
    assert steps.configured_user_defines(tmp_path) == []


def test_build_help_documents_reset_options(capsys):
    assert cli.main(["build", "--help"]) == 0
    assert "--reset-options" in capsys.readouterr().out


def test_fake_build_disk_full(fake_toolchain, monkeypatch):
    monkeypatch.setenv("FAKE_NINJA_MODE", "full")
    out = io.StringIO()
    d = fake_toolchain / "b"
    with pytest.raises(BuildError) as err:
        B.build(build_dir=d, bindings=False, out=out)
    msg = str(err.value)
    assert "Compiling llama.cpp failed" in msg and "disk is full" in msg and str(d / "build.log") in msg
    assert "\n" not in msg  # one paragraph
    assert err.value.kind == "disk_full"
    assert "No space left on device" in out.getvalue()  # the tail of the log was shown
    assert not (d / "manifest.json").exists()


def test_a_build_directory_removed_while_building_is_one_clear_error(fake_toolchain, monkeypatch, capsys,
                                                                      restore_logging):
    """`rm -rf` of the directory mid-build printed "last 0 lines of build.log" (issue 26)."""
    monkeypatch.setenv("FAKE_NINJA_MODE", "rmdir")
    d = fake_toolchain / "b"
    assert cli.main(["build", "--no-bindings", "--build-dir", str(d)]) == 1
    err = capsys.readouterr().err
    assert "last 0 lines" not in err and "Traceback" not in err
    assert err.strip().splitlines()[-1] == (f"error: The build directory {d} was removed while building; "
                                            "run the build again to build it anew.")


REMOVING_HOLDER = """
import sys, shutil, time
from pathlib import Path
from pyllama_headinfer.build.lock import build_lock
d, waiting = Path(sys.argv[1]), Path(sys.argv[2])
with build_lock(d):
    print("locked", flush=True)
    deadline = time.monotonic() + 60
    while not waiting.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    shutil.rmtree(d)  # the user removes the directory while this build holds it
"""


def test_a_build_waiting_for_a_directory_that_is_removed_fails_clearly(fake_toolchain, monkeypatch, capsys,
                                                                       restore_logging):
    """The build that waited for the lock used to die on `[Errno 2] ... build.log` with exit status 2."""
    monkeypatch.setenv("FAKE_NINJA_MODE", "ok")
    d = fake_toolchain / "b"
    d.mkdir()
    waiting = fake_toolchain / "waiting"
    holder = subprocess.Popen([sys.executable, "-c", REMOVING_HOLDER, str(d), str(waiting)], stdout=subprocess.PIPE,
                              text=True, env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + sys.path)))
    try:
        assert holder.stdout.readline().strip() == "locked"

        class Signal(io.StringIO):  # tells the holder when this build waits
            def write(self, text):
                if "Waiting for another build" in text:
                    waiting.touch()
                return super().write(text)

        out = Signal()
        with pytest.raises(BuildError) as err:
            B.build(build_dir=d, bindings=False, out=out)
    finally:
        holder.wait(timeout=60)
    assert str(err.value) == (f"The build directory {d} was removed while another build was using it (this one "
                              "waited for it); run the build again to build it anew.")
    assert cli.exit_status(err.value) == 1
    assert not d.exists()  # and nothing was made in its place


# --------------------------------------------------------------------------
# a changed patch series: only what changed gets a new mtime (fake pin)


def test_changed_series_is_swapped_keeping_unchanged_files(fake_pin, isolated_cache, tmp_path, monkeypatch):
    tree = fake_pin.fresh_tree(tmp_path / "llama.cpp")
    first = tmp_path / "series1"  # only the first patch
    shutil.copytree(fake_pin.patches, first)
    names = read_series_names(fake_pin.patches)
    (first / "series").write_text(names[0] + "\n")
    monkeypatch.setenv(paths.PATCHES_ENV, str(first))
    said = []
    got, h1 = prepare_source(tree, False, said.append)
    assert got == tree.resolve() and h1 == series_hash(first)
    assert status(tree).state == State.APPLIED
    old = 1_000_000_000 * 1_500_000_000  # 2017: older than anything a build makes
    for rel in ("src/core.c", "src/headinfer.c", "include/hi/headinfer.h", "README.md"):
        os.utime(tree / rel, ns=(old, old))
    # no change: nothing touched
    prepare_source(tree, False, said.append)
    assert (tree / "src/core.c").stat().st_mtime_ns == old and not said

    monkeypatch.setenv(paths.PATCHES_ENV, str(fake_pin.patches))  # the series grows a patch
    _, h2 = prepare_source(tree, False, said.append)
    assert h2 != h1 and status(tree).state == State.APPLIED
    assert said and "patch series changed" in said[0]
    # untouched by the second patch: old mtimes kept; changed by it: new
    assert (tree / "src/headinfer.c").stat().st_mtime_ns == old
    assert (tree / "include/hi/headinfer.h").stat().st_mtime_ns == old
    assert (tree / "src/core.c").stat().st_mtime_ns > old
    assert (tree / "README.md").stat().st_mtime_ns > old
    assert not (tree / "docs/old.txt").exists()


# --------------------------------------------------------------------------
# the real CPU build (shared with .ci/run)


@pytest.fixture(scope="session")
def cpu_build_dir():
    """build/cpu of the checkout, built (incrementally) only when missing or stale.
    (Its own name: conftest's ``built`` is the loaded bindings.)"""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(paths.CACHE_ENV, str(REAL_CACHE))
        d = default_build_dir("cpu")
        try:
            find_manifest(d, require_current=True)
        except BuildError:
            B.build(build_dir=d, cuda=False)
    return d


@pytest.fixture
def real_cache(monkeypatch):
    monkeypatch.setenv(paths.CACHE_ENV, str(REAL_CACHE))


def test_manifest(cpu_build_dir):
    m = read_manifest(cpu_build_dir).data
    assert m["pin"] == {"build": pin.active().build, "commit": pin.active().commit}
    assert m["series_hash"] == series_hash()
    assert m["backend"] == "cpu" and m["config_key"] == "cpu" and m["build_dir"] == str(cpu_build_dir)
    assert {"llama", "ggml", "ggml-base", "ggml-cpu"} <= set(m["libraries"])
    for lib in m["libraries"].values():
        assert Path(lib).is_file() and Path(lib).parent == Path(m["lib_dir"])
    assert (Path(m["include_dirs"][0]) / "llama.h").is_file()
    assert all(Path(d).is_dir() for d in m["include_dirs"])
    assert Path(m["source_tree"]).is_dir()
    assert m["compilers"]["c"]["version"] and m["compilers"]["cxx"]["version"]
    assert m["cmake_options"]["BUILD_SHARED_LIBS"] == "ON"
    assert m["build_tools"]["cmake"]["version"] and m["build_tools"]["ninja"]["version"]
    assert m["duration_s"] >= 0 and m["built_at"]


def cpuinfo_flags() -> set:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {flag for line in text.splitlines() if line.startswith("flags") for flag in line.split(":", 1)[1].split()}


def test_manifest_records_the_cpu_kernels(cpu_build_dir):
    """The native build says what -march=native gave it: on an AMX Xeon (the CI machines) AMX is on."""
    m = read_manifest(cpu_build_dir)
    assert m.backend_dl is False and m.data["backend_modules"] == {}
    kernels = m.data["cpu_kernels"]
    assert kernels["kind"] == "native" and kernels["backend_dl"] is False
    assert [v["target"] for v in kernels["variants"]] == ["ggml-cpu"]
    variant = kernels["variants"][0]
    assert variant["flags"] == ["-march=native"] and variant["library"] is None
    features = set(variant["features"])  # asked from the compiler: never unknown with GCC/Clang
    cpu = cpuinfo_flags()
    if not cpu:
        pytest.skip("no /proc/cpuinfo flags to compare with")
    for flag, feature in (("avx2", "AVX2"), ("avx512f", "AVX512"), ("avx512_vnni", "AVX512_VNNI"),
                          ("amx_int8", "AMX_INT8")):
        assert (feature in features) == (flag in cpu), (flag, sorted(features))
    assert kernels["amx"] is ("amx_int8" in cpu and "avx512_vnni" in cpu)
    assert variant["amx"] is kernels["amx"]


def test_libllama_exports_the_headinfer_api(cpu_build_dir):
    m = read_manifest(cpu_build_dir).data
    lib = ctypes.CDLL(m["libraries"]["llama"])
    for symbol in ("llama_memory_get_kv_buffers", "llama_context_default_params"):
        assert hasattr(lib, symbol), symbol
    nm = shutil.which("nm")
    if nm:
        out = subprocess.run([nm, "-D", "--defined-only", m["libraries"]["llama"]], capture_output=True,
                             text=True, check=True).stdout
        assert " T llama_memory_get_kv_buffers" in out


PROBE_C = r"""
#include <stdio.h>
#include <stddef.h>
#include "llama.h"
int main(void) {
    struct llama_context_params p = llama_context_default_params();
    printf("%zu %g\n", offsetof(struct llama_context_params, headinfer_gpu_heads_frac),
           (double) p.headinfer_gpu_heads_frac);
    return 0;
}
"""


def test_context_params_carry_gpu_heads_frac(cpu_build_dir, tmp_path):
    m = read_manifest(cpu_build_dir).data
    cc = (m["compilers"]["c"] or {}).get("path") or "cc"
    (tmp_path / "probe.c").write_text(PROBE_C)
    cmd = [cc, "probe.c", "-o", "probe", *(f"-I{d}" for d in m["include_dirs"]),
           f"-L{m['lib_dir']}", "-lllama", f"-Wl,-rpath,{m['lib_dir']}"]
    compiled = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True)
    assert compiled.returncode == 0, compiled.stderr
    ran = subprocess.run([str(tmp_path / "probe")], capture_output=True, text=True, check=True)
    offset, default = ran.stdout.split()
    assert int(offset) > 0
    assert float(default) == 1.0


def test_noop_rebuild_is_up_to_date(cpu_build_dir, real_cache):
    out = io.StringIO()
    result = B.build(build_dir=cpu_build_dir, cuda=False, out=out)
    assert result.up_to_date and not result.configured and result.steps == 0, out.getvalue()
    assert "Up to date" in out.getvalue()
    assert out.getvalue().splitlines()[-1].startswith("CPU kernels: native (-march=native): ")
    log = (cpu_build_dir / "build.log").read_text()
    # with the tools, upstream's web-UI step runs at every build: the only step allowed
    assert ("no work to do" in log or "Provisioning UI assets" in log) and "Building" not in log \
        and "Linking" not in log
    assert read_manifest(cpu_build_dir).data["up_to_date"] is True


def test_failing_configure_gives_a_clear_error(real_cache, tmp_path, capsys, restore_logging):
    d = tmp_path / "bad"
    rc = cli.main(["build", "--no-cuda", "--no-bindings", "--build-dir", str(d),
                   "--cmake-arg=-DCMAKE_C_COMPILER=/nonexistent"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: Configuring llama.cpp with CMake failed")
    assert "compiler" in last and str(d / "build.log") in last
    assert "/nonexistent" in err  # the tail of the log was printed
    assert not (d / "manifest.json").exists()
