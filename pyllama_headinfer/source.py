"""Get a verified copy of the pinned llama.cpp source tree.

A tree *is the pin* when every file's git blob id and mode equal the packaged
``git ls-tree -r`` listing of the pinned commit (:func:`pin.pinned_files`),
with no file missing or extra; a top-level ``.git`` (dir or gitfile) is
ignored. The listing itself is checked against the commit: the git tree id
rebuilt from it must equal the tree the commit object names.

:func:`ensure_source` tries, in order, and verifies each before use:

1. an explicit tree (``llama_src`` argument or ``$PYLLAMA_HEADINFER_LLAMA_SRC``);
2. the tree cached by an earlier fetch, ``cache_dir()/src/<SOURCE_DIRNAME>``;
3. GitHub's archive of the commit (``$PYLLAMA_HEADINFER_ARCHIVE_URL`` overrides);
4. the llama-cpp-python sdist from PyPI, whose ``vendor/llama.cpp`` is the pin
   (``$PYLLAMA_HEADINFER_PIP_ARGS`` adds arguments to ``pip download``, e.g.
   ``--find-links DIR --no-index``).

A tree is acceptable when it is pristine or carries exactly our patch series
(see :func:`pyllama_headinfer.patches.status`), so a patched cache is reused.

Hashing the ~176 MB tree takes about a second, so blob ids are remembered in a
stat cache (size, mtime, ctime, inode -> blob id) kept in the cache directory,
keyed by the tree's absolute path, never inside the tree.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import logging
import os
import posixpath
import shlex
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Tuple, Union

from . import paths, pin
from .errors import HeadInferError, PatchError, SourceError
from .pin import PinnedFile

log = logging.getLogger(__name__)

LLAMA_SRC_ENV = "PYLLAMA_HEADINFER_LLAMA_SRC"
ARCHIVE_URL_ENV = "PYLLAMA_HEADINFER_ARCHIVE_URL"
PIP_ARGS_ENV = "PYLLAMA_HEADINFER_PIP_ARGS"

CONNECT_TIMEOUT_S = 10
READ_TIMEOUT_S = 60
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


def check_pin_listing() -> None:
    """Prove the packaged listing is the pinned commit's tree (once per process)."""
    listing = pin.pinned_files()
    expected = pin.pinned_tree_id()
    key = (id(listing), len(listing), expected)  # pin.pinned_files() is cached: same object
    if key in _proven_listings:
        return
    rebuilt = git_tree_id(listing)
    if rebuilt != expected:
        raise SourceError(
            f"the packaged file listing of llama.cpp {pin.LLAMA_CPP_BUILD} hashes to tree "
            f"{rebuilt}, but the pinned commit names tree {expected}: the package data is corrupt"
        )
    _proven_listings.add(key)


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


def _move_stat_cache(old: Path, new: Path) -> None:
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


def verify_tree(tree: PathLike) -> TreeDiff:
    """Compare a tree on disk with the pinned commit (checking the listing first)."""
    check_pin_listing()
    return compare_listings(scan_tree(tree), pin.pinned_files())


def tree_acceptance(tree: PathLike) -> Tuple[bool, str]:
    """(usable, description): usable when pristine or exactly our series applied."""
    diff = verify_tree(tree)
    if diff.ok:
        return True, "pristine"
    from . import patches  # patches builds on this module

    try:
        report = patches.status(tree)
    except PatchError as exc:
        return False, f"not the pin ({diff.describe()}); patch state unknown: {exc}"
    if report.state == patches.State.APPLIED:
        return True, "patch series applied"
    return False, report.describe()


# --------------------------------------------------------------------------
# where things go in the cache


def cached_tree_path() -> Path:
    return paths.cache_dir() / "src" / pin.SOURCE_DIRNAME


def downloads_dir() -> Path:
    return paths.cache_dir() / "downloads"


def archive_url() -> str:
    return os.environ.get(ARCHIVE_URL_ENV) or pin.GITHUB_ARCHIVE_URL


# --------------------------------------------------------------------------
# safe extraction


def _strip_top(name: str) -> Tuple[str, str]:
    top, _, rest = name.partition("/")
    return top, rest


def _check_member(member: tarfile.TarInfo, relative: str) -> None:
    """Refuse anything that could land outside the destination or is not plain data."""
    name = member.name
    if name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":"):
        raise SourceError(f"unsafe archive member {name!r}: absolute path")
    if ".." in name.replace("\\", "/").split("/"):
        raise SourceError(f"unsafe archive member {name!r}: '..' in path")
    if not (member.isfile() or member.isdir() or member.issym() or member.islnk()):
        raise SourceError(f"unsafe archive member {name!r}: device, fifo or other special file")
    if member.issym():
        target = member.linkname
        resolved = posixpath.normpath(posixpath.join(posixpath.dirname(relative), target))
        if target.startswith("/") or resolved == ".." or resolved.startswith("../"):
            raise SourceError(f"unsafe archive member {name!r}: symlink to {target!r} leaves the tree")
    if member.islnk():
        target = member.linkname
        if target.startswith("/") or ".." in target.split("/"):
            raise SourceError(f"unsafe archive member {name!r}: hard link to {target!r}")


def extract_subtree(archive: PathLike, destination: PathLike, subdir: str = "") -> int:
    """Extract ``<top>/<subdir>/...`` of a tar archive into ``destination``.

    Every member must sit under one common top-level directory (GitHub archives
    and sdists do); its ``subdir`` part is stripped. Unsafe members anywhere
    in the archive abort the extraction; the caller extracts into a temporary
    directory so an aborted extraction never reaches the final place. A
    ``.git`` at the subtree's top is skipped: in an sdist it is a gitfile
    pointing outside the subtree, which would break git commands run inside.
    Returns the number of members extracted.
    """
    dest = Path(destination)
    prefix = subdir.strip("/") + "/" if subdir.strip("/") else ""
    top_dir: Optional[str] = None
    extracted = 0
    try:
        with tarfile.open(archive, "r:*") as tar:
            for member in tar:
                if member.type in (tarfile.XGLTYPE, tarfile.XHDTYPE):
                    continue
                top, rest = _strip_top(member.name.rstrip("/"))
                _check_member(member, rest)
                if top_dir is None:
                    top_dir = top
                elif top != top_dir:
                    raise SourceError(
                        f"unexpected archive layout: {member.name!r} is not under {top_dir!r}/"
                    )
                if not rest.startswith(prefix) or rest == prefix.rstrip("/"):
                    continue
                relative = rest[len(prefix):]
                if relative == ".git" or relative.startswith(".git/"):
                    continue
                _extract_member(tar, member, relative, prefix, top_dir, dest)
                extracted += 1
    except tarfile.TarError as exc:
        raise SourceError(f"cannot extract {archive}: {exc}") from exc
    if not extracted:
        where = f"{top_dir}/{prefix}" if top_dir else "(empty archive)"
        raise SourceError(f"{archive} holds nothing under {where}")
    return extracted


def _extract_member(tar, member, relative, prefix, top_dir, dest: Path) -> None:
    renamed = copy.copy(member)
    renamed.name = relative
    if member.islnk():
        link_top, link_rest = _strip_top(member.linkname)
        if link_top != top_dir or not link_rest.startswith(prefix):
            raise SourceError(f"unsafe archive member {member.name!r}: hard link leaves the subtree")
        renamed.linkname = link_rest[len(prefix):]
    if hasattr(tarfile, "data_filter"):  # Python >= 3.12, and 3.8-3.11 security releases
        tar.extract(renamed, path=dest, filter="data")
    else:
        tar.extract(renamed, path=dest)


# --------------------------------------------------------------------------
# fetching


def _download_github_archive(downloads: Path) -> Tuple[Path, str]:
    target = downloads / f"llama.cpp-{pin.LLAMA_CPP_COMMIT}.tar.gz"
    if target.is_file():
        log.info("using the archive downloaded earlier: %s", target)
        return target, ""
    import requests  # imported here: only this source needs it

    url = archive_url()
    log.info("downloading %s", url)
    fd, name = tempfile.mkstemp(dir=downloads, prefix=f".{target.name}.", suffix=".part")
    partial = Path(name)
    try:
        with os.fdopen(fd, "wb") as handle, requests.get(
            url, stream=True, timeout=(CONNECT_TIMEOUT_S, READ_TIMEOUT_S)
        ) as response:
            response.raise_for_status()
            for chunk in response.iter_content(chunk_size=1 << 20):
                handle.write(chunk)
    except requests.RequestException as exc:
        partial.unlink(missing_ok=True)
        raise SourceError(f"download failed: {exc}") from exc
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, target)
    log.info("downloaded %s (%.1f MB)", target.name, target.stat().st_size / 1e6)
    return target, ""


def _find_sdist(downloads: Path) -> Optional[Path]:
    for name in (pin.SDIST_NAME.replace("-", "_"), pin.SDIST_NAME):
        candidate = downloads / f"{name}-{pin.SDIST_VERSION}.tar.gz"
        if candidate.is_file():
            return candidate
    return None


def pip_download_command(downloads: Path) -> List[str]:
    extra = shlex.split(os.environ.get(PIP_ARGS_ENV, ""))
    return [
        # --no-binary for this package only: ":all:" would also make pip build the sdist's build
        # requirements (CMake!) from source just to read its metadata -- over 20 minutes on 2 cores
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", pin.SDIST_NAME,
        "--dest", str(downloads), *extra, f"{pin.SDIST_NAME}=={pin.SDIST_VERSION}",
    ]


def _download_sdist(downloads: Path) -> Tuple[Path, str]:
    found = _find_sdist(downloads)
    if found is None:
        command = pip_download_command(downloads)
        log.info("downloading the %s %s sdist with pip (about a minute)", pin.SDIST_NAME, pin.SDIST_VERSION)
        log.debug("running %s", shlex.join(command))
        result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if result.returncode != 0:
            tail = "\n".join(result.stdout.strip().splitlines()[-5:])
            raise SourceError(f"pip download failed (exit {result.returncode}): {tail}")
        found = _find_sdist(downloads)
        if found is None:
            raise SourceError(f"pip download succeeded but left no {pin.SDIST_NAME} sdist in {downloads}")
    else:
        log.info("using the sdist downloaded earlier: %s", found)
    return found, pin.SDIST_SUBDIR


@dataclass
class _Fetcher:
    label: str
    download: Callable[[Path], Tuple[Path, str]]  # downloads dir -> (archive, subdir to extract)


def _remote_sources() -> List[_Fetcher]:
    return [
        _Fetcher(f"GitHub archive {archive_url()}", _download_github_archive),
        _Fetcher(f"PyPI sdist {pin.SDIST_NAME}=={pin.SDIST_VERSION}", _download_sdist),
    ]


def _install_tree(staged: Path, final: Path, replace: bool) -> Path:
    """Rename a verified staged tree into place.

    An existing tree is replaced only when asked (``fetch --force``); otherwise
    it was installed by a concurrent fetch, and that one is kept.
    """
    old = None
    if final.exists() and not replace:
        log.info("another process installed %s meanwhile; keeping it", final)
        return final
    if final.exists():
        old = final.with_name(f".old-{final.name}-{os.getpid()}")
        os.rename(final, old)
    os.rename(staged, final)
    _move_stat_cache(staged, final)
    if old is not None:
        forget_stat_cache(old)
        shutil.rmtree(old, ignore_errors=True)
    return final


def _fetch_one(fetcher: _Fetcher, downloads: Path, final: Path, replace: bool) -> Path:
    archive, subdir = fetcher.download(downloads)
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=final.parent, prefix=".staging-"))
    try:
        tree = staging / final.name
        tree.mkdir()
        log.info("extracting %s", archive.name)
        try:
            extract_subtree(archive, tree, subdir)
            diff = verify_tree(tree)
            if not diff.ok:
                raise SourceError(f"the extracted tree is not the pin ({diff.describe()})")
        except SourceError as exc:
            # a corrupt, unsafe or wrong archive must not satisfy the next attempt
            archive.unlink(missing_ok=True)
            raise SourceError(f"{exc}; deleted {archive.name}") from exc
        return _install_tree(tree, final, replace)
    finally:
        forget_stat_cache(staging / final.name)
        shutil.rmtree(staging, ignore_errors=True)


def _fetch_into_cache(tried: List[str], *, replace: bool = False) -> Path:
    final = cached_tree_path()
    downloads = downloads_dir()
    downloads.mkdir(parents=True, exist_ok=True)
    for fetcher in _remote_sources():
        try:
            tree = _fetch_one(fetcher, downloads, final, replace)
        except (HeadInferError, OSError, subprocess.SubprocessError) as exc:
            log.info("%s: failed: %s", fetcher.label, exc)
            tried.append(f"{fetcher.label}: {exc}")
            continue
        log.info("pinned llama.cpp %s ready at %s", pin.LLAMA_CPP_BUILD, tree)
        return tree
    raise SourceError(
        f"could not obtain llama.cpp {pin.LLAMA_CPP_BUILD} ({pin.LLAMA_CPP_COMMIT}); tried:\n"
        + "\n".join(f"  - {line}" for line in tried)
    )


def fetch_source(*, force: bool = False) -> Path:
    """Download and verify the pin into the cache (replacing a cached tree when ``force``)."""
    final = cached_tree_path()
    if final.exists() and not force:
        return _use_existing(final, "the cached tree", False, _CACHED_RECIPE)
    return _fetch_into_cache([], replace=force)


_CACHED_RECIPE = (
    "Run `pyllama-headinfer patch revert` if it is partially patched, or "
    "`pyllama-headinfer source fetch --force` to replace it."
)


def _use_existing(tree: Path, label: str, allow_unverified: bool, recipe: str) -> Path:
    if not tree.is_dir():
        raise SourceError(f"{label} {tree} is not a directory")
    usable, description = tree_acceptance(tree)
    if usable:
        log.info("using %s %s (%s)", label, tree, description)
        return tree
    if allow_unverified:
        log.warning("using %s %s although it is not the pin: %s", label, tree, description)
        return tree
    raise SourceError(
        f"{label} {tree} is not usable: {description}. {recipe} "
        "Or pass --allow-unverified to use it anyway."
    )


def ensure_source(llama_src: Optional[PathLike] = None, *, allow_unverified: bool = False) -> Path:
    """Path of a verified pinned llama.cpp tree (pristine or with our series applied).

    See the module docstring for the order of sources. An explicit tree that is
    not acceptable is an error (never silently replaced by another source);
    so is a cached tree modified by hand. ``allow_unverified`` accepts such a
    tree with a warning.
    """
    explicit = llama_src if llama_src is not None else os.environ.get(LLAMA_SRC_ENV)
    if explicit:
        return _use_existing(
            Path(explicit).expanduser().resolve(), "the llama.cpp tree", allow_unverified,
            "Point --llama-src at a checkout of "
            f"{pin.LLAMA_CPP_COMMIT} ({pin.LLAMA_CPP_BUILD}), or leave it out to use the cached download.",
        )
    cached = cached_tree_path()
    if cached.exists():
        return _use_existing(
            cached, "the cached tree", allow_unverified, _CACHED_RECIPE
        )
    return _fetch_into_cache([f"cached tree: none at {cached}"])


def locate_tree(llama_src: Optional[PathLike] = None) -> Path:
    """The tree a command should work on, without judging its state.

    Explicit path or ``$PYLLAMA_HEADINFER_LLAMA_SRC``, else the cached tree,
    fetched first if absent. Patch commands use this so they can report on
    (and repair) partially patched or modified trees that ensure_source refuses.
    """
    explicit = llama_src if llama_src is not None else os.environ.get(LLAMA_SRC_ENV)
    if explicit:
        tree = Path(explicit).expanduser().resolve()
        if not tree.is_dir():
            raise SourceError(f"the llama.cpp tree {tree} is not a directory")
        return tree
    cached = cached_tree_path()
    return cached if cached.exists() else ensure_source()


# --------------------------------------------------------------------------
# CLI: pyllama-headinfer source fetch|verify|path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="source_action", metavar="ACTION")
    actions.required = True
    fetch = actions.add_parser("fetch", help="download and verify the pinned llama.cpp into the cache")
    fetch.add_argument("--force", action="store_true", help="re-download even if a cached tree exists")
    verify = actions.add_parser("verify", help="check a tree against the pinned commit")
    path = actions.add_parser("path", help="print the path of a verified tree (fetching it if needed)")
    for sub in (verify, path):
        sub.add_argument("--llama-src", metavar="PATH", help="llama.cpp tree (default: the cached one)")
    path.add_argument("--allow-unverified", action="store_true", help="accept a tree that is not the pin")


def run(args: argparse.Namespace) -> int:
    if args.source_action == "fetch":
        print(fetch_source(force=args.force))
        return 0
    if args.source_action == "path":
        print(ensure_source(args.llama_src, allow_unverified=args.allow_unverified))
        return 0
    tree = locate_tree(args.llama_src)
    usable, description = tree_acceptance(tree)
    print(f"{tree}: {description}")
    return 0 if usable else 1
