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

Where the code lives (this module: apply, revert and the CLI):

- ``patches.py``: :func:`apply` and :func:`revert` (computed in a workspace,
  then installed all or nothing, with a backup put back on failure) and the
  CLI (``add_arguments``, ``run``);
- ``patch_series.py``: reading ``series`` (:func:`read_series_names`,
  :func:`load_series`), parsing patch files (:func:`parse_patch`,
  :class:`Series`, :class:`Patch`, :class:`FilePatch`, :class:`Hunk`) and
  :func:`series_hash`;
- ``patch_workspace.py``: :class:`Workspace`, the temporary copy of the
  touched files where ``git apply`` runs, and :func:`run_git`;
- ``patch_status.py``: :func:`status`, :class:`State`, :class:`StatusReport`;
- ``patch_check.py``: :func:`check` and its per-patch, per-hunk report
  (:class:`CheckReport`, :class:`PatchCheck`, :class:`HunkResult`,
  :class:`Outcome`);
- ``patch_export.py``: :func:`export` (the maintainer workflow above);
- ``tree_verify.py``: comparing a tree with the pin (used by status and revert).

Every name other modules and the tests use (``patches.status``,
``patches.State``, ``patches.series_hash``, ...) is importable from this
module.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterable, Optional

from pyllama_headinfer import paths
from pyllama_headinfer.source import fetch as source
from pyllama_headinfer.errors import PatchError
from pyllama_headinfer.patches.check import CheckReport, HunkResult, Outcome, PatchCheck, _check, check
from pyllama_headinfer.patches.export import export
from pyllama_headinfer.patches.series import SERIES_FILE, FilePatch, Hunk, Patch, PathLike, Series, _series_dir, load_series, parse_patch, read_series_names, series_hash
from pyllama_headinfer.patches.status import DIFF_EXAMPLES, REVERT_RECIPE, State, StatusReport, _tree_root, status
from pyllama_headinfer.patches.workspace import Workspace, _reversed_prefix, run_git

__all__ = [
    # apply / revert and the CLI
    "apply", "revert", "ChangeResult", "REFETCH_RECIPE", "add_arguments", "run",
    # patch_series
    "SERIES_FILE", "Series", "Patch", "FilePatch", "Hunk", "PathLike", "read_series_names", "load_series",
    "parse_patch", "series_hash",
    # patch_workspace, patch_status, patch_check, patch_export
    "Workspace", "run_git", "status", "State", "StatusReport", "DIFF_EXAMPLES", "REVERT_RECIPE",
    "check", "CheckReport", "PatchCheck", "HunkResult", "Outcome", "export",
]

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
                _replace_file(self.store / relative, target, keep_times=True)
            elif target.exists() or target.is_symlink():
                target.unlink()
                _remove_empty_parents(target.parent, self.tree)


def _replace_file(new: Path, target: Path, *, keep_times: bool = False) -> None:
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
                    _replace_file(result, target)
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


def apply(tree: PathLike, patches_dir: Optional[PathLike] = None) -> ChangeResult:
    """Apply the whole series: all or nothing, and a no-op on an already patched tree."""
    root = _tree_root(tree)
    series = load_series(patches_dir)
    before = status(root, patches_dir)
    if before.state == State.APPLIED or (before.state == State.PRISTINE and not series.patches):
        what = "the series is empty" if not series.patches else "the series is already applied"
        return ChangeResult(root, False, f"{root}: {what}; nothing changed")
    if before.state == State.PARTIAL:
        raise PatchError(f"refusing to patch {root}: {before.describe()}")
    if before.state == State.MODIFIED:
        report = _check(root, series, before)
        raise PatchError(
            f"refusing to patch {root}: {before.describe()}\n{report.describe()}\nTo recover, {REFETCH_RECIPE}"
        )
    with Workspace(series.touched) as work:
        work.load(root)
        result = work.apply(series.patches)
        if result.returncode != 0:
            report = _check(root, series, before)
            raise PatchError(f"the series does not apply to {root}; nothing changed:\n{report.describe()}")

        def applied_everything() -> Optional[str]:
            after = status(root, patches_dir)
            return None if after.state == State.APPLIED else f"after applying, {root} is {after.describe()}"

        _install(work, root, applied_everything)
    log.debug("applied %d patches to %s", len(series), root)
    return ChangeResult(root, True, f"{root}: applied {len(series)} patches")


def revert(tree: PathLike, patches_dir: Optional[PathLike] = None) -> ChangeResult:
    """Undo the applied patches (all, or the first k of a PARTIAL tree); the result must be the pin."""
    root = _tree_root(tree)
    series = load_series(patches_dir)
    before = status(root, patches_dir)
    if before.state == State.PRISTINE:
        return ChangeResult(root, False, f"{root}: already pristine; nothing changed")
    if before.state == State.MODIFIED:
        raise PatchError(f"cannot revert {root}: {before.describe()}. To recover, {REFETCH_RECIPE}")
    with Workspace(series.touched) as work:
        work.load(root)
        result = work.apply(_reversed_prefix(series, before.applied), reverse=True)
        if result.returncode != 0:
            raise PatchError(f"reverse-applying the series to {root} failed; nothing changed:\n{result.stderr.strip()}")

        def back_to_the_pin() -> Optional[str]:
            diff = source.verify_tree(root)
            return None if diff.ok else f"after reverting, {root} is still not the pin ({diff.describe()})"

        _install(work, root, back_to_the_pin)
    log.debug("reverted %d patches in %s", before.applied, root)
    return ChangeResult(root, True, f"{root}: reverted {before.applied} patches; the tree is the pristine pin")


# --------------------------------------------------------------------------
# CLI: pyllama-headinfer patch check|apply|revert|status|export


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="patch_action", metavar="ACTION")
    actions.required = True
    helps = {
        "check": "report, per patch and per failing hunk, whether the series applies (read-only)",
        "apply": "apply the whole series (all or nothing; no-op if already applied)",
        "revert": "undo the series and verify the tree is the pristine pin",
        "status": "PRISTINE, APPLIED, PARTIAL or MODIFIED (exit 1 for the last two)",
        "export": "rewrite the series from a git checkout's commits on top of the pin",
    }
    for name, text in helps.items():
        sub = actions.add_parser(name, help=text, description=text)
        target = "the git checkout to export from" if name == "export" else "the llama.cpp tree"
        sub.add_argument("--llama-src", metavar="PATH", help=f"{target} (default: the cached tree)")
        sub.add_argument("--patches-dir", metavar="DIR", help=f"series directory (default: {paths.patches_dir()})")
        if name == "export":
            sub.add_argument("--base", metavar="COMMIT",
                             help="the commit the series starts from (default: the pin, or the commit with its tree)")


def run(args: argparse.Namespace) -> int:
    action = args.patch_action
    if action == "export":
        if not args.llama_src and not os.environ.get(source.LLAMA_SRC_ENV):
            raise PatchError("export needs --llama-src: a git checkout whose commits on top of the pin are the series")
        names = export(source.locate_tree(args.llama_src), args.patches_dir, base=args.base)
        print(f"exported {len(names)} patches to {_series_dir(args.patches_dir)}")
        return 0
    tree = source.locate_tree(args.llama_src)
    if action == "status":
        report = status(tree, args.patches_dir)
        print(f"{tree}: {report.describe()}")
        return 0 if report.state in (State.PRISTINE, State.APPLIED) else 1
    if action == "check":
        report = check(tree, args.patches_dir)
        print(report.describe())
        return 0 if report.ok else 1
    change = apply(tree, args.patches_dir) if action == "apply" else revert(tree, args.patches_dir)
    print(change.message)
    return 0
