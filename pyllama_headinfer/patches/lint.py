"""``patch lint``: whether a series reads as a set of upstream pull requests, not as a history.

Each patch of the series (default: the active pin's ``patches/<pin>``) is checked for:

size
  its added lines (``+`` lines of its hunks; the ``+++`` file headers are not hunk lines),
  split into lines of test files (paths under ``tests/``) and the rest. FAIL when it adds more
  than :data:`MAX_ADDED_OUTSIDE_TESTS` (300) lines outside ``tests/``: a pull request that large
  is not one change.

churn
  lines this patch adds that a later patch of the series removes again (changed or deleted
  lines count: a change is a removal and an addition). FAIL on any: the later patch should be
  folded into this one. Counted exactly, by replaying the series: the files the series touches
  are taken as the pin has them (:func:`~.retarget.pristine_pin_files`: the cached pin tree,
  with the series undone when it carries it, else the pin's archive), every line is tagged
  with the patch that added it (or with upstream), and the patches' hunks are applied in order
  to the tagged lines -- each hunk where its context and removed lines stand, at its stated
  line first, then at the nearest line where they match (as ``git apply`` does). A removed line
  tagged with an earlier patch is that patch's churn. The result is then compared with the same
  files after ``git apply`` of the whole series: a difference is an error (the count would not
  be exact), never a guess. A content match without the tree (a ``-`` line equal to an earlier
  ``+`` line) would count lines that merely look alike (``}``, blank lines) elsewhere in a file.

message
  the commit message (the subject and the body up to the patch: a ``---`` line or the first
  ``diff --git``) must not name project-internal things; FAIL on any of

  * an issue reference of the project: ``#N``, ``issue N``, ``issue #N``, ``issues N``. The one
    rule for upstream references: a ``#N`` is upstream's when written ``ggml-org/llama.cpp#N``
    (or ``ggerganov/llama.cpp#N``, the old name), or directly after ``PR``, ``pull request``,
    ``upstream``, ``upstream PR`` or ``upstream issue`` (``PR #123``, ``upstream #123``,
    ``upstream issue #123``); an upstream URL (``github.com/ggml-org/llama.cpp/pull/N``) has
    no ``#``. Each reference stands on its own: in ``ggml-org/llama.cpp#1 and #2`` the ``#2`` is
    flagged (write ``ggml-org/llama.cpp#2``);
  * the series as a history: ``this series``, and ``previous``, ``earlier``, ``later`` or
    ``next`` before ``patch``, ``change`` or ``commit`` (or their plurals);
  * GPU models used as evidence (:data:`GPU_MODELS`: H100, H200, GB200, A100, RTX ..., ...):
    upstream reviewers reproduce on their hardware, a message says what was measured and how;
  * ``pyllama`` (in any word), ``headinfer project``, and ``CI`` as a word (upper case).

author and disclosure
  ``From:`` must be a name and an email address whose domain has a dot and is not a reserved
  placeholder (RFC 2606/6761: ``example``, ``example.com``/``.org``/``.net`` and their
  subdomains, ``*.example``, ``invalid``, ``localhost``, ``test`` and their subdomains).
  Every message must carry llama.cpp's AI-usage disclosure (its pull-request template: "AI
  usage disclosure: YES / NO - if yes, describe how AI was used") as a line starting with
  ``AI usage disclosure:`` whose answer starts with ``YES`` or ``NO``; a ``YES`` says how, on
  the same line or the next. FAIL when missing or unanswered.

Read-only; the report is one line per patch and a summary (:meth:`LintReport.describe`), or
JSON (:meth:`LintReport.as_dict`). ``patch lint`` exits 0 when every patch passes, 1 when one
fails (a "no", like ``patch check``), 2 for bad usage.
"""

from __future__ import annotations

import email
import email.policy
import email.utils
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from pyllama_headinfer.errors import PatchError, UsageError
from pyllama_headinfer.patches.retarget import pristine_pin_files
from pyllama_headinfer.patches.series import Patch, PathLike, Series, load_series, parse_patch
from pyllama_headinfer.patches.workspace import Workspace
from pyllama_headinfer.series import SERIES_FILE, series_dir

MAX_ADDED_OUTSIDE_TESTS = 300
TESTS_PREFIX = "tests/"
DISCLOSURE = "AI usage disclosure:"

UPSTREAM = -1  # the origin of a line the pin has


# --------------------------------------------------------------------------
# the hunks of a patch, with their lines


@dataclass(frozen=True)
class HunkLines:
    old_start: int
    old_count: int
    lines: Tuple[Tuple[str, str], ...]  # (" ", "-" or "+", the line without its newline)
    old_no_newline: bool  # "\ No newline at end of file" after a line of the old side
    new_no_newline: bool  # ... after a line of the new side

    @property
    def preimage(self) -> List[str]:
        return [text for op, text in self.lines if op != "+"]


@dataclass(frozen=True)
class FileDiff:
    old_path: Optional[str]  # None: created
    new_path: Optional[str]  # None: deleted
    copy: bool  # "copy from": the old file stays
    binary: bool  # no line hunks (GIT binary patch, "Binary files ... differ")
    hunks: Tuple[HunkLines, ...]

    @property
    def path(self) -> str:
        return self.new_path or self.old_path or ""


_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def file_diffs(text: str) -> List[FileDiff]:
    """The file sections of a git patch with their hunks' lines (the paths as
    :func:`~.series.parse_patch` reads them). Lines are split at ``\\n`` only: a ``\\r`` or a
    form feed is part of a line, as it is to git."""
    lines = text.split("\n")
    sections: List[List[str]] = []
    for line in lines:
        if line.startswith("diff --git "):
            sections.append([])
        elif sections:  # (a signature after the last hunk is not a hunk: _file_diff passes over it)
            sections[-1].append(line)
    paths = parse_patch(text)
    if len(paths) != len(sections):
        raise PatchError(f"cannot read the file sections of a patch ({len(paths)} != {len(sections)})")
    return [_file_diff(section, found.old_path, found.new_path) for section, found in zip(sections, paths)]


def _file_diff(section: List[str], old_path: Optional[str], new_path: Optional[str]) -> FileDiff:
    hunks: List[HunkLines] = []
    copy = binary = False
    index = 0
    while index < len(section):
        line = section[index]
        index += 1
        match = _HUNK_RE.match(line)
        if match is None:
            copy = copy or line.startswith("copy from ")
            binary = binary or line.startswith("GIT binary patch") or (line.startswith("Binary files ") and not hunks)
            continue
        old_count = int(match.group(2) if match.group(2) is not None else 1)
        new_count = int(match.group(4) if match.group(4) is not None else 1)
        body: List[Tuple[str, str]] = []
        old_no_newline = new_no_newline = False
        left_old, left_new = old_count, new_count
        while index < len(section) and (left_old > 0 or left_new > 0 or section[index].startswith("\\")):
            text = section[index]
            if text.startswith("\\"):  # "\ No newline at end of file": about the line before
                if body and body[-1][0] in " -":
                    old_no_newline = True
                if body and body[-1][0] in " +":
                    new_no_newline = True
                index += 1
                continue
            op = text[:1] or " "  # an empty line: a blank context line whose space was stripped
            if op not in " -+":
                break
            body.append((op, text[1:]))
            left_old -= op != "+"
            left_new -= op != "-"
            index += 1
        if left_old != 0 or left_new != 0:
            raise PatchError(f"a hunk of {new_path or old_path} is cut short ({line})")
        hunks.append(HunkLines(int(match.group(1)), old_count, tuple(body), old_no_newline, new_no_newline))
    return FileDiff(old_path, new_path, copy, binary and not hunks, tuple(hunks))


# --------------------------------------------------------------------------
# replaying the series on lines tagged with the patch that added them


Line = Tuple[str, int]  # (text, origin: UPSTREAM or the index of the patch that added it)


@dataclass
class TaggedFile:
    lines: List[Line]
    final_newline: bool = True

    @classmethod
    def read(cls, path: Path) -> "TaggedFile":
        text = path.read_bytes().decode("utf-8", "surrogateescape")
        if not text:
            return cls([], True)
        parts = text.split("\n")
        final_newline = parts[-1] == ""
        if final_newline:
            parts.pop()
        return cls([(part, UPSTREAM) for part in parts], final_newline)

    def data(self) -> bytes:
        text = "\n".join(line for line, _ in self.lines)
        if self.lines and self.final_newline:
            text += "\n"
        return text.encode("utf-8", "surrogateescape")


def _find(preimage: List[str], lines: List[Line], stated: int, start: int) -> Optional[int]:
    """Where ``preimage`` stands in ``lines`` at or after ``start``: at ``stated`` if it does, else
    at the nearest index that matches (``git apply``'s search), None when nowhere."""
    size = len(preimage)

    def matches(at: int) -> bool:
        return start <= at <= len(lines) - size and all(lines[at + k][0] == preimage[k] for k in range(size))

    if matches(stated):
        return stated
    for distance in range(1, len(lines) + 1):
        for at in (stated - distance, stated + distance):
            if matches(at):
                return at
        if stated - distance < start and stated + distance > len(lines) - size:
            break
    return None


def apply_hunks(current: TaggedFile, diff: FileDiff, index: int, churn: Dict[int, Counter], name: str) -> TaggedFile:
    """``diff``'s hunks applied to ``current`` by patch ``index``: added lines tagged ``index``;
    each removed line added by an earlier patch counted in ``churn[its patch][index]``."""
    old = current.lines
    out: List[Line] = []
    cursor = 0
    final_newline = current.final_newline
    for hunk in diff.hunks:
        stated = hunk.old_start - 1 if hunk.old_count else hunk.old_start
        at = _find(hunk.preimage, old, max(stated, 0), cursor)
        if at is None:
            raise PatchError(f"{name} does not apply to {diff.path} as the patches before it leave it "
                             f"(hunk at line {hunk.old_start}): run `patch check` (another pin's series needs --pin)")
        out.extend(old[cursor:at])
        position = at
        for op, text in hunk.lines:
            if op == "+":
                out.append((text, index))
                continue
            line = old[position]
            position += 1
            if op == " ":
                out.append(line)
            elif line[1] != UPSTREAM:
                churn.setdefault(line[1], Counter())[index] += 1
        cursor = position
        if hunk.new_no_newline:
            final_newline = False
        elif hunk.old_no_newline:
            final_newline = True
    out.extend(old[cursor:])
    return TaggedFile(out, final_newline)


@dataclass
class Replay:
    files: Dict[str, TaggedFile]  # the touched files after the series (binary ones left out)
    churn: Dict[int, Counter]  # patch index -> Counter(later patch index -> its lines that one removes)
    unknown: set  # paths whose content is not followed (binary diffs)


def _text_of(patch: Patch) -> str:
    """A patch file's text, every byte kept (``read_text`` would turn a CRLF file's ``\\r\\n`` into ``\\n``)."""
    return patch.path.read_bytes().decode("utf-8", "surrogateescape")


def replay(series: Series, pin_files: Path) -> Replay:
    """The series replayed on tagged lines, from the pin's files in ``pin_files``."""
    files: Dict[str, TaggedFile] = {}
    for relative in sorted(series.touched):
        path = pin_files / relative
        if path.is_file() and not path.is_symlink():
            files[relative] = TaggedFile.read(path)
    churn: Dict[int, Counter] = {}
    unknown: set = set()
    for index, patch in enumerate(series.patches):
        for diff in file_diffs(_text_of(patch)):
            if diff.binary or (diff.old_path and diff.old_path in unknown):
                unknown.update(p for p in (diff.old_path, diff.new_path) if p)
                continue
            if diff.old_path and diff.old_path not in files:
                raise PatchError(f"{patch.name} changes {diff.old_path}, which the pin does not have "
                                 "and no patch before it creates")
            current = files[diff.old_path] if diff.old_path else TaggedFile([])
            if diff.old_path and not diff.copy and diff.old_path != diff.new_path:
                files.pop(diff.old_path)  # renamed or deleted
            result = apply_hunks(current, diff, index, churn, patch.name)
            if diff.new_path is None:
                for _text, origin in result.lines:  # a deleted file's lines that were left: removed too
                    if origin != UPSTREAM:
                        churn.setdefault(origin, Counter())[index] += 1
            else:
                files[diff.new_path] = result
    return Replay(files, churn, unknown)


def verify_replay(series: Series, pin_files: Path, result: Replay) -> None:
    """The replay's files must be ``git apply``'s, byte for byte (else the counts are not exact)."""
    with Workspace(series.touched) as work:
        work.load(pin_files)
        applied = work.apply(list(series.patches))
        if applied.returncode != 0:
            raise PatchError(f"the series does not apply to the pin's files: {applied.stderr.strip()}: "
                             "run `patch check`")
        for relative in sorted(series.touched - result.unknown):
            path = work.root / relative
            theirs = path.read_bytes() if path.is_file() and not path.is_symlink() else None
            ours = result.files[relative].data() if relative in result.files else None
            if ours != theirs:
                raise PatchError(f"lint's replay of the series gives another {relative} than git apply: "
                                 "its churn count would not be exact")


# --------------------------------------------------------------------------
# the message, the author and the disclosure


@dataclass(frozen=True)
class Header:
    author: str  # the From: header, decoded and unfolded
    message: str  # subject, blank line, body (up to the patch)


def read_header(text: str) -> Header:
    head, _, rest = text.partition("\n\n")
    parsed = email.message_from_string(head + "\n\n", policy=email.policy.default)
    subject = re.sub(r"^\[PATCH[^\]]*\]\s*", "", str(parsed.get("Subject", "")).strip())
    body: List[str] = []
    for line in rest.split("\n"):
        if line == "---" or line.startswith("diff --git "):
            break
        body.append(line)
    message = subject + ("\n\n" + "\n".join(body).strip() if "".join(body).strip() else "")
    return Header(str(parsed.get("From", "")).strip(), message)


GPU_MODELS = (r"G[HB]\d00", r"[ABH][1-9]00", r"H20", r"A10G?", r"A[34]0", r"L40S?", r"L4", r"[VP]100", r"T4",
              r"(?:RTX|GTX)(?: ?(?:PRO )?[A-Z]?\d{3,4}\w*)?", r"MI\d{3}[AX]?", r"Tesla", r"Quadro", r"Jetson")
_GPU_RE = re.compile(r"\b(?:" + "|".join(GPU_MODELS) + r")\b")
_REFERENCE_RE = re.compile(r"\bissues?\s+#?\d+|#\d+", re.IGNORECASE)
_UPSTREAM_OWNER_RE = re.compile(r"\b(?:ggml-org|ggerganov)/llama\.cpp$", re.IGNORECASE)
_UPSTREAM_WORD_RE = re.compile(r"\b(?:PR|pull request|upstream(?: PR| issue| pull request)?)\s*$", re.IGNORECASE)
_UPSTREAM_ISSUE_RE = re.compile(r"\bupstream\s+$", re.IGNORECASE)
_PHRASES = (
    (re.compile(r"\bthis series\b", re.IGNORECASE), "the series as a history"),
    (re.compile(r"\b(?:previous|earlier|later|next)\s+(?:patch|change|commit)(?:e?s)?\b", re.IGNORECASE),
     "the series as a history"),
    (_GPU_RE, "a GPU model as evidence"),
    (re.compile(r"\w*pyllama\w*", re.IGNORECASE), "the project's name"),
    (re.compile(r"\bheadinfer project\b", re.IGNORECASE), "the project's name"),
    (re.compile(r"\bCI\b"), "the project's CI"),
)


def message_problems(message: str) -> List[str]:
    """What the message names that upstream has no use for (see the module docstring)."""
    found: List[Tuple[int, str]] = []
    for match in _REFERENCE_RE.finditer(message):
        before, text = message[:match.start()], " ".join(match.group().split())
        if match.group().startswith("#"):
            upstream = _UPSTREAM_OWNER_RE.search(before) or _UPSTREAM_WORD_RE.search(before)
        else:
            upstream = _UPSTREAM_ISSUE_RE.search(before)
        if not upstream:
            found.append((match.start(), f'"{text}" is not an upstream reference (ggml-org/llama.cpp#N, PR #N, '
                                         'upstream #N)'))
    for pattern, why in _PHRASES:
        for match in pattern.finditer(message):  # a phrase may be cut by the line's end: one line in the report
            found.append((match.start(), f'"{" ".join(match.group().split())}" ({why})'))
    seen, problems = set(), []
    for _at, text in sorted(found):
        if text not in seen:
            seen.add(text)
            problems.append("message: " + text)
    return problems


PLACEHOLDER_DOMAINS = ("example", "example.com", "example.org", "example.net", "invalid", "localhost", "test")


def author_problems(author: str) -> List[str]:
    name, address = email.utils.parseaddr(author)
    if not author:
        return ["no From: line"]
    if not name.strip() or "@" not in address:
        return [f'author "{author}": not a name and an email address']
    domain = address.rsplit("@", 1)[1].lower().rstrip(".")
    if "." not in domain:
        return [f'author "{author}": its domain has no dot']
    if any(domain == reserved or domain.endswith("." + reserved) for reserved in PLACEHOLDER_DOMAINS):
        return [f'author "{author}": {domain} is a reserved placeholder domain']
    return []


def disclosure_problems(message: str) -> List[str]:
    lines = message.split("\n")
    for number, line in enumerate(lines):
        if not line.startswith(DISCLOSURE):
            continue
        answer = line[len(DISCLOSURE):].strip()
        word = re.match(r"(?i)(yes|no)\b", answer)
        if word is None:
            return [f'"{DISCLOSURE}" does not answer YES or NO']
        if word.group(1).lower() == "yes":
            how = answer[word.end():].strip(" -:,.;")
            following = lines[number + 1].strip() if number + 1 < len(lines) else ""
            if not how and not following:
                return [f'"{DISCLOSURE} YES" does not say how AI was used']
        return []
    return [f'no "{DISCLOSURE}" line']


# --------------------------------------------------------------------------
# the report


@dataclass
class PatchLint:
    name: str
    added_outside_tests: int
    added_in_tests: int
    churned: int = 0
    churned_by: Dict[str, int] = field(default_factory=dict)  # later patch -> lines of this one it removes
    problems: List[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def describe(self) -> str:
        by = ", ".join(f"{_short(name)}: {count}" for name, count in self.churned_by.items())
        head = (f"{self.name}: added {self.added_outside_tests} outside tests + {self.added_in_tests} in tests, "
                f"churned {self.churned}" + (f" (removed by {by})" if by else ""))
        return head + (": ok" if self.ok else ": FAIL: " + "; ".join(self.problems))


def _short(name: str) -> str:
    """``0007-kv-cache-….patch`` -> ``0007`` (a name without a number stays whole)."""
    match = re.match(r"(\d+)-", name)
    return match.group(1) if match else name


@dataclass
class LintReport:
    directory: Path
    patches: List[PatchLint]

    @property
    def ok(self) -> bool:
        return all(p.ok for p in self.patches)

    def _failing(self, prefix: str) -> int:
        return sum(1 for p in self.patches if any(problem.startswith(prefix) for problem in p.problems))

    def counts(self) -> Dict[str, int]:
        return {
            "patches": len(self.patches),
            "added": sum(p.added_outside_tests + p.added_in_tests for p in self.patches),
            "added_outside_tests": sum(p.added_outside_tests for p in self.patches),
            "added_in_tests": sum(p.added_in_tests for p in self.patches),
            "churned": sum(p.churned for p in self.patches),
            "over_limit": self._failing("adds "),
            "with_churn": sum(1 for p in self.patches if p.churned),
            "with_message_problems": self._failing("message: "),
            "message_problems": sum(1 for p in self.patches for problem in p.problems if problem.startswith("message: ")),
            "with_author_problems": self._failing("author ") + self._failing("no From:"),
            "without_disclosure": sum(1 for p in self.patches for problem in p.problems if DISCLOSURE in problem),
        }

    def summary(self) -> str:
        c = self.counts()
        head = (f"{c['patches']} patches: {c['added']} lines added ({c['added_outside_tests']} outside tests, "
                f"{c['added_in_tests']} in tests), {c['churned']} churned")
        if self.ok:
            return head + ": ok"
        parts = [(c["over_limit"], f"over {MAX_ADDED_OUTSIDE_TESTS} lines outside tests"),
                 (c["with_churn"], "with churned lines"),
                 (c["with_message_problems"], f"with message problems ({c['message_problems']} in all)"),
                 (c["with_author_problems"], "with a bad author"),
                 (c["without_disclosure"], "without a usable AI usage disclosure")]
        return head + ": FAIL: " + ", ".join(f"{count} {what}" for count, what in parts if count)

    def describe(self) -> str:
        return "\n".join([*(p.describe() for p in self.patches), self.summary()])

    def as_dict(self) -> dict:
        return {"series": str(self.directory), "ok": self.ok, "limit_outside_tests": MAX_ADDED_OUTSIDE_TESTS,
                "summary": self.counts(),
                "patches": [{"name": p.name, "added_outside_tests": p.added_outside_tests,
                             "added_in_tests": p.added_in_tests, "churned": p.churned,
                             "churned_by": p.churned_by, "problems": p.problems, "ok": p.ok} for p in self.patches]}


def _added(patch: Patch) -> Tuple[int, int]:
    outside = inside = 0
    for diff in file_diffs(_text_of(patch)):
        added = sum(1 for hunk in diff.hunks for op, _ in hunk.lines if op == "+")
        if diff.path.startswith(TESTS_PREFIX):
            inside += added
        else:
            outside += added
    return outside, inside


def lint_patches(series: Series, pin_files: Path) -> LintReport:
    """The report for ``series``, whose pin's files (those the series touches) are in ``pin_files``."""
    result = replay(series, pin_files)
    verify_replay(series, pin_files, result)
    names: Sequence[str] = series.names
    report = LintReport(series.directory, [])
    for index, patch in enumerate(series.patches):
        outside, inside = _added(patch)
        churned_by = {names[later]: count for later, count in sorted(result.churn.get(index, Counter()).items())}
        churned = sum(churned_by.values())
        problems: List[str] = []
        if outside > MAX_ADDED_OUTSIDE_TESTS:
            problems.append(f"adds {outside} lines outside tests (at most {MAX_ADDED_OUTSIDE_TESTS})")
        if churned:
            problems.append(f"{churned} of its added lines are removed again by "
                            f"{', '.join(_short(name) for name in churned_by)}")
        header = read_header(_text_of(patch))
        problems += message_problems(header.message)
        problems += author_problems(header.author)
        problems += disclosure_problems(header.message)
        report.patches.append(PatchLint(patch.name, outside, inside, churned, churned_by, problems))
    return report


def lint(patches_dir: Optional[PathLike] = None) -> LintReport:
    """Lint the series in ``patches_dir`` (default: the active pin's), replayed on the active pin's files."""
    directory = series_dir(patches_dir)
    if not (directory / SERIES_FILE).is_file():
        raise UsageError(f"no series in {directory} (no {SERIES_FILE} file)")
    series = load_series(directory)
    if not series.patches:
        raise UsageError(f"the series in {directory} is empty")
    with pristine_pin_files(series) as pin_files:
        return lint_patches(series, pin_files)
