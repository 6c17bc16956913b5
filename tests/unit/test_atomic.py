"""Files written whole or not at all; what killed writers leave, removed."""

from __future__ import annotations

import errno
import os

import pytest

from fixtures import dead_pid
from transformer import atomic


def test_write_atomic_replaces_the_file_whole_or_leaves_it(tmp_path):
    path = tmp_path / "notes.txt"
    atomic.write_atomic(path, lambda f: f.write(b"old"))
    assert path.read_bytes() == b"old"

    def fails(f):  # half written, then the disk is full
        f.write(b"ne")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        atomic.write_atomic(path, fails)
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]  # no temporary left
    atomic.write_atomic(path, lambda f: f.write(b"new"))
    assert path.read_bytes() == b"new" and [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_remove_stale_removes_only_what_dead_processes_left(tmp_path):
    dead, alive = dead_pid(), os.getpid()
    for name in (f".ckpt_4.pt.tmp-{dead}", f".latest.tmp-{dead}", f".config.yaml.tmp-{dead}",
                 f".ckpt_6.pt.tmp-{alive}", "ckpt_4.pt", "notes.tmp-12"):  # fmt: skip
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / f".out.partial-{dead}").mkdir()
    removed = atomic.remove_stale(tmp_path)
    assert sorted(p.name for p in removed) == sorted(
        [f".ckpt_4.pt.tmp-{dead}", f".latest.tmp-{dead}", f".config.yaml.tmp-{dead}",
         f".out.partial-{dead}"]
    )  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f".ckpt_6.pt.tmp-{alive}", "ckpt_4.pt", "notes.tmp-12"]
    )
