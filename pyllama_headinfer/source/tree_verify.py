"""Whether a tree on disk is the pinned llama.cpp commit, file by file.

A tree *is the pin* when every file's git blob id and mode equal the packaged
``git ls-tree -r`` listing of the pin (:meth:`pin.Pin.files`),
with no file missing or extra; a top-level ``.git`` (dir or gitfile) is
ignored. The listing itself is checked: the git tree id rebuilt from it must
equal the pin's tree (and the tree its commit object names, where packaged)
(:func:`check_pin_listing`).

Here: git blob and tree hashing (:func:`hash_file`, :func:`git_tree_id`),
scanning a tree (:func:`scan_tree`), comparing listings (:class:`TreeDiff`,
:func:`compare_listings`) and :func:`verify_tree`, which does all three.

Hashing the ~176 MB tree takes about a second, so blob ids are remembered in a
stat cache (size, mtime, ctime, inode -> blob id) kept in the cache directory,
keyed by the tree's absolute path, never inside the tree.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Mapping, Optional, Tuple, Union

from pyllama_headinfer import paths, pin
from pyllama_headinfer.errors import SourceError
from pyllama_headinfer.pin import PinnedFile

# the name it had before this code moved out of source.py
log = logging.getLogger("pyllama_headinfer.source")

STAT_CACHE_VERSION = 1
# A file whose mtime is this close to the scan is not cached: it could still
# be changed within the same timestamp tick without its mtime moving.
RACY_WINDOW_NS = 2_000_000_000
DIFF_EXAMPLES = 5

PathLike = Union[str, "os.PathLike[str]"]
Listing = Mapping[str, PinnedFile]

MODE_FILE = "100644"
MODE_EXEC = "100755"
MODE_LINK = "120000"
MODE_TREE = "40000"
MODE_SPECIAL = "special"  # fifo, socket, device: never part of a git tree


# --------------------------------------------------------------------------
# git object hashing


def git_blob_id(data: bytes) -> str:
    """The id git gives a blob with this content."""
    return pin.git_object_id("blob", data)


def hash_file(path: PathLike, size: Optional[int] = None) -> str:
    """Git blob id of a regular file, read in chunks."""
    if size is None:
        size = os.stat(path).st_size
    digest = hashlib.sha1(b"blob %d\0" % size)
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def git_tree_id(listing: Listing) -> str:
    """The root tree id git would build from a flat ``path -> (mode, blob)`` listing."""
    root: dict = {}
    for path, entry in listing.items():
        *dirs, name = path.split("/")
        node = root
        for part in dirs:
            node = node.setdefault(part, {})
        node[name] = entry
    return _hash_tree_node(root)


def _hash_tree_node(node: dict) -> str:
    def sort_key(item: Tuple[str, object]) -> bytes:
        # git compares a subtree's name as if it ended in "/"
        name, value = item
        raw = name.encode("utf-8", "surrogateescape")
        return raw + b"/" if isinstance(value, dict) else raw

    payload = bytearray()
    for name, value in sorted(node.items(), key=sort_key):
        if isinstance(value, dict):
            mode, object_id = MODE_TREE, _hash_tree_node(value)
        else:
            mode, object_id = value.mode, value.blob
        payload += f"{mode} ".encode() + name.encode("utf-8", "surrogateescape") + b"\0"
        payload += bytes.fromhex(object_id)
    return pin.git_object_id("tree", bytes(payload))


_proven_listings: set = set()


def check_pin_listing(chosen: Optional[pin.Pin] = None) -> None:
    """Prove the packaged listing of a pin (default: the active one) is its tree, and where the
    commit object is packaged, that the commit names that tree (once per process and pin)."""
    chosen = chosen or pin.active()
    if chosen.build in _proven_listings:
        return
    rebuilt = git_tree_id(chosen.files())
    named = pin.commit_tree(chosen)
    if rebuilt != chosen.tree or named not in (None, chosen.tree):
        raise SourceError(
            f"the packaged file listing of llama.cpp {chosen.build} hashes to tree {rebuilt}, but the pin "
            f"names tree {chosen.tree}" + (f" and its commit tree {named}" if named else "") +
            ": the package data is corrupt"
        )
    _proven_listings.add(chosen.build)


# --------------------------------------------------------------------------
# scanning a tree on disk (with a stat cache)


def _stat_cache_file(tree: Path) -> Path:
    key = hashlib.sha256(str(tree).encode("utf-8", "surrogateescape")).hexdigest()[:32]
    return paths.cache_dir() / "statcache" / f"{key}.json"


def _load_stat_cache(tree: Path) -> Dict[str, list]:
    try:
        data = json.loads(_stat_cache_file(tree).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if data.get("version") != STAT_CACHE_VERSION or data.get("tree") != str(tree):
        return {}
    entries = data.get("entries")
    return entries if isinstance(entries, dict) else {}


def _save_stat_cache(tree: Path, entries: Dict[str, list]) -> None:
    target = _stat_cache_file(tree)
    payload = {"version": STAT_CACHE_VERSION, "tree": str(tree), "entries": entries}
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, temp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-")
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(payload, handle, separators=(",", ":"))
        os.replace(temp, target)
    except OSError as exc:  # a cache that cannot be written only costs time
        log.debug("could not write the stat cache %s: %s", target, exc)


def forget_stat_cache(tree: PathLike) -> None:
    """Drop the remembered blob ids of a tree (after deleting or replacing it)."""
    try:
        _stat_cache_file(Path(tree).resolve()).unlink()
    except OSError:
        pass


def move_stat_cache(old: Path, new: Path) -> None:
    """A renamed tree keeps its files' inodes and times: keep their blob ids too."""
    entries = _load_stat_cache(old)
    forget_stat_cache(old)
    if entries:
        _save_stat_cache(new, entries)


def _walk(tree: Path) -> Iterator[Tuple[str, str, os.stat_result]]:
    """(relative posix path, absolute path, lstat) of every non-directory entry."""
    pending: List[Tuple[str, str]] = [("", str(tree))]
    while pending:
        prefix, directory = pending.pop()
        with os.scandir(directory) as entries:
            for entry in entries:
                relative = prefix + entry.name
                if relative == ".git":
                    continue  # the tree's own repository (dir or gitfile) is not content
                if entry.is_dir(follow_symlinks=False):
                    pending.append((relative + "/", entry.path))
                else:
                    yield relative, entry.path, entry.stat(follow_symlinks=False)


def _git_mode(st: os.stat_result) -> str:
    if stat.S_ISLNK(st.st_mode):
        return MODE_LINK
    if stat.S_ISREG(st.st_mode):
        return MODE_EXEC if st.st_mode & stat.S_IXUSR else MODE_FILE
    return MODE_SPECIAL


def _blob_of(absolute: str, st: os.stat_result, mode: str) -> str:
    if mode == MODE_LINK:
        return git_blob_id(os.fsencode(os.readlink(absolute)))
    if mode == MODE_SPECIAL:
        return "0" * 40
    return hash_file(absolute, st.st_size)


def scan_tree(tree: PathLike, *, use_cache: bool = True) -> Dict[str, PinnedFile]:
    """``path -> (mode, blob id)`` of every file in ``tree``, like ``git ls-tree -r``."""
    root = Path(tree).resolve()
    if not root.is_dir():
        raise SourceError(f"{root} is not a directory")
    previous = _load_stat_cache(root) if use_cache else {}
    racy_after = time.time_ns() - RACY_WINDOW_NS
    remembered: Dict[str, list] = {}
    listing: Dict[str, PinnedFile] = {}
    hashed = 0
    for relative, absolute, st in _walk(root):
        mode = _git_mode(st)
        key = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
        cached = previous.get(relative)
        if cached is not None and cached[:4] == key:
            blob = cached[4]
        else:
            try:
                blob = _blob_of(absolute, st, mode)
            except OSError as exc:
                raise SourceError(f"cannot read {absolute}: {exc}") from exc
            hashed += 1
        listing[relative] = PinnedFile(mode, blob)
        if st.st_mtime_ns < racy_after:
            remembered[relative] = key + [blob]
    if use_cache and remembered != previous:
        _save_stat_cache(root, remembered)
    log.debug("scanned %s: %d files, %d hashed", root, len(listing), hashed)
    return listing


# --------------------------------------------------------------------------
# comparing a tree with the pin


@dataclass(frozen=True)
class TreeDiff:
    """How a tree differs from an expected listing (all empty: identical)."""

    missing: Tuple[str, ...] = ()
    extra: Tuple[str, ...] = ()
    differing: Tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not (self.missing or self.extra or self.differing)

    @property
    def paths(self) -> Tuple[str, ...]:
        return tuple(sorted(self.missing + self.extra + self.differing))

    def describe(self, limit: int = DIFF_EXAMPLES) -> str:
        """One line per kind of difference, naming at most ``limit`` files each."""
        if self.ok:
            return "identical"
        parts = []
        for label, items in (
            ("differing", self.differing),
            ("missing", self.missing),
            ("extra", self.extra),
        ):
            if items:
                shown = ", ".join(items[:limit])
                more = f", ... ({len(items) - limit} more)" if len(items) > limit else ""
                parts.append(f"{len(items)} {label}: {shown}{more}")
        return "; ".join(parts)


def compare_listings(actual: Listing, expected: Listing) -> TreeDiff:
    missing = sorted(set(expected) - set(actual))
    extra = sorted(set(actual) - set(expected))
    differing = sorted(p for p in set(actual) & set(expected) if actual[p] != expected[p])
    return TreeDiff(tuple(missing), tuple(extra), tuple(differing))


def verify_tree(tree: PathLike, chosen: Optional[pin.Pin] = None) -> TreeDiff:
    """Compare a tree on disk with a pin (default: the active one), checking its listing first."""
    chosen = chosen or pin.active()
    check_pin_listing(chosen)
    return compare_listings(scan_tree(tree), chosen.files())
