"""``patch check``: whether each patch applies to a tree, per hunk for those that fail.

:func:`check` tries the patches one by one in a
:class:`~.workspace.Workspace` (after the ones the tree already
carries) and parses ``git apply --reject -v`` into per-hunk verdicts; the
:class:`CheckReport` also says whether ``apply`` would accept the tree.
Read-only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from pyllama_headinfer.patches.series import PathLike, Patch, Series, load_series
from pyllama_headinfer.patches.status import State, StatusReport, tree_root, status
from pyllama_headinfer.patches.workspace import Workspace
from pyllama_headinfer.source.tree_verify import Listing


# --------------------------------------------------------------------------
# check


class Outcome(str, Enum):
    APPLIES = "applies"
    ALREADY_APPLIED = "already applied"
    FAILS = "FAILS"


@dataclass(frozen=True)
class HunkResult:
    path: str
    header: str
    number: int
    applies: bool


@dataclass(frozen=True)
class PatchCheck:
    name: str
    outcome: Outcome
    hunks: Tuple[HunkResult, ...] = ()  # filled for a failing patch
    errors: Tuple[str, ...] = ()  # git's error lines for a failing patch

    def describe(self) -> str:
        lines = [f"{self.name}: {self.outcome.value}"]
        for hunk in self.hunks:
            verdict = "applies" if hunk.applies else "FAILS"
            lines.append(f"    {hunk.path}: hunk #{hunk.number} {hunk.header}: {verdict}")
        lines.extend(f"    {error}" for error in self.errors)
        return "\n".join(lines)


@dataclass(frozen=True)
class CheckReport:
    tree: Path
    status: StatusReport
    patches: Tuple[PatchCheck, ...]

    @property
    def applies(self) -> bool:
        """Every patch applies (or is applied) to the files as they are."""
        return all(p.outcome != Outcome.FAILS for p in self.patches)

    @property
    def ok(self) -> bool:
        """``apply`` would succeed: the patches apply and the tree is one apply accepts
        (a hand-edited or half-patched tree is refused even where the hunks still fit)."""
        return self.applies and self.status.state in (State.PRISTINE, State.APPLIED)

    @property
    def failing(self) -> Tuple[PatchCheck, ...]:
        return tuple(p for p in self.patches if p.outcome == Outcome.FAILS)

    def describe(self) -> str:
        head = f"{self.tree}: {self.status.describe()}"
        if not self.patches:
            return head + "\n(the patch series is empty)"
        if not self.applies:
            verdict = f"{len(self.failing)} patch(es) fail"
        elif not self.ok:
            verdict = (f"the patches apply, but `patch apply` refuses a {self.status.state.name} tree: "
                       "restore the files named above, or start from a fresh tree (`source fetch --force`)")
        else:
            verdict = "the series applies"
        return "\n".join([head, *(p.describe() for p in self.patches), verdict])


def _hunk_results(patch: Patch, output: str) -> Tuple[Tuple[HunkResult, ...], Tuple[str, ...]]:
    """Per-hunk verdicts from ``git apply --reject -v`` output."""
    verdicts: Dict[str, Dict[int, bool]] = {}
    errors: List[str] = []
    current: Optional[str] = None
    for line in output.splitlines():
        if line.startswith("Applied patch ") and line.endswith(" cleanly."):
            name = line[len("Applied patch "):-len(" cleanly.")]
            section = patch.file_patch(name)
            if section is not None:
                verdicts[section.path] = {h.number: True for h in section.hunks}
            current = None
        elif line.startswith("Applying patch ") and " with " in line:
            section = patch.file_patch(line[len("Applying patch "):].rsplit(" with ", 1)[0])
            current = section.path if section is not None else None
            if current is not None:
                verdicts.setdefault(current, {})
        elif current is not None and re.match(r"^Hunk #(\d+) applied cleanly\.$", line):
            verdicts[current][int(line.split("#")[1].split()[0])] = True
        elif current is not None and re.match(r"^Rejected hunk #(\d+)\.$", line):
            verdicts[current][int(line.split("#")[1].rstrip("."))] = False
        elif line.startswith(("error: ", "fatal: ")) and "while searching for" not in line:
            errors.append(line)
    results = []
    for section in patch.files:
        seen = verdicts.get(section.path, {})
        for hunk in section.hunks:
            results.append(HunkResult(section.path, hunk.header, hunk.number, seen.get(hunk.number, False)))
    return tuple(results), tuple(errors)


def _check_one(work: Workspace, patch: Patch) -> PatchCheck:
    """Try one patch on the workspace, leaving it applied when it applies."""
    if work.apply([patch], check=True).returncode == 0:
        work.apply([patch])
        return PatchCheck(patch.name, Outcome.APPLIES)
    if work.apply([patch], reverse=True, check=True).returncode == 0:
        return PatchCheck(patch.name, Outcome.ALREADY_APPLIED)
    attempt = work.apply([patch], reject=True)
    hunks, errors = _hunk_results(patch, attempt.stdout + attempt.stderr)
    return PatchCheck(patch.name, Outcome.FAILS, hunks, errors)


def check(tree: PathLike, patches_dir: Optional[PathLike] = None, *,
          pristine: Optional[Listing] = None) -> CheckReport:
    """Whether each patch applies to the tree, per hunk for those that fail. Read-only.
    (``pristine``: see :func:`~.status.status`.)"""
    root = tree_root(tree)
    return check_series(root, load_series(patches_dir), status(root, patches_dir, pristine=pristine))


def check_series(root: Path, series: Series, state: StatusReport) -> CheckReport:
    done = state.applied if state.state in (State.APPLIED, State.PARTIAL) else 0
    results = [PatchCheck(p.name, Outcome.ALREADY_APPLIED) for p in series.patches[:done]]
    with Workspace(series.touched) as work:
        work.load(root)
        for patch in series.patches[done:]:
            results.append(_check_one(work, patch))
    return CheckReport(root, state, tuple(results))

