"""Moving the series to another llama.cpp tree: the 3-way drift report and ``patch rebase``.

A maintainer re-targets a patch series by replaying its commits onto the new
upstream with 3-way merges; this module does exactly that, in a scratch git
repository that holds only the files the series touches (seconds, not the
176 MB tree):

1. commit ``pin``: those files as the pin has them; branch ``series``: the
   patches applied on top with ``git am`` (so every blob a patch's ``index``
   line names exists -- the bases of the 3-way merges);
2. commit ``upstream`` on top of ``pin``: the same files as the target tree has
   them;
3. each patch in turn onto ``upstream`` + the patches before it, and a verdict:

   * ``clean``: applies as it is (``git apply --check``; offsets allowed);
   * ``already upstream``: its reverse applies, so the tree carries the change;
   * ``merged``: ``git am -3`` merges it without a conflict;
   * ``replayed``: this patch, unchanged, was resolved by hand onto this very
     state before -- the earlier result (in the output series) is used again;
   * ``resolved``: it conflicted, and every conflict -- a block of conflict
     markers whose two sides, the tree's and the patch's, were found in the
     merged file -- has a recorded resolution for exactly those sides;
   * ``CONFLICT``: conflicts remain; the result is committed *with* the
     markers, so the patches after it are still tried, and each conflict is
     reported with its file, line and the upstream code now standing there.
     A conflict over a whole file (the tree lacks a file the patch changes,
     the patch deletes a file the tree changed, a binary file) has no markers
     and no recorded resolution can settle it: it is always a ``CONFLICT``
     (it once counted as ``resolved``, having no unresolved markers, so the
     series "applied" to a tree that lacked its files).

Recorded resolutions are the equivalent of ``git rerere``, kept next to the
target series as small JSON files (``<out>/resolutions/<id>.json``: the patch,
the file, both sides of the conflict and the resolution) instead of rerere's
whole-file pre- and post-images, which would be copies of upstream's sources.
They are learned from the output series itself: when ``--out`` already holds a
re-targeted series (a human resolved the markers and ran ``patch export``
into it), :func:`rebase` first replays that series onto the tree and, for
every patch of the source series that conflicts there, pairs each conflict
with the text the human put in its place. The next re-target -- after the
source series changed, say -- reuses both: a patch whose text and starting
state are unchanged is replayed whole, and a conflict seen before is resolved
as before.

:func:`drift` is the read-only report behind ``patch check`` on a tree that is
not the pin; :func:`rebase` writes the re-targeted series.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from pyllama_headinfer import pin
from pyllama_headinfer.errors import PatchError, UsageError
from pyllama_headinfer.patches.series import Patch, Series, load_series
from pyllama_headinfer.patches.workspace import Workspace, listing_without, restrict_listing, reversed_prefix, run_git

log = logging.getLogger("pyllama_headinfer.patches")

RESOLUTIONS_DIR = "resolutions"
SOURCES_FILE = "sources.json"  # in RESOLUTIONS_DIR: which source patch each output patch was made from
SHOWN_LINES = 6  # lines of upstream code shown per conflict in a report

# identity and settings for the scratch repository (never the user's configuration: run_git)
_GIT = ["-c", "user.name=pyllama-headinfer", "-c", "user.email=retarget@pyllama-headinfer.invalid",
        "-c", "core.autocrlf=false", "-c", "merge.conflictStyle=merge", "-c", "am.keepcr=true",
        "-c", "commit.gpgSign=false", "-c", "rerere.enabled=false"]


class Verdict(str, Enum):
    CLEAN = "clean"
    UPSTREAM = "already upstream"
    MERGED = "merged"
    REPLAYED = "replayed"
    RESOLVED = "resolved"
    CONFLICT = "CONFLICT"


@dataclass(frozen=True)
class Conflict:
    path: str
    line: int  # 1-based line of the "<<<<<<<" marker in the merged file
    ours: str  # the target tree's side (upstream, plus the patches before this one)
    theirs: str  # the patch's side
    resolved: bool = False
    whole_file: str = ""  # a conflict over the whole file, without markers: what happened to it (line 0)

    @property
    def ident(self) -> str:
        """What identifies the conflict wherever it shows up again (like rerere's conflict id)."""
        return hashlib.sha1(f"{self.path}\0{self.ours}\0{self.theirs}".encode()).hexdigest()[:16]

    def describe(self) -> str:
        if self.whole_file:
            return f"    {self.path}: {self.whole_file}"
        shown = self.ours.splitlines()[:SHOWN_LINES]
        more = len(self.ours.splitlines()) - len(shown)
        lines = [f"    {self.path}:{self.line}: {'resolved from record ' + self.ident if self.resolved else 'conflict ' + self.ident}"]
        if not self.resolved:
            lines.append("      upstream has here:" if shown else "      upstream has nothing here (the patch's context moved)")
            lines.extend(f"      | {text}" for text in shown)
            if more > 0:
                lines.append(f"      | ... ({more} more lines)")
        return "\n".join(lines)


@dataclass(frozen=True)
class PatchResult:
    name: str
    verdict: Verdict
    conflicts: Tuple[Conflict, ...] = ()
    note: str = ""

    def describe(self) -> str:
        head = f"{self.name}: {self.verdict.value}" + (f" ({self.note})" if self.note else "")
        return "\n".join([head, *(c.describe() for c in self.conflicts)])


@dataclass
class RetargetReport:
    tree: Path
    source: str  # what the series was made for, "llama.cpp b11312"
    patches: List[PatchResult] = field(default_factory=list)
    learned: int = 0  # resolutions recorded in this run
    out: Optional[Path] = None
    upstream: str = ""  # the scratch repository's commit of the tree: the base the output series starts from

    def count(self, verdict: Verdict) -> int:
        return sum(1 for p in self.patches if p.verdict == verdict)

    @property
    def conflicting(self) -> List[PatchResult]:
        return [p for p in self.patches if p.verdict == Verdict.CONFLICT]

    @property
    def messages_left(self) -> List[PatchResult]:
        """Patches whose hand-edited message could not be carried over (a human must redo it)."""
        return [p for p in self.patches if MESSAGE_LEFT in p.note]

    @property
    def ok(self) -> bool:
        return not self.conflicting and not self.messages_left

    def summary(self) -> str:
        parts = [f"{self.count(v)} {v.value}" for v in Verdict if self.count(v)]
        return f"{len(self.patches)} patches: " + ", ".join(parts)

    def describe(self) -> str:
        lines = [f"{self.tree}: the series for {self.source}, applied 3-way onto this tree"]
        lines.extend(p.describe() for p in self.patches)
        lines.append(self.summary())
        if self.learned:
            lines.append(f"learned {self.learned} resolution(s) from the series in {self.out}")
        return "\n".join(lines)


# --------------------------------------------------------------------------
# conflict markers


_MARK_OURS, _MARK_SEP, _MARK_THEIRS = "<<<<<<< ", "=======", ">>>>>>> "


def parse_conflicts(path: str, text: str) -> List[Tuple[int, int, Conflict]]:
    """(first line index, end line index, conflict) of each marker block in ``text`` (0-based,
    end exclusive, the marker lines included)."""
    lines = text.splitlines(keepends=True)
    found = []
    i = 0
    while i < len(lines):
        if lines[i].startswith(_MARK_OURS):
            start, ours, theirs = i, [], []
            i += 1
            while i < len(lines) and not lines[i].rstrip("\n") == _MARK_SEP:
                ours.append(lines[i])
                i += 1
            i += 1
            while i < len(lines) and not lines[i].startswith(_MARK_THEIRS):
                theirs.append(lines[i])
                i += 1
            found.append((start, i + 1, Conflict(path, start + 1, "".join(ours), "".join(theirs))))
        i += 1
    return found


def has_markers(text: str) -> bool:
    """Whether a file's text, or the lines a patch adds or keeps, hold a conflict marker."""
    return any(line.lstrip("+ ").startswith(_MARK_OURS) for line in text.splitlines())


def learn_from(path: str, merged: str, resolved: str) -> List[Tuple[Conflict, str]]:
    """Pair each conflict of ``merged`` with the text that stands in its place in ``resolved``.

    The text between the conflicts must appear unchanged in ``resolved``, in order (the human
    edited only the conflicts); each conflict's resolution is what lies between its neighbours.
    Where that does not hold, the conflicts from there on are not learned (the whole resolved
    patch is still replayed when its inputs are unchanged)."""
    lines = merged.splitlines(keepends=True)
    blocks = parse_conflicts(path, merged)
    segments, position = [], 0
    for start, end, _conflict in blocks:
        segments.append("".join(lines[position:start]))
        position = end
    segments.append("".join(lines[position:]))
    if not resolved.startswith(segments[0]):
        return []
    learned: List[Tuple[Conflict, str]] = []
    cursor = len(segments[0])
    for index, (_start, _end, conflict) in enumerate(blocks):
        following = segments[index + 1]
        if index + 1 == len(blocks):
            at = len(resolved) - len(following)
            if at < cursor or not resolved.endswith(following):
                break
        else:
            at = resolved.find(following, cursor)
            if at < 0 or resolved.find(following, at + 1) >= 0:
                break  # absent, or not unique: which text is the resolution cannot be told
        learned.append((conflict, resolved[cursor:at]))
        cursor = at + len(following)
    return learned


# --------------------------------------------------------------------------
# recorded resolutions


class Resolutions:
    """The recorded resolutions of a target series: ``<dir>/resolutions/<conflict id>.json``, and
    ``sources.json``: for each patch of the target series, the digest of the source patch it was
    re-targeted from (a hand-resolved patch teaches something only about that source patch)."""

    def __init__(self, series_dir: Optional[Path]):
        self.directory = series_dir / RESOLUTIONS_DIR if series_dir is not None else None
        self._known: Dict[str, str] = {}
        self.sources: Dict[str, object] = {}
        if self.directory is not None and (self.directory / SOURCES_FILE).is_file():
            try:
                self.sources = json.loads((self.directory / SOURCES_FILE).read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise PatchError(f"unreadable {self.directory / SOURCES_FILE}: {exc}") from exc
        if self.directory is not None and self.directory.is_dir():
            for entry in sorted(p for p in self.directory.glob("*.json") if p.name != SOURCES_FILE):
                try:
                    record = json.loads(entry.read_text(encoding="utf-8"))
                    self._known[record["id"]] = record["resolution"]
                except (OSError, ValueError, KeyError) as exc:
                    raise PatchError(f"unreadable recorded resolution {entry}: {exc}") from exc

    def source_of(self, name: str) -> Dict[str, str]:
        """{"patch": digest of the source patch's diff, "message": digest of its message} that the
        output patch ``name`` was made from ({} when not recorded)."""
        entry = self.sources.get(name)
        if isinstance(entry, str):  # a record from before messages were kept
            return {"patch": entry}
        return dict(entry or {})

    def save_sources(self, sources: Dict[str, Dict[str, str]]) -> None:
        self.sources = dict(sources)
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            (self.directory / SOURCES_FILE).write_text(json.dumps(self.sources, indent=1, sort_keys=True) + "\n",
                                                       encoding="utf-8")

    def get(self, conflict: Conflict) -> Optional[str]:
        return self._known.get(conflict.ident)

    def record(self, patch: str, conflict: Conflict, resolution: str) -> bool:
        """Keep a resolution (on disk when there is a directory); False when it was known already."""
        if self._known.get(conflict.ident) == resolution:
            return False
        self._known[conflict.ident] = resolution
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            record = {"id": conflict.ident, "patch": patch, "path": conflict.path,
                      "ours": conflict.ours, "theirs": conflict.theirs, "resolution": resolution}
            (self.directory / f"{conflict.ident}.json").write_text(
                json.dumps(record, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        return True


def resolve_text(path: str, text: str, resolutions: Resolutions) -> Tuple[str, List[Conflict]]:
    """``text`` with every conflict that has a recorded resolution replaced by it; the conflicts
    (resolved or not), in order."""
    lines = text.splitlines(keepends=True)
    out: List[str] = []
    conflicts = []
    position = 0
    for start, end, conflict in parse_conflicts(path, text):
        out.extend(lines[position:start])
        resolution = resolutions.get(conflict)
        if resolution is None:
            out.extend(lines[start:end])
            conflicts.append(conflict)
        else:
            out.append(resolution)
            conflicts.append(Conflict(conflict.path, conflict.line, conflict.ours, conflict.theirs, True))
        position = end
    out.extend(lines[position:])
    return "".join(out), conflicts


# --------------------------------------------------------------------------
# the scratch repository


def _patch_body(patch_file: Path) -> bytes:
    """A patch without its mail header: what "the same change" compares."""
    data = patch_file.read_bytes()
    at = data.find(b"\ndiff --git ")
    return data[at:] if at >= 0 else data


def patch_digest(patch_file: Path) -> str:
    return hashlib.sha256(_patch_body(patch_file)).hexdigest()


class Scratch:
    """A git repository of the files a series touches, where patches are replayed."""

    def __init__(self, touched: Sequence[str]):
        self.touched = sorted(set(touched))
        self._temp = tempfile.TemporaryDirectory(prefix="pyllama-headinfer-retarget-")
        self.root = Path(self._temp.name) / "repo"
        self.root.mkdir()
        self.git("init", "-q")

    def __enter__(self) -> "Scratch":
        return self

    def __exit__(self, *exc) -> None:
        self._temp.cleanup()

    def git(self, *args: str, check: bool = True):
        result = run_git([*_GIT, *args], self.root)
        if check and result.returncode != 0:
            raise PatchError(f"git {args[0]} failed in {self.root}: {(result.stderr or result.stdout).strip()}")
        return result

    def head(self) -> str:
        return self.git("rev-parse", "HEAD").stdout.strip()

    def tree_id(self) -> str:
        return self.git("rev-parse", "HEAD^{tree}").stdout.strip()

    def commit_files(self, tree: Path, message: str) -> str:
        """Make the touched files those of ``tree`` (absent ones deleted) and commit."""
        for relative in self.touched:
            source, target = tree / relative, self.root / relative
            if target.exists() or target.is_symlink():
                target.unlink()
            if source.is_file() or source.is_symlink():
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, target, follow_symlinks=False)
        self.git("add", "-A")
        self.git("commit", "-q", "--allow-empty", "-m", message)
        return self.head()

    def message(self, patch: Path) -> str:
        """The commit message of a patch file (subject, blank line, body), as ``git am`` makes it."""
        info = self.root.parent / "mailinfo"
        with open(patch, "rb") as handle:
            result = subprocess.run(["git", "mailinfo", str(info) + ".msg", str(info) + ".patch"], stdin=handle,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=self.root)
        if result.returncode != 0:
            raise PatchError(f"cannot read the message of {patch.name}: {result.stderr.decode(errors='replace').strip()}")
        subject = next((line[len("Subject: "):] for line in result.stdout.decode(errors="replace").splitlines()
                        if line.startswith("Subject: ")), "")
        body = Path(str(info) + ".msg").read_text(encoding="utf-8", errors="replace").strip()
        return subject + ("\n\n" + body if body else "") + "\n"

    def reword(self, message: str) -> None:
        """Give HEAD this commit message (author and date kept)."""
        path = self.root.parent / "message"
        path.write_text(message, encoding="utf-8")
        self.git("commit", "-q", "--amend", "--allow-empty", "-F", str(path))

    def apply_check(self, patch: Path, reverse: bool = False) -> bool:
        args = ["apply", "--check", "--whitespace=nowarn"] + (["--reverse"] if reverse else []) + [str(patch)]
        return self.git(*args, check=False).returncode == 0

    def am(self, patch: Path, three_way: bool = False) -> bool:
        """``git am`` one patch; False (and the merge left in the work tree) when it conflicts."""
        args = ["am", "-q", "--whitespace=nowarn", "--committer-date-is-author-date"]
        if three_way:
            args.append("-3")
        return self.git(*args, str(patch), check=False).returncode == 0

    def unmerged(self) -> List[str]:
        out = self.git("diff", "--name-only", "--diff-filter=U").stdout
        return sorted(set(out.split()))

    def whole_file_conflict(self, relative: str) -> Conflict:
        """The conflict of an unmerged file that has no conflict markers, from the index stages
        git left (1: the pin's, 2: the tree's, 3: the patch's)."""
        out = self.git("ls-files", "-u", "-z", "--", relative).stdout
        stages = {int(entry.split("\t", 1)[0].split()[2]) for entry in out.split("\0") if entry.strip()}
        if 2 not in stages and 3 in stages:
            what = "the tree has no such file (deleted or never there); the patch changes it"
        elif 3 not in stages and 2 in stages:
            what = "the patch deletes this file, which the tree changed"
        else:
            what = "both changed the file and git left no conflict markers (a binary file?)"
        return Conflict(relative, 0, "", "", whole_file=what)

    def read(self, relative: str) -> str:
        return (self.root / relative).read_text(encoding="utf-8", errors="surrogateescape")

    def write(self, relative: str, text: str) -> None:
        (self.root / relative).write_text(text, encoding="utf-8", errors="surrogateescape")

    def finish_am(self) -> None:
        """Commit the merge in progress as it stands (markers included)."""
        self.git("add", "-A")
        self.git("-c", "core.editor=true", "am", "--continue")

    def abort_am(self) -> None:
        self.git("am", "--abort", check=False)

    def checkout(self, commit: str) -> None:
        self.git("checkout", "-q", "--detach", commit)


# --------------------------------------------------------------------------
# re-targeting


@dataclass(frozen=True)
class _Earlier:
    """A hand-resolved patch of the output series, for the same source patch and starting state."""

    path: Path
    message_edited: bool  # its message is not the source's message it was made from
    source_message: Optional[str]  # digest of that source message (None: not recorded)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()


def _replay_earlier(scratch: Scratch, patch: Patch, earlier: _Earlier) -> Optional[PatchResult]:
    """Apply the hand-resolved patch again; its message is the source's current one unless a human
    edited it (then theirs is kept, flagged when the source's message changed since)."""
    if not scratch.am(earlier.path):
        scratch.abort_am()
        return None
    message = scratch.message(patch.path)
    note = "resolved by hand before"
    if not earlier.message_edited:
        scratch.reword(message)
    elif earlier.source_message is not None and earlier.source_message != _digest(message):
        note += "; its message was edited by hand, and the source's message changed since: review it"
    else:
        note += "; its message edited by hand"
    return PatchResult(patch.name, Verdict.REPLAYED, note=note)


def merge_messages(base: str, ours: str, theirs: str) -> Optional[str]:
    """A human's edit of a commit message (``base`` -> ``ours``) carried onto the source's new message
    ``theirs`` (``git merge-file``); None when they overlap."""
    with tempfile.TemporaryDirectory(prefix="pyllama-headinfer-message-") as temp:
        files = []
        for name, text in (("ours", ours), ("base", base), ("theirs", theirs)):
            path = Path(temp) / name
            path.write_text(text, encoding="utf-8")
            files.append(str(path))
        result = subprocess.run(["git", "merge-file", "-p", *files], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return result.stdout.decode("utf-8", "replace") if result.returncode == 0 else None


MESSAGE_LEFT = "its message was edited by hand before, and the edit does not merge with the source's new message: redo it"


def _carry_message(scratch: Scratch, patch: Patch, edits: Dict[str, Tuple[str, str]]) -> str:
    """After ``patch`` was committed with the source's message: bring a human's earlier edit of its
    message across (a note for the report; "" when there was none)."""
    if patch.name not in edits:
        return ""
    base, edited = edits[patch.name]
    merged = merge_messages(base, edited, scratch.message(patch.path))
    if merged is None:
        return MESSAGE_LEFT
    scratch.reword(merged)
    return "the hand edit of its message carried over"


def _with_note(result: PatchResult, note: str) -> PatchResult:
    if not note:
        return result
    return PatchResult(result.name, result.verdict, result.conflicts, "; ".join(n for n in (result.note, note) if n))


def _replay(scratch: Scratch, source: Series, resolutions: Resolutions,
            memo: Dict[Tuple[str, str], _Earlier], edits: Dict[str, Tuple[str, str]]) -> List[PatchResult]:
    """Each patch of ``source`` onto the scratch repository's HEAD, committed; the verdicts."""
    return [_replay_one(scratch, patch, resolutions, memo, edits) for patch in source.patches]


def _replay_one(scratch: Scratch, patch: Patch, resolutions: Resolutions,
                memo: Dict[Tuple[str, str], _Earlier], edits: Dict[str, Tuple[str, str]]) -> PatchResult:
    earlier = memo.get((patch_digest(patch.path), scratch.tree_id()))
    if earlier is not None and earlier.message_edited:  # even a clean patch keeps a human's message
        result = _replay_earlier(scratch, patch, earlier)
        if result is not None:
            return result
    if scratch.apply_check(patch.path):
        if not scratch.am(patch.path):
            scratch.abort_am()
            raise PatchError(f"git am refused {patch.name}, which git apply --check accepted")
        return _with_note(PatchResult(patch.name, Verdict.CLEAN), _carry_message(scratch, patch, edits))
    if scratch.apply_check(patch.path, reverse=True):
        return PatchResult(patch.name, Verdict.UPSTREAM)
    result = _replay_earlier(scratch, patch, earlier) if earlier is not None else None
    if result is not None:
        return result
    if scratch.am(patch.path, three_way=True):
        return _with_note(PatchResult(patch.name, Verdict.MERGED), _carry_message(scratch, patch, edits))
    files = scratch.unmerged()
    if not files:
        scratch.abort_am()
        raise PatchError(f"git am -3 could not apply {patch.name} and left no conflict to resolve")
    conflicts: List[Conflict] = []
    for relative in files:
        found: List[Conflict] = []
        if (scratch.root / relative).is_file():
            text, found = resolve_text(relative, scratch.read(relative), resolutions)
            if found:
                scratch.write(relative, text)
        if not found:  # unmerged without markers: nothing was found that a resolution could answer
            found = [scratch.whole_file_conflict(relative)]
        conflicts.extend(found)
    scratch.finish_am()
    left = [c for c in conflicts if not c.resolved]
    # "resolved" only when each conflict is a marker block whose recorded resolution was used
    verdict = Verdict.CONFLICT if left or not conflicts else Verdict.RESOLVED
    how = "unresolved" if any(c.whole_file for c in left) else "with markers"
    note = (f"{len(left)} of {len(conflicts)} conflict(s) left {how} in "
            f"{', '.join(sorted({c.path for c in left}))}") if left else ""
    return _with_note(PatchResult(patch.name, verdict, tuple(conflicts), note), _carry_message(scratch, patch, edits))


def _learn(scratch: Scratch, upstream: str, source: Series, resolved: Series,
           resolutions: Resolutions) -> Tuple[int, Dict[Tuple[str, str], _Earlier], Dict[str, Tuple[str, str]]]:
    """Replay the hand-resolved series ``resolved`` onto ``upstream`` next to ``source``: record the
    resolution of every conflict the source patches meet on the way, remember each resolved patch
    by (source patch text, state it starts from), and each message a human edited (name -> (the
    source message it was made from, the edited one)). Stops at the first resolved patch that does
    not apply or still has markers."""
    learned = 0
    memo: Dict[Tuple[str, str], _Earlier] = {}
    edits: Dict[str, Tuple[str, str]] = {}
    scratch.checkout(upstream)
    by_subject = {_subject_of(p.name): p for p in source.patches}
    for done in resolved.patches:
        # format-patch numbers the files in order: a patch already upstream shifts the numbers after it
        src = by_subject.get(_subject_of(done.name))
        if src is None:
            log.warning("learning stops at %s: no patch of the source series has its subject", done.name)
            break
        recorded = resolutions.source_of(done.name)
        made_from, message_now = recorded.get("message_text"), scratch.message(done.path)
        if made_from is not None and message_now != made_from:
            edits[done.name] = (made_from, message_now)  # kept even while its code still has markers
        if has_markers(done.path.read_text(encoding="utf-8", errors="surrogateescape")):
            log.info("learning stops at %s: it still has conflict markers", done.name)
            break
        state = scratch.head()
        # the resolved patch answers the source patch it was made from, which may have changed since
        same_source = recorded.get("patch") == patch_digest(src.path)
        merged: Dict[str, str] = {}
        if same_source:
            message = recorded.get("message")
            edited = message is None or _digest(message_now) != message
            memo[(patch_digest(src.path), scratch.tree_id())] = _Earlier(done.path, edited, message)
            if not scratch.apply_check(src.path) and not scratch.am(src.path, three_way=True):
                merged = {relative: scratch.read(relative) for relative in scratch.unmerged()}
            scratch.abort_am()
        scratch.checkout(state)
        if not scratch.am(done.path):
            scratch.abort_am()
            log.info("learning stops at %s: the resolved patch does not apply", done.name)
            break
        for relative, text in merged.items():
            target = scratch.read(relative) if (scratch.root / relative).exists() else ""
            for conflict, resolution in learn_from(relative, text, target):
                if not has_markers(resolution):
                    learned += resolutions.record(done.name, conflict, resolution)
    return learned, memo, edits


def _subject_of(name: str) -> str:
    """``0007-kv-cache-store-….patch`` -> ``kv-cache-store-…`` (the file name without its number)."""
    return re.sub(r"^\d+-", "", name)


def _prepare(scratch: Scratch, pin_tree: Path, source: Series, tree: Path) -> str:
    """Commit the pin, the series on a side branch, and the tree on top of the pin; HEAD at the tree."""
    base = scratch.commit_files(pin_tree, "pin")
    scratch.git("checkout", "-q", "-b", "series")
    for patch in source.patches:
        if not scratch.am(patch.path):
            scratch.abort_am()
            raise PatchError(f"{patch.name} does not apply to the pin it was made for: run `patch check`")
    scratch.checkout(base)
    return scratch.commit_files(tree, "upstream")


def retarget(tree: Path, pin_tree: Path, source_dir: Optional[Path] = None,
             out: Optional[Path] = None) -> Tuple[RetargetReport, Optional[Scratch]]:
    """Replay the series of ``source_dir`` (made for the pin whose pristine tree is ``pin_tree``)
    onto ``tree``. With ``out``: learn from the series already there, use and keep its recorded
    resolutions, and return the scratch repository (the caller exports it and cleans it up)."""
    source = load_series(source_dir)
    if not source.patches:
        raise PatchError(f"the series in {source.directory} is empty")
    resolutions = Resolutions(out)
    with contextlib.ExitStack() as stack:
        scratch = stack.enter_context(Scratch(source.touched))
        upstream = _prepare(scratch, pin_tree, source, tree)
        learned, memo, edits = 0, {}, {}
        if out is not None and (out / "series").is_file():
            learned, memo, edits = _learn(scratch, upstream, source, load_series(out), resolutions)
            scratch.checkout(upstream)
        report = RetargetReport(tree, f"llama.cpp {pin.active().build}", learned=learned, out=out, upstream=upstream)
        report.patches = _replay(scratch, source, resolutions, memo, edits)
        if out is None:
            return report, None
        stack.pop_all()  # the caller exports it, then cleans it up
        return report, scratch


def drift(tree: Path, pin_tree: Path, source_dir: Optional[Path] = None) -> RetargetReport:
    """The 3-way drift report of the series onto ``tree`` (read-only)."""
    return retarget(tree, pin_tree, source_dir)[0]


def files_not_in_pin(series: Series, listing: Dict[str, object]) -> List[str]:
    """The files ``series`` changes without creating them first (its first change to each has an
    old side) that are not in ``listing``: a series made for another tree (the llama-cpp-python
    layer's) has nothing to replay on the pin's files."""
    seen: set = set()
    foreign = []
    for patch in series.patches:
        for file_patch in patch.files:
            if file_patch.path in seen:
                continue
            seen.add(file_patch.path)
            if file_patch.old_path is not None and file_patch.old_path not in listing:
                foreign.append(file_patch.old_path)
    return sorted(foreign)


@contextlib.contextmanager
def pristine_pin_files(series: Series, extra: Sequence[str] = ()) -> Iterator[Path]:
    """A directory with the files ``series`` touches (and ``extra``) as the active pin has them:
    from the cached (or given) pin tree, with ``series`` undone when the tree carries it; else
    (the tree carries another series, or was edited) from the pin's archive. Checked against the pin."""
    from pyllama_headinfer.patches.status import State, status
    from pyllama_headinfer.source.fetch import extract_pin_files, locate_tree
    from pyllama_headinfer.source.tree_verify import scan_tree

    listing = pin.active().files()
    foreign = files_not_in_pin(series, listing)
    if foreign:
        raise UsageError(f"{series.directory} is not a series of llama.cpp {pin.active().short}: it changes "
                         f"{', '.join(foreign[:3])}{' ...' if len(foreign) > 3 else ''}, which the pin does not have")
    tree = locate_tree()
    state = status(tree, series.directory)
    files = set(series.touched) | set(extra)
    expected = restrict_listing(listing, files)
    with Workspace(files) as work:
        if state.state in (State.PRISTINE, State.APPLIED):
            work.load(tree)
            if state.state == State.APPLIED and state.applied:
                result = work.apply(reversed_prefix(series, state.applied), reverse=True)
                if result.returncode != 0:
                    raise PatchError(f"could not undo the series in a copy of {tree}: {result.stderr.strip()}")
        if state.state not in (State.PRISTINE, State.APPLIED) or \
                restrict_listing(scan_tree(work.root, use_cache=False), files) != expected:
            log.info("%s is %s: taking the pin's files from its archive", tree, state.state.value)
            extract_pin_files(sorted(files), work.root)
        yield work.root


def _is_pin_outside(tree: Path, record: pin.Pin, series: Series) -> bool:
    """Whether the files of ``tree`` that ``series`` does not touch are exactly ``record``'s (a
    hand-edited or half-patched tree of that pin differs only in files the series touches)."""
    from pyllama_headinfer.source.tree_verify import compare_listings, scan_tree

    return compare_listings(listing_without(scan_tree(tree), series.touched),
                            listing_without(record.files(), series.touched)).ok


def pin_of_tree(tree: Path) -> Optional[pin.Pin]:
    """The pin whose tree ``tree`` is, pristine or carrying that pin's own series; None for any other tree."""
    from pyllama_headinfer import paths

    return next((record for record in pin.PINS.values()
                 if _is_pin_outside(tree, record, load_series(paths.patches_dir(record)))), None)


def is_other_tree(tree: Path, series: Series) -> bool:
    """Whether ``tree`` is another llama.cpp than the active pin (see :func:`_is_pin_outside`)."""
    return not _is_pin_outside(tree, pin.active(), series)


@contextlib.contextmanager
def pristine_files_of_pin(chosen: pin.Pin, files: Sequence[str]) -> Iterator[Path]:
    """The given files of another pin's pristine tree (its cached tree, its series undone)."""
    from pyllama_headinfer import paths

    with contextlib.ExitStack() as stack:
        with pin.using(chosen.build):  # only while the files are taken: the caller works with its own pin
            directory = stack.enter_context(pristine_pin_files(load_series(paths.patches_dir(chosen)), extra=files))
        yield directory


def rebase(tree: Path, out: Path, source_dir: Optional[Path] = None, *, target: str) -> RetargetReport:
    """Write the series re-targeted onto ``tree`` into ``out`` (``series``, the patch files, and
    ``resolutions/``): clean, merged and resolved patches rewritten, conflicting ones with their
    markers (see the module docstring). ``target`` names the tree in the series header."""
    from pyllama_headinfer.patches.export import export

    source = load_series(source_dir)
    out = Path(out).resolve()
    if source.directory.resolve() == out:
        raise PatchError(f"--out {out} is the source series itself; re-target into another directory")
    with pristine_pin_files(source) as pin_files:
        report, scratch = retarget(tree, pin_files, source.directory, out)
    assert scratch is not None
    with scratch:
        names = export(scratch.root, out, base=report.upstream, target=target)
        if len(names) == len(source.patches) - report.count(Verdict.UPSTREAM):
            kept = [p for p, r in zip(source.patches, report.patches) if r.verdict != Verdict.UPSTREAM]
            left = {r.name for r in report.messages_left}
            recorded = Resolutions(out)
            sources = {}
            for name, patch in zip(names, kept):
                before = recorded.source_of(name)
                if patch.name in left and before:
                    # a hand edit that did not carry over stays recorded against its old source message
                    sources[name] = {**before, "patch": patch_digest(patch.path)}
                else:
                    message = scratch.message(patch.path)
                    sources[name] = {"patch": patch_digest(patch.path), "message": _digest(message),
                                     "message_text": message}
            recorded.save_sources(sources)
    return report
