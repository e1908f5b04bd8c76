"""The one place that declares which llama.cpp this project patches.

The pin is anchored cryptographically: ``data/llama.cpp-<build>.commit`` is
the raw git commit object, whose SHA-1 *is* the pinned commit id, and whose
``tree`` line names the root tree. ``data/llama.cpp-<build>.tree`` is
``git ls-tree -r`` of that commit (mode, blob id, path of every file); the
git tree hash rebuilt from it must equal the commit's tree. A source tree on
disk is the pin when every file's git blob id matches this listing and no
file is missing or extra (see :mod:`pyllama_headinfer.source`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

LLAMA_CPP_BUILD = "b11312"
LLAMA_CPP_COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"

# Sources that carry the pinned commit.
GITHUB_ARCHIVE_URL = f"https://github.com/ggml-org/llama.cpp/archive/{LLAMA_CPP_COMMIT}.tar.gz"
SDIST_NAME = "llama-cpp-python"
SDIST_VERSION = "0.3.36"  # its vendor/llama.cpp is exactly the pinned commit
SDIST_SUBDIR = "vendor/llama.cpp"

# Name of the source tree directory we create (cache) for the pin.
SOURCE_DIRNAME = f"llama.cpp-{LLAMA_CPP_BUILD}-{LLAMA_CPP_COMMIT[:12]}"


@dataclass(frozen=True)
class PinnedFile:
    mode: str  # git mode: "100644", "100755" or "120000"
    blob: str  # git blob id (sha1 hex)


def _data(name: str) -> bytes:
    return resources.files("pyllama_headinfer").joinpath("data", name).read_bytes()


def git_object_id(kind: str, payload: bytes) -> str:
    """The id git gives an object of ``kind`` ("blob", "tree", "commit")."""
    header = f"{kind} {len(payload)}\0".encode()
    return hashlib.sha1(header + payload).hexdigest()


@lru_cache(maxsize=1)
def commit_object() -> bytes:
    return _data(f"llama.cpp-{LLAMA_CPP_BUILD}.commit")


@lru_cache(maxsize=1)
def pinned_tree_id() -> str:
    """The root tree id named by the pinned commit (after checking the commit id)."""
    raw = commit_object()
    if git_object_id("commit", raw) != LLAMA_CPP_COMMIT:
        raise RuntimeError("packaged commit object does not hash to the pinned commit")
    first = raw.split(b"\n", 1)[0].decode()
    kind, tree = first.split(" ")
    assert kind == "tree"
    return tree


def _read_listing(name: str) -> dict[str, PinnedFile]:
    """Path -> (mode, blob) of a packaged tree listing (``git ls-tree -r`` lines: mode, "blob", id, path)."""
    files = {}
    for line in _data(name).decode().splitlines():
        meta, path = line.split("\t", 1)
        mode, kind, blob = meta.split(" ")
        if kind != "blob":
            raise RuntimeError(f"unexpected {kind} entry in the listing {name}: {path}")
        files[path] = PinnedFile(mode, blob)
    return files


@lru_cache(maxsize=1)
def pinned_files() -> dict[str, PinnedFile]:
    """Path -> (mode, blob) of every file in the pinned commit."""
    return _read_listing(f"llama.cpp-{LLAMA_CPP_BUILD}.tree")


# The Python layer of the same sdist (llama_cpp/, its server, tests, packaging: everything but
# vendor/), which `build --llama-cpp-python` patches with the series in patches/llama-cpp-python.
# Pinned like the C tree: data/llama-cpp-python-<version>.tree lists every file's mode and git
# blob id, as extracted from the sdist.
SDIST_PYTHON_EXCLUDE = ("vendor",)
PYTHON_LAYER_DIRNAME = f"llama-cpp-python-{SDIST_VERSION}"


@lru_cache(maxsize=1)
def python_layer_files() -> dict[str, PinnedFile]:
    """Path -> (mode, blob) of every file of the sdist's Python layer (all but vendor/)."""
    return _read_listing(f"llama-cpp-python-{SDIST_VERSION}.tree")
