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
"""

from __future__ import annotations

import argparse
import codecs
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple, Union

from . import paths, pin, source
from .errors import PatchError
from .pin import PinnedFile

log = logging.getLogger(__name__)

PathLike = Union[str, "os.PathLike[str]"]
SERIES_FILE = "series"
DIFF_EXAMPLES = 8

REVERT_RECIPE = "run `pyllama-headinfer patch revert` to return it to the pristine pin"
REFETCH_RECIPE = (
    "restore the files named above by hand, or start from a fresh tree "
    "(`pyllama-headinfer source fetch --force` replaces the cached one)"
)


# --------------------------------------------------------------------------
# reading the series


@dataclass(frozen=True)
class Hunk:
    number: int  # 1-based within its file, as git apply counts them
    header: str  # "@@ -a,b +c,d @@"


@dataclass(frozen=True)
class FilePatch:
    old_path: Optional[str]  # None for a created file
    new_path: Optional[str]  # None for a deleted file
    hunks: Tuple[Hunk, ...]

    @property
    def path(self) -> str:
        return self.new_path or self.old_path or ""

    @property
    def paths(self) -> Set[str]:
        return {p for p in (self.old_path, self.new_path) if p}


@dataclass(frozen=True)
class Patch:
    name: str
    path: Path
    files: Tuple[FilePatch, ...]

    @property
    def touched(self) -> Set[str]:
        return set().union(*(f.paths for f in self.files)) if self.files else set()

    def file_patch(self, reported: str) -> Optional[FilePatch]:
        """The file section git apply reports as ``reported`` (a path, or "old => new")."""
        candidates = {p.strip() for p in reported.split(" => ")}
        for file_patch in self.files:
            if file_patch.paths & candidates:
                return file_patch
        return None


@dataclass(frozen=True)
class Series:
    directory: Path
    patches: Tuple[Patch, ...]

    @property
    def names(self) -> Tuple[str, ...]:
        return tuple(p.name for p in self.patches)

    @property
    def touched(self) -> Set[str]:
        return set().union(*(p.touched for p in self.patches)) if self.patches else set()

    def __len__(self) -> int:
        return len(self.patches)


def _series_dir(patches_dir: Optional[PathLike]) -> Path:
    return Path(patches_dir) if patches_dir is not None else paths.patches_dir()


def read_series_names(patches_dir: Optional[PathLike] = None) -> List[str]:
    """Patch file names listed in ``series`` (empty when the file or directory is absent)."""
    series_file = _series_dir(patches_dir) / SERIES_FILE
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


def load_series(patches_dir: Optional[PathLike] = None) -> Series:
    directory = _series_dir(patches_dir)
    patches = []
    for name in read_series_names(directory):
        patch_path = directory / name
        if not patch_path.is_file():
            raise PatchError(f"{directory / SERIES_FILE} lists {name}, which does not exist")
        text = patch_path.read_text(encoding="utf-8", errors="surrogateescape")
        files = parse_patch(text)
        if not files:
            raise PatchError(f"{patch_path} contains no diff")
        patches.append(Patch(name, patch_path.resolve(), tuple(files)))
    return Series(directory, tuple(patches))


def series_hash(patches_dir: Optional[PathLike] = None) -> str:
    """sha256 over ``series`` and the listed patch files, in order.

    Each part is framed with its name and length, so moving bytes between
    files changes the hash. An absent series hashes like an empty one.
    """
    directory = _series_dir(patches_dir)
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


# --------------------------------------------------------------------------
# parsing a git diff (just enough: touched paths and hunk headers)

_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def _unquote(name: str) -> str:
    """A path as git prints it: C-quoted when it has special characters."""
    name = name.rstrip("\t")
    if len(name) >= 2 and name[0] == name[-1] == '"':
        raw = codecs.escape_decode(name[1:-1].encode("utf-8", "surrogateescape"))[0]
        return raw.decode("utf-8", "surrogateescape")
    return name


def _strip_prefix(name: str) -> Optional[str]:
    name = _unquote(name)
    if name == "/dev/null":
        return None
    return name[2:] if name[:2] in ("a/", "b/") else name


def _paths_from_diff_line(rest: str) -> Tuple[Optional[str], Optional[str]]:
    """Paths of ``diff --git a/X b/Y`` (only used when no ---/+++ lines follow)."""
    if rest.startswith('"'):
        end = rest.index('"', 1)
        while rest[end - 1] == "\\":
            end = rest.index('"', end + 1)
        return _strip_prefix(rest[: end + 1]), _strip_prefix(rest[end + 2:])
    # unquoted: "a/X b/X"; when X contains " b/" prefer the split giving equal halves
    splits = [m.start() for m in re.finditer(r" b/", rest)]
    for at in splits:
        if rest[2:at] == rest[at + 3:]:
            return rest[2:at], rest[at + 3:]
    at = splits[0] if splits else len(rest)
    return _strip_prefix(rest[:at]), _strip_prefix(rest[at + 1:])


def parse_patch(text: str) -> List[FilePatch]:
    """The file sections of a git patch, with their hunk headers."""
    sections: List[FilePatch] = []
    lines = text.splitlines()
    index = 0
    while index < len(lines):
        line = lines[index]
        index += 1
        if not line.startswith("diff --git "):
            continue
        old, new = _paths_from_diff_line(line[len("diff --git "):])
        created = deleted = False
        hunks: List[Hunk] = []
        while index < len(lines) and not lines[index].startswith("diff --git "):
            line = lines[index]
            index += 1
            match = _HUNK_RE.match(line)
            if match:
                hunks.append(Hunk(len(hunks) + 1, line[: line.index("@@", 2) + 2]))
                old_count = int(match.group(2) or 1)
                new_count = int(match.group(4) or 1)
                index = _skip_hunk_body(lines, index, old_count, new_count)
            elif line.startswith("new file mode"):
                created = True
            elif line.startswith("deleted file mode"):
                deleted = True
            elif line.startswith("rename from ") or line.startswith("copy from "):
                old = _unquote(line.split(" from ", 1)[1])
            elif line.startswith("rename to ") or line.startswith("copy to "):
                new = _unquote(line.split(" to ", 1)[1])
            elif line.startswith("--- ") and not hunks:
                old = _strip_prefix(line[4:])
            elif line.startswith("+++ ") and not hunks:
                new = _strip_prefix(line[4:])
            elif line == "-- ":  # format-patch signature: the diff is over
                break
        sections.append(FilePatch(None if created else old, None if deleted else new, tuple(hunks)))
    return sections


def _skip_hunk_body(lines: Sequence[str], index: int, old_count: int, new_count: int) -> int:
    """Index after a hunk's body (counting lines, since a body line may start with '---')."""
    while index < len(lines) and (old_count > 0 or new_count > 0):
        marker = lines[index][:1]
        if marker == " " or lines[index] == "":
            old_count -= 1
            new_count -= 1
        elif marker == "-":
            old_count -= 1
        elif marker == "+":
            new_count -= 1
        elif marker != "\\":
            break  # malformed: let git apply complain
        index += 1
    while index < len(lines) and lines[index].startswith("\\"):
        index += 1  # "\ No newline at end of file"
    return index


# --------------------------------------------------------------------------
# running git apply in a scratch copy of the touched files


def _git_env(cwd: Path) -> Dict[str, str]:
    env = dict(os.environ)
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
        return source.scan_tree(self.root, use_cache=False)


def _restrict(listing: Dict[str, PinnedFile], keep: Set[str]) -> Dict[str, PinnedFile]:
    return {p: v for p, v in listing.items() if p in keep}


def _without(listing: Dict[str, PinnedFile], drop: Set[str]) -> Dict[str, PinnedFile]:
    return {p: v for p, v in listing.items() if p not in drop}


def _reversed_prefix(series: Series, count: int) -> List[Patch]:
    """The first ``count`` patches in the order that undoes them."""
    return list(reversed(series.patches[:count]))


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

    def describe(self) -> str:
        if self.state == State.PRISTINE:
            return f"PRISTINE: the pinned llama.cpp {pin.LLAMA_CPP_BUILD}, no patch applied ({self.total} in the series)"
        if self.state == State.APPLIED:
            return f"APPLIED: all {self.total} patches of the series are applied"
        if self.state == State.PARTIAL:
            last = self.series_names[self.applied - 1] if self.series_names else self.applied
            return (f"PARTIAL: the first {self.applied} of {self.total} patches are applied "
                    f"(up to {last}); {REVERT_RECIPE}, then apply again")
        shown = "; ".join(self.modified[:DIFF_EXAMPLES])
        more = f"; ... ({len(self.modified) - DIFF_EXAMPLES} more)" if len(self.modified) > DIFF_EXAMPLES else ""
        return f"MODIFIED: files match neither the pin nor the patch series: {shown}{more}"


def _tree_root(tree: PathLike) -> Path:
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
        if work.apply(_reversed_prefix(series, count), reverse=True).returncode != 0:
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
    want_actual = _restrict(actual, {relative})
    want_pristine = _restrict(pristine, {relative})
    if want_actual == want_pristine:
        return "pristine"
    for count in range(len(mine), 0, -1):
        work.load(tree)
        undo = list(reversed(mine[:count]))
        if work.apply(undo, reverse=True, include=relative).returncode != 0:
            continue
        if _restrict(work.listing(), {relative}) != want_pristine:
            continue
        redo = work.apply(mine[:count], include=relative)
        if redo.returncode == 0 and _restrict(work.listing(), {relative}) == want_actual:
            return f"after {mine[count - 1].name}"
    return None


def status(tree: PathLike, patches_dir: Optional[PathLike] = None) -> StatusReport:
    """Which state the tree is in relative to the pin and the series (never changes it)."""
    root = _tree_root(tree)
    series = load_series(patches_dir)
    source.check_pin_listing()
    expected = pin.pinned_files()
    actual = source.scan_tree(root)
    touched = series.touched
    outside = source.compare_listings(_without(actual, touched), _without(expected, touched))
    outside_notes = [f"{p} (differs from the pin)" for p in outside.differing]
    outside_notes += [f"{p} (missing)" for p in outside.missing]
    outside_notes += [f"{p} (extra)" for p in outside.extra]

    def report(state: State, applied: int = 0, notes: Sequence[str] = ()) -> StatusReport:
        return StatusReport(root, state, applied, len(series), series.names, tuple(notes))

    actual_touched = _restrict(actual, touched)
    pristine_touched = _restrict(expected, touched)
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


def check(tree: PathLike, patches_dir: Optional[PathLike] = None) -> CheckReport:
    """Whether each patch applies to the tree, per hunk for those that fail. Read-only."""
    root = _tree_root(tree)
    return _check(root, load_series(patches_dir), status(root, patches_dir))


def _check(root: Path, series: Series, state: StatusReport) -> CheckReport:
    done = state.applied if state.state in (State.APPLIED, State.PARTIAL) else 0
    results = [PatchCheck(p.name, Outcome.ALREADY_APPLIED) for p in series.patches[:done]]
    with Workspace(series.touched) as work:
        work.load(root)
        for patch in series.patches[done:]:
            results.append(_check_one(work, patch))
    return CheckReport(root, state, tuple(results))


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
# export: regenerate the series from a git repository


def _git_out(args: Sequence[str], repo: Path, what: str) -> str:
    result = run_git(args, repo)
    if result.returncode != 0:
        raise PatchError(f"{what} failed: {result.stderr.strip() or result.stdout.strip()}")
    return result.stdout.strip()


def _export_base(repo: Path, base: Optional[str]) -> str:
    """The commit the series starts from.

    An explicit ``base``; else the pinned commit when the repository has it;
    else the newest ancestor of HEAD whose tree is the pin's tree (a copy of
    the pinned source committed with ``git init``).
    """
    top = run_git(["rev-parse", "--show-toplevel"], repo)
    if top.returncode != 0 or Path(top.stdout.strip()).resolve() != repo:
        raise PatchError(f"{repo} is not the top of a git repository; export needs a checkout "
                         "whose commits on top of the pin are the series")
    if base is not None:
        if run_git(["cat-file", "-e", f"{base}^{{commit}}"], repo).returncode != 0:
            raise PatchError(f"{repo} does not contain the base commit {base}")
        return base
    if run_git(["cat-file", "-e", f"{pin.LLAMA_CPP_COMMIT}^{{commit}}"], repo).returncode == 0:
        return pin.LLAMA_CPP_COMMIT
    history = _git_out(["log", "--format=%H %T", "HEAD"], repo, "git log")
    for line in history.splitlines():
        commit, tree = line.split()
        if tree == pin.pinned_tree_id():
            log.info("exporting from %s, the commit of %s whose tree is the pin's", commit[:12], repo)
            return commit
    raise PatchError(f"{repo} contains neither the pinned commit {pin.LLAMA_CPP_COMMIT} nor a commit "
                     "with the pin's tree; pass --base COMMIT")


def _check_export_repo(repo: Path, base: str) -> None:
    if run_git(["merge-base", "--is-ancestor", base, "HEAD"], repo).returncode != 0:
        raise PatchError(f"HEAD of {repo} does not descend from the pinned commit {base}")
    if _git_out(["rev-list", "--merges", f"{base}..HEAD"], repo, "git rev-list"):
        raise PatchError(f"{repo} has merge commits after the pin; rebase them into a linear series first")
    dirty = _git_out(["status", "--porcelain", "--untracked-files=no"], repo, "git status")
    if dirty:
        raise PatchError(f"{repo} has uncommitted changes, which would not be exported:\n{dirty}")


def export(tree: PathLike, patches_dir: Optional[PathLike] = None, *, base: Optional[str] = None) -> List[str]:
    """Rewrite the series from the commits ``<base>..HEAD`` of the git repository ``tree``.

    ``base`` defaults to the pinned commit, or to the commit whose tree is the
    pin's (see :func:`_export_base`; the module docstring has the workflow).

    Runs ``git format-patch --zero-commit --no-signature --no-stat -N`` (plus
    fixed a/ b/ prefixes and no rename detection, so users' git config cannot
    change the output), replaces the patch files the old series listed, and
    rewrites ``series``. Files the old series did not list are left alone.
    Returns the new patch names.
    """
    repo = _tree_root(tree)
    base = _export_base(repo, base)
    directory = _series_dir(patches_dir)
    _check_export_repo(repo, base)
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory, prefix=".export-") as staging:
        _git_out(
            ["format-patch", "--zero-commit", "--no-signature", "--no-stat", "-N", "--no-renames",
             "--src-prefix=a/", "--dst-prefix=b/", "-o", staging, f"{base}..HEAD"],
            repo, "git format-patch",
        )
        names = sorted(p.name for p in Path(staging).iterdir() if p.suffix == ".patch")
        try:
            old_names = read_series_names(directory)
        except PatchError:
            old_names = []
        for name in old_names:
            (directory / name).unlink(missing_ok=True)
        for name in names:
            os.replace(Path(staging) / name, directory / name)
    header = (
        f"# The HeadInfer patch series for llama.cpp {pin.LLAMA_CPP_BUILD} ({pin.LLAMA_CPP_COMMIT}),\n"
        "# applied in this order. Generated by `pyllama-headinfer patch export`.\n"
    )
    (directory / SERIES_FILE).write_text(header + "".join(f"{n}\n" for n in names), encoding="utf-8")
    log.info("exported %d patches from %s to %s", len(names), repo, directory)
    return names


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
