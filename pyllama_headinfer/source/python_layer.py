"""The Python layer of the pinned llama-cpp-python sdist: everything but its
``vendor/`` (the C tree, which :mod:`.fetch` takes from the same archive).

``build --llama-cpp-python`` patches this layer with the second series
(``patches/llama-cpp-python``) and packs it with our compiled libraries.
:func:`extract_python_layer` extracts it safely (:mod:`.archive`, without
``vendor/``) into a fresh directory and verifies every file against the
packaged listing (:func:`pin.python_layer_files`), so a tampered or wrong
sdist is refused like a wrong C tree.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

from pyllama_headinfer import pin
from pyllama_headinfer.errors import SourceError
from pyllama_headinfer.source.archive import extract_subtree
from pyllama_headinfer.source.fetch import sdist_archive
from pyllama_headinfer.source.tree_verify import PathLike, compare_listings, forget_stat_cache, scan_tree

log = logging.getLogger(__name__)


def extract_python_layer(destination: PathLike) -> Path:
    """A pristine, verified copy of the sdist's Python layer at ``destination``
    (replaced if it exists; built next to it and renamed into place)."""
    final = Path(destination).resolve()
    final.parent.mkdir(parents=True, exist_ok=True)
    archive = sdist_archive()
    staging = Path(tempfile.mkdtemp(dir=final.parent, prefix=".staging-"))
    try:
        tree = staging / final.name
        tree.mkdir()
        extract_subtree(archive, tree, "", exclude=pin.SDIST_PYTHON_EXCLUDE)
        diff = compare_listings(scan_tree(tree, use_cache=False), pin.python_layer_files())
        if not diff.ok:
            raise SourceError(f"the Python layer of {archive.name} is not the pinned "
                              f"{pin.PYTHON_LAYER_SDIST.requirement} ({diff.describe()}); delete {archive} "
                              "and build again to download it afresh")
        if final.exists():
            forget_stat_cache(final)
            shutil.rmtree(final)
        tree.rename(final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.debug("extracted the Python layer of %s into %s", archive.name, final)
    return final
