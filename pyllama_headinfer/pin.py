"""The one place that declares which llama.cpp trees this project patches.

A pin is *content*, not history: a build number, the upstream commit where it
is known, and the git tree id of its files. Any source that produces that
tree -- GitHub's archive of the commit, the copy an sdist vendors, a local
checkout -- is accepted after the same file-by-file check
(:mod:`pyllama_headinfer.source`): ``data/llama.cpp-<build>.tree`` lists every
file's mode and git blob id (``git ls-tree -r`` lines), the tree id rebuilt
from that listing must equal the pin's ``tree``, and a tree on disk is the pin
when every file matches the listing with none missing or extra.

Where the raw git commit object is packaged too
(``data/llama.cpp-<build>.commit``), its SHA-1 must be the pin's commit and its
``tree`` line the pin's tree, which ties the listing to upstream's history.
A pin whose only reachable source has no git metadata (an sdist) has no
commit here: its tree id is what identifies it.

Each pin has its own patch series, ``patches/<build>/`` (see
:func:`pyllama_headinfer.paths.patches_dir`). :data:`DEFAULT_PIN` is used
unless ``$PYLLAMA_HEADINFER_PIN`` or a command's ``--pin`` names another one.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Dict, Iterator, Optional, Tuple

from pyllama_headinfer.errors import UsageError

PIN_ENV = "PYLLAMA_HEADINFER_PIN"


@dataclass(frozen=True)
class PinnedFile:
    mode: str  # git mode: "100644", "100755" or "120000"
    blob: str  # git blob id (sha1 hex)


@dataclass(frozen=True)
class Sdist:
    """A PyPI source distribution that vendors a pin's tree in ``subdir``."""

    name: str
    version: str
    subdir: str

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"


@dataclass(frozen=True)
class Pin:
    build: str  # upstream's build number, "b11312"
    commit: Optional[str]  # upstream commit id; None when no reachable source carries git metadata
    tree: str  # git tree id of the files: what every source is verified against
    date: str  # the upstream build's date
    sdists: Tuple[Sdist, ...]  # PyPI sdists that vendor exactly this tree, tried in order

    @property
    def github_archive_url(self) -> Optional[str]:
        if self.commit is None:
            return None
        return f"https://github.com/ggml-org/llama.cpp/archive/{self.commit}.tar.gz"

    @property
    def ident(self) -> str:
        """What identifies the pin in build stamps: the commit, else ``tree:<tree id>``."""
        return self.commit or f"tree:{self.tree}"

    @property
    def short(self) -> str:
        """``b11312 (0c1e57098bba)`` -- for messages."""
        return f"{self.build} ({(self.commit or 'tree ' + self.tree)[:12 if self.commit else 17]})"

    @property
    def source_dirname(self) -> str:
        """Name of the cached source tree directory."""
        return f"llama.cpp-{self.build}-{(self.commit or self.tree)[:12]}"

    def files(self) -> Dict[str, PinnedFile]:
        """Path -> (mode, blob) of every file of the pin (packaged listing)."""
        return _read_listing(f"llama.cpp-{self.build}.tree")

    def commit_object(self) -> Optional[bytes]:
        """The packaged raw git commit object, where the pin has one."""
        if self.commit is None:
            return None
        return _data(f"llama.cpp-{self.build}.commit")


PINS: Dict[str, Pin] = {
    pin.build: pin
    for pin in (
        Pin("b11312", "0c1e57098bba43ac29e6e3b677cdceebdd22334f", "b2da53584951ec8aa40680229509a6646a637560",
            "2026-10-01", (Sdist("llama-cpp-python", "0.3.36", "vendor/llama.cpp"),)),
        # The xllamacpp sdist vendors b11549 without git metadata: its commit is not known here.
        Pin("b11549", None, "ee320e359dbb0816d6bd0d873585a3ca932e9313",
            "2026-10-11", (Sdist("xllamacpp", "2026.10.11549", "thirdparty/llama.cpp"),)),
    )
}
DEFAULT_PIN = "b11312"


def get(build: str) -> Pin:
    """The pin named ``build``; :class:`UsageError` naming the known ones otherwise."""
    try:
        return PINS[build]
    except KeyError:
        raise UsageError(f"unknown pin {build!r}; known pins: {', '.join(PINS)} (default {DEFAULT_PIN})") from None


def active() -> Pin:
    """``$PYLLAMA_HEADINFER_PIN``, else :data:`DEFAULT_PIN`."""
    return get(os.environ.get(PIN_ENV) or DEFAULT_PIN)


@contextlib.contextmanager
def using(build: Optional[str]) -> Iterator[None]:
    """Make ``build`` the active pin for a while (``$PYLLAMA_HEADINFER_PIN``, so child processes
    agree), then restore the environment; None changes nothing."""
    before = os.environ.get(PIN_ENV)
    try:
        if build is not None:
            os.environ[PIN_ENV] = build
        yield
    finally:
        if before is None:
            os.environ.pop(PIN_ENV, None)
        else:
            os.environ[PIN_ENV] = before


def _data(name: str) -> bytes:
    return resources.files("pyllama_headinfer").joinpath("data", name).read_bytes()


def git_object_id(kind: str, payload: bytes) -> str:
    """The id git gives an object of ``kind`` ("blob", "tree", "commit")."""
    header = f"{kind} {len(payload)}\0".encode()
    return hashlib.sha1(header + payload).hexdigest()


def commit_tree(pin: Pin) -> Optional[str]:
    """The root tree the packaged commit object names (after checking it hashes to the commit)."""
    raw = pin.commit_object()
    if raw is None:
        return None
    if git_object_id("commit", raw) != pin.commit:
        raise RuntimeError(f"packaged commit object of {pin.build} does not hash to {pin.commit}")
    kind, tree = raw.split(b"\n", 1)[0].decode().split(" ")
    assert kind == "tree"
    return tree


@lru_cache(maxsize=None)
def _read_listing(name: str) -> Dict[str, PinnedFile]:
    """Path -> (mode, blob) of a packaged tree listing (``git ls-tree -r`` lines: mode, "blob", id, path)."""
    files = {}
    for line in _data(name).decode().splitlines():
        meta, path = line.split("\t", 1)
        mode, kind, blob = meta.split(" ")
        if kind != "blob":
            raise RuntimeError(f"unexpected {kind} entry in the listing {name}: {path}")
        files[path] = PinnedFile(mode, blob)
    return files


# The Python layer of the llama-cpp-python sdist (llama_cpp/, its server, tests, packaging:
# everything but vendor/), which `build --llama-cpp-python` patches with the series in
# patches/llama-cpp-python. That sdist vendors the default pin (b11312), so the Python layer goes
# with that pin only. Pinned like the C tree: data/llama-cpp-python-<version>.tree lists every
# file's mode and git blob id, as extracted from the sdist.
PYTHON_LAYER_SDIST = Sdist("llama-cpp-python", "0.3.36", "")
PYTHON_LAYER_PIN = "b11312"
SDIST_PYTHON_EXCLUDE = ("vendor",)
PYTHON_LAYER_DIRNAME = f"llama-cpp-python-{PYTHON_LAYER_SDIST.version}"


def python_layer_files() -> Dict[str, PinnedFile]:
    """Path -> (mode, blob) of every file of the sdist's Python layer (all but vendor/)."""
    return _read_listing(f"llama-cpp-python-{PYTHON_LAYER_SDIST.version}.tree")
