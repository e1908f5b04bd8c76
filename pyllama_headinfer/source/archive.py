"""Safe extraction of a tar archive's subtree (:func:`extract_subtree`).

Used for GitHub's archive of the pinned commit and for the llama-cpp-python
sdist (see ``source.py``). Members that could land outside the destination
(absolute paths, ``..``, symlinks or hard links leaving the tree) or that are
not plain data (devices, fifos) abort the extraction.
"""

from __future__ import annotations

import copy
import os
import posixpath
import tarfile
import zlib
from pathlib import Path
from typing import Collection, Optional, Sequence, Tuple, Union

from pyllama_headinfer.errors import SourceError

PathLike = Union[str, "os.PathLike[str]"]


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


def extract_subtree(archive: PathLike, destination: PathLike, subdir: str = "",
                    exclude: Sequence[str] = (), only: Optional[Collection[str]] = None) -> int:
    """Extract ``<top>/<subdir>/...`` of a tar archive into ``destination``.

    Every member must sit under one common top-level directory (GitHub archives
    and sdists do); its ``subdir`` part is stripped. Unsafe members anywhere
    in the archive abort the extraction; the caller extracts into a temporary
    directory so an aborted extraction never reaches the final place. A
    ``.git`` at the subtree's top is skipped: in an sdist it is a gitfile
    pointing outside the subtree, which would break git commands run inside.
    Members under a directory named in ``exclude`` (relative to the subtree,
    e.g. ``"vendor"`` for the Python layer of the sdist) are checked like the
    others but not extracted; with ``only``, just the files it names (paths relative
    to the subtree) are. Returns the number of members extracted.
    """
    dest = Path(destination)
    prefix = subdir.strip("/") + "/" if subdir.strip("/") else ""
    skipped = tuple(e.strip("/") for e in exclude if e.strip("/"))
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
                if any(relative == top_name or relative.startswith(top_name + "/")
                       for top_name in (".git", *skipped)):
                    continue
                if only is not None and relative not in only:
                    continue
                _extract_member(tar, member, relative, prefix, top_dir, dest)
                extracted += 1
    except (tarfile.TarError, EOFError, zlib.error) as exc:  # a truncated or corrupt .tar.gz
        raise SourceError(f"cannot extract {archive}: {exc or type(exc).__name__}") from exc
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
