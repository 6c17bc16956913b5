"""allocator.py: large per-step tensors come from the heap, not from a fresh mmap each time."""

from __future__ import annotations

import ctypes
import sys

import pytest
import torch

import transformer.allocator as allocator

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]  # fmt: skip


def _mmapped_blocks() -> int:
    mallinfo2 = ctypes.CDLL(None).mallinfo2
    mallinfo2.restype = _MallInfo2
    return mallinfo2().hblks


def _from_mmap(t: torch.Tensor) -> bool:
    """Whether glibc gave t's memory its own mmap: the IS_MMAPPED bit (2) of the chunk's size
    field, the word before the pointer malloc returned (torch.empty's own, at offset 0)."""
    return bool(ctypes.c_size_t.from_address(t.data_ptr() - 8).value & 2)


def test_a_64_mib_tensor_comes_from_the_heap_once_applied() -> None:
    """Read on the tensor itself, not on the process's count of mmapped blocks (mallinfo2's
    hblks), which any thread moves. It fails where the worker's thread no longer allocates from
    glibc's main arena: after a malloc that failed there (the suite makes its out-of-memory
    errors in a child process for this: conftest's `allocation_failures`)."""
    assert allocator.keep_large_blocks() is True
    assert allocator.keep_large_blocks() is True  # idempotent
    x = torch.empty(64 << 20, dtype=torch.uint8)  # glibc's default: above 32 MiB, an mmap
    x.fill_(1)
    assert not _from_mmap(x)
    del x


def test_the_probe_sees_an_mmapped_block() -> None:
    """`_from_mmap` against glibc's own count: a 2 GiB block (above keep_large_blocks' 1 GiB)
    is mmapped even once applied; a small one never is."""
    allocator.keep_large_blocks()
    before = _mmapped_blocks()
    big = torch.empty(2 << 30, dtype=torch.uint8)
    assert _from_mmap(big) and _mmapped_blocks() >= before + 1
    del big
    assert not _from_mmap(torch.empty(1000, dtype=torch.uint8))


# In a second thread, with glibc's malloc itself: a 40 MiB block A kept (the arena's first
# heap), a second one B that does not fit beside it (a heap of its own), filled with 2s and
# freed (that heap then holds nothing), then a 30 MiB block C, not written. Where the arena
# kept B's heap, C is carved from it and still holds B's 2s; where it deleted it, C is a fresh
# mapping of zeros, each page faulted in again when written (what a decoding thread paid).
# Read on the memory, not on page faults, which a kernel with transparent huge pages counts
# otherwise. (torch's own aligned blocks leave a small chunk at a heap's start, which keeps
# this toy's heap either way; a real search's heaps came and went, docs/performance.md.)
_THREAD_REFILL = """
import ctypes, threading
import transformer.allocator as allocator
assert allocator.keep_large_blocks()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
MiB = 1 << 20
out = []
def work():
    a = libc.malloc(40 * MiB)
    libc.memset(a, 1, 40 * MiB)
    b = libc.malloc(40 * MiB)
    libc.memset(b, 2, 40 * MiB)
    libc.free(b)
    c = libc.malloc(30 * MiB)
    out.append(ctypes.string_at(c + 20 * MiB, 1)[0])
    libc.free(c)
    libc.free(a)
t = threading.Thread(target=work)
t.start()
t.join()
print(out[0])
"""


def _refilled_byte(**env: str) -> int:
    import os
    import subprocess

    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUN"))}
    done = subprocess.run([sys.executable, "-c", _THREAD_REFILL], env=clean | env,
                          capture_output=True, text=True, check=True, timeout=120)  # fmt: skip
    return int(done.stdout)


def test_a_threads_heaps_are_kept_between_blocks() -> None:
    """The top pad (a whole heap) keeps glibc from deleting a thread arena's heap when its
    blocks are freed: C reuses B's memory. With glibc's own pad (the user's choice, left
    alone) C is fresh zeros: the probe sees the deletion."""
    assert _refilled_byte() == 2
    assert _refilled_byte(MALLOC_TOP_PAD_="131072") == 0


@pytest.mark.parametrize("env", [{"TRANSFORMER_MALLOC": "system"},
                                 {"MALLOC_MMAP_THRESHOLD_": "65536"},
                                 {"MALLOC_TRIM_THRESHOLD_": "0"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}])  # fmt: skip
def test_the_users_choice_is_left_alone(monkeypatch, env) -> None:
    calls = []
    monkeypatch.setattr(allocator.ctypes, "CDLL", lambda name: calls.append(name))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(allocator, "_applied", None)
    assert allocator.keep_large_blocks() is False
    assert calls == []  # mallopt never looked up


@pytest.mark.parametrize("env", [("MALLOC_TOP_PAD_", "131072"),
                                 ("GLIBC_TUNABLES", "glibc.malloc.top_pad=131072")])  # fmt: skip
def test_a_users_top_pad_is_left_alone(monkeypatch, env) -> None:
    calls = []

    class _Libc:
        @staticmethod
        def mallopt(option, value):
            calls.append(option)
            return 1

    monkeypatch.setattr(allocator.ctypes, "CDLL", lambda name: _Libc)
    monkeypatch.setattr(allocator, "_applied", None)
    monkeypatch.setenv(*env)
    assert allocator.keep_large_blocks() is True
    assert allocator.M_TOP_PAD not in calls and allocator.M_MMAP_THRESHOLD in calls


MADVISE = "always [madvise] never\n"


def test_huge_pages_ask_for_the_tunable_where_thp_is_madvised(monkeypatch) -> None:
    monkeypatch.setattr(sys, "orig_argv", ["python", "-m", "transformer", "train", "data"])
    exe, argv, env = allocator.huge_pages_exec({"HOME": "/h"}, MADVISE, "glibc 2.36")
    assert exe == sys.executable and argv == [sys.executable, "-m", "transformer", "train", "data"]
    assert env == {"HOME": "/h", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    # a user's other tunables are kept, the new one appended
    _, _, env = allocator.huge_pages_exec(
        {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, MADVISE, "glibc 2.39"
    )
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"


@pytest.mark.parametrize(
    ("environ", "thp", "glibc"),
    [
        ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, MADVISE, "glibc 2.36"),  # the user's
        ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}, MADVISE, "glibc 2.36"),  # the run again
        ({"TRANSFORMER_MALLOC": "system"}, MADVISE, "glibc 2.36"),
        ({}, "[always] madvise never\n", "glibc 2.36"),  # every large mapping has them
        ({}, "always madvise [never]\n", "glibc 2.36"),
        ({}, MADVISE, "glibc 2.34"),  # before the tunable
        ({}, MADVISE, "musl 1.2"),
        ({}, MADVISE, "glibc unknown"),
    ],
)
def test_huge_pages_are_not_asked_for_where_they_gain_nothing(monkeypatch, environ, thp, glibc):
    monkeypatch.setattr(sys, "orig_argv", ["python", "-m", "transformer", "train"])
    assert allocator.huge_pages_exec(environ, thp, glibc) is None


def test_huge_pages_need_a_command_line_to_run_again(monkeypatch) -> None:
    monkeypatch.setattr(sys, "orig_argv", ["python"])  # an embedded interpreter
    assert allocator.huge_pages_exec({}, MADVISE, "glibc 2.36") is None
