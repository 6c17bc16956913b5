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


@pytest.mark.parametrize("env", [{"TRANSFORMER_MALLOC": "system"},
                                 {"MALLOC_MMAP_THRESHOLD_": "65536"},
                                 {"MALLOC_TRIM_THRESHOLD_": "0"}])  # fmt: skip
def test_the_users_choice_is_left_alone(monkeypatch, env) -> None:
    calls = []
    monkeypatch.setattr(allocator.ctypes, "CDLL", lambda name: calls.append(name))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(allocator, "_applied", None)
    assert allocator.keep_large_blocks() is False
    assert calls == []  # mallopt never looked up
