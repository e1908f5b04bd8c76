"""The patch series: reading ``series``, parsing the patch files, hashing them.

The series lives in a directory (default :func:`paths.patches_dir`): a file
``series`` lists patch file names in the order they apply (blank lines and
``#`` comments ignored), each a ``git format-patch --zero-commit`` file whose
paths (``a/...``, ``b/...``) are relative to the llama.cpp root.

:func:`load_series` gives a :class:`Series` of :class:`Patch` objects, each
with the files (:class:`FilePatch`) and hunk headers (:class:`Hunk`) that
:func:`parse_patch` found. The names in ``series`` and the hash builds record
are read by :mod:`pyllama_headinfer.series` (which the runtime uses too).
Nothing here touches a llama.cpp tree (see :mod:`.apply` for what does).
"""

from __future__ import annotations

import codecs
import re
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Set, Tuple

from pyllama_headinfer.errors import PatchError
from pyllama_headinfer.series import SERIES_FILE, PathLike, read_series_names, series_dir


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


def load_series(patches_dir: Optional[PathLike] = None) -> Series:
    directory = series_dir(patches_dir)
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
