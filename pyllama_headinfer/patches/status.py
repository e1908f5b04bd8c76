"""Which state a tree is in relative to the pin and the series (:func:`status`).

* PRISTINE: exactly the pinned commit;
* APPLIED:  the pinned commit with the whole series applied;
* PARTIAL:  the first k patches applied (an interrupted or hand-made apply);
* MODIFIED: anything else (files edited by hand, extra or missing files).

The files outside the series are compared with the pin directly; the files it
touches are undone and redone in a :class:`~.workspace.Workspace` to
find how many leading patches they carry (and, for a MODIFIED tree, which
files fit no patch level). Read-only. The pristine tree is the pinned
llama.cpp unless the caller passes another listing (``pristine``: the Python
layer of the llama-cpp-python sdist for its own series).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from pyllama_headinfer import pin
from pyllama_headinfer.source import tree_verify
from pyllama_headinfer.errors import PatchError
from pyllama_headinfer.patches.series import PathLike, Patch, Series, load_series
from pyllama_headinfer.patches.workspace import Workspace, restrict_listing, reversed_prefix, listing_without
from pyllama_headinfer.pin import PinnedFile
from pyllama_headinfer.source.tree_verify import Listing

DIFF_EXAMPLES = 8

REVERT_RECIPE = "run `pyllama-headinfer patch revert` to return it to the pristine pin"


# --------------------------------------------------------------------------
# status


class State(str, Enum):
    PRISTINE = "PRISTINE"
    APPLIED = "APPLIED"
    PARTIAL = "PARTIAL"
    MODIFIED = "MODIFIED"


@dataclass(frozen=True)
class StatusReport:
    tree: Path
    state: State
    applied: int  # patches applied (PARTIAL: the first `applied`; MODIFIED: 0)
    total: int
    series_names: Tuple[str, ...] = ()
    modified: Tuple[str, ...] = ()  # MODIFIED: the offending files, with a note each
    pinned: str = "llama.cpp"  # what the pristine tree is (pinned_label)

    def describe(self) -> str:
        if self.state == State.PRISTINE:
            return f"PRISTINE: the pinned {self.pinned}, no patch applied ({self.total} in the series)"
        if self.state == State.APPLIED:
            return f"APPLIED: all {self.total} patches of the series are applied"
        if self.state == State.PARTIAL:
            last = self.series_names[self.applied - 1] if self.series_names else self.applied
            return (f"PARTIAL: the first {self.applied} of {self.total} patches are applied "
                    f"(up to {last}); {REVERT_RECIPE}, then apply again")
        shown = "; ".join(self.modified[:DIFF_EXAMPLES])
        more = f"; ... ({len(self.modified) - DIFF_EXAMPLES} more)" if len(self.modified) > DIFF_EXAMPLES else ""
        return f"MODIFIED: files match neither the pin nor the patch series: {shown}{more}"


def tree_root(tree: PathLike) -> Path:
    root = Path(tree).expanduser().resolve()
    if not root.is_dir():
        raise PatchError(f"{root} is not a directory")
    return root


def _stage_of_touched(work: Workspace, tree: Path, series: Series,
                      actual: Dict[str, PinnedFile], pristine: Dict[str, PinnedFile]) -> Optional[int]:
    """How many leading patches the touched files carry, or None if no count fits.

    For k = n..1: undo patches k..1 in the workspace; if that yields exactly
    the pinned blobs, redo them and require exactly the tree's blobs (so the
    answer never rests on a lenient reverse apply).
    """
    if actual == pristine:
        return 0
    for count in range(len(series), 0, -1):
        work.load(tree)
        if work.apply(reversed_prefix(series, count), reverse=True).returncode != 0:
            continue
        if work.listing() != pristine:
            continue
        if work.apply(series.patches[:count]).returncode == 0 and work.listing() == actual:
            return count
    return None


def _diagnose_files(work: Workspace, tree: Path, series: Series, actual: Dict[str, PinnedFile],
                    pristine: Dict[str, PinnedFile]) -> List[str]:
    """Per touched file: which patch level it is at, to name the files that fit none."""
    notes, levels = [], {}
    for relative in sorted(series.touched):
        mine = [p for p in series.patches if relative in p.touched]
        level = _file_level(work, tree, relative, mine, actual, pristine)
        if level is None:
            notes.append(f"{relative} (edited: matches no patch level)")
        else:
            levels[relative] = level
    if not notes:  # every file fits some level, but not the same one
        for relative, level in sorted(levels.items()):
            notes.append(f"{relative} (at {level})")
    return notes


def _file_level(work: Workspace, tree: Path, relative: str, mine: List[Patch],
                actual: Dict[str, PinnedFile], pristine: Dict[str, PinnedFile]) -> Optional[str]:
    want_actual = restrict_listing(actual, {relative})
    want_pristine = restrict_listing(pristine, {relative})
    if want_actual == want_pristine:
        return "pristine"
    for count in range(len(mine), 0, -1):
        work.load(tree)
        undo = list(reversed(mine[:count]))
        if work.apply(undo, reverse=True, include=relative).returncode != 0:
            continue
        if restrict_listing(work.listing(), {relative}) != want_pristine:
            continue
        redo = work.apply(mine[:count], include=relative)
        if redo.returncode == 0 and restrict_listing(work.listing(), {relative}) == want_actual:
            return f"after {mine[count - 1].name}"
    return None


def pinned_listing(pristine: Optional[Listing] = None) -> Listing:
    """``pristine``, else the pinned llama.cpp tree's listing (checked against the commit first)."""
    if pristine is not None:
        return pristine
    tree_verify.check_pin_listing()
    return pin.active().files()


def pinned_label(pristine: Optional[Listing] = None) -> str:
    """What a pristine tree is, for messages: the pinned llama.cpp, or the sdist's Python layer."""
    if pristine is None:
        return f"llama.cpp {pin.active().build}"
    return f"Python layer of {pin.PYTHON_LAYER_SDIST.name} {pin.PYTHON_LAYER_SDIST.version}"


def status(tree: PathLike, patches_dir: Optional[PathLike] = None, *,
           pristine: Optional[Listing] = None) -> StatusReport:
    """Which state the tree is in relative to the pin and the series (never changes it).

    ``pristine`` is the listing of the unpatched tree, by default the pinned
    llama.cpp (:meth:`pin.Pin.files` of the active pin); the Python-layer series passes
    :func:`pin.python_layer_files` with its own ``patches_dir``."""
    root = tree_root(tree)
    series = load_series(patches_dir)
    expected = pinned_listing(pristine)
    actual = tree_verify.scan_tree(root)
    touched = series.touched
    outside = tree_verify.compare_listings(listing_without(actual, touched), listing_without(expected, touched))
    outside_notes = [f"{p} (differs from the pin)" for p in outside.differing]
    outside_notes += [f"{p} (missing)" for p in outside.missing]
    outside_notes += [f"{p} (extra)" for p in outside.extra]

    def report(state: State, applied: int = 0, notes: Sequence[str] = ()) -> StatusReport:
        return StatusReport(root, state, applied, len(series), series.names, tuple(notes), pinned_label(pristine))

    actual_touched = restrict_listing(actual, touched)
    pristine_touched = restrict_listing(expected, touched)
    with Workspace(touched) as work:
        applied = _stage_of_touched(work, root, series, actual_touched, pristine_touched)
        if applied is None:
            notes = _diagnose_files(work, root, series, actual_touched, pristine_touched)
            return report(State.MODIFIED, 0, notes + outside_notes)
    if not outside.ok:
        return report(State.MODIFIED, 0, outside_notes)
    if applied == 0:
        return report(State.PRISTINE)
    if applied == len(series):
        return report(State.APPLIED, applied)
    return report(State.PARTIAL, applied)


def tree_acceptance(tree: PathLike) -> Tuple[bool, str]:
    """(usable, description): usable when ``tree`` is pristine or has exactly
    our series applied -- the acceptance the build and the ``source`` command
    pass to :func:`pyllama_headinfer.source.fetch.ensure_source`."""
    diff = tree_verify.verify_tree(tree)
    if diff.ok:
        return True, "pristine"
    try:
        report = status(tree)
    except PatchError as exc:
        return False, f"not the pin ({diff.describe()}); patch state unknown: {exc}"
    if report.state == State.APPLIED:
        return True, "patch series applied"
    return False, report.describe()
