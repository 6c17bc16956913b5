"""kernels.py: the compiled transposing copy equals torch's, and without it torch's is used."""

from __future__ import annotations

import platform

import pytest
import torch

from transformer import kernels


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """kernels as if not yet loaded, building into an empty cache folder; restored after."""
    saved = (kernels._LIB, kernels._WHY, kernels._TRIED)
    monkeypatch.setenv("TRANSFORMER_KERNELS", str(tmp_path / "cache"))
    kernels._LIB, kernels._WHY, kernels._TRIED = None, None, False
    yield tmp_path / "cache"
    kernels._LIB, kernels._WHY, kernels._TRIED = saved


def test_it_builds_on_this_x86_64_machine():
    assert platform.machine().lower() in ("x86_64", "amd64"), "the suite runs on x86-64"
    assert kernels.unavailable() is None  # a C compiler is part of the test set-up


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int16])
@pytest.mark.parametrize(
    "shape", [(0, 5), (5, 0), (1, 1), (8, 8), (7, 9), (9, 7), (33, 65), (3, 1000), (300, 514)]
)
@pytest.mark.parametrize("threads", [1, 2])
def test_transposed_equals_torchs_copy(dtype, shape, threads):
    x = torch.arange(shape[0] * shape[1]).reshape(shape).to(dtype)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = kernels.transposed(x)
    finally:
        torch.set_num_threads(old)
    assert out.is_contiguous() and out.dtype == dtype and torch.equal(out, x.t())


def test_large_matrices_take_the_threaded_path():
    x = torch.randn(3840, 512).to(torch.bfloat16)  # above MIN_THREADED, as a W1 layer's input
    assert x.numel() >= kernels.MIN_THREADED
    assert torch.equal(kernels.transposed(x), x.t())


def test_a_view_with_a_row_stride_and_an_offset():
    base = torch.randn(70, 90).to(torch.bfloat16)
    x = base[3:60, 5:41]  # rows of 36 values 90 apart, starting 3 * 90 + 5 in
    assert torch.equal(kernels.transposed(x), x.t())


@pytest.mark.parametrize(
    "x",
    [
        torch.randn(30, 20),  # 4-byte values
        torch.randn(20, 30).to(torch.bfloat16).t(),  # columns contiguous, not rows
        torch.randn(2, 3, 4).to(torch.bfloat16)[0],  # fine: 2-D view
    ],
)
def test_other_tensors_get_torchs_copy_with_the_same_values(x):
    assert torch.equal(kernels.transposed(x), x.t())


def test_no_compiler_means_torchs_copy(fresh, monkeypatch):
    monkeypatch.setenv("CC", "no-such-compiler-here")
    x = torch.randn(40, 24).to(torch.bfloat16)
    assert torch.equal(kernels.transposed(x), x.t())
    assert "no C compiler" in kernels.unavailable()


def test_a_failing_compiler_means_torchs_copy(fresh, monkeypatch):
    monkeypatch.setenv("CC", "false")  # exits 1
    assert "failed" in kernels.unavailable()
    assert not list(fresh.glob("*.so")) and not list(fresh.glob(".*tmp"))  # nothing half-made
    x = torch.randn(40, 24).to(torch.bfloat16)
    assert torch.equal(kernels.transposed(x), x.t())


def test_it_is_built_once_into_the_cache_folder(fresh):
    assert kernels.unavailable() is None
    (built,) = fresh.glob("transpose16-*.so")
    stamp = built.stat().st_mtime_ns
    kernels._LIB, kernels._WHY, kernels._TRIED = None, None, False
    assert kernels.unavailable() is None  # loaded again, not rebuilt
    assert built.stat().st_mtime_ns == stamp and len(list(fresh.iterdir())) == 1


def test_a_damaged_cached_library_is_built_again(fresh):
    built = kernels._build(kernels._compiler())  # built, not loaded (a loaded one is mapped)
    built.write_bytes(b"\x7fELF not really")  # a truncated copy, a full disk
    assert kernels.unavailable() is None
    assert built.stat().st_size > 1000
    x = torch.randn(16, 24).to(torch.bfloat16)
    assert torch.equal(kernels.transposed(x), x.t())


def test_a_library_that_copies_wrongly_is_not_used(fresh, monkeypatch):
    monkeypatch.setattr(kernels, "_SOURCE", kernels._SOURCE.replace("+ i] = s[", "+ i] = 1 + s["))
    assert "differs from torch's" in kernels.unavailable()
    x = torch.randn(9, 13).to(torch.bfloat16)
    assert torch.equal(kernels.transposed(x), x.t())


def test_an_unwritable_cache_folder_means_torchs_copy(fresh, monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("TRANSFORMER_KERNELS", str(blocker / "cache"))  # under a file
    assert kernels.unavailable()
    x = torch.randn(16, 24).to(torch.bfloat16)
    assert torch.equal(kernels.transposed(x), x.t())


def test_the_cache_folder_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("TRANSFORMER_KERNELS", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert kernels.cache_dir() == tmp_path / "transformer"
