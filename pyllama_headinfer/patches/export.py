"""``patch export``: regenerate the series from a git repository of the pin.

:func:`export` runs ``git format-patch`` over the commits on top of the pin
(or of ``--base``) and rewrites the patch files and ``series``. The
maintainer workflow is in the docstring of :mod:`.apply`.

The output depends on the commits only, never on the machine: git runs
without the user's and the system's configuration (see
:func:`~.workspace.run_git`), and every setting that shapes a patch that the
repository's own config could change is fixed on the command line
(:data:`FORMAT_PATCH`). A patch whose content is unchanged is not rewritten,
even when its commit got a new date (a rebase that reset author dates): a
re-export of the same series touches no file.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import List, Optional, Sequence

from pyllama_headinfer import pin
from pyllama_headinfer.errors import PatchError
from pyllama_headinfer.patches.series import SERIES_FILE, PathLike, series_dir, read_series_names
from pyllama_headinfer.patches.status import tree_root
from pyllama_headinfer.patches.workspace import run_git
from pyllama_headinfer.source.tree_verify import Listing, git_tree_id

# the name it had before export moved out of patches.py
log = logging.getLogger("pyllama_headinfer.patches")

# git format-patch, with every option a repository's config could change pinned
FORMAT_PATCH = [
    "-c", "core.abbrev=7", "-c", "core.quotePath=true", "-c", "i18n.logOutputEncoding=UTF-8",
    "-c", "diff.algorithm=myers", "-c", "diff.context=3", "-c", "diff.interHunkContext=0",
    "-c", "diff.indentHeuristic=true", "-c", "diff.noprefix=false", "-c", "diff.mnemonicPrefix=false",
    "-c", "diff.suppressBlankEmpty=false", "-c", "diff.relative=false", "-c", "format.signOff=false",
    "-c", "format.useAutoBase=false", "-c", "format.coverLetter=false", "-c", "format.thread=false",
    "-c", "format.suffix=.patch", "-c", "format.forceInBodyFrom=false",
    "format-patch", "--zero-commit", "--no-signature", "--no-stat", "-N", "--no-renames", "--no-notes",
    "--no-attach", "--no-cover-letter", "--no-thread", "--no-add-header", "--no-to", "--no-cc", "--no-from",
    "--abbrev=7", "--diff-algorithm=myers", "-U3",
    "--inter-hunk-context=0", "-O/dev/null", "--src-prefix=a/", "--dst-prefix=b/",
]


def _without_date(text: bytes) -> bytes:
    """A patch file without the ``Date:`` line of its mail header: what "the same content" compares."""
    header, sep, body = text.partition(b"\n\n")
    return b"\n".join(line for line in header.split(b"\n") if not line.startswith(b"Date: ")) + sep + body


def _install(new: Path, target: Path) -> bool:
    """Move ``new`` over ``target`` unless ``target`` already says the same
    (byte for byte, or all but the date): True when ``target`` changed."""
    try:
        old = target.read_bytes()
    except OSError:
        old = None
    if old is not None and _without_date(old) == _without_date(new.read_bytes()):
        return False  # same content: keep the file, its date and its mtime
    os.replace(new, target)
    return True


# --------------------------------------------------------------------------
# export: regenerate the series from a git repository


def _git_out(args: Sequence[str], repo: Path, what: str) -> str:
    result = run_git(args, repo)
    if result.returncode != 0:
        raise PatchError(f"{what} failed: {result.stderr.strip() or result.stdout.strip()}")
    return result.stdout.strip()


def _export_base(repo: Path, base: Optional[str], pristine: Optional[Listing] = None) -> str:
    """The commit the series starts from.

    An explicit ``base``; else the pinned commit when the repository has it;
    else the newest ancestor of HEAD whose tree is the pin's tree (a copy of
    the pinned source committed with ``git init``). With ``pristine`` (the
    Python layer's listing), the newest ancestor whose tree is that listing's.
    """
    top = run_git(["rev-parse", "--show-toplevel"], repo)
    if top.returncode != 0 or Path(top.stdout.strip()).resolve() != repo:
        raise PatchError(f"{repo} is not the top of a git repository; export needs a checkout "
                         "whose commits on top of the pin are the series")
    if base is not None:
        if run_git(["cat-file", "-e", f"{base}^{{commit}}"], repo).returncode != 0:
            raise PatchError(f"{repo} does not contain the base commit {base}")
        return base
    commit = pin.active().commit if pristine is None else None
    if commit and run_git(["cat-file", "-e", f"{commit}^{{commit}}"], repo).returncode == 0:
        return commit
    wanted = pin.active().tree if pristine is None else git_tree_id(pristine)
    history = _git_out(["log", "--format=%H %T", "HEAD"], repo, "git log")
    for line in history.splitlines():
        commit, tree = line.split()
        if tree == wanted:
            log.info("exporting from %s, the commit of %s whose tree is the pin's", commit[:12], repo)
            return commit
    if pristine is not None:
        raise PatchError(f"{repo} has no commit whose tree is the pristine Python layer of "
                         f"{pin.PYTHON_LAYER_SDIST.requirement}; pass --base COMMIT")
    raise PatchError(f"{repo} contains neither the pinned commit nor a commit with the tree of llama.cpp "
                     f"{pin.active().short}; pass --base COMMIT")


def _check_export_repo(repo: Path, base: str) -> None:
    if run_git(["merge-base", "--is-ancestor", base, "HEAD"], repo).returncode != 0:
        raise PatchError(f"HEAD of {repo} does not descend from the pinned commit {base}")
    if _git_out(["rev-list", "--merges", f"{base}..HEAD"], repo, "git rev-list"):
        raise PatchError(f"{repo} has merge commits after the pin; rebase them into a linear series first")
    dirty = _git_out(["status", "--porcelain", "--untracked-files=no"], repo, "git status")
    if dirty:
        raise PatchError(f"{repo} has uncommitted changes, which would not be exported:\n{dirty}")


def export(tree: PathLike, patches_dir: Optional[PathLike] = None, *, base: Optional[str] = None,
           pristine: Optional[Listing] = None, target: Optional[str] = None) -> List[str]:
    """Rewrite the series from the commits ``<base>..HEAD`` of the git repository ``tree``.

    ``base`` defaults to the pinned commit, or to the commit whose tree is the
    pin's (see :func:`_export_base`; the module docstring has the workflow);
    with ``pristine`` (the Python-layer series), the commit whose tree is that listing.

    Runs ``git format-patch`` as :data:`FORMAT_PATCH` says, replaces the patch
    files the old series listed whose content changed (see the module
    docstring), removes those the new series does not list, and rewrites
    ``series`` when it changed. Files the old series did not list are left
    alone. ``target`` names what the series is for in its header (default: the active pin, or
    the Python layer). Returns the new patch names.
    """
    repo = tree_root(tree)
    base = _export_base(repo, base, pristine)
    # absolute: git runs in the repository, so a relative staging path would land there (and the series
    # directory would be emptied)
    directory = series_dir(patches_dir).resolve()
    _check_export_repo(repo, base)
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory, prefix=".export-") as staging:
        _git_out([*FORMAT_PATCH, "-o", staging, f"{base}..HEAD"], repo, "git format-patch")
        names = sorted(p.name for p in Path(staging).iterdir() if p.suffix == ".patch")
        try:
            old_names = read_series_names(directory)
        except PatchError:
            old_names = []
        for name in old_names:
            if name not in names:
                (directory / name).unlink(missing_ok=True)
        changed = [name for name in names if _install(Path(staging) / name, directory / name)]
        active = pin.active()
        target = target or (f"llama.cpp {active.build} ({active.commit or 'tree ' + active.tree})" if pristine is None else
                  f"the Python layer of {pin.PYTHON_LAYER_SDIST.name} {pin.PYTHON_LAYER_SDIST.version} "
                  "(the sdist without vendor/)")
        header = (
            f"# The HeadInfer patch series for {target},\n"
            "# applied in this order. Generated by `pyllama-headinfer patch export`.\n"
        )
        staged_series = Path(staging) / SERIES_FILE
        staged_series.write_text(header + "".join(f"{n}\n" for n in names), encoding="utf-8")
        _install(staged_series, directory / SERIES_FILE)
    log.info("exported %d patches from %s to %s (%d rewritten)", len(names), repo, directory, len(changed))
    return names
