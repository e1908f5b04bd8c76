"""Get a verified copy of a pinned llama.cpp source tree (the active pin:
:func:`pyllama_headinfer.pin.active`, which ``--pin`` sets).

A tree *is the pin* when every file's git blob id and mode equal the packaged
``git ls-tree -r`` listing of the pin (:meth:`pin.Pin.files`), with no file
missing or extra; a top-level ``.git`` (dir or gitfile) is ignored. Where the
tree came from does not matter: a pin is content (:mod:`pyllama_headinfer.pin`).

:func:`ensure_source` tries, in order, and verifies each before use:

1. an explicit tree (``llama_src`` argument or ``$PYLLAMA_HEADINFER_LLAMA_SRC``);
2. the tree cached by an earlier fetch, ``cache_dir()/src/<Pin.source_dirname>``;
3. the PyPI sdists that vendor the pin (for b11312, llama-cpp-python's ``vendor/llama.cpp``;
   for b11549, xllamacpp's ``thirdparty/llama.cpp``)
   (``$PYLLAMA_HEADINFER_PIP_ARGS`` adds arguments to ``pip download``, e.g.
   ``--find-links DIR --no-index``): pip's index, proxy and mirror settings
   apply, and it is what README documents;
4. GitHub's archive of the commit, where the pin's commit is known
   (``$PYLLAMA_HEADINFER_ARCHIVE_URL`` overrides).

An archive of 3 or 4 downloaded earlier (``cache_dir()/downloads``) is used
before anything goes to the network. A source that fails while another is
left to try is one INFO line ("not available ...; trying ..."), not an error:
only when every source failed is there an error, listing them all.

Which trees are acceptable is the caller's choice (``accept``): by default
only the pristine pin (:func:`pristine`); the build passes the patch manager's
:func:`pyllama_headinfer.patches.status.tree_acceptance`, which also accepts
the tree with exactly our series applied, so a patched cache is reused. (This
module does not import the patch manager: it sits below it.)

Hashing the ~176 MB tree takes about a second, so blob ids are remembered in a
stat cache (size, mtime, ctime, inode -> blob id) kept in the cache directory,
keyed by the tree's absolute path, never inside the tree
(:mod:`.tree_verify`); archives are extracted by :mod:`.archive`. The
``source`` command is :mod:`pyllama_headinfer.cli.source`.
"""

from __future__ import annotations

import filecmp
import functools
import hashlib
import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from pyllama_headinfer import paths, pin
from pyllama_headinfer.source.archive import extract_subtree
from pyllama_headinfer.errors import CacheError, HeadInferError, SourceError, UsageError
from pyllama_headinfer.pin import PinnedFile
from pyllama_headinfer.source.tree_verify import (PathLike, check_pin_listing, compare_listings, forget_stat_cache,
                                                  move_stat_cache, scan_tree, verify_tree)

log = logging.getLogger(__name__)

LLAMA_SRC_ENV = "PYLLAMA_HEADINFER_LLAMA_SRC"
ARCHIVE_URL_ENV = "PYLLAMA_HEADINFER_ARCHIVE_URL"
PIP_ARGS_ENV = "PYLLAMA_HEADINFER_PIP_ARGS"

CONNECT_TIMEOUT_S = 10
READ_TIMEOUT_S = 60


# --------------------------------------------------------------------------
# whether a tree is usable: pristine, or our series applied


Acceptance = Callable[[Path], Tuple[bool, str]]


def pristine(tree: PathLike) -> Tuple[bool, str]:
    """(usable, description): usable when ``tree`` is exactly the pin. The
    acceptance :func:`ensure_source` uses unless given another one (the patch
    manager's :func:`pyllama_headinfer.patches.status.tree_acceptance` also
    accepts our series applied)."""
    diff = verify_tree(tree)
    return (True, "pristine") if diff.ok else (False, f"not the pin ({diff.describe()})")


# --------------------------------------------------------------------------
# where things go in the cache


# the cache's subdirectories written here, each created by paths.writable_cache_dir before it is written
SRC_DIR, DOWNLOADS_DIR, REPLACED_TIMES_DIR = "src", "downloads", "replaced-file-times"


def cached_tree_path() -> Path:
    """Where the active pin's tree is cached."""
    return paths.cache_dir() / SRC_DIR / pin.active().source_dirname


def downloads_dir() -> Path:
    return paths.cache_dir() / DOWNLOADS_DIR


def archive_url() -> Optional[str]:
    """GitHub's archive of the active pin's commit (None for a pin without a known commit)."""
    return os.environ.get(ARCHIVE_URL_ENV) or pin.active().github_archive_url


# --------------------------------------------------------------------------
# fetching


def _short_reason(exc: BaseException) -> str:
    """One short line for a failed download (requests nests urllib3's long repr of the connection)."""
    import requests

    if isinstance(exc, requests.ConnectionError):
        text = str(exc)
        for marker, reason in (("NameResolutionError", "the host name does not resolve (no network?)"),
                               ("Name or service not known", "the host name does not resolve (no network?)"),
                               ("Connection refused", "connection refused"),
                               ("timed out", "the connection timed out")):
            if marker in text:
                return f"{reason} ({exc.request.url if exc.request is not None else 'no URL'})"
        return "cannot connect" + (f" to {exc.request.url}" if exc.request is not None else "")
    if isinstance(exc, requests.Timeout):
        return "the download timed out"
    return str(exc).splitlines()[0][:200]


def _download_github_archive(downloads: Path) -> Tuple[Path, str]:
    target = _github_archive_path(downloads)
    if target.is_file():
        log.info("using the archive downloaded earlier: %s", target)
        return target, ""
    import requests  # imported here: only this source needs it

    url = archive_url()
    if url is None:
        raise SourceError(f"llama.cpp {pin.active().build} has no known commit, so no GitHub archive")
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
        raise SourceError(f"download failed: {_short_reason(exc)}") from exc
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, target)
    log.info("downloaded %s (%.1f MB)", target.name, target.stat().st_size / 1e6)
    return target, ""


def _find_sdist(downloads: Path, sdist: pin.Sdist) -> Optional[Path]:
    for name in (sdist.name.replace("-", "_"), sdist.name):
        candidate = downloads / f"{name}-{sdist.version}.tar.gz"
        if candidate.is_file():
            return candidate
    return None


def pip_download_command(downloads: Path, sdist: pin.Sdist) -> List[str]:
    extra = shlex.split(os.environ.get(PIP_ARGS_ENV, ""))
    return [
        # --no-binary for this package only: ":all:" would also make pip build the sdist's build
        # requirements (CMake!) from source just to read its metadata -- over 20 minutes on 2 cores
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", sdist.name,
        "--dest", str(downloads), *extra, sdist.requirement,
    ]


def _download_sdist(downloads: Path, sdist: pin.Sdist) -> Tuple[Path, str]:
    found = _find_sdist(downloads, sdist)
    if found is None:
        command = pip_download_command(downloads, sdist)
        log.info("downloading the %s %s sdist with pip (about a minute)", sdist.name, sdist.version)
        log.debug("running %s", shlex.join(command))
        result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if result.returncode != 0:
            tail = "\n".join(result.stdout.strip().splitlines()[-5:])
            raise SourceError(f"pip download failed (exit {result.returncode}): {tail}")
        found = _find_sdist(downloads, sdist)
        if found is None:
            raise SourceError(f"pip download succeeded but left no {sdist.name} sdist in {downloads}")
    else:
        log.info("using the sdist downloaded earlier: %s", found)
    return found, sdist.subdir


def sdist_archive(sdist: pin.Sdist = pin.PYTHON_LAYER_SDIST) -> Path:
    """An sdist in the downloads directory (default: llama-cpp-python's, whose Python layer
    :mod:`.python_layer` verifies), downloaded with pip if it is not there."""
    downloads = downloads_dir()
    if _find_sdist(downloads, sdist) is None:  # a read-only cache may still give one downloaded earlier
        downloads = paths.writable_cache_dir(DOWNLOADS_DIR)
    return _download_sdist(downloads, sdist)[0]


def _github_archive_path(downloads: Path) -> Path:
    return downloads / f"llama.cpp-{pin.active().commit}.tar.gz"


@dataclass
class _Fetcher:
    label: str
    download: Callable[[Path], Tuple[Path, str]]  # downloads dir -> (archive, subdir to extract)
    downloaded: Callable[[Path], bool]  # whether its archive is in the downloads dir already


def _remote_sources(downloads: Path) -> List[_Fetcher]:
    """PyPI, then GitHub (see the module docstring); one downloaded earlier first."""
    sources = [
        _Fetcher(f"PyPI sdist {sdist.requirement}", functools.partial(_download_sdist, sdist=sdist),
                 functools.partial(lambda d, sdist: _find_sdist(d, sdist) is not None, sdist=sdist))
        for sdist in pin.active().sdists
    ]
    if archive_url() is not None:
        sources.append(_Fetcher(f"GitHub archive {archive_url()}", _download_github_archive,
                                lambda d: _github_archive_path(d).is_file()))
    return sorted(sources, key=lambda fetcher: not fetcher.downloaded(downloads))


def install_tree(staged: Path, final: Path, replace: bool) -> Path:
    """Rename a verified staged tree into place.

    An existing tree is replaced only when asked (``fetch --force``); otherwise
    it was installed by a concurrent fetch, and that one is kept.
    """
    old = None
    if final.exists() and not replace:
        log.info("another process installed %s meanwhile; keeping it", final)
        return final
    if final.exists():
        _keep_unchanged_mtimes(final, staged)
        old = final.with_name(f".old-{final.name}-{os.getpid()}")
        os.rename(final, old)
    os.rename(staged, final)
    move_stat_cache(staged, final)
    if old is not None:
        forget_stat_cache(old)
        shutil.rmtree(old, ignore_errors=True)
    return final


def _keep_unchanged_mtimes(old: Path, new: Path) -> None:
    """Before ``new`` replaces ``old`` (``fetch --force``): files with the same
    bytes get the old file's times, so a build over the new tree recompiles
    nothing for them. Files that differ -- edited by hand, or patched by the
    series, which the next build applies again -- are remembered with their
    digest and times (:func:`take_replaced_file_times`): a patched file that
    comes out of that build byte-identical gets its old times back too."""
    differing = {}
    for directory, _dirs, files in os.walk(new):
        for name in files:
            fresh = Path(directory) / name
            rel = fresh.relative_to(new)
            previous = old / rel
            if fresh.is_symlink() or not previous.is_file() or previous.is_symlink():
                continue
            st = previous.stat()
            if st.st_size == fresh.stat().st_size and filecmp.cmp(previous, fresh, shallow=False):
                os.utime(fresh, ns=(st.st_atime_ns, st.st_mtime_ns))
            else:
                digest = hashlib.sha256(previous.read_bytes()).hexdigest()
                differing[rel.as_posix()] = [digest, st.st_atime_ns, st.st_mtime_ns]
    for directory, _dirs, files in os.walk(old):  # files the series created: the build creates them again
        for name in files:
            previous = Path(directory) / name
            rel = previous.relative_to(old)
            if not previous.is_symlink() and not (new / rel).exists() and previous.stat().st_size < (1 << 24):
                st = previous.stat()
                differing[rel.as_posix()] = [hashlib.sha256(previous.read_bytes()).hexdigest(),
                                             st.st_atime_ns, st.st_mtime_ns]
    record = _replaced_times_path(old)
    paths.writable_cache_dir(REPLACED_TIMES_DIR)
    record.write_text(json.dumps(differing), encoding="utf-8")


def _replaced_times_path(tree: Path) -> Path:
    return paths.cache_dir() / REPLACED_TIMES_DIR / (hashlib.sha256(str(tree).encode()).hexdigest()[:16] + ".json")


def take_replaced_file_times(tree: os.PathLike) -> Dict[str, Tuple[str, int, int]]:
    """What :func:`_keep_unchanged_mtimes` remembered of the files of ``tree``
    that ``fetch --force`` replaced by different bytes: ``{relative path:
    (sha256, atime_ns, mtime_ns)}``, handed out once (the record is removed)."""
    record = _replaced_times_path(Path(tree))
    try:
        kept = json.loads(record.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    record.unlink(missing_ok=True)
    return {rel: (str(v[0]), int(v[1]), int(v[2])) for rel, v in kept.items()}


def _extract_checked(archive: Path, target: Path, subdir: str, expected: Mapping[str, PinnedFile], wrong: str,
                     only: Optional[Set[str]] = None) -> None:
    """Extract ``subdir`` of ``archive`` (just the files ``only`` names, if given) into ``target``
    and check it holds exactly ``expected`` (else the error says ``wrong``). A corrupt, unsafe or
    wrong archive is deleted: it must not fail the next attempt too."""
    try:
        if only is None or only:
            extract_subtree(archive, target, subdir, only=only)
        diff = compare_listings(scan_tree(target, use_cache=False), expected)
        if not diff.ok:
            raise SourceError(f"{wrong} ({diff.describe()})")
    except SourceError as exc:
        archive.unlink(missing_ok=True)
        raise SourceError(f"{exc}; deleted {archive.name}") from exc


def _from_sources(action: Callable[[_Fetcher, Path], Path], what: str, tried: List[str]) -> Path:
    """``action(fetcher, downloads dir)`` with each source in turn (one downloaded earlier first)
    until one succeeds; a failure with a source left to try is an INFO line, all failing an error
    listing ``tried`` (which the caller may have started). The downloads directory must be
    writable unless it holds an archive already (a read-only cache may still give its files)."""
    downloads = downloads_dir()
    sources = _remote_sources(downloads)
    if not any(fetcher.downloaded(downloads) for fetcher in sources):
        paths.writable_cache_dir(DOWNLOADS_DIR)
    for i, fetcher in enumerate(sources):
        try:
            return action(fetcher, downloads)
        except CacheError:
            raise  # not this source's fault: the next one needs the cache too
        except (HeadInferError, OSError, subprocess.SubprocessError) as exc:
            tried.append(f"{fetcher.label}: {exc}")
            if i + 1 < len(sources):  # not an error yet: the next source may well work
                log.info("%s: not available (%s); trying the %s", fetcher.label, exc, sources[i + 1].label)
    raise SourceError(f"could not obtain {what}; tried:\n" + "\n".join(f"  - {line}" for line in tried))


def _fetch_into_cache(tried: List[str], *, replace: bool = False) -> Path:
    final = cached_tree_path()
    paths.writable_cache_dir(SRC_DIR)  # before anything is downloaded

    def fetch_one(fetcher: _Fetcher, downloads: Path) -> Path:
        archive, subdir = fetcher.download(downloads)
        final.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=final.parent, prefix=".staging-"))
        try:
            tree = staging / final.name
            tree.mkdir()
            log.info("extracting %s", archive.name)
            check_pin_listing()
            _extract_checked(archive, tree, subdir, pin.active().files(), "the extracted tree is not the pin")
            return install_tree(tree, final, replace)
        finally:
            forget_stat_cache(staging / final.name)
            shutil.rmtree(staging, ignore_errors=True)

    tree = _from_sources(fetch_one, f"llama.cpp {pin.active().short}", tried)
    log.info("pinned llama.cpp %s ready at %s", pin.active().build, tree)
    return tree


def extract_pin_files(files: Sequence[str], destination: PathLike) -> Path:
    """The given files of the active pin, as it has them, in ``destination``: extracted from its
    archive (one downloaded earlier, else downloaded as :func:`fetch_source` would) and verified
    against the pin's listing. For tools that need the pristine files whatever state the cached
    tree is in (the patch manager's re-targeting, :mod:`pyllama_headinfer.patches.retarget`)."""
    wanted = set(files)
    expected = {p: v for p, v in pin.active().files().items() if p in wanted}
    target = Path(destination)
    if not expected:  # nothing of the pin's asked for: no archive to open (an archive that lacks files is deleted)
        raise UsageError(f"none of {', '.join(sorted(wanted)[:3]) or 'no files'} is a file of llama.cpp {pin.active().short}")

    def extract_one(fetcher: _Fetcher, downloads: Path) -> Path:
        archive, subdir = fetcher.download(downloads)
        if target.exists():
            shutil.rmtree(target)
        target.mkdir(parents=True)
        _extract_checked(archive, target, subdir, expected, f"{archive.name} does not hold the pin's files", only=wanted)
        return target

    return _from_sources(extract_one, f"files of llama.cpp {pin.active().short}", [])


def fetch_source(*, force: bool = False, accept: Acceptance = pristine) -> Path:
    """Download and verify the pin into the cache (replacing a cached tree when ``force``)."""
    final = cached_tree_path()
    if final.exists() and not force:
        return _use_existing(final, "the cached tree", False, _CACHED_RECIPE, accept)
    return _fetch_into_cache([], replace=force)


_CACHED_RECIPE = (
    "Run `pyllama-headinfer patch revert` if it is partially patched, or "
    "`pyllama-headinfer source fetch --force` to replace it."
)


def _explicit_tree(explicit: PathLike) -> Path:
    """The tree the user named (--llama-src or the environment): a path that is not a directory is bad input
    (a UsageError, exit 2), not a failed operation."""
    tree = Path(explicit).expanduser().resolve()
    if not tree.is_dir():
        raise UsageError(f"the llama.cpp tree {tree} is not a directory")
    return tree


def _use_existing(tree: Path, label: str, allow_unverified: bool, recipe: str, accept: Acceptance) -> Path:
    if not tree.is_dir():
        raise SourceError(f"{label} {tree} is not a directory")
    usable, description = accept(tree)
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


def ensure_source(llama_src: Optional[PathLike] = None, *, allow_unverified: bool = False,
                  accept: Acceptance = pristine) -> Path:
    """Path of a verified pinned llama.cpp tree (pristine or with our series applied).

    See the module docstring for the order of sources. An explicit tree that is
    not acceptable is an error (never silently replaced by another source);
    so is a cached tree modified by hand. ``allow_unverified`` accepts such a
    tree with a warning. ``accept`` judges a tree (default :func:`pristine`).
    """
    explicit = llama_src if llama_src is not None else os.environ.get(LLAMA_SRC_ENV)
    if explicit:
        return _use_existing(
            _explicit_tree(explicit), "the llama.cpp tree", allow_unverified,
            f"Point --llama-src at a tree of llama.cpp {pin.active().short}, "
            "or leave it out to use the cached download.",
            accept,
        )
    cached = cached_tree_path()
    if cached.exists():
        return _use_existing(cached, "the cached tree", allow_unverified, _CACHED_RECIPE, accept)
    return _fetch_into_cache([f"cached tree: none at {cached}"])


# What makes a directory a llama.cpp tree, for the commands that work on one (``patch
# check|apply|revert|status|export|rebase`` on the C series): these files, which every llama.cpp
# of the layout since mid-2024 has (ggml in ggml/, the library in src/, its header in include/;
# every pin and the trees a series is re-targeted to). A tree missing any of them is bad input
# (exit 2) before any work: without it, a wrong --llama-src (an empty directory, a project's
# own checkout) is "another llama.cpp" to the 3-way drift report, whose every patch then meets a
# tree without its files. The pin's identity is a different question (``verify_tree``).
LLAMA_CPP_KEY_FILES = ("CMakeLists.txt", "include/llama.h", "ggml/include/ggml.h", "src/llama.cpp")


def missing_key_files(tree: PathLike) -> List[str]:
    """The :data:`LLAMA_CPP_KEY_FILES` that ``tree`` lacks ([] for a llama.cpp tree)."""
    return [relative for relative in LLAMA_CPP_KEY_FILES if not (Path(tree) / relative).is_file()]


def require_llama_tree(tree: PathLike) -> Path:
    """``tree`` when it is a llama.cpp tree (see :data:`LLAMA_CPP_KEY_FILES`), else a UsageError."""
    missing = missing_key_files(tree)
    if missing:
        raise UsageError(f"{tree} is not a llama.cpp tree: it has no {', '.join(missing)}")
    return Path(tree)


def locate_tree(llama_src: Optional[PathLike] = None) -> Path:
    """The tree a command should work on, without judging its state.

    Explicit path or ``$PYLLAMA_HEADINFER_LLAMA_SRC``, else the cached tree,
    fetched first if absent. Patch commands use this so they can report on
    (and repair) partially patched or modified trees that ensure_source refuses.
    """
    explicit = llama_src if llama_src is not None else os.environ.get(LLAMA_SRC_ENV)
    if explicit:
        return _explicit_tree(explicit)
    cached = cached_tree_path()
    return cached if cached.exists() else ensure_source()
