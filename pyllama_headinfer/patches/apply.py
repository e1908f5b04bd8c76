"""The patch manager: check, apply, revert and export the HeadInfer patch series.

The series lives in a directory (default :func:`paths.patches_dir`): a file
``series`` lists patch file names in the order they apply (blank lines and
``#`` comments ignored), each a ``git format-patch --zero-commit`` file whose
paths (``a/...``, ``b/...``) are relative to the llama.cpp root.

A tree is in one of four states (:func:`status`):

* PRISTINE: exactly the pinned commit;
* APPLIED:  the pinned commit with the whole series applied;
* PARTIAL:  the first k patches applied (an interrupted or hand-made apply);
* MODIFIED: anything else (files edited by hand, extra or missing files).

``git apply`` never runs inside the tree: the files the series touches are
copied to a temporary directory (outside any repository; the ceiling is its
parent), the series is applied or reversed there in one ``git apply`` call,
and only a fully successful result is copied back, with a backup restored if
copying fails. So no enclosing repository, index, attribute or gitfile of the
tree can interfere, and a failed apply leaves the tree byte-identical.

Maintainer workflow (regenerating the series, see :func:`export`)::

    P=<project>/patches
    # a git repository of the pristine pin: a clone of llama.cpp checked out at
    # the pinned commit, or a copy of a pristine tree committed as a root commit
    cp -r "$(pyllama-headinfer source path)" hi && cd hi   # `patch revert` it if patched
    git init -q && git add -A && git commit -qm "llama.cpp b11312"
    for p in $(sed 's/#.*//' "$P/series"); do git am "$P/$p"; done  # one commit per patch
    # edit, commit, `git rebase -i` ... until the commits on top of the pin are the series
    pyllama-headinfer patch export --llama-src .   # rewrites $P/*.patch and $P/series
    pyllama-headinfer patch check                  # the new series against the cached tree

Where the code lives (this module: apply and revert):

- :mod:`.series`: parsing patch files (:func:`~.series.load_series`,
  :func:`~.series.parse_patch`); the names in ``series`` and the series hash
  are :mod:`pyllama_headinfer.series`;
- :mod:`.workspace`: :class:`~.workspace.Workspace`, the temporary copy of
  the touched files where ``git apply`` runs, and :func:`~.workspace.run_git`;
- :mod:`.status`: :func:`~.status.status`, :class:`~.status.State`,
  :func:`~.status.tree_acceptance`;
- :mod:`.check`: :func:`~.check.check` and its per-patch, per-hunk report;
- :mod:`.export`: :func:`~.export.export` (the maintainer workflow above).

The ``patch`` command is :mod:`pyllama_headinfer.cli.patch`.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterable, Optional

from pyllama_headinfer.errors import PatchError
from pyllama_headinfer.source.tree_verify import Listing, compare_listings, scan_tree
from pyllama_headinfer.patches.check import check_series
from pyllama_headinfer.patches.series import PathLike, load_series
from pyllama_headinfer.patches.status import State, pinned_label, pinned_listing, tree_root, status
from pyllama_headinfer.patches.workspace import Workspace, reversed_prefix

log = logging.getLogger(__name__)

REFETCH_RECIPE = (
    "restore the files named above by hand, or start from a fresh tree "
    "(`pyllama-headinfer source fetch --force` replaces the cached one)"
)


# --------------------------------------------------------------------------
# apply / revert: compute in the workspace, then install atomically


class _Backup:
    """Copies of some files of a tree, to put everything back if installing fails."""

    def __init__(self, tree: Path, relatives: Iterable[str], store: Path):
        self.tree, self.store = tree, store
        self.existed: Dict[str, bool] = {}
        for relative in relatives:
            original = tree / relative
            self.existed[relative] = original.is_file() or original.is_symlink()
            if self.existed[relative]:
                saved = store / relative
                saved.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(original, saved, follow_symlinks=False)

    def restore(self) -> None:
        for relative, existed in self.existed.items():
            target = self.tree / relative
            if existed:
                target.parent.mkdir(parents=True, exist_ok=True)
                replace_file(self.store / relative, target, keep_times=True)
            elif target.exists() or target.is_symlink():
                target.unlink()
                _remove_empty_parents(target.parent, self.tree)


def replace_file(new: Path, target: Path, *, keep_times: bool = False) -> None:
    """Put ``new``'s content and mode at ``target`` in one rename."""
    temp = target.with_name(f".{target.name}.pyllama-headinfer-tmp")
    if keep_times:
        shutil.copy2(new, temp, follow_symlinks=False)
    else:
        shutil.copyfile(new, temp, follow_symlinks=False)
        shutil.copymode(new, temp)
    os.replace(temp, target)


def _remove_empty_parents(directory: Path, tree: Path) -> None:
    """Like git: a directory emptied by deleting a file goes too."""
    while directory != tree and tree in directory.parents:
        try:
            directory.rmdir()
        except OSError:
            return
        directory = directory.parent


def _install(work: Workspace, tree: Path, postcondition: Callable[[], Optional[str]]) -> None:
    """Make the tree's touched files equal the workspace's, all or nothing.

    ``postcondition`` runs after the files are in place and returns a problem
    (or None); on a problem, or when writing fails, the backup goes back.
    """
    with tempfile.TemporaryDirectory(prefix="pyllama-headinfer-backup-") as store:
        backup = _Backup(tree, work.touched, Path(store))
        try:
            for relative in work.touched:
                result, target = work.root / relative, tree / relative
                if result.is_file() or result.is_symlink():
                    target.parent.mkdir(parents=True, exist_ok=True)
                    replace_file(result, target)
                elif target.exists() or target.is_symlink():
                    target.unlink()
                    _remove_empty_parents(target.parent, tree)
        except OSError as exc:
            backup.restore()
            raise PatchError(f"could not write the patched files into {tree}: {exc}; tree restored") from exc
        problem = postcondition()
        if problem:
            backup.restore()
            raise PatchError(f"{problem}; tree restored")


@dataclass(frozen=True)
class ChangeResult:
    tree: Path
    changed: bool
    message: str


def apply(tree: PathLike, patches_dir: Optional[PathLike] = None, *,
          pristine: Optional[Listing] = None) -> ChangeResult:
    """Apply the whole series: all or nothing, and a no-op on an already patched tree.

    ``pristine``: the unpatched tree's listing when it is not the pinned
    llama.cpp (see :func:`~.status.status`)."""
    root = tree_root(tree)
    series = load_series(patches_dir)
    before = status(root, patches_dir, pristine=pristine)
    if before.state == State.APPLIED or (before.state == State.PRISTINE and not series.patches):
        what = "the series is empty" if not series.patches else "the series is already applied"
        return ChangeResult(root, False, f"{root}: {what}; nothing changed")
    if before.state == State.PARTIAL:
        raise PatchError(f"refusing to patch {root}: {before.describe()}")
    if before.state == State.MODIFIED:
        report = check_series(root, series, before)
        raise PatchError(
            f"refusing to patch {root}: {before.describe()}\n{report.describe()}\nTo recover, {REFETCH_RECIPE}"
        )
    with Workspace(series.touched) as work:
        work.load(root)
        result = work.apply(series.patches)
        if result.returncode != 0:
            report = check_series(root, series, before)
            raise PatchError(f"the series does not apply to {root}; nothing changed:\n{report.describe()}")

        def applied_everything() -> Optional[str]:
            after = status(root, patches_dir, pristine=pristine)
            return None if after.state == State.APPLIED else f"after applying, {root} is {after.describe()}"

        _install(work, root, applied_everything)
    log.debug("applied %d patches to %s", len(series), root)
    return ChangeResult(root, True, f"{root}: applied {len(series)} patches")


def revert(tree: PathLike, patches_dir: Optional[PathLike] = None, *,
           pristine: Optional[Listing] = None) -> ChangeResult:
    """Undo the applied patches (all, or the first k of a PARTIAL tree); the result must be the pin
    (``pristine``, by default the pinned llama.cpp)."""
    root = tree_root(tree)
    series = load_series(patches_dir)
    before = status(root, patches_dir, pristine=pristine)
    if before.state == State.PRISTINE:
        return ChangeResult(root, False, f"{root}: already pristine; nothing changed")
    if before.state == State.MODIFIED:
        raise PatchError(f"cannot revert {root}: {before.describe()}. To recover, {REFETCH_RECIPE}")
    with Workspace(series.touched) as work:
        work.load(root)
        result = work.apply(reversed_prefix(series, before.applied), reverse=True)
        if result.returncode != 0:
            raise PatchError(f"reverse-applying the series to {root} failed; nothing changed:\n{result.stderr.strip()}")

        def back_to_the_pin() -> Optional[str]:
            diff = compare_listings(scan_tree(root), pinned_listing(pristine))
            return None if diff.ok else f"after reverting, {root} is still not the pin ({diff.describe()})"

        _install(work, root, back_to_the_pin)
    log.debug("reverted %d patches in %s", before.applied, root)
    return ChangeResult(root, True, f"{root}: reverted {before.applied} patches; the tree is the pristine "
                                    f"{pinned_label(pristine)}")
