"""Which patch series a checkout carries: the names in ``series`` and the
series hash, which (with the pin's commit) makes the stamp a build is
compiled with.

Kept apart from the patch manager (:mod:`pyllama_headinfer.patches`) so that
the runtime can compute the stamp it expects from a build without importing
the patch manager: reading the series file and hashing it is all it needs.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import List, Optional, Union

from pyllama_headinfer import paths, pin
from pyllama_headinfer.errors import PatchError

PathLike = Union[str, "os.PathLike[str]"]

SERIES_FILE = "series"


def series_dir(patches_dir: Optional[PathLike] = None) -> Path:
    """``patches_dir``, else :func:`paths.patches_dir`."""
    return Path(patches_dir) if patches_dir is not None else paths.patches_dir()


def read_series_names(patches_dir: Optional[PathLike] = None) -> List[str]:
    """Patch file names listed in ``series`` (empty when the file or directory is absent)."""
    series_file = series_dir(patches_dir) / SERIES_FILE
    if not series_file.is_file():
        return []
    names: List[str] = []
    for number, line in enumerate(series_file.read_text(encoding="utf-8").splitlines(), 1):
        name = re.sub(r"(^|\s)#.*$", "", line).strip()
        if not name:
            continue
        if name.startswith("/") or ".." in name.split("/") or " " in name:
            raise PatchError(f"{series_file}:{number}: invalid patch name {name!r}")
        if name in names:
            raise PatchError(f"{series_file}:{number}: {name} is listed twice")
        names.append(name)
    return names


def series_hash(patches_dir: Optional[PathLike] = None) -> str:
    """sha256 over ``series`` and the listed patch files, in order.

    Each part is framed with its name and length, so moving bytes between
    files changes the hash. An absent series hashes like an empty one.
    """
    directory = series_dir(patches_dir)
    digest = hashlib.sha256()

    def feed(label: str, data: bytes) -> None:
        digest.update(f"{label}\0{len(data)}\0".encode("utf-8"))
        digest.update(data)

    series_file = directory / SERIES_FILE
    feed(SERIES_FILE, series_file.read_bytes() if series_file.is_file() else b"")
    for name in read_series_names(directory):
        try:
            feed(name, (directory / name).read_bytes())
        except OSError as exc:
            raise PatchError(f"cannot read patch {name}: {exc}") from exc
    return digest.hexdigest()


def build_stamp(chosen: Optional[pin.Pin] = None) -> str:
    """The stamp a build of this checkout for a pin (default: the active one) is compiled with:
    ``"<pin ident>+<series hash>"`` (the ident is the commit, or ``tree:<id>`` without one)."""
    chosen = chosen or pin.active()
    return f"{chosen.ident}+{series_hash(paths.patches_dir(chosen))}"
