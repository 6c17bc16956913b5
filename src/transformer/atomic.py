"""Files written whole or not at all, and the temporaries that killed writers leave.

`write_atomic` writes a file beside its place, fsyncs and renames it: a reader, or a kill at any
moment, sees the old file or the new one, never a part. `remove_stale` removes what a killed
writer left (".NAME.tmp-PID", and `prepare`'s ".OUT.partial-PID" directories). Kept apart from
checkpoint.py, which needs torch: the commands that write no tensors (`prepare`, `score`) start
without importing it.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some platforms cannot open directories
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, write) -> None:
    """Write `path` by `write(binary file)` into `.NAME.tmp-PID`, fsync, rename: a reader (or a
    kill at any moment) sees the old file or the new one, never a part. The temporary file is
    removed if writing fails (disk full); a killed writer's is removed by `remove_stale`."""

    def make(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            write(f)

    replace_atomic(path, make)


def replace_atomic(path: Path, make) -> None:
    """`write_atomic` for writers that need a file name: `make(tmp)` writes `.NAME.tmp-PID`,
    which is then fsynced and renamed to `path`."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        make(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


# What `write_atomic` (".NAME.tmp-PID") and `prepare` (".OUT.partial-PID") leave when killed.
TEMPORARY = re.compile(r"^\..+\.(?:tmp|partial)-(\d+)$")


def remove_stale(directory: Path, pattern: re.Pattern = TEMPORARY) -> list[Path]:
    """Remove the entries of `directory` whose name matches `pattern` (group 1: a process id)
    and whose process is no longer running on this machine: the temporary files and directories
    of killed runs. Those of live processes (another run writing there now) are kept.

    Returns:
        The removed paths.
    """
    directory = Path(directory)
    removed: list[Path] = []
    if not directory.is_dir():
        return removed
    for path in sorted(directory.iterdir()):
        m = pattern.match(path.name)
        if m is None or _running(int(m.group(1))):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        logger.warning("removed %s, left by a killed run (process %s)", path, m.group(1))
        removed.append(path)
    return removed


def _running(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True
