"""Step 2 of ``build``: one build per directory at a time.

:func:`build_lock` holds an exclusive ``flock`` on ``<build_dir>/.lock`` while
a build runs; the file names the holder (pid, host, start time, command), so
a second build can say whom it waits for, or, with ``--no-wait``, fail
naming it.
"""

from __future__ import annotations

import os
import shlex
import socket
import sys
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

from pyllama_headinfer.errors import BuildError

try:  # POSIX only; on Windows the lock is skipped.
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

LOCK_NAME = ".lock"


def _lock_holder_text() -> str:
    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    argv = list(sys.argv)
    if argv and argv[0].endswith("__main__.py"):
        argv[0] = "python -m " + (Path(argv[0]).parent.name or "pyllama_headinfer")
    cmd = " ".join([argv[0]] + [shlex.quote(a) for a in argv[1:]]) if argv else "python"
    return f"pid {os.getpid()} on {socket.gethostname()}, started {started}: {cmd}"


@contextmanager
def build_lock(build_dir: Path, *, wait: bool = True, say=print) -> Iterator[None]:
    """Exclusive ``flock`` on ``<build_dir>/.lock`` for the duration of a build.

    Released by the kernel when the process dies, so a crashed build never
    leaves a stale lock. ``wait=False`` fails at once when it is taken.
    """
    if fcntl is None:  # pragma: no cover - Windows
        yield
        return
    fd = os.open(build_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "another process"
            if not wait:
                raise BuildError(
                    f"Another build is using {build_dir} ({holder}). Wait for it to finish, "
                    "run without --no-wait to wait for it, or choose another --build-dir."
                ) from None
            say(f"Waiting for another build using {build_dir} to finish ({holder}) ...")
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, (_lock_holder_text() + "\n").encode(), 0)
        yield
    finally:
        os.close(fd)
