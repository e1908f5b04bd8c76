"""Running ``git apply`` in a scratch copy of the files a series touches.

``git apply`` never runs inside the tree: the files the series touches are
copied to a temporary directory (outside any repository; the ceiling is its
parent) by :class:`Workspace`, and the series is applied or reversed there.
So no enclosing repository, index, attribute or gitfile of the tree can
interfere. Writing a result back into the tree is ``patches.py``'s job
(``_install``, all or nothing).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Set

from pyllama_headinfer.source import tree_verify
from pyllama_headinfer.errors import PatchError
from pyllama_headinfer.patches.series import Patch, Series
from pyllama_headinfer.pin import PinnedFile


# --------------------------------------------------------------------------
# running git apply in a scratch copy of the touched files


def _git_env(cwd: Path) -> Dict[str, str]:
    env = dict(os.environ)
    # the user's and the system's git configuration must not change what we
    # compute (apply's whitespace rules, export's diff format): only the
    # repository's own config and our -c options apply
    env["GIT_CONFIG_GLOBAL"] = os.devnull
    env["GIT_CONFIG_NOSYSTEM"] = "1"
    env["GIT_CEILING_DIRECTORIES"] = str(cwd.parent)
    env["LC_ALL"] = "C"  # we parse git's messages
    env["LANGUAGE"] = ""
    for variable in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE"):
        env.pop(variable, None)
    return env


def run_git(args: Sequence[str], cwd: Path) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            ["git", *args], cwd=cwd, env=_git_env(cwd),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
    except FileNotFoundError as exc:
        raise PatchError("git is required to manage patches but was not found on PATH") from exc


class Workspace:
    """A temporary directory holding copies of the files a series touches."""

    def __init__(self, touched: Iterable[str]):
        self.touched = sorted(set(touched))
        self._temp = tempfile.TemporaryDirectory(prefix="pyllama-headinfer-")
        self.root = Path(self._temp.name) / "tree"

    def __enter__(self) -> "Workspace":
        return self

    def __exit__(self, *exc) -> None:
        self._temp.cleanup()

    def load(self, tree: Path) -> "Workspace":
        """Replace the workspace content with the tree's touched files."""
        if self.root.exists():
            shutil.rmtree(self.root)
        self.root.mkdir()
        for relative in self.touched:
            source_file = tree / relative
            if source_file.is_file() or source_file.is_symlink():
                target = self.root / relative
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source_file, target, follow_symlinks=False)
        return self

    def apply(self, patches: Sequence[Patch], *, reverse: bool = False, check: bool = False,
              reject: bool = False, include: Optional[str] = None) -> subprocess.CompletedProcess:
        """``git apply`` the patches (in the order given) to the workspace."""
        args = ["apply", "--whitespace=nowarn", "-v"]
        if reverse:
            args.append("--reverse")
        if check:
            args.append("--check")
        if reject:
            args.append("--reject")
        if include is not None:
            args.append(f"--include={include}")
        args.extend(str(p.path) for p in patches)
        return run_git(args, self.root)

    def listing(self) -> Dict[str, PinnedFile]:
        return tree_verify.scan_tree(self.root, use_cache=False)


def restrict_listing(listing: Dict[str, PinnedFile], keep: Set[str]) -> Dict[str, PinnedFile]:
    return {p: v for p, v in listing.items() if p in keep}


def listing_without(listing: Dict[str, PinnedFile], drop: Set[str]) -> Dict[str, PinnedFile]:
    return {p: v for p, v in listing.items() if p not in drop}


def reversed_prefix(series: Series, count: int) -> List[Patch]:
    """The first ``count`` patches in the order that undoes them."""
    return list(reversed(series.patches[:count]))
