"""Step 3 of ``build``: the verified pinned tree with the current patch series applied.

:func:`prepare_source` gets the tree (``source``) and applies the series
(``patches``). It also records the applied series in the cache
(``<cache>/applied-series/<hash of the tree's path>``, never in the tree):
when the series has changed since an earlier build, the recorded old series
is reverted first, and files that come out byte-identical get their old
mtimes back, so ninja recompiles only what the new series really changed.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Dict, Mapping, Optional, Tuple

from pyllama_headinfer import paths
from pyllama_headinfer.errors import HeadInferError
from pyllama_headinfer.patches.apply import apply, revert
from pyllama_headinfer.patches.series import load_series
from pyllama_headinfer.patches.status import State, status, tree_acceptance
from pyllama_headinfer.series import read_series_names, series_hash
from pyllama_headinfer.source.fetch import ensure_source, locate_tree, take_replaced_file_times


def prepare_source(llama_src, allow_unverified: bool, say=print) -> Tuple[Path, str]:
    """The verified tree with the current series applied, and the series hash.

    When the series changed since an earlier build patched this tree, the old
    series (recorded by that build) is reverted first, and files whose content
    comes out unchanged get their old mtimes back: ninja then recompiles only
    what the new series really changed.
    """
    current = series_hash()
    located = Path(locate_tree(llama_src)).resolve()
    kept = _revert_recorded_series(located, current, say)
    tree = Path(ensure_source(llama_src, allow_unverified=allow_unverified, accept=tree_acceptance)).resolve()
    # a tree replaced by `source fetch --force`: patched files that come out as they were keep their times
    kept = {**take_replaced_file_times(tree), **kept}
    apply(tree)
    if kept:
        _restore_unchanged_mtimes(tree, kept)
    _record_series(tree, current)
    return tree, current


RECORDS_DIR = "applied-series"  # in the cache


def _series_record_dir(tree: Path) -> Path:
    """Copy of the series that build last applied to ``tree`` (in the cache, never in the tree)."""
    return paths.cache_dir() / RECORDS_DIR / hashlib.sha256(str(tree).encode()).hexdigest()[:16]


def _read_text(path: Path) -> Optional[str]:
    try:
        return path.read_text(encoding="utf-8").strip()
    except OSError:
        return None


def _record_series(tree: Path, series_hash: str) -> None:

    record = _series_record_dir(tree)
    if _read_text(record / "hash") == series_hash:
        return
    directory = paths.patches_dir()
    paths.writable_cache_dir(RECORDS_DIR)
    staged = record.with_name(f"{record.name}.tmp{os.getpid()}")
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir(parents=True)
    if (directory / "series").is_file():
        shutil.copy2(directory / "series", staged / "series")
    for name in read_series_names(directory):
        (staged / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(directory / name, staged / name)
    (staged / "tree").write_text(str(tree) + "\n", encoding="utf-8")
    (staged / "hash").write_text(series_hash + "\n", encoding="utf-8")
    shutil.rmtree(record, ignore_errors=True)
    os.replace(staged, record)


def _file_digest(path: Path) -> Optional[str]:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def _revert_recorded_series(tree: Path, current: str, say) -> Dict[str, Tuple[str, int, int]]:
    """Reverts an older recorded series still applied to ``tree``; returns the
    touched files' (digest, atime_ns, mtime_ns) from before, or {}."""
    record = _series_record_dir(tree)
    old = _read_text(record / "hash")
    if not old or old == current or not tree.is_dir():
        return {}
    try:
        if status(tree, record).state != State.APPLIED:
            return {}
        touched = load_series(record).touched | load_series().touched
    except HeadInferError:
        return {}
    kept = {}
    for rel in touched:
        path = tree / rel
        digest = _file_digest(path) if path.is_file() else None
        if digest:
            st = path.stat()
            kept[rel] = (digest, st.st_atime_ns, st.st_mtime_ns)
    say(f"The patch series changed since {tree} was patched (series {old[:12]} -> {current[:12]}): "
        "reverting the old series before applying the new one.")
    revert(tree, record)
    return kept


def _restore_unchanged_mtimes(tree: Path, kept: Mapping[str, Tuple[str, int, int]]) -> None:
    for rel, (digest, atime, mtime) in kept.items():
        path = tree / rel
        if path.is_file() and _file_digest(path) == digest:
            os.utime(path, ns=(atime, mtime))
