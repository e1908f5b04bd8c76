"""Files that appear whole or not at all (state saves).

llama.cpp writes a state file itself, by path; if it fails half-way (a full
disk) the partial file would later load as a corrupt state. So it writes to a
temporary name in the same directory, and the temporary is renamed over the
target only when the writer succeeded (``os.replace`` is atomic within one
file system) and removed otherwise.
"""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


@contextmanager
def atomic_output_path(path: str | os.PathLike) -> Iterator[str]:
    """Yield a temporary path beside ``path``; on a clean exit rename it to
    ``path``, on an exception remove it (``path`` is left untouched)."""
    target = Path(os.fspath(path))
    directory = target.parent if str(target.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=directory)
    os.close(fd)
    # mkstemp makes the file private (0600); the result gets the mode a plain open() would give it
    os.chmod(tmp, _mode_like(target))
    try:
        yield tmp
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _mode_like(target: Path) -> int:
    """The existing file's mode, else 0666 less the process umask."""
    try:
        return target.stat().st_mode & 0o7777
    except OSError:
        pass
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o644
