"""llama.cpp's log, routed to the Python logger ``pyllama_headinfer.llama``,
and :func:`checked_call`, the one way the API calls a llama.cpp function
that can fail with its reason in the log.

Levels are mapped (DEBUG, INFO, WARNING, ERROR); the logger has a
``NullHandler``, so nothing is printed unless the application configures
logging. ``with capture_log() as lines:`` collects the lines logged inside
the block, so an exception can quote llama.cpp's reason.
"""

from __future__ import annotations

import logging
import re
import threading
from contextlib import contextmanager
from typing import Callable, List, Tuple, TypeVar

logger = logging.getLogger("pyllama_headinfer.llama")
logger.addHandler(logging.NullHandler())

LogLines = List[Tuple[int, str]]

COMPUTE_BUFFER_RE = re.compile(r"(\S+) compute buffer size = +([0-9.]+) MiB")  # llama_context::sched_reserve's line
CAPTURED_ATTR = "pyllama_captured"  # LogRecord attribute: the line was also captured (capture_log)
T = TypeVar("T")


class LogRouter:
    """Joins llama.cpp's partial log messages (GGML_LOG_LEVEL_CONT, text
    without a newline) into lines and hands them to ``logger``."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pending = ""
        self._level = logging.INFO
        self._captures: list[LogLines] = []
        self.levels: dict[int, int] = {}  # ggml level -> logging level (set_levels)
        self.cont_level = 5  # GGML_LOG_LEVEL_CONT (set_levels)

    def set_levels(self, levels: dict[int, int], cont_level: int) -> None:
        self.levels, self.cont_level = dict(levels), cont_level

    def feed(self, level: int, text: str) -> None:
        with self._lock:
            if level != self.cont_level:
                if self._pending:  # a new message: flush the unterminated one
                    self._emit(self._level, self._pending)
                    self._pending = ""
                self._level = self.levels.get(level, logging.INFO)
            self._pending += text
            if "\n" in self._pending:
                *lines, self._pending = self._pending.split("\n")
                for line in lines:
                    self._emit(self._level, line)

    def _emit(self, level: int, line: str) -> None:
        line = line.rstrip()
        if not line:
            return
        for cap in self._captures:
            cap.append((level, line))
        if logger.isEnabledFor(level):
            # captured lines are quoted by the exception the API raises when the call fails: a CLI
            # that prints that exception can leave them out (see cli.main.cli_logging)
            logger.log(level, "%s", line, extra={CAPTURED_ATTR: bool(self._captures)})

    def flush(self) -> None:
        with self._lock:
            if self._pending:
                self._emit(self._level, self._pending)
                self._pending = ""

    @contextmanager
    def capture(self):
        """Collect the (level, line) pairs logged inside the block."""
        cap: LogLines = []
        with self._lock:
            self._captures.append(cap)
        try:
            yield cap
        finally:
            self.flush()
            with self._lock:
                # by identity: nested captures can hold equal lists, and list.remove() compares by value
                self._captures = [c for c in self._captures if c is not cap]


router = LogRouter()


@contextmanager
def capture_log():
    """``with capture_log() as lines:`` -- the llama.cpp log lines (level,
    text) emitted inside the block, e.g. to put into an exception message."""
    with router.capture() as cap:
        yield cap


def log_reason(lines: LogLines, n: int = 3) -> str:
    """The last ``n`` warnings/errors of a captured log (else its last lines), joined: the
    reason llama.cpp gave for a failure; "" when it logged nothing."""
    errs = [t for lvl, t in lines if lvl >= logging.WARNING]
    picked = (errs or [t for _, t in lines])[-n:]
    return "; ".join(picked)


def compute_buffers_mib(lines: LogLines) -> dict[str, float]:
    """{buffer type: MiB} of the compute buffers llama.cpp logged reserving in a captured log (``sched_reserve:
    CUDA0 compute buffer size = 1034.00 MiB``; an RPC device's name carries its endpoint, ``RPC0[host:port]``).
    The last reservation of each wins: a context reserves again after its first graphs."""
    return {m.group(1): float(m.group(2)) for _, text in lines for m in [COMPUTE_BUFFER_RE.search(text)] if m}


def checked_call(fn: Callable[..., T], *args, ok: Callable[[T], bool],
                 error: Callable[[T, str], Exception]) -> T:
    """``fn(*args)`` with llama.cpp's log captured; when ``ok(result)`` is false,
    raise ``error(result, reason)``, the reason being :func:`log_reason` of
    what llama.cpp logged during the call, or "no reason given"."""
    with capture_log() as lines:
        result = fn(*args)
    if not ok(result):
        raise error(result, log_reason(lines) or "no reason given")
    return result
