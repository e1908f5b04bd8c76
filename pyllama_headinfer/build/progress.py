"""Progress display and failure diagnosis for ``build``.

Ninja prints one status line per finished edge, ``[n/N] description``
(we force that format through ``NINJA_STATUS``). :class:`Progress` turns those
lines into a single self-overwriting line on a terminal, or into a plain log
line every ~10 % otherwise (CI logs stay short). Everything ninja and CMake
print also goes, unabridged, to ``<build_dir>/build.log``;
:func:`classify_failure` reads that log to name the usual causes of a failed
build in one sentence.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections import deque
from pathlib import Path
from typing import IO, Iterable, List, Optional, Tuple

# The status prefix ninja prints before each finished step.
NINJA_STATUS = "[%f/%t] "

_STATUS_RE = re.compile(r"^\[(\d+)/(\d+)\]\s?(.*)$")


def parse_progress(line: str) -> Optional[Tuple[int, int, str]]:
    """``"[12/78] Building C object ..."`` -> ``(12, 78, "Building C object ...")``.

    Returns None for every other line (compiler warnings, ninja's own messages).
    """
    m = _STATUS_RE.match(line.rstrip("\r\n"))
    if not m:
        return None
    done, total = int(m.group(1)), int(m.group(2))
    if total <= 0 or done > total:
        return None
    return done, total, m.group(3)


def is_tty(stream: IO[str]) -> bool:
    try:
        return stream.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):
        return False


class Progress:
    """Shows ninja's progress on ``stream``.

    On a terminal: one line rewritten with a carriage return
    (``[ 45%] 35/78 Building CXX object ...``). Otherwise: a log line each time
    the build crosses another ``step_pct`` percent.
    """

    def __init__(self, stream: IO[str], *, tty: Optional[bool] = None, step_pct: int = 10):
        self.stream = stream
        self.tty = is_tty(stream) if tty is None else tty
        self.step_pct = step_pct
        self._next_pct = step_pct
        self._line_open = False
        self.done = 0
        self.total = 0
        self._start = time.monotonic()

    def feed(self, line: str) -> bool:
        """Takes one line of ninja output; returns True if it was a status line."""
        parsed = parse_progress(line)
        if parsed is None:
            return False
        self.update(*parsed)
        return True

    def update(self, done: int, total: int, what: str = "") -> None:
        if total != self.total:  # a new ninja run (or ninja re-ran CMake first)
            self._next_pct = self.step_pct
        self.done, self.total = done, total
        pct = 100 * done // total
        if what.startswith("Re-running CMake"):
            what = "Re-running CMake (build files changed)"
            if not self.tty:
                self.stream.write(f"  {what}\n")
                self.stream.flush()
                return
        if self.tty:
            width = shutil.get_terminal_size((80, 24)).columns
            text = f"[{pct:3d}%] {done}/{total} {what}"
            self.stream.write("\r" + text[: max(width - 1, 10)].ljust(max(width - 1, 10)))
            self.stream.flush()
            self._line_open = True
            return
        if pct >= self._next_pct or done == total:
            elapsed = time.monotonic() - self._start
            self.stream.write(f"  {pct:3d}% ({done}/{total} steps, {elapsed:.0f} s)\n")
            self.stream.flush()
            while self._next_pct <= pct:
                self._next_pct += self.step_pct

    def close(self) -> None:
        """Ends the terminal line so that later messages start on a fresh one."""
        if self._line_open:
            self.stream.write("\n")
            self.stream.flush()
            self._line_open = False


def tail(path: Path, n: int = 30) -> List[str]:
    """The last ``n`` lines of a text file (empty when it does not exist)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return [line.rstrip("\n") for line in deque(f, maxlen=n)]
    except OSError:
        return []


# (kind, regex, one-sentence explanation). First match wins, so the specific
# causes come before the generic ones.
_FAILURES: Tuple[Tuple[str, "re.Pattern[str]", str], ...] = (
    (
        "disk_full",
        re.compile(r"No space left on device|Disk quota exceeded", re.I),
        "the disk is full (\"No space left on device\"); free some space "
        "(a CPU build needs about 2 GB, a CUDA build several) and run build again",
    ),
    (
        "out_of_memory",
        re.compile(r"internal compiler error: Killed|Killed signal terminated program|"
                   r"virtual memory exhausted|out of memory allocating|std::bad_alloc", re.I),
        "the compiler ran out of memory; retry with fewer parallel jobs (e.g. --jobs 1)",
    ),
    (
        "no_compiler",
        re.compile(r"No CMAKE_(C|CXX)_COMPILER could be found|"
                   r"is not a full path to an existing compiler tool|"
                   r"The (C|CXX) compiler identification is unknown|"
                   r"is not able to compile a simple test program"),
        "CMake found no working C/C++ compiler; check -DCMAKE_C_COMPILER/-DCMAKE_CXX_COMPILER "
        "and CC/CXX, or install one (Debian/Ubuntu: "
        "apt-get install build-essential; macOS: xcode-select --install) or point "
        "CC/CXX at it",
    ),
    (
        "cmake_too_old",
        re.compile(r"CMake (\d+(\.\d+)+) or higher is required"),
        "this CMake is too old for llama.cpp; `pip install -U cmake` gives a recent one",
    ),
    (
        "no_cuda_toolkit",
        re.compile(r"No CMAKE_CUDA_COMPILER could be found|CUDA Toolkit not found|"
                   r"Could NOT find CUDAToolkit|Failed to find nvcc|"
                   r"Failed to detect a default CUDA architecture"),
        "CMake could not use the CUDA toolkit; check that nvcc works and that "
        "CUDA_HOME/CUDAToolkit_ROOT point at the toolkit",
    ),
    (
        "cuda_arch",
        re.compile(r"Unsupported gpu architecture|"
                   r"is not defined for option 'gpu-architecture'|"
                   r"CMAKE_CUDA_ARCHITECTURES must be"),
        "nvcc rejected a CUDA architecture; pass --cuda-arch with values this "
        "toolkit supports (e.g. 90 for H100/H200, 86 for RTX 30xx)",
    ),
    (
        "interrupted",
        re.compile(r"ninja: build stopped: interrupted by user"),
        "the build was interrupted",
    ),
)


def classify_failure(lines: Iterable[str]) -> Optional[Tuple[str, str]]:
    """Names a known cause of a failed configure/build from its log lines.

    Returns ``(kind, explanation)`` or None when nothing known matches.
    """
    text = "\n".join(lines)
    for kind, pattern, explanation in _FAILURES:
        if pattern.search(text):
            return kind, explanation
    return None
