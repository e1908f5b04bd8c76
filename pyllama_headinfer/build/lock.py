"""Step 2 of ``build``: one build per directory at a time.

:func:`build_lock` holds an exclusive ``flock`` on ``<build_dir>/.lock`` while
a build runs; the file names the holder (pid, host, start time, command), so
a second build can say whom it waits for, or, with ``--no-wait``, fail
naming it.

The processes a build starts (CMake, ninja and, through ninja, the compilers)
inherit the locked descriptor (:func:`held_lock_fds`): an ``flock`` belongs to
the open file, so the directory stays locked until the last of them exits.
If the build's Python process is killed (``kill -9``), the next build waits
for its orphaned ninja instead of starting a second one in the same
directory.

A lock belongs to the file, not to its name: when the directory is removed
while a build holds it, :meth:`HeldLock.removed` says so, and a build that
was waiting for it gets :func:`removed_error` (one line, exit status 1)
instead of working in a directory that no longer exists.
"""

from __future__ import annotations

import os
import shlex
import socket
import sys
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator, Optional, Set, Tuple

from pyllama_headinfer.errors import BuildError, BuildInterrupted

try:  # POSIX only; on Windows the lock is skipped.
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

LOCK_NAME = ".lock"

_held: Set[int] = set()  # descriptors of the locks this process holds now


def held_lock_fds() -> Tuple[int, ...]:
    """The build locks held by this process, for ``subprocess.Popen(pass_fds=...)``."""
    return tuple(sorted(_held))


def _holder_pid(text: str):
    parts = text.split()
    return int(parts[1]) if len(parts) > 1 and parts[0] == "pid" and parts[1].isdigit() else None


def _describe_holder(text: str) -> str:
    pid = _holder_pid(text)
    if pid is not None and pid != os.getpid():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return (f"{text}; that process has exited, but the compilers it started (ninja) still run "
                    "and hold the directory")
        except OSError:
            pass
    return text


def _lock_holder_text() -> str:
    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    argv = list(sys.argv)
    if argv and argv[0].endswith("__main__.py"):
        argv[0] = "python -m " + (Path(argv[0]).parent.name or "pyllama_headinfer")
    cmd = " ".join([argv[0]] + [shlex.quote(a) for a in argv[1:]]) if argv else "python"
    return f"pid {os.getpid()} on {socket.gethostname()}, started {started}: {cmd}"


class HeldLock:
    """The lock :func:`build_lock` holds on ``<build_dir>/.lock``."""

    def __init__(self, build_dir: Path, fd: Optional[int]):
        self.build_dir, self.fd = build_dir, fd

    def removed(self) -> bool:
        """Whether ``<build_dir>/.lock`` is no longer the file locked here: the directory was
        removed (or removed and made again) since."""
        if self.fd is None:  # pragma: no cover - Windows: no lock
            return not self.build_dir.is_dir()
        try:
            now = os.stat(self.build_dir / LOCK_NAME)
        except FileNotFoundError:
            return True
        except OSError:
            return False
        held = os.fstat(self.fd)
        return (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino)


def removed_error(build_dir: Path, waited: bool = False) -> BuildError:
    """The error of a build whose directory was removed under it (``waited``: under the build it waited for)."""
    when = "while another build was using it (this one waited for it)" if waited else "while building"
    return BuildError(f"The build directory {build_dir} was removed {when}; run the build again to build it anew.")


@contextmanager
def removal_is_one_error(lock: HeldLock) -> Iterator[None]:
    """Inside a build: once the directory is removed, every step fails on some missing file
    (or ninja's log tail is empty); any such failure becomes :func:`removed_error`."""
    try:
        yield
    except (BuildError, OSError) as exc:
        if isinstance(exc, BuildInterrupted) or not lock.removed():
            raise
        raise removed_error(lock.build_dir) from None


@contextmanager
def build_lock(build_dir: Path, *, wait: bool = True, say=print) -> Iterator[HeldLock]:
    """Exclusive ``flock`` on ``<build_dir>/.lock`` for the duration of a build.

    Released by the kernel when the process dies, so a crashed build never
    leaves a stale lock. ``wait=False`` fails at once when it is taken. A
    directory removed while this call waited for it is :func:`removed_error`.
    """
    if fcntl is None:  # pragma: no cover - Windows
        yield HeldLock(build_dir, None)
        return
    fd = os.open(build_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe_holder(os.pread(fd, 4096, 0).decode(errors="replace").strip() or "another process")
            if not wait:
                raise BuildError(
                    f"Another build is using {build_dir} ({holder}). Wait for it to finish, "
                    "run without --no-wait to wait for it, or choose another --build-dir."
                ) from None
            say(f"Waiting for another build using {build_dir} to finish ({holder}) ...")
            fcntl.flock(fd, fcntl.LOCK_EX)
            if HeldLock(build_dir, fd).removed():
                raise removed_error(build_dir, waited=True)
        os.ftruncate(fd, 0)
        os.pwrite(fd, (_lock_holder_text() + "\n").encode(), 0)
        _held.add(fd)
        try:
            yield HeldLock(build_dir, fd)
        finally:
            _held.discard(fd)
    finally:
        os.close(fd)
