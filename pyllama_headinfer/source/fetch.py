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

import logging
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Tuple

from pyllama_headinfer import paths, pin
from pyllama_headinfer.source.archive import extract_subtree
from pyllama_headinfer.errors import HeadInferError, SourceError
from pyllama_headinfer.source.tree_verify import PathLike, forget_stat_cache, move_stat_cache, verify_tree

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


def cached_tree_path() -> Path:
    return paths.cache_dir() / "src" / pin.SOURCE_DIRNAME


def downloads_dir() -> Path:
    return paths.cache_dir() / "downloads"


def archive_url() -> str:
    return os.environ.get(ARCHIVE_URL_ENV) or pin.GITHUB_ARCHIVE_URL


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
        old = final.with_name(f".old-{final.name}-{os.getpid()}")
        os.rename(final, old)
    os.rename(staged, final)
    move_stat_cache(staged, final)
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
        return install_tree(tree, final, replace)
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
            Path(explicit).expanduser().resolve(), "the llama.cpp tree", allow_unverified,
            "Point --llama-src at a checkout of "
            f"{pin.LLAMA_CPP_COMMIT} ({pin.LLAMA_CPP_BUILD}), or leave it out to use the cached download.",
            accept,
        )
    cached = cached_tree_path()
    if cached.exists():
        return _use_existing(cached, "the cached tree", allow_unverified, _CACHED_RECIPE, accept)
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
