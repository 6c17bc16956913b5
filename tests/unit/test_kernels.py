"""kernels.py: each compiled kernel against torch (and fp64); torch's ops where none can run."""

from __future__ import annotations

import contextlib
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from transformer import kernels
from transformer.cpuinfo import cpu_flags
from transformer.model import packed_attention_case
from transformer.translate import _same_bits, int8_product_exact

# the training attention's products (`kernels.attention_products`) each test takes in turn
PRODUCTS = ["lanes", "tiles", "dots"]


def products_here(which: str) -> str:
    """Where `attention_products(which)` puts the products on this machine: the tiles on a CPU
    with AMX where the process can have them (the compiler knew AMX, and Linux grants it:
    `amx_tiles`), else its dot products; the dot products where the CPU has AVX-512 BF16 (and
    the compiler knew it); else the fp32 lanes."""
    # asked of the kernels: the dot products need a compiler that knows them (gcc 11, clang 12)
    old = kernels.attention_products()
    dots = "avx512_bf16" in cpu_flags() and kernels.attention_products("dots") == "dots"
    kernels.attention_products(old)
    if which == "tiles" and {"amx_tile", "amx_bf16"} <= cpu_flags():
        return "tiles" if kernels.amx_tiles() else "dots" if dots else "lanes"
    return "dots" if which == "dots" and dots else "lanes"


@contextlib.contextmanager
def attention_in(which: str):
    """The training attention's products on AMX's tiles, AVX-512 BF16's dot products or
    AVX-512's fp32 lanes inside (`products_here(which)`, asserted), as they were after."""
    old = kernels.attention_products()
    try:
        expected = products_here(which)
        assert kernels.attention_products(which) == expected
        assert kernels.amx_tiles() <= ({"amx_tile", "amx_bf16"} <= cpu_flags())
        yield
    finally:
        kernels.attention_products(old)


@contextlib.contextmanager
def threads_of(n: int):
    """torch (and so the kernels' OpenMP teams) at n threads inside, as it was after."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


COMPILE = kernels._compile  # the compiler run for real (`fresh` swaps in a copy of its output)


@pytest.fixture(scope="session")
def compiled(tmp_path_factory) -> Path:
    """Where `fresh` keeps each library the C compiler made this session."""
    return tmp_path_factory.mktemp("compiled")


@pytest.fixture
def fresh(monkeypatch, tmp_path, compiled):
    """kernels as if not yet loaded, building into an empty cache folder, with an empty folder
    of libraries built ahead (`kernels.PREBUILT`); restored after.

    Each build goes through `kernels._build` (its temporary file, its rename, then the load
    and check), but the compiler runs once per source, compiler and flags in a worker: a
    second build of the same source copies the first's output, or the library this process
    had loaded (gcc -O3 takes ~5 s on a Zen 3 and ran in 17 tests). A failing compiler and
    an altered source still run for real."""
    saved = (kernels._LIB, kernels._NOGIL, kernels._PATH, kernels._WHY, kernels._TRIED)

    def compile_once(cc: str, src: Path, out: Path) -> subprocess.CompletedProcess:
        kept = compiled / kernels._library_name(cc)  # `_build` writes `kernels._SOURCE` to src
        loaded = saved[2]  # the process's own library, if built from this source by this cc
        if not kept.exists() and loaded is not None and loaded.name == kept.name:
            shutil.copyfile(loaded, kept)
        if kept.exists():
            shutil.copyfile(kept, out)
            return subprocess.CompletedProcess([cc, str(src)], 0, "", "")
        done = COMPILE(cc, src, out)
        if done.returncode == 0:
            shutil.copyfile(out, kept)
        return done

    monkeypatch.setattr(kernels, "_compile", compile_once)
    monkeypatch.setenv("TRANSFORMER_KERNELS", str(tmp_path / "cache"))
    monkeypatch.setattr(kernels, "PREBUILT", tmp_path / "prebuilt")
    kernels._LIB, kernels._PATH, kernels._WHY, kernels._TRIED = None, None, None, False
    yield tmp_path / "cache"
    kernels._LIB, kernels._NOGIL, kernels._PATH, kernels._WHY, kernels._TRIED = saved


def _again():
    """kernels as if not yet loaded (the folders as they are)."""
    kernels._LIB, kernels._NOGIL, kernels._PATH, kernels._WHY = None, None, None, None
    kernels._TRIED = False


def test_it_builds_on_this_x86_64_machine():
    assert platform.machine().lower() in ("x86_64", "amd64"), "the suite runs on x86-64"
    assert kernels.unavailable() is None  # a C compiler is part of the test set-up


@pytest.mark.parametrize("amx", [True, False])
def test_the_source_compiles_without_a_warning_with_amx_and_without(amx, tmp_path):
    """`-Wall -Wextra` find nothing, as this compiler builds the source and as one without AMX's
    intrinsics (gcc < 11, clang < 12) would: there `HAVE_AMX` stays undefined and the bf16
    products' code goes; the names only it reads must go with it (`-fsyntax-only`: the front
    end's warnings, ~0.3 s)."""
    source = kernels._SOURCE
    if not amx:
        start = source.index("#if defined(__x86_64__) && ((defined(__clang__)")
        end = source.index("#define HAVE_AMX 1")
        source = source[:start] + "#if 0\n" + source[end:]
    src = tmp_path / "kernels.c"
    src.write_text(source)
    cmd = [kernels._compiler(), *kernels._FLAGS, "-fsyntax-only", "-Wall", "-Wextra", "-Werror"]
    done = subprocess.run([*cmd, str(src)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int16])
@pytest.mark.parametrize(
    "shape", [(0, 5), (5, 0), (1, 1), (8, 8), (7, 9), (9, 7), (33, 65), (3, 1000), (300, 514)]
)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("wide", [True, False])  # AVX-512's 32 x 32 blocks, or 8 x 8 ones
def test_transposed_equals_torchs_copy(dtype, shape, threads, wide, monkeypatch):
    monkeypatch.setattr(kernels, "_AVX512", kernels._AVX512 and wide)
    x = torch.arange(shape[0] * shape[1]).reshape(shape).to(dtype)
    with threads_of(threads):
        out = kernels.transposed(x)
    assert out.is_contiguous() and out.dtype == dtype and torch.equal(out, x.t())


def test_the_wide_copy_is_the_one_an_avx512_cpu_takes(monkeypatch):
    assert kernels._library() is not None  # (its load checks both copies against torch's)
    calls = []
    for name in ("transpose16", "transpose16_wide"):
        real = getattr(kernels._LIB, name)
        monkeypatch.setattr(kernels._LIB, name, lambda *a, n=name, f=real: calls.append(n) or f(*a))
    x = torch.randn(96, 70).to(torch.bfloat16)
    wide = "transpose16_wide" if kernels._AVX512 else "transpose16"  # an AVX2 Zen 3: t8x8's
    assert torch.equal(kernels.transposed(x), x.t()) and calls == [wide]
    monkeypatch.setattr(kernels, "_AVX512", False)
    assert torch.equal(kernels.transposed(x), x.t()) and calls[1:] == ["transpose16"]


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


def test_no_compiler_means_torchs_copy(fresh, monkeypatch, caplog):
    monkeypatch.setenv("CC", "no-such-compiler-here")
    x = torch.randn(40, 24).to(torch.bfloat16)
    with caplog.at_level("INFO", logger="transformer.kernels"):
        assert torch.equal(kernels.transposed(x), x.t())
    assert "no C compiler" in kernels.unavailable()
    assert "nothing built ahead (`transformer kernels`)" in kernels.unavailable()
    assert kernels.library_path() is None
    (record,) = caplog.records  # a warning, once: it costs a search ~25% of its speed
    assert record.levelname == "WARNING" and "transformer kernels" in record.getMessage()
    assert kernels.describe() == [f"not in use: {kernels.unavailable()}"]


def _built_ahead_only(cache: Path) -> Path:
    """The library built ahead into `kernels.PREBUILT` and nowhere else (the cache's removed)."""
    kept = kernels.build_ahead()
    for built in cache.glob("*.so"):
        built.unlink()
    return kept


def test_without_a_compiler_a_library_built_ahead_is_loaded(fresh, monkeypatch, tmp_path):
    """`transformer kernels` where there is a compiler, then a process without one (a copy of
    the environment, a container's second stage): the library in the package's folder."""
    kept = kernels.build_ahead()
    assert kept.parent == kernels.PREBUILT and kept.name == kernels.library_path().name
    assert kernels.library_path().parent == fresh  # built into the cache folder first
    monkeypatch.setenv("CC", "no-such-compiler-here")
    monkeypatch.setenv("TRANSFORMER_KERNELS", str(tmp_path / "another-cache"))
    _again()
    assert kernels.unavailable() is None and kernels.library_path() == kept
    assert kernels.describe()[0] == f"in use: {kept}"
    x = torch.randn(40, 24).to(torch.bfloat16)
    assert torch.equal(kernels.transposed(x), x.t())


def test_without_a_compiler_the_cache_folders_library_is_loaded(fresh, monkeypatch):
    """One built by another compiler (or kept there with --into): found by its source's key."""
    assert kernels.unavailable() is None
    built = kernels.library_path()
    other = built.with_name(built.name.rsplit("-", 1)[0] + "-0badc0de.so")
    built.rename(other)
    monkeypatch.setenv("CC", "no-such-compiler-here")
    _again()
    assert kernels.unavailable() is None and kernels.library_path() == other


def test_another_versions_library_is_not_loaded(fresh, monkeypatch):
    kept = _built_ahead_only(fresh)
    kept.rename(kept.with_name("kernels-0123456789abcdef-d162fbe9.so"))  # another source's
    monkeypatch.setenv("CC", "no-such-compiler-here")
    _again()
    assert "nothing built ahead" in kernels.unavailable()


def test_a_failing_compiler_falls_back_on_a_library_built_ahead(fresh, monkeypatch):
    kept = _built_ahead_only(fresh)
    monkeypatch.setenv("CC", "false")  # exits 1
    _again()
    assert kernels.unavailable() is None and kernels.library_path() == kept


def test_a_damaged_library_built_ahead_is_passed_over_and_left_alone(fresh, monkeypatch):
    kept = _built_ahead_only(fresh)
    monkeypatch.setenv("CC", "no-such-compiler-here")
    damaged = kept.with_name(kept.name.rsplit("-", 1)[0] + "-0badc0de.so")
    damaged.write_bytes(b"\x7fELF not really")  # newer than `kept`: tried first
    os.utime(kept, ns=(0, 0))
    _again()
    assert kernels.unavailable() is None and kernels.library_path() == kept
    kept.unlink()
    _again()
    why = kernels.unavailable()
    assert why.startswith("no C compiler") and f"{damaged}: " in why
    assert damaged.read_bytes() == b"\x7fELF not really"  # not ours to remove


def test_build_ahead_keeps_one_whole_library_per_version(fresh, tmp_path):
    kernels.PREBUILT.mkdir()
    stale = kernels.PREBUILT / "kernels-0123456789abcdef-d162fbe9.so"  # an older package's
    stale.write_bytes(b"old")
    kept = kernels.build_ahead()
    assert kernels.build_ahead() == kept  # again: the same file
    assert [p.name for p in kernels.PREBUILT.iterdir()] == [kept.name]
    assert kept.read_bytes() == kernels.library_path().read_bytes()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / stale.name).write_bytes(b"old")  # a folder of the user's: left as it is
    assert kernels.build_ahead(elsewhere).parent == elsewhere
    assert sorted(p.name for p in elsewhere.iterdir()) == sorted([stale.name, kept.name])


def test_build_ahead_says_which_folder_it_cannot_write(fresh, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(OSError) as e:
        kernels.build_ahead(blocker / "kernels")
    assert str(blocker) in str(e.value)


def test_build_ahead_without_a_library_says_why(fresh, monkeypatch):
    monkeypatch.setenv("CC", "no-such-compiler-here")
    with pytest.raises(OSError, match="no C compiler"):
        kernels.build_ahead()
    assert not kernels.PREBUILT.exists()


def test_a_process_without_a_compiler_on_its_path_loads_the_copy(fresh, tmp_path):
    """A real process with no compiler on PATH (a slim image) and the copy kept with --into:
    the same kernel's values as this process's."""
    kept = kernels.build_ahead(tmp_path / "kept")
    x = torch.randn(3, 300, generator=torch.Generator().manual_seed(1))
    ids, _ = kernels.row_top(x, 7)
    code = (
        "import sys, torch\n"
        "from transformer import kernels\n"
        f"kernels.PREBUILT = kernels.Path({str(kernels.PREBUILT)!r})  # empty\n"
        "assert kernels._compiler() is None, kernels._compiler()\n"
        "x = torch.randn(3, 300, generator=torch.Generator().manual_seed(1))\n"
        "print(kernels.unavailable(), kernels.library_path(), kernels.row_top(x, 7)[0].tolist())\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("CC", "PATH")}
    env.update(PATH=str(tmp_path / "no-tools"), TRANSFORMER_KERNELS=str(kept.parent))
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split(" ", 2) == ["None", str(kept), f"{ids.tolist()}\n"]


def test_a_failing_compiler_means_torchs_copy(fresh, monkeypatch):
    monkeypatch.setenv("CC", "false")  # exits 1
    assert "failed" in kernels.unavailable()
    assert not list(fresh.glob("*.so")) and not list(fresh.glob(".*tmp"))  # nothing half-made
    x = torch.randn(40, 24).to(torch.bfloat16)
    assert torch.equal(kernels.transposed(x), x.t())


def test_it_is_built_once_into_the_cache_folder(fresh):
    assert kernels.unavailable() is None
    (built,) = fresh.glob("kernels-*.so")
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


def test_an_unwritable_cache_folder_means_a_build_for_the_process_alone(
    fresh, monkeypatch, tmp_path, caplog
):
    """`docker run -u UID` (HOME=/), a read-only home: built in a private temporary folder."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("TRANSFORMER_KERNELS", str(blocker / "cache"))  # under a file
    private = tmp_path / "tmp"
    private.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(private))
    with caplog.at_level("INFO", logger="transformer.kernels"):
        assert kernels.unavailable() is None
    (folder,) = private.glob("transformer-kernels-*")
    assert kernels.library_path().parent == folder and folder.stat().st_mode & 0o077 == 0
    (record,) = caplog.records
    assert record.levelname == "INFO" and "built for this process alone" in record.getMessage()
    x = torch.randn(16, 24).to(torch.bfloat16)
    assert torch.equal(kernels.transposed(x), x.t())


def test_a_library_built_ahead_is_preferred_to_a_build_for_the_process_alone(
    fresh, monkeypatch, tmp_path
):
    kept = kernels.build_ahead()
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("TRANSFORMER_KERNELS", str(blocker / "cache"))
    _again()
    assert kernels.unavailable() is None and kernels.library_path() == kept


def test_no_folder_to_build_in_means_torchs_copy(fresh, monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("TRANSFORMER_KERNELS", str(blocker / "cache"))
    monkeypatch.setattr(tempfile, "tempdir", str(blocker / "tmp"))  # no temporary folder either
    why = kernels.unavailable()
    assert "Not a directory" in why and "built in a temporary folder: " in why
    assert "nothing built ahead" in why
    x = torch.randn(16, 24).to(torch.bfloat16)
    assert torch.equal(kernels.transposed(x), x.t())


def test_the_cache_folder_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("TRANSFORMER_KERNELS", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert kernels.cache_dir() == tmp_path / "transformer"


def _reference(x, f, keep, scale, w, b, gy):
    """torch's bf16 s = x + (f * scale) * keep, and LayerNorm(s) with its gradients in fp64."""
    t = f if keep is None else (f * scale).mul_(keep.to(torch.bfloat16))
    s = x + t
    sd = s.double().requires_grad_()
    wd, bd = w.double().requires_grad_(), b.double().requires_grad_()
    y = torch.nn.functional.layer_norm(sd, (x.size(1),), wd, bd, 1e-5)
    y.backward(gy.double())
    df = sd.grad if keep is None else sd.grad * keep.double() * scale
    return s, y.detach(), sd.grad, df, wd.grad, bd.grad


def _close(ours, ref, rel):
    assert torch.isfinite(ours).all()
    assert (ours.double() - ref).abs().max() <= rel * ref.abs().max()


@pytest.mark.parametrize("n, d", [(1, 16), (5, 40), (37, 512), (300, 520), (3001, 256)])
@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("threads", [1, 2])
def test_residual_norm_matches_layer_norm_of_x_plus_dropout(n, d, p, threads):
    """s to the bit; y and the gradients within bf16 rounding of fp64 LayerNorm of that s;
    the gain's and bias's gradients summed in fp32 (to 2^-9 of the largest after rounding)."""
    if not kernels.fused_supported():  # a CPU without AVX-512F: torch's ops instead
        with pytest.raises(RuntimeError, match="not on this machine"):
            kernels.residual_norm(*[torch.zeros(1, 16, dtype=torch.bfloat16)] * 2, None, 1.0,
                                  torch.ones(16), torch.zeros(16), 1e-5)  # fmt: skip
        return
    g = torch.Generator().manual_seed(n * d)
    x = (3 + torch.randn(n, d, generator=g)).to(torch.bfloat16)  # a mean far from 0
    f, gy = (torch.randn(n, d, generator=g).to(torch.bfloat16) for _ in range(2))
    keep = None if p == 0.0 else torch.rand(n, d, generator=g) >= p
    scale = 1.0 if keep is None else 1.0 / (1.0 - p)
    w = (1 + 0.2 * torch.randn(d, generator=g)).to(torch.bfloat16)
    b = (0.2 * torch.randn(d, generator=g)).to(torch.bfloat16)
    with threads_of(threads):
        y, s, mean, rstd = kernels.residual_norm(x, f, keep, scale, w, b, 1e-5)
        dx, df, dw, db = kernels.residual_norm_backward(gy, s, mean, rstd, w, keep, scale)
    s_ref, y_ref, dx_ref, df_ref, dw_ref, db_ref = _reference(x, f, keep, scale, w, b, gy)
    assert torch.equal(s, s_ref) and s.dtype == y.dtype == dx.dtype == df.dtype == torch.bfloat16
    _close(y, y_ref, 2**-7)
    _close(dx, dx_ref, 2**-7)
    _close(df, df_ref, 2**-7)
    _close(dw.to(torch.bfloat16), dw_ref, 2**-8)
    _close(db.to(torch.bfloat16), db_ref, 2**-8)
    torch.testing.assert_close(mean.double(), s_ref.double().mean(1), rtol=1e-5, atol=1e-5)
    # the dropped elements get no gradient; the kept ones dx's, times the scale, in bf16
    if keep is not None:
        assert torch.equal(df, (dx * keep.to(torch.bfloat16)).mul_(scale))
    else:
        assert torch.equal(df, dx)


def test_residual_norm_is_the_same_bits_run_after_run():
    if not kernels.fused_supported():
        return  # torch's ops run instead (the test above checks the refusal)
    g = torch.Generator().manual_seed(1)
    x, f, gy = (torch.randn(700, 512, generator=g).to(torch.bfloat16) for _ in range(3))
    keep = torch.rand(700, 512, generator=g) >= 0.1
    w, b = torch.ones(512, dtype=torch.bfloat16), torch.zeros(512, dtype=torch.bfloat16)
    runs = []
    for _ in range(2):
        y, s, mean, rstd = kernels.residual_norm(x, f, keep, 1 / 0.9, w, b, 1e-5)
        runs.append((y, *kernels.residual_norm_backward(gy, s, mean, rstd, w, keep, 1 / 0.9)))
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


@pytest.mark.parametrize(
    "bad",
    [
        lambda x: (x.t(), x),  # not contiguous
        lambda x: (x[:-1], x),  # shapes differ
        lambda x: (x.float(), x.float()),  # not bf16
    ],
)
def test_residual_norm_refuses_what_it_cannot_read(bad):
    if not kernels.fused_supported():
        return
    a, b = bad(torch.zeros(16, 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="residual_norm"):
        kernels.residual_norm(a, b, None, 1.0, torch.ones(16), torch.zeros(16), 1e-5)


def test_without_avx512f_there_is_no_residual_norm(monkeypatch):
    monkeypatch.setattr(kernels, "_AVX512", False)
    assert not kernels.fused_supported()
    assert kernels.unavailable() is None  # the transposing copy still runs


def test_a_library_whose_norm_errs_is_not_used(fresh, monkeypatch):
    if not kernels._AVX512:
        return  # the check runs the norm only where the CPU can
    wrong = kernels._SOURCE.replace("(float)d + eps", "(float)d + 1")  # eps = 1
    monkeypatch.setattr(kernels, "_SOURCE", wrong)
    assert "residual LayerNorm differs" in kernels.unavailable()
    assert not kernels.fused_supported()


SPECIALS = [0.0, -0.0, 1.0, -1.0, float("inf"), float("-inf"), float("nan"), -float("nan"), 1e-40]


@pytest.mark.parametrize("n", [0, 1, 15, 17, 64, 1000, 3 * 2048 + 5])
def test_relu_and_its_gradient_are_torchs(n):
    if not kernels.fused_supported():
        with pytest.raises(RuntimeError, match="not on this machine"):
            kernels.relu_(torch.zeros(4, dtype=torch.bfloat16))
        return
    g = torch.Generator().manual_seed(n)
    h = torch.cat([torch.tensor(SPECIALS), torch.randn(n, generator=g)]).to(torch.bfloat16)[:n]
    grad = torch.randn(h.shape, generator=g).to(torch.bfloat16)
    ref = torch.relu(h)
    out = kernels.relu_(h)  # in place
    assert out.data_ptr() == h.data_ptr()
    assert torch.equal(out.isnan(), ref.isnan()) and bool(
        (out[~ref.isnan()] == ref[~ref.isnan()]).all()
    )
    dh = kernels.relu_grad(grad, out)
    assert torch.equal(dh, torch.ops.aten.threshold_backward(grad, ref, 0))


def test_relu_refuses_what_it_cannot_read():
    if not kernels.fused_supported():
        return
    for bad in (torch.zeros(8, 8, dtype=torch.bfloat16).t(), torch.zeros(8)):
        with pytest.raises(ValueError, match="relu"):
            kernels.relu_(bad)
    with pytest.raises(ValueError, match="differ in shape"):
        kernels.relu_grad(
            torch.zeros(4, dtype=torch.bfloat16), torch.zeros(5, dtype=torch.bfloat16)
        )


@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 63, 1000, 65536 + 7, 3840 * 512 + 2])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_dropout_mask_is_numpys_pcg64_stream(n, threads):
    import numpy as np

    for seed, p in ((0, 0.1), (12345, 0.5), (2**63 - 1, 0.9)):
        state = np.random.PCG64(seed).state["state"]
        threshold = round(p * 65536)
        ref = np.random.PCG64(seed).random_raw((n + 3) // 4).view(np.uint16)[:n] >= threshold
        with threads_of(threads):
            keep = kernels.pcg64_keep(state["state"], state["inc"], threshold, n)
        assert keep.dtype == torch.bool and torch.equal(keep, torch.from_numpy(ref)), (n, seed)


def test_no_library_means_no_compiled_mask(fresh, monkeypatch):
    monkeypatch.setenv("CC", "no-such-compiler-here")
    assert kernels.pcg64_keep(1, 3, 100, 10) is None


def _masks(B, Tq, Tk):
    pad = torch.rand(B, 1, 1, Tk, generator=torch.Generator().manual_seed(Tk)) > 0.25
    pad[0] = False  # a sentence whose keys are all padding: zero weights
    causal = torch.ones(Tq, Tk, dtype=torch.bool).tril(Tk - Tq)
    strided = torch.ones(B, 1, Tk, Tq, dtype=torch.bool).tril().transpose(-1, -2)  # keys strided
    return {"padding": pad, "causal": causal, "both": pad & causal, "strided": strided}


@pytest.mark.parametrize("shape", [(2, 3, 5, 5), (4, 2, 34, 34), (3, 2, 7, 40), (1, 1, 3, 16)])
@pytest.mark.parametrize("c", [8.0, 5.656854, 0.0])
def test_masked_softmax_is_the_models_to_bf16_rounding(shape, c):
    from transformer.model import masked_softmax

    B, H, Tq, Tk = shape
    g = torch.Generator().manual_seed(B * Tk)
    x = (4 * torch.randn(shape, generator=g)).to(torch.bfloat16)
    gy = torch.randn(shape, generator=g).to(torch.bfloat16)
    for name, mask in _masks(B, Tq, Tk).items():
        if not kernels.fused_supported():
            with pytest.raises(RuntimeError, match="not on this machine"):
                kernels.masked_softmax(x, mask, c)
            return
        if mask.shape[-2:] != (Tq, Tk) and mask.shape[-2] != 1:
            continue
        xs = x.clone().requires_grad_()
        ref = masked_softmax(xs / c if c else xs, mask)
        ref.backward(gy)
        w = kernels.masked_softmax(x, mask, c)
        dx = kernels.masked_softmax_backward(gy, w, c)
        assert w.dtype == dx.dtype == torch.bfloat16 and w.shape == shape
        # bf16 rounding of ~1-ulp fp32 differences: at most one bf16 step, rarely
        assert (w.float() - ref.float()).abs().max() <= 2**-8 * ref.float().abs().max(), name
        assert torch.equal(w == 0, ref == 0), name  # the same masked (and empty) positions
        ref_dx = xs.grad.float()
        assert (dx.float() - ref_dx).abs().max() <= 2**-6 * ref_dx.abs().max(), name
        if name == "padding":
            assert bool((w[0] == 0).all()) and bool((dx[0] == 0).all())


@pytest.mark.parametrize("shape", [(1, 1), (3, 37), (5, 32000), (64, 1000)])
@pytest.mark.parametrize("threads", [1, 2])
def test_softmax_in_place_is_softmax_to_bf16_rounding(shape, threads):
    # The chunked loss's (n, V) softmax over its logits (loss.py), fp32 inside.
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(shape[1])) * 4).bfloat16()
    if not kernels.fused_supported():
        with pytest.raises(RuntimeError, match="not on this machine"):
            kernels.softmax_(x)
        return
    ref = torch.softmax(x.double(), -1)
    y = x.clone()
    with threads_of(threads):
        out = kernels.softmax_(y)
    assert out.data_ptr() == y.data_ptr() and out.dtype == torch.bfloat16  # written over x
    assert ((out.double() - ref).abs() <= 2**-8 * ref).all()  # one bf16 rounding
    with threads_of(3 - threads):
        assert torch.equal(kernels.softmax_(x.clone()), out)  # one thread or two: the same bits
    # torch's bf16 softmax: the same rounding, but for a few values one bf16 step apart
    torch_out = torch.softmax(x, -1)
    assert ((out.double() - torch_out.double()).abs() <= 2**-7 * ref).all()


def test_softmax_in_place_keeps_a_nan_row_nan_and_refuses_what_it_cannot_read():
    if not kernels.fused_supported():
        return
    x = torch.randn(3, 40).bfloat16()
    x[1, 7] = float("nan")
    out = kernels.softmax_(x.clone())
    assert out[1].isnan().all() and not out[[0, 2]].isnan().any()  # as torch's
    for bad in (x.float(), x.t(), x[None]):
        with pytest.raises(ValueError, match="softmax_"):
            kernels.softmax_(bad)


def test_masked_softmax_refuses_what_it_cannot_read():
    if not kernels.fused_supported():
        return
    x = torch.zeros(2, 2, 3, 3, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.masked_softmax(x.transpose(-1, -2), torch.ones(3, 3, dtype=torch.bool), 1.0)
    with pytest.raises(ValueError, match="bool mask"):
        kernels.masked_softmax(x, torch.ones(3, 3), 1.0)
    with pytest.raises(ValueError, match="one shape"):
        kernels.masked_softmax_backward(x, x[:1], 1.0)


@pytest.mark.parametrize(
    "B, Tq, Tk, H, d, dv, causal",
    [
        (3, 7, 7, 2, 16, 16, True),  # tiny, causal
        (4, 34, 34, 8, 64, 64, True),  # the W1 shape's decoder self-attention
        (4, 34, 41, 8, 64, 64, False),  # encoder-decoder, keys off 16
        (2, 9, 130, 3, 32, 48, False),  # keys in three column tiles; d != dv
        (2, 70, 70, 1, 128, 80, True),  # 18 row tiles; widths past one tile of 64
    ],
)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("products", PRODUCTS)
def test_training_attention_is_eq_1_to_bf16_rounding(
    B, Tq, Tk, H, d, dv, causal, threads, products
):
    """`attention_train` and its backward against eq. (1) in fp64 on the padded layout
    (`model.packed_attention_reference`), by autograd: causal and key-masked batches, padding
    left out, spare rows (zeros both ways) and a batch row with no legal key (zeros)."""
    from transformer.model import packed_attention_reference

    g = torch.Generator().manual_seed(Tq * Tk + d)
    q, kv, grad, qrow, krow, kmask, nq, nk = packed_attention_case(B, Tq, Tk, H, d, dv, causal, g)
    inv_c = d**-0.5
    if not kernels.fused_supported():
        with pytest.raises(RuntimeError, match="not on this machine"):
            kernels.attention_train(q, kv, qrow, krow, kmask, causal, H, inv_c, nq)
        return
    with threads_of(threads), attention_in(products):
        out, p = kernels.attention_train(q, kv, qrow, krow, kmask, causal, H, inv_c, nq)
        dq, dkv = kernels.attention_train_backward(
            grad, q, kv, p, qrow, krow, kmask, causal, H, inv_c, nq, nk
        )
    qd, kvd = q.double().requires_grad_(), kv.double().requires_grad_()
    ref = packed_attention_reference(qd, kvd, qrow, krow, kmask, causal, H, inv_c)
    (ref * grad.double()).sum().backward()
    assert out.shape == (nq + 2, H * dv) and p.shape == (B, H, Tq, Tk)
    assert dq.shape == q.shape and dkv.shape == kv.shape
    for ours, theirs in ((out, ref.detach()), (dq, qd.grad), (dkv, kvd.grad)):
        # one bf16 rounding of each operand's fp32 sums, and of the weights: ~2^-8 relative
        assert (ours.double() - theirs).abs().max() <= 2**-6 * theirs.abs().max()
    assert not out[nq:].any() and not dq[nq:].any() and not dkv[nk:].any()  # spares
    # the weights kept: each packed query's sum to 1 over its legal keys, in order
    sums = p.double().sum(-1)
    packed = (qrow >= 0)[:, None, :].expand_as(sums)
    if kmask is not None:
        packed = packed & kmask.any(-1)[:, None, None]  # the row with no legal key: zeros
        assert not p[-1].any() and not out[qrow[-1][qrow[-1] >= 0]].any()
    assert (sums[packed] - 1).abs().max() < 2**-6 and not sums[~packed].any()


@pytest.mark.parametrize("products", PRODUCTS)
def test_training_attention_is_the_same_bits_on_one_thread_or_two(products):
    if not kernels.fused_supported():
        return
    g = torch.Generator().manual_seed(1)
    q, kv, grad, qrow, krow, kmask, nq, nk = packed_attention_case(6, 20, 25, 4, 32, 32, False, g)
    runs = []
    for threads in (1, 2):
        with threads_of(threads), attention_in(products):
            out, p = kernels.attention_train(q, kv, qrow, krow, kmask, False, 4, 0.17, nq)
            runs.append((out, p, *kernels.attention_train_backward(
                grad, q, kv, p, qrow, krow, kmask, False, 4, 0.17, nq, nk
            )))  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("products", ["tiles", "dots"])
def test_training_attention_in_bf16_is_the_lanes_to_bf16_rounding(causal, products):
    """The tiles' or the dot products' (bf16 operands, dS in two bf16 parts) against the fp32
    lanes' on the W1 shape's heads, with padding, a key mask and a row of 16 + 1 queries (a
    lone tile, a block of 4 and a row): the same weights to one bf16 step, every output within
    a few bf16 roundings."""
    if not kernels.fused_supported():
        return
    g = torch.Generator().manual_seed(7)
    q, kv, grad, qrow, krow, kmask, nq, nk = packed_attention_case(5, 17, 33, 8, 64, 64, causal, g)
    runs = {}
    for which in ("lanes", products):
        with attention_in(which):
            out, p = kernels.attention_train(q, kv, qrow, krow, kmask, causal, 8, 0.125, nq)
            runs[which] = (out, p, *kernels.attention_train_backward(
                grad, q, kv, p, qrow, krow, kmask, causal, 8, 0.125, nq, nk
            ))  # fmt: skip
            runs[which] += (kernels.attention_products(),)
    ours, lanes = runs[products][:-1], runs["lanes"][:-1]
    if runs[products][-1] == "lanes":  # no bf16 products here: the lanes both times, same bits
        assert all(torch.equal(a, b) for a, b in zip(ours, lanes, strict=True))
        return
    for a, b in zip(ours, lanes, strict=True):
        scale = b.double().abs().max()
        assert (a.double() - b.double()).abs().max() <= 2**-7 * scale
    assert (ours[1].double() - lanes[1].double()).abs().max() <= 2**-8


def test_training_attention_refuses_what_it_cannot_read():
    if not kernels.fused_supported():
        return
    g = torch.Generator().manual_seed(2)
    q, kv, grad, qrow, krow, kmask, nq, nk = packed_attention_case(2, 5, 6, 2, 16, 16, False, g)

    def fwd(q=q, kv=kv, qrow=qrow, krow=krow, kmask=kmask, heads=2):
        return kernels.attention_train(q, kv, qrow, krow, kmask, False, heads, 0.25, nq)

    for bad, match in (
        (dict(q=q.float()), "bf16 q"),
        (dict(kv=kv[:, :-16].contiguous()), "not multiples of 16"),  # values 8 wide
        (dict(heads=3), "3 heads do not divide"),
        (dict(q=q.t().contiguous().t()), "contiguous rows"),
        (dict(qrow=qrow.int()), "int64 row maps"),
        (dict(krow=krow[:1]), "one batch"),
        (dict(kmask=kmask.float()), "bool key mask"),
        (dict(qrow=qrow + 100), "query row map outside"),
        (dict(krow=krow.clamp(min=-2) - 1), "key row map outside"),
    ):
        with pytest.raises(ValueError, match=match):
            fwd(**bad)
    out, p = fwd()
    with pytest.raises(ValueError, match="bf16 gradient and weights"):
        kernels.attention_train_backward(
            grad, q, kv, p.float(), qrow, krow, kmask, False, 2, 0.25, nq, nk
        )  # fmt: skip
    with pytest.raises(ValueError, match="shape does not match"):
        kernels.attention_train_backward(
            grad[:1], q, kv, p, qrow, krow, kmask, False, 2, 0.25, nq, nk
        )  # fmt: skip
    for out in ((q.float(), kv), (q, kv[:-1]), (q.t().contiguous().t(), kv)):
        with pytest.raises(ValueError, match="out is not bf16 dq and dkv"):
            kernels.attention_train_backward(
                grad, q, kv, p, qrow, krow, kmask, False, 2, 0.25, nq, nk, out=out
            )  # fmt: skip


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("products", PRODUCTS)
def test_training_attention_reads_and_writes_a_stacked_projection(threads, products):
    # Self-attention's q and kv as the two column blocks of one (N, H*D + H*(D+Dv)) tensor
    # (gradhelper.stacked_linear), its gradient written into one such tensor: the same bits
    # as from and into contiguous q and kv, every element of the stacked gradient written.
    if not kernels.fused_supported():
        return
    g = torch.Generator().manual_seed(5)
    q, kv, grad, qrow, krow, _, nq, nk = packed_attention_case(3, 9, 9, 2, 16, 32, True, g)
    qkv = torch.cat([q, kv], 1)
    qs, kvs = qkv.split([q.size(1), kv.size(1)], 1)
    assert not qs.is_contiguous() and not kvs.is_contiguous()
    with threads_of(threads), attention_in(products):
        out, p = kernels.attention_train(q, kv, qrow, krow, None, True, 2, 0.25, nq)
        out_s, p_s = kernels.attention_train(qs, kvs, qrow, krow, None, True, 2, 0.25, nq)
        dq, dkv = kernels.attention_train_backward(
            grad, q, kv, p, qrow, krow, None, True, 2, 0.25, nq, nk
        )  # fmt: skip
        dqkv = torch.full_like(qkv, float("nan"))
        parts = dqkv.split([q.size(1), kv.size(1)], 1)
        got = kernels.attention_train_backward(
            grad, qs, kvs, p_s, qrow, krow, None, True, 2, 0.25, nq, nk, out=parts
        )  # fmt: skip
    assert got[0].data_ptr() == dqkv.data_ptr()
    assert torch.equal(out_s, out) and torch.equal(p_s, p)
    assert torch.equal(dqkv, torch.cat([dq, dkv], 1))


def _switched_off(variable: str, switch: str, prefix: str) -> tuple[str, str]:
    """A fresh process's kernels with `variable`=0: what `kernels.<switch>()` says, and
    `describe()`'s line that starts with `prefix`."""
    code = (
        "from transformer import kernels; kernels.unavailable(); "
        f"print(kernels.{switch}(), *[d for d in kernels.describe() if d.startswith({prefix!r})])"
    )
    env = {**os.environ, variable: "0"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    on, said = done.stdout.strip().split(" ", 1)
    return on, said


def _described(prefix: str) -> str:
    """This process's `kernels.describe()` line that starts with `prefix`."""
    (line,) = [d for d in kernels.describe() if d.startswith(prefix)]
    return line


@pytest.mark.parametrize("variable", ["TRANSFORMER_ATTENTION_BF16", "TRANSFORMER_ATTENTION_AMX"])
def test_attention_in_bf16_is_off_with_the_variable_and_where_the_cpu_has_no_bf16(variable):
    # The older variable's name (the tiles' switch before the dot products) is heeded too.
    on, line = _switched_off(variable, "attention_bf16", "bf16 training's attention products: ")
    assert on == "False" and line.endswith(f"AVX-512 fp32 ({variable}=0)") == (
        kernels.fused_supported() and "avx512_bf16" in cpu_flags()
    )  # fmt: skip
    if kernels.unavailable() is None:
        bf16 = "avx512_bf16" in cpu_flags()  # every AMX CPU has it
        amx = {"amx_tile", "amx_bf16"} <= cpu_flags()
        expected = products_here("tiles" if amx else "dots")  # the variables unset here
        assert kernels.attention_bf16() == (expected != "lanes") <= bf16
        assert kernels.attention_products() == expected
        assert _described("bf16 training's attention products: ").endswith(
            {"tiles": "AMX tiles", "dots": "AVX-512 BF16 dot products", "lanes": "AVX-512 fp32"}[
                expected
            ]
        )
    with pytest.raises(ValueError, match="'amx' is not one of lanes, tiles, dots"):
        kernels.attention_products("amx")
    assert kernels.attention_amx is kernels.attention_bf16  # the older scripts' name


def _bf16_views(a: tuple[int, int], b: tuple[int, int], seed: int, pad: int, b_scale=1.0):
    """Normal bf16 matrices of shapes a and b (b's values times b_scale), each a view of wider
    rows where pad > 0 (a's last columns, b's first)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(a[0], a[1] + pad, generator=gen).to(torch.bfloat16)[:, pad:]
    y = (torch.randn(b[0], b[1] + pad, generator=gen) * b_scale).to(torch.bfloat16)[:, : b[1]]
    return x, y


def _weight_grad_case(rows: int, m: int, n: int, seed: int = 0, pad: int = 0):
    """g (rows, m) and x (rows, n) bf16, each a view of wider rows where pad > 0."""
    return _bf16_views((rows, m), (rows, n), seed, pad)


# rows: under one 256-row block, a block and a bit (the halves unequal), a W1 step's; widths:
# one 2 x 2 block of tiles, a lone tile's columns (48 = 32 + 16), the base model's
@pytest.mark.parametrize(
    "rows,m,n,pad",
    [(1, 32, 16, 0), (31, 32, 48, 0), (257, 64, 48, 16), (600, 96, 32, 0), (3888, 512, 512, 0),
     (1000, 512, 512, 64), (513, 64, 1024, 0)],
)  # fmt: skip
def test_weight_grad_is_g_transposed_x_in_fp32_on_the_tiles(rows, m, n, pad):
    g, x = _weight_grad_case(rows, m, n, pad=pad)
    got = kernels.weight_grad(g, x)
    if not kernels.weight_grad_amx():
        assert got is None  # no tiles here: the caller multiplies with torch
        return
    ref = g.double().t() @ x.double()
    assert got.shape == (m, n) and got.dtype == torch.bfloat16 and got.is_contiguous()
    # fp32 sums rounded once: within half a bf16 ulp of the exact sum and the fp32 sums' error
    bound = 2**-8 * ref.abs() + rows * 2**-23 * (g.double().abs().t() @ x.double().abs())
    assert bool(((got.double() - ref).abs() <= bound).all())


# (40, 32, 16): one block of dW's rows, so four threads leave a team without rows
@pytest.mark.parametrize(
    "rows,m,n", [(40, 32, 16), (100, 64, 48), (3888, 512, 512), (700, 96, 1024)]
)
def test_weight_grad_has_the_same_bits_on_any_number_of_threads(rows, m, n):
    g, x = _weight_grad_case(rows, m, n, seed=1)
    outs = []
    for threads in (1, 2, 3, 4, 5):
        with threads_of(threads):
            outs.append(kernels.weight_grad(g, x))
    if not kernels.weight_grad_amx():
        assert outs == [None] * 5
        return
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    ref = g.double().t() @ x.double()
    assert float((outs[0].double() - ref).abs().max()) <= 2**-7 * float(ref.abs().max())


def _switch_turns_it_off(switch, call) -> None:
    """A tile kernel's switch: off, `call` leaves the product to torch (None); on, it takes
    where the tiles can be had; then as it was."""
    old = switch()
    try:
        assert switch(False) is False
        assert call() is None
        assert switch(True) is kernels.amx_tiles()
    finally:
        switch(old)


def test_weight_grad_leaves_to_torch_what_it_does_not_take(monkeypatch):
    g, x = _weight_grad_case(64, 64, 48)
    assert (kernels.weight_grad(g, x) is None) is not kernels.weight_grad_amx()
    assert kernels.weight_grad(g[:, :48], x) is None  # M not a multiple of 32
    assert kernels.weight_grad(g, x[:, :40]) is None  # N not a multiple of 16
    assert kernels.weight_grad(g.float(), x.float()) is None
    assert kernels.weight_grad(g, x[:32]) is None  # not the same rows
    assert kernels.weight_grad(g[:0], x[:0]) is None
    assert kernels.weight_grad(g.t().contiguous().t(), x) is None  # rows not contiguous
    monkeypatch.setattr(kernels, "FUSED", False)
    assert kernels.weight_grad(g, x) is None
    monkeypatch.setattr(kernels, "FUSED", True)
    _switch_turns_it_off(kernels.weight_grad_amx, lambda: kernels.weight_grad(g, x))
    assert kernels.amx_tiles() <= ({"amx_tile", "amx_bf16"} <= cpu_flags())


def _project_case(rows: int, v: int, d: int, seed: int = 0, pad: int = 0):
    """h (rows, d) and w (v, d) bf16 (w ~ N(0, 0.05^2)), each a view of wider rows where pad > 0."""
    return _bf16_views((rows, d), (v, d), seed, pad, b_scale=0.05)


# rows: one, a tile's and a bit, past the 256 rows of a pass (2-5 passes); vocabularies: a
# lone tile of rows, a 32-row block cut (49, 130: the last rows padded), past a 512-row chunk;
# pad 1: h's rows at odd offsets (copied: the kernel reads them as 32-bit words)
@pytest.mark.parametrize(
    "rows,v,d,pad",
    [(1, 16, 32, 0), (3, 49, 64, 0), (17, 130, 512, 0), (40, 1000, 512, 16), (600, 70, 64, 0),
     (1030, 545, 96, 32), (5, 70, 64, 1)],
)  # fmt: skip
def test_project_is_h_times_w_transposed_in_fp32_on_the_tiles(rows, v, d, pad):
    h, w = _project_case(rows, v, d, pad=pad)
    got = kernels.project(h, w)
    if not kernels.project_amx():
        assert got is None  # no tiles here: the caller multiplies with torch
        return
    ref = h.double() @ w.double().t()
    assert got.shape == (rows, v) and got.dtype == torch.float32 and got.is_contiguous()
    # fp32 sums of exact products: within the fp32 sums' error, far inside bf16's rounding
    bound = d * 2**-23 * (h.double().abs() @ w.double().abs().t()) + 1e-30
    assert bool(((got.double() - ref).abs() <= bound).all())
    bf16 = torch.nn.functional.linear(h, w).double()
    assert float((got.double() - ref).abs().max()) < float((bf16 - ref).abs().max()) / 16


@pytest.mark.parametrize("rows,v,d", [(37, 130, 64), (520, 1000, 512)])
def test_project_gives_a_row_the_same_bits_in_any_batch_and_on_any_number_of_threads(rows, v, d):
    h, w = _project_case(rows, v, d, seed=1)
    outs = []
    for threads in (1, 2, 3, 5):
        with threads_of(threads):
            outs.append(kernels.project(h, w))
    if not kernels.project_amx():
        assert outs == [None] * 4
        return
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    for i in (0, 17, rows - 1):  # alone, and at another place of another batch
        assert torch.equal(kernels.project(h[i : i + 1], w), outs[0][i : i + 1])
        assert torch.equal(kernels.project(h[i:].flip(0), w)[-1], outs[0][i])
    batched = kernels.project(h[:36].view(4, 9, d), w)  # (..., D) rows: (4, 9, V)
    assert batched.shape == (4, 9, v) and torch.equal(batched.view(36, v), outs[0][:36])


def test_project_leaves_to_torch_what_it_does_not_take(monkeypatch):
    h, w = _project_case(8, 64, 64)
    assert (kernels.project(h, w) is None) is not kernels.project_amx()
    assert kernels.project(h[:, :48], w[:, :48]) is None  # D not a multiple of 32
    assert kernels.project(h, w[:, :32]) is None  # not the same D
    assert kernels.project(h.float(), w.float()) is None
    assert kernels.project(h, w.t().contiguous().t()) is None  # w's rows not contiguous
    assert kernels.project(h[:0], w) is None
    assert kernels.project(h, w[:0]) is None
    assert kernels.project(h.requires_grad_(), w) is None  # no gradient through it
    h = h.detach()
    monkeypatch.setattr(kernels, "FUSED", False)
    assert kernels.project(h, w) is None
    monkeypatch.setattr(kernels, "FUSED", True)
    _switch_turns_it_off(kernels.project_amx, lambda: kernels.project(h, w))
    if kernels.project_amx():  # h's rows need not be contiguous: they are copied
        got = kernels.project(h.t().contiguous().t(), w)
        assert torch.equal(got, kernels.project(h, w))


@pytest.mark.parametrize(
    "variable,switch,prefix,on,off",
    [("TRANSFORMER_WEIGHT_GRAD_AMX", "weight_grad_amx", "bf16 training's square weight gradients: ",
      "AMX tiles", "torch's product"),
     ("TRANSFORMER_PROJECT_AMX", "project_amx", "bf16 decoding's output logits: ",
      "AMX tiles, fp32 logits", "bf16 logits")],
)  # fmt: skip
def test_a_tile_kernel_is_off_with_its_variable(variable, switch, prefix, on, off):
    said_on, line = _switched_off(variable, switch, prefix)
    assert said_on == "False"
    if kernels.unavailable() is None and kernels.fused_supported():
        amx = {"amx_tile", "amx_bf16"} <= cpu_flags()
        assert (f"{variable}=0" in line) == amx
        assert _described(prefix).endswith(on if kernels.amx_tiles() else off)


@pytest.mark.parametrize("shape", [(1, 16), (3, 40), (7, 2048), (3888, 2048), (4001, 520)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_relu_grad_sums_are_relu_grad_and_its_column_sums(shape, threads):
    gen = torch.Generator().manual_seed(shape[0])
    g = torch.randn(shape, generator=gen).to(torch.bfloat16)
    h = torch.randn(shape, generator=gen).to(torch.bfloat16).relu()
    h[0, :3] = torch.tensor([-0.0, float("nan"), 0.0])[: shape[1]].to(torch.bfloat16)
    if not kernels.fused_supported():
        with pytest.raises(RuntimeError, match="not on this machine"):
            kernels.relu_grad_sums(g, h)
        return
    with threads_of(threads):
        dh, sums = kernels.relu_grad_sums(g, h)
        alone = kernels.relu_grad(g, h)
        assert torch.equal(dh, alone) and torch.equal(sums, kernels.column_sums(alone))
    with pytest.raises(ValueError, match="same"):
        kernels.relu_grad_sums(g[:, :8].contiguous(), h)
    with pytest.raises(ValueError, match="same"):
        kernels.relu_grad_sums(g.reshape(-1), h.reshape(-1))


def test_fused_off_keeps_torchs_ops(monkeypatch):
    monkeypatch.setattr(kernels, "FUSED", False)
    assert not kernels.fused_supported()
    assert kernels.unavailable() is None  # the transposing copy and the mask are unaffected


@pytest.mark.parametrize("shape", [(1, 16), (3, 5), (7, 37), (3888, 2048), (4001, 520)])
@pytest.mark.parametrize("threads", [1, 2])
def test_column_sums_are_fp32_sums(shape, threads):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(shape[1])).to(torch.bfloat16)
    if not kernels.fused_supported():
        with pytest.raises(RuntimeError, match="not on this machine"):
            kernels.column_sums(x)
        return
    with threads_of(threads):
        out = kernels.column_sums(x)
    ref = x.double().sum(0)
    assert out.dtype == torch.bfloat16 and out.shape == (shape[1],)
    assert (out.double() - ref).abs().max() <= 2**-8 * ref.abs().max() + 1e-6
    with threads_of(threads):
        out32 = kernels.column_sums(x, fp32=True)  # the same sums, not rounded to bf16
    assert out32.dtype == torch.float32 and torch.equal(out32.to(torch.bfloat16), out)
    bound = shape[0] * 2**-24 * x.double().abs().sum(0).max()  # n fp32 adds' worst case
    assert (out32.double() - ref).abs().max() <= bound
    with pytest.raises(ValueError, match="column_sums"):
        kernels.column_sums(x[:, ::2])  # rows not contiguous


def _int8_rows(rows: int, k: int, nonnegative: bool) -> torch.Tensor:
    """Rows of every kind an `Int8Linear` can be given: ordinary, scaled 10^±3, zeros,
    infinities, a NaN (rows 0-5 where there are so many), widths off the vector width."""
    g = torch.Generator().manual_seed(rows * 1000 + k)
    x = torch.randn(rows, k, generator=g) * torch.logspace(-3, 3, rows)[:, None]
    special = [(0, slice(None), 0.0), (1, slice(0, 2), float("inf")), (2, -1, -float("inf")),
               (3, k // 2, float("nan")), (4, slice(None), -0.0)]  # fmt: skip
    for row, cols, value in special[: rows // 2]:
        x[row, cols] = value
    return x.relu() if nonnegative else x


# The row kernels' instruction sets this CPU runs (AVX-512 F and AVX2 on the suite's x86-64
# machines with AVX-512, AVX2 alone on a Zen 3); each is tested where it can run.
ROWS_ISAS = [
    isa
    for isa, flags in (("avx512", {"avx512f", "avx512bw", "avx512vl"}), ("avx2", {"avx2"}))
    if flags <= cpu_flags()
]


@pytest.mark.parametrize("shape", [(1, 1), (3, 16), (5, 37), (12, 512), (64, 2048), (300, 260)])
@pytest.mark.parametrize("nonnegative", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("isa", ROWS_ISAS)
def test_int8_rows_are_the_bits_of_int8_linears_torch_ops(
    monkeypatch, shape, nonnegative, threads, isa
):
    """`translate.Int8Linear`'s rows: the same bits as its torch ops, in and out (a NaN row:
    NaN both ways), with and without a bias, on one thread and on the team (the last shapes
    are above MIN_THREADED), in each instruction set the CPU has."""
    from transformer.translate import TINY, _rows_in, _rows_out_

    monkeypatch.setattr(kernels, "_ROWS_ISA", isa)
    x = _int8_rows(*shape, nonnegative)
    with threads_of(threads):
        xs, top = kernels.int8_rows_in(x, nonnegative, TINY)
    ref_xs, ref_top = _rows_in(x, nonnegative)
    assert xs.shape == x.shape and top.shape == (shape[0], 1)
    for got, want in ((xs, ref_xs), (top, ref_top)):
        nan = want.isnan()
        assert torch.equal(got.isnan(), nan)
        assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))
    y = torch.randn(shape[0], 3 * shape[1] + 1, generator=torch.Generator().manual_seed(1))
    for bias in (torch.randn(y.size(1)), None):
        with threads_of(threads):
            got = kernels.int8_rows_out_(y.clone(), top, bias)
        want = _rows_out_(y.clone(), top, bias)
        nan = want.isnan()
        assert torch.equal(got.isnan(), nan)
        assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))


@pytest.mark.parametrize("shape", [(1, 1), (3, 16), (5, 37), (12, 512), (64, 2048), (300, 260)])
@pytest.mark.parametrize("nonnegative", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("isa", ROWS_ISAS)
def test_int8_rows_u8_are_the_bytes_of_int8_linears_torch_ops(
    monkeypatch, shape, nonnegative, threads, isa
):
    """oneDNN's 8-bit inputs (`translate.Int8Linear`): the same bytes and row maxima as its
    torch ops (`_rows_u8`: rounding to nearest even, saturation, a NaN's zero point), for the
    rows of every kind above, in each instruction set, on one thread and on the team."""
    from transformer.translate import TINY, _rows_u8

    monkeypatch.setattr(kernels, "_ROWS_ISA", isa)
    x = _int8_rows(*shape, nonnegative)
    levels, zero = (255.0, 0) if nonnegative else (127.0, 128)
    with threads_of(threads):
        q, top = kernels.int8_rows_u8(x, nonnegative, TINY, levels, zero)
    want_q, want_top = _rows_u8(x, nonnegative)
    assert q.dtype == torch.uint8 and q.shape == x.shape and top.shape == (shape[0], 1)
    assert torch.equal(q, want_q)
    nan = want_top.isnan()
    assert torch.equal(top.isnan(), nan) and torch.equal(top[~nan], want_top[~nan])
    halves = torch.tensor([[1.0, 0.5 / 127, 1.5 / 127, -0.5 / 127, 2.5 / 127]])  # ties: even
    assert kernels.int8_rows_u8(halves, False, TINY, 127.0, 128)[0].tolist() == [
        _rows_u8(halves, False)[0].flatten().tolist()
    ]
    with pytest.raises(ValueError, match="int8_rows_u8"):
        kernels.int8_rows_u8(x.double(), nonnegative, TINY, levels, zero)


@pytest.mark.parametrize("isa", ROWS_ISAS)
def test_int8_rows_out_multiplies_then_adds_never_one_fma(monkeypatch, isa):
    """y * top + bias rounded twice: values where one fused multiply-add would differ."""
    monkeypatch.setattr(kernels, "_ROWS_ISA", isa)
    y = torch.full((1, 32), 1.0 + 2**-22)
    top = torch.full((1, 1), 1.0 + 2**-22)
    bias = torch.full((32,), -1.0)
    got = kernels.int8_rows_out_(y.clone(), top, bias)
    fused = (y.double() * top.double() + bias.double()).float()  # one rounding: 2^-21 + 2^-44
    assert torch.equal(got, (y * top) + bias) and not torch.equal(got, fused)


def test_int8_rows_keep_shape_and_refuse_what_they_cannot_read():
    from transformer.translate import TINY

    x = torch.randn(2, 3, 20)
    xs, top = kernels.int8_rows_in(x, False, TINY)
    assert xs.shape == (2, 3, 20) and top.shape == (2, 3, 1)
    empty, top0 = kernels.int8_rows_in(torch.empty(0, 20), False, TINY)
    assert empty.shape == (0, 20) and top0.shape == (0, 1)
    for bad in (x.to(torch.bfloat16), x[..., ::2], torch.tensor(1.0)):
        with pytest.raises(ValueError, match="int8_rows_in"):
            kernels.int8_rows_in(bad, False, TINY)
    for off in ({"FUSED": False}, {"_ROWS_ISA": None}):  # torch's ops, and a clear refusal
        with pytest.MonkeyPatch.context() as m:
            for name, value in off.items():
                m.setattr(kernels, name, value)
            assert not kernels.rows_supported()
            with pytest.raises(RuntimeError, match="int8_rows_in: not on this machine"):
                kernels.int8_rows_in(x, False, TINY)
    y = torch.randn(2, 3, 7)
    for args in ((y, top, torch.randn(6)), (y, top[:1], None), (y.double(), top, None)):
        with pytest.raises(ValueError, match="int8_rows_out_"):
            kernels.int8_rows_out_(*args)


@pytest.mark.parametrize("k", [1, 2, 15, 16, 17, 512])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 23, 24, 25, 49, 300])
@pytest.mark.parametrize("zero", [0, 128])
def test_int8_product_is_the_exact_product_bit_for_bit(k, n, zero):
    """The int32 sums of (q - zero) x w exact (inputs at 255 and weights at 127 in the first
    row and column: pairs of products past int16, where AVX2's vpmaddubsw saturates), scaled
    per column, per row and the bias added in `_rows_out_`'s roundings: every tile of 1-4 rows
    x 1-3 blocks of 8 columns, columns and k past whole blocks and pairs, a NaN row, with and
    without a bias."""
    g = torch.Generator().manual_seed(k * 1000 + n * 10 + zero)
    ints = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    ints[0] = 127
    packed = kernels.int8_pack(ints)
    assert packed.shape == ((n + 7) // 8, (k + 1) // 2, 16) and packed.dtype == torch.int8
    assert torch.equal(kernels.int8_unpack(packed, n, k), ints)
    assert packed.untyped_storage().data_ptr() != ints.untyped_storage().data_ptr()  # a copy
    scales, bias = torch.rand(n, generator=g) * 1e-3 + 1e-6, torch.randn(n, generator=g)
    for m in (1, 2, 3, 4, 5, 9, 64):
        q = torch.randint(0, 256, (m, k), generator=g, dtype=torch.uint8)
        q[0] = 255
        top = torch.rand(m, 1, generator=g) * 4
        top[m // 2] = float("nan")
        for b in (bias, None):
            got = kernels.int8_product(q, zero, 1 / 127, packed, n, scales, top, b)
            assert got.shape == (m, n) and got.dtype == torch.float32
            want = int8_product_exact(q, zero, 1 / 127, ints, scales, top, b)
            assert _same_bits(got, want), (m, b)


@pytest.mark.parametrize(("m", "k"), [(256, 512), (61, 512), (515, 512), (130, 2048)])
def test_int8_product_is_the_same_on_one_thread_and_two_and_alone_in_a_batch(m, k):
    """A decoding step's shapes (256 rows: beam 4, 512 -> 2,040; above MIN_THREADED; the
    rows in chunks of 512, or 128 at k = 2,048, a last chunk of 3 or 2 rows read from the int8
    bytes), on one thread and on two: the same bits, each row's the same alone; the largest
    sums exact."""
    g = torch.Generator().manual_seed(m)
    ints = torch.randint(-127, 128, (2040, k), generator=g, dtype=torch.int8)
    q = torch.randint(0, 256, (m, k), generator=g, dtype=torch.uint8)
    ints[5], q[7] = -127, 255  # -127 x 255 x k at zero 0: exact, an int16 pair sum would not be
    scales, top = torch.full((2040,), 1.0), torch.ones(m, 1)
    bias = torch.randn(2040, generator=g)
    packed = kernels.int8_pack(ints)
    with threads_of(1):
        one = kernels.int8_product(q, 0, 1.0, packed, 2040, scales, top, bias)
    with threads_of(2):
        two = kernels.int8_product(q, 0, 1.0, packed, 2040, scales, top, bias)
        row = kernels.int8_product(q[7:8].clone(), 0, 1.0, packed, 2040, scales, top[7:8], bias)
        last = kernels.int8_product(q[-3:].clone(), 0, 1.0, packed, 2040, scales, top[-3:], bias)
    assert _same_bits(one, two) and _same_bits(row, one[7:8]) and _same_bits(last, one[-3:])
    assert one[7, 5] == float(-127 * 255 * k) + bias[5]
    assert _same_bits(one, int8_product_exact(q, 0, 1.0, ints, scales, top, bias))


def test_int8_product_refuses_what_it_cannot_read_in_one_line():
    ints = torch.randint(-127, 128, (10, 6), dtype=torch.int8)
    packed = kernels.int8_pack(ints)
    q, scales, top = torch.zeros(3, 6, dtype=torch.uint8), torch.ones(10), torch.ones(3, 1)
    assert kernels.int8_product(q[:0], 128, 0.1, packed, 10, scales, top[:0], None).shape == (
        0,
        10,
    )
    assert kernels.int8_pack(ints[:0]).shape == (0, 3, 16)
    assert kernels.int8_unpack(kernels.int8_pack(ints[:0]), 0, 6).shape == (0, 6)
    bad = [
        (q.float(), 128, 0.1, packed, 10, scales, top, None),  # not uint8
        (q, 256, 0.1, packed, 10, scales, top, None),  # a zero point past a byte
        (q[:, :4], 128, 0.1, packed, 10, scales, top, None),  # packed for another k
        (q, 128, 0.1, packed, 11, scales, top, None),  # ... and another n
        (q, 128, 0.1, packed, 10, scales[:9], top, None),
        (q, 128, 0.1, packed, 10, scales, top[:2], None),
        (q, 128, 0.1, packed, 10, scales, top, torch.ones(9)),
        (q, 128, 0.1, packed, 10, scales.double(), top, None),
        (q.t(), 128, 0.1, packed, 10, scales, top, None),  # not contiguous
        (q, 128, 0.1, packed.short(), 10, scales, top, None),  # not int8_pack's
    ]
    for args in bad:
        with pytest.raises(ValueError, match="int8_product"):
            kernels.int8_product(*args)
    for ints_bad in (ints.short(), ints.t(), ints[0], torch.zeros(1, 70000, dtype=torch.int8)):
        with pytest.raises(ValueError, match="int8_pack"):
            kernels.int8_pack(ints_bad)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels, "FUSED", False)
        assert not kernels.int8_product_supported()
        with pytest.raises(RuntimeError, match="int8_product: not on this machine"):
            kernels.int8_product(q, 128, 0.1, packed, 10, scales, top, None)


def test_the_library_is_first_loaded_in_inference_mode(fresh):
    """A translation may be the first to load the library (`Int8Linear`'s rows), inside
    torch.inference_mode: its check, which runs a backward, still passes."""
    with torch.inference_mode():
        assert kernels.unavailable() is None


def test_threads_asking_at_once_all_get_the_library(fresh, monkeypatch):
    """Decoding streams make their first steps at once (translate.py): the threads that ask
    while one builds and checks the library wait for it, none is told there is none."""
    import threading

    copy = kernels._compile  # `fresh`'s copy of a build, a second late: a build's window
    monkeypatch.setattr(kernels, "_compile", lambda *a: (time.sleep(1.0), copy(*a))[1])

    start, seen = threading.Barrier(4), []

    def ask() -> None:
        start.wait()
        seen.append(kernels._library() is not None)

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == [True] * 4


@pytest.mark.parametrize("isa", ROWS_ISAS)
def test_int8_rows_call_the_form_of_the_cpus_instruction_set(monkeypatch, isa):
    """Both row kernels call the form `_ROWS_ISA` names: an AVX-512 form called on a CPU with
    AVX2 alone (a Zen 3) would stop the process with an illegal instruction."""
    from transformer.translate import TINY

    assert kernels.rows_supported()
    monkeypatch.setattr(kernels, "_ROWS_ISA", isa)
    called = _spy_library(monkeypatch)
    x = torch.randn(3, 20)
    xs, top = kernels.int8_rows_in(x, False, TINY)
    kernels.int8_rows_out_(torch.randn(3, 5), top, None)
    suffix = "" if isa == "avx512" else "_avx2"
    assert [name for name, _ in called] == ["int8_rows_in" + suffix, "int8_rows_out" + suffix]


def _spy_library(monkeypatch) -> list:
    """Every call into the GIL-free library handle from here on, as (symbol, arguments)."""
    called, real = [], kernels._NOGIL

    class Spy:
        def __getattr__(self, name):
            def call(*args):
                called.append((name, args))
                return getattr(real, name)(*args)

            return call

    monkeypatch.setattr(kernels, "_NOGIL", Spy())
    return called


# ---- a decoding step's attention (`step_attention`) ----

# Its instruction sets this CPU runs (AVX-512 F, BW and VL, and AVX2 with FMA, on the suite's
# machines with AVX-512; AVX2 alone on a Zen 3): each test runs in each form.
ATTENTION_ISAS = [
    isa
    for isa, flags in (("avx512", {"avx512f", "avx512bw", "avx512vl"}), ("avx2", {"avx2", "fma"}))
    if flags <= cpu_flags()
]


@pytest.fixture(params=ATTENTION_ISAS)
def attention_isa(request, monkeypatch):
    """`step_attention` in the form of one instruction set this CPU has."""
    monkeypatch.setattr(kernels, "_ATTENTION_ISA", request.param)
    return request.param


def _step_case(B, H, Tq, L, d, dv, rows, g, *, bias_shape=None, p_masked=0.3):
    """q strided (a view of a wider projection), k as rows or as a view of K^T, v, an additive
    bias (0 / -inf) over the keys."""
    q = torch.randn(B, Tq, H, d + 3, generator=g)[..., :d].transpose(1, 2)
    k = torch.randn(B, H, L, d, generator=g)
    if not rows:
        k = k.transpose(-2, -1).contiguous().transpose(-2, -1)
    v = torch.randn(B, H, L, dv, generator=g)
    shape = bias_shape or (B, 1, Tq, L)
    masked = torch.rand(shape, generator=g) < p_masked
    bias = torch.zeros(shape).masked_fill_(masked, float("-inf"))
    return q, k, v, bias


def _eq1(q, k, v, bias, c):
    s = q.double() @ k.double().transpose(-2, -1)
    s = (s / c if c else s) + (0.0 if bias is None else bias.double())
    return s.softmax(-1).nan_to_num_(0.0) @ v.double()


STEP_SHAPES = [  # B, H, Tq, L, d, dv
    (1, 1, 1, 1, 64, 64), (2, 3, 1, 37, 64, 64), (3, 2, 4, 20, 24, 70), (2, 2, 3, 150, 16, 130),
    (64, 8, 1, 48, 64, 64), (4, 8, 4, 196, 64, 64),
]  # fmt: skip


@pytest.mark.parametrize("shape", STEP_SHAPES)
@pytest.mark.parametrize("rows", [True, False])
@pytest.mark.parametrize("c", [8.0, 0.0])
def test_step_attention_is_eq1_in_fp64_to_fp32_rounding(shape, rows, c, attention_isa):
    if not kernels.attention_supported():  # a CPU without AVX-512: torch's ops instead
        with pytest.raises(RuntimeError, match="not on this machine"):
            kernels.step_attention(*[torch.zeros(1, 1, 1, 16)] * 3, None, 0.0)
        return
    B, H, Tq, L, d, dv = shape
    g = torch.Generator().manual_seed(B * L + d)
    q, k, v, bias = _step_case(B, H, Tq, L, d, dv, rows, g)
    for b in (bias, None):
        out = kernels.step_attention(q, k, v, b, c)
        ref = _eq1(q, k, v, b, c)
        assert out.dtype == torch.float32 and out.shape == (B, H, Tq, dv) and out.is_contiguous()
        assert (out.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize("keys", [torch.float32, torch.bfloat16])
def test_step_attention_bf16_values_give_bf16_to_its_rounding(keys, attention_isa):
    """A bf16 model's step: bf16 values, and bf16 keys read in place (a cache's rows)."""
    if not kernels.attention_supported():
        return
    g = torch.Generator().manual_seed(1)
    q, k, v, bias = _step_case(3, 4, 2, 53, 32, 40, True, g)
    big = torch.zeros(3, 4, 60, 32, dtype=keys)  # a cache with room for more positions
    big[:, :, :53] = k
    k, v = big[:, :, :53], v.bfloat16()
    out = kernels.step_attention(q, k, v, bias, 0.0)
    ref = _eq1(q, k, v, bias, 0.0)
    assert out.dtype == torch.bfloat16
    assert (out.double() - ref).abs().max() <= 2**-8 * ref.abs().max()


def test_step_attention_a_query_with_no_legal_key_gets_zeros(attention_isa):
    if not kernels.attention_supported():
        return
    g = torch.Generator().manual_seed(2)
    for rows in (True, False):
        q, k, v, bias = _step_case(2, 2, 3, 20, 16, 16, rows, g)
        bias[1, 0, 2] = float("-inf")
        out = kernels.step_attention(q, k, v, bias, 4.0)
        assert bool((out[1, :, 2] == 0).all()) and torch.isfinite(out).all()


def test_step_attention_does_not_read_the_keys_the_bias_masks(attention_isa):
    """Key rows masked anywhere, K^T columns masked at the end (a source's padding), and the
    value rows of every masked key: NaN there changes nothing, to the bit."""
    if not kernels.attention_supported():
        return
    g = torch.Generator().manual_seed(3)
    for rows in (True, False):
        q, k, v, bias = _step_case(3, 2, 4, 48, 64, 64, rows, g, bias_shape=(3, 1, 1, 48))
        if not rows:  # K^T: only a tail of masked keys is skipped
            bias = torch.zeros(3, 1, 1, 48)
            bias[:, :, :, 30:] = float("-inf")
        clean = kernels.step_attention(q, k, v, bias, 8.0)
        masked = torch.isinf(bias.expand(3, 2, 1, 48))[:, :, 0]  # (B, H, L)
        k2, v2 = k.clone(), v.clone()
        if not rows:
            k2 = k.transpose(-2, -1).contiguous().transpose(-2, -1)
        k2[masked], v2[masked] = float("nan"), float("nan")
        assert torch.equal(kernels.step_attention(q, k2, v2, bias, 8.0), clean)


@pytest.mark.parametrize("rows", [True, False])
def test_step_attention_rows_do_not_depend_on_the_batch_or_the_threads(rows, attention_isa):
    """A sentence's row alone, in a batch of 64, and on one or two threads: the same bits."""
    if not kernels.attention_supported():
        return
    g = torch.Generator().manual_seed(4)
    q, k, v, bias = _step_case(64, 8, 4, 100, 64, 64, rows, g, bias_shape=(64, 1, 4, 100))
    with threads_of(2):
        batch = kernels.step_attention(q, k, v, bias, 8.0)
    for i in (0, 17, 63):
        with threads_of(1):
            alone = kernels.step_attention(q[i : i + 1], k[i : i + 1], v[i : i + 1],
                                           bias[i : i + 1], 8.0)  # fmt: skip
        assert torch.equal(alone[0], batch[i])


def test_step_attention_refuses_what_it_cannot_read(attention_isa):
    if not kernels.attention_supported():
        return
    q = k = v = torch.zeros(2, 2, 1, 16)
    with pytest.raises(ValueError, match="fp32 CPU q, fp32 or bf16 k and v"):
        kernels.step_attention(q.double(), k, v, None, 0.0)
    with pytest.raises(ValueError, match="fp32 k's columns"):  # bf16 keys as rows only
        kt = torch.zeros(2, 2, 16, 3, dtype=torch.bfloat16).transpose(-1, -2)
        kernels.step_attention(q, kt, torch.zeros(2, 2, 3, 16), None, 0.0)
    with pytest.raises(ValueError, match="do not match"):
        kernels.step_attention(q, torch.zeros(2, 2, 3, 8), torch.zeros(2, 2, 3, 16), None, 0.0)
    with pytest.raises(ValueError, match="contiguous"):
        wide = torch.zeros(2, 2, 16, 3)
        kernels.step_attention(q, k, wide.transpose(-1, -2)[:, :, :1], None, 0.0)
    with pytest.raises(ValueError, match="fp32 CPU bias"):
        kernels.step_attention(q, k, v, torch.zeros(2, 1, 1, 1, dtype=torch.bool), 0.0)


def test_without_avx512_or_avx2_there_is_no_step_attention(monkeypatch):
    monkeypatch.setattr(kernels, "_ATTENTION_ISA", None)
    assert not kernels.attention_supported()
    with pytest.raises(RuntimeError, match="not on this machine"):
        kernels.step_attention(*[torch.zeros(1, 1, 1, 16)] * 3, None, 0.0)


@pytest.mark.parametrize("isa", ATTENTION_ISAS)
def test_step_attention_calls_the_form_of_the_cpus_instruction_set(monkeypatch, isa):
    """The AVX-512 form called on a CPU with AVX2 alone would be an illegal instruction."""
    assert kernels.attention_supported()
    monkeypatch.setattr(kernels, "_ATTENTION_ISA", isa)
    called = _spy_library(monkeypatch)
    q = torch.randn(2, 2, 1, 16)
    kernels.step_attention(q, q, q, None, 4.0)
    assert [(name, args[-1]) for name, args in called] == [("step_attention", isa == "avx512")]


def test_the_two_forms_agree_to_fp32_rounding():
    if len(ATTENTION_ISAS) < 2:
        return
    g = torch.Generator().manual_seed(5)
    for rows in (True, False):
        q, k, v, bias = _step_case(8, 4, 4, 77, 64, 64, rows, g)
        outs = []
        for isa in ATTENTION_ISAS:
            kernels._ATTENTION_ISA = isa
            try:
                outs.append(kernels.step_attention(q, k, v, bias, 8.0))
            finally:
                kernels._ATTENTION_ISA = ATTENTION_ISAS[0]
        assert (outs[0] - outs[1]).abs().max() <= 1e-5 * outs[0].abs().max()


def _torch_adam(masters, grads, copies, steps: int, lr: float, scale: float, clip: float):
    """torch's five passes of a mixed-precision Adam step, the masters, moments (new
    tensors) and copies updated in place; returns the moments."""
    state = [torch.zeros_like(m) for m in masters], [torch.zeros_like(m) for m in masters]
    count = [torch.zeros(()) for _ in masters]
    for step in range(steps):
        gs = [torch.zeros_like(m) if g is None else g[step].float().clone() for m, g in
              zip(masters, grads, strict=True)]  # fmt: skip
        if scale != 1.0:
            torch._foreach_mul_(gs, scale)
        if clip != 1.0:
            torch._foreach_mul_(gs, clip)
        torch._foreach_add_(count, 1)
        torch._fused_adam_(masters, gs, *state, [], count, amsgrad=False, lr=lr * (step + 1),
                           beta1=0.9, beta2=0.98, weight_decay=0.0, eps=1e-9, maximize=False,
                           grad_scale=None, found_inf=None)  # fmt: skip
        pairs = [(c, m) for c, m in zip(copies, masters, strict=True) if c is not None]
        torch._foreach_copy_([c for c, _ in pairs], [m for _, m in pairs])
    return state


def _adam_case(seed: int, sizes, kinds):
    """Masters, per-step gradients (kinds: 'bf16', 'fp32' or None) and bf16 copies."""
    g = torch.Generator().manual_seed(seed)
    masters = [torch.randn(n, generator=g) for n in sizes]
    grads = [None if k is None else [
        (torch.randn(n, generator=g) * 10.0 ** torch.randint(-6, 2, (n,), generator=g)).to(
            torch.bfloat16 if k == "bf16" else torch.float32) for _ in range(3)]
        for n, k in zip(sizes, kinds, strict=True)]  # fmt: skip
    return masters, grads, [m.bfloat16() for m in masters]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("scale", "clip"), [(1.0, 1.0), (1 / 3826, 1.0), (1 / 777, 0.0417)])
def test_adam_update_is_torchs_five_passes_bit_for_bit(threads, scale, clip):
    # Every length of a tensor's last partial vector (1-15, torch's scalar loop: its first 8 in
    # one FMA form, the rest in another), whole vectors, bf16 / fp32 / no gradients, a model's
    # bf16 copy or none: masters, moments and copies the same bits as torch's passes.
    sizes = [*range(1, 34), 4099, 70001]
    kinds = [("bf16", "fp32", None)[i % 3] for i in range(len(sizes))]
    masters, grads, copies = _adam_case(7, sizes, kinds)
    copies[5] = None
    if not kernels.fused_supported():
        with pytest.raises(RuntimeError, match="not on this machine"):
            kernels.adam_update(masters, masters, masters, [None] * len(masters),
                                copies, [1.0] * len(masters), 1e-3, (0.9, 0.98), 1e-9)  # fmt: skip
        return
    ours_m, ours_c = (
        [m.clone() for m in masters],
        [None if c is None else c.clone() for c in copies],
    )
    exp_avg, exp_avg_sq = _torch_adam(masters, grads, copies, 3, 1e-3, scale, clip)
    moments = [torch.zeros_like(m) for m in ours_m], [torch.zeros_like(m) for m in ours_m]
    with threads_of(threads):
        for step in range(3):
            kernels.adam_update(ours_m, *moments, [None if g is None else g[step] for g in grads],
                                ours_c, [float(step + 1)] * len(sizes), 1e-3 * (step + 1),
                                (0.9, 0.98), 1e-9, scale, clip)  # fmt: skip
    bits = [t.view(torch.int32) for t in (*masters, *exp_avg, *exp_avg_sq)]
    ours = [t.view(torch.int32) for t in (*ours_m, *moments[0], *moments[1])]
    assert all(torch.equal(a, b) for a, b in zip(bits, ours, strict=True))
    assert all(c is o or torch.equal(c.view(torch.int16), o.view(torch.int16))
               for c, o in zip(copies, ours_c, strict=True))  # fmt: skip


@pytest.mark.parametrize("threads", [1, 2])
def test_adam_sum_squares_is_the_scaled_gradients_in_fp64(threads):
    sizes = [1, 15, 16, 17, 9000, 70001]
    kinds = ["bf16", "fp32", None, "bf16", "fp32", "bf16"]
    _, grads, _ = _adam_case(3, sizes, kinds)
    grads = [None if g is None else g[0] for g in grads]
    grads[0] = torch.tensor([float("nan")], dtype=torch.bfloat16)
    if not kernels.fused_supported():
        with pytest.raises(RuntimeError, match="not on this machine"):
            kernels.adam_sum_squares(grads)
        return
    scale = 1 / 3826
    ref = sum(float(((g.float() * scale).double() ** 2).sum()) for g in grads[1:] if g is not None)
    with threads_of(threads):
        got = kernels.adam_sum_squares(grads[1:], scale)
        assert kernels.adam_sum_squares(grads[1:], scale) == got  # a fixed order
        assert kernels.adam_sum_squares(grads[1:]) == pytest.approx(ref / scale**2, rel=1e-6)
        assert kernels.adam_sum_squares(grads) != kernels.adam_sum_squares(grads)  # a NaN
    assert got == pytest.approx(ref, rel=1e-12)
    with threads_of(3 - threads):
        assert kernels.adam_sum_squares(grads[1:], scale) == got  # any thread count


def test_adam_refuses_what_it_cannot_read():
    if not kernels.fused_supported():
        return
    m = torch.zeros(8, 4)
    cases = [
        ([m.t()], [None], [None], "master 0 is not a contiguous fp32"),
        ([m], [torch.zeros(8, 4, dtype=torch.float16)], [None], "gradient 0 is not"),
        ([m], [torch.zeros(4, 8)], [None], r"gradient 0 has shape \(4, 8\)"),
        ([m], [None], [torch.zeros(8, 4, dtype=torch.bfloat16).t()], "parameter 0 is not"),
    ]
    for masters, grads, params, message in cases:
        assert kernels.adam_problem(masters, grads, params) is not None
        with pytest.raises(ValueError, match=message):
            kernels.adam_update(masters, [m], [m], grads, params, [1.0], 1e-3, (0.9, 0.98), 1e-9)
    with pytest.raises(ValueError, match="the moments of master 0"):
        kernels.adam_update([m], [m.bfloat16()], [m], [None], [None], [1.0], 1e-3, (0.9, 0.98),
                            1e-9)  # fmt: skip
    with pytest.raises(ValueError, match="gradient 1 is not"):
        kernels.adam_sum_squares([None, torch.zeros(4, 8).t()])


def test_adam_sum_squares_says_when_the_library_could_not_allocate(monkeypatch):
    if not kernels.fused_supported():
        return
    monkeypatch.setattr(kernels._LIB, "adam_sumsq", lambda *args: 1)  # malloc failed
    with pytest.raises(MemoryError, match="adam_sum_squares: out of memory"):
        kernels.adam_sum_squares([torch.ones(3)])


def _topk_by_scan(x: torch.Tensor, n: int) -> torch.Tensor:
    """The reference for `row_top`: each row's columns ranked by value, largest first, a tie
    to the column first in the row and a NaN ranked as -inf (a stable sort), the first n."""
    keys = x.nan_to_num(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    return keys.sort(dim=1, descending=True, stable=True).indices[:, :n]


@pytest.mark.parametrize("V", [1, 5, 16, 17, 63, 64, 65, 1000, 8000, 32000])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("isa", ROWS_ISAS)
def test_row_top_takes_each_rows_best_columns_as_a_stable_sort_would(monkeypatch, V, threads, isa):
    """Each row's n best columns and their values: those of a stable descending sort (ties to
    the first column, a NaN as -inf), on rows of every kind (ties, -inf, a NaN, +inf, fewer finite
    values than n, the best in the tail past the last full vector, rising rows where every
    column enters), for n from 1 to min(V, ROW_TOP_MAX), in each instruction set, on one
    thread and on the team (70 x 32,000 is above MIN_THREADED)."""
    monkeypatch.setattr(kernels, "_ROWS_ISA", isa)
    g = torch.Generator().manual_seed(V)
    x = torch.randn(70, V, generator=g).round(decimals=1)  # many ties
    x[0] = float("-inf")
    x[1, 3:] = float("-inf")
    x[2, V // 2] = float("nan")
    x[3, :] = float("nan")
    x[4, -1] = 50.0
    x[5] = torch.arange(V, dtype=torch.float32)  # rising: every column beats the n-th
    x[6] = 7.0  # all tied
    x[7, V // 3] = float("inf")
    for n in sorted({1, 3, 8, min(V, 33), min(V, kernels.ROW_TOP_MAX)}):
        if n > V:
            continue
        with threads_of(threads):
            ids, values = kernels.row_top(x, n)
        assert ids.dtype == torch.int64 and ids.shape == values.shape == (70, n)
        assert torch.equal(ids, _topk_by_scan(x, n)), n
        read = x.gather(1, ids)
        assert torch.equal(read.isnan(), values.isnan())
        assert torch.equal(read.nan_to_num(nan=0.0), values.nan_to_num(nan=0.0))


def test_row_top_refuses_what_it_cannot_read_in_one_line():
    x = torch.randn(4, 10)
    assert kernels.row_top_problem(x, 3) is None
    assert kernels.row_top(torch.empty(0, 10), 3)[0].shape == (0, 3)
    for bad, n, says in ((x.double(), 3, "fp32"), (x[:, ::2], 2, "contiguous"),
                         (x[0], 1, r"\(R, V\)"), (x, 0, "1 <= n"), (x, 11, "1 <= n"),
                         (torch.randn(2, 100), kernels.ROW_TOP_MAX + 1, "1 <= n")):  # fmt: skip
        assert kernels.row_top_problem(bad, n) is not None
        with pytest.raises(ValueError, match=f"row_top: .*{says}"):
            kernels.row_top(bad, n)
    with pytest.MonkeyPatch.context() as m:  # no kernel here: a reason, never a crash
        m.setattr(kernels, "_ROWS_ISA", None)
        assert kernels.row_top_problem(x, 3)


@pytest.mark.parametrize("isa", ROWS_ISAS)
def test_row_top_calls_the_form_of_the_cpus_instruction_set(monkeypatch, isa):
    monkeypatch.setattr(kernels, "_ROWS_ISA", isa)
    called = _spy_library(monkeypatch)
    kernels.row_top(torch.randn(3, 40), 4)
    assert [(name, args[-1]) for name, args in called] == [("row_top", int(isa == "avx512"))]


def test_the_kernels_command_keeps_a_copy_and_says_what_runs(fresh, capsys, tmp_path):
    from transformer.cli import main

    assert main(["kernels"]) == 0
    out = capsys.readouterr().out.splitlines()
    (kept,) = kernels.PREBUILT.glob("kernels-*.so")
    from transformer.translate import int8_product_said

    assert out[0] == f"in use: {kernels.library_path()}" and out[1:-2] == kernels.describe()[1:]
    assert out[-2] == f"int8 decoding's products: {int8_product_said()}"
    assert out[-1].startswith(f"kept in {kept}: a process without a C compiler loads it")
    assert main(["kernels", "--into", str(tmp_path / "k")]) == 0
    assert (
        capsys.readouterr()
        .out.splitlines()[-1]
        .endswith(f"from there with TRANSFORMER_KERNELS={tmp_path / 'k'}")
    )


def test_the_kernels_command_without_a_compiler_fails_in_one_line(fresh, monkeypatch, capsys):
    from transformer.cli import main

    monkeypatch.setenv("CC", "no-such-compiler-here")
    assert main(["kernels"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("transformer kernels: error: the compiled kernels cannot be had here: ")
    assert "no C compiler" in err and err.count("\n") == 1
    assert not kernels.PREBUILT.exists()


def test_the_kernels_command_names_a_folder_it_cannot_write_in_one_line(fresh, capsys, tmp_path):
    from transformer.cli import main

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["kernels", "--into", str(blocker / "k")]) == 2
    err = capsys.readouterr().err
    assert err == f"transformer kernels: error: {blocker / 'k'}: Not a directory\n"


def _embedding_case(n: int, d: int, keep: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(50, d, generator=gen) * 0.05).to(torch.bfloat16)
    ids = torch.randint(0, 50, (n,), generator=gen)
    ids[: min(n, 4)] = 7  # one row looked up again and again: its sum's order matters
    table = torch.randn(9, d, generator=gen)  # fp32, as the sinusoid buffer
    pos = torch.randint(0, 9, (n,), generator=gen)
    mask = torch.rand(n, d, generator=gen) >= 0.1 if keep else None
    g = torch.randn(n, d, generator=gen).to(torch.bfloat16)
    return weight, ids, table, pos, mask, g


@pytest.mark.parametrize("n, d", [(1, 16), (37, 64), (3888, 512)])
@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_embed_is_the_lookup_scale_sum_and_dropout_bit_for_bit(n, d, keep, threads):
    # model._embed_packed's ops (the lookup, * sqrt(d), + the positions' rows, _KeepScale) and
    # their gradient into an fp32 master (index_add_): the same bits both ways.
    weight, ids, table, pos, mask, g = _embedding_case(n, d, keep)
    scale, keep_scale = math.sqrt(d), 1.0 / (1.0 - 0.1)
    if not kernels.fused_supported():
        with pytest.raises(RuntimeError, match="not on this machine"):
            kernels.embed(weight, ids, table.bfloat16(), pos, scale, mask, keep_scale)
        return
    x = weight.index_select(0, ids) * scale + table.index_select(0, pos).to(torch.bfloat16)
    if mask is not None:
        x = (x * keep_scale).mul_(mask.view(torch.uint8).to(x.dtype))
    master = torch.randn(50, d, generator=torch.Generator().manual_seed(1))
    ref = master.clone()
    gr = g if mask is None else (g * mask.view(torch.uint8).to(g.dtype)).mul_(keep_scale)
    ref.index_add_(0, ids, (gr * scale).float())
    with threads_of(threads):
        out = kernels.embed(weight, ids, table.bfloat16(), pos, scale, mask, keep_scale)
        kernels.embed_backward(g, ids, scale, mask, keep_scale, master)
    assert torch.equal(out, x)
    assert torch.equal(master, ref)


def test_embed_refuses_rows_it_cannot_read():
    weight, ids, table, pos, mask, g = _embedding_case(8, 32, True)
    t = table.bfloat16()
    if not kernels.fused_supported():
        with pytest.raises(RuntimeError, match="not on this machine"):
            kernels.embed_backward(g, ids, 1.0, mask, 1.0, torch.zeros(50, 32))
        return
    with pytest.raises(ValueError, match="ids outside"):
        kernels.embed(weight, ids + 50, t, pos, 1.0, mask, 1.0)
    with pytest.raises(ValueError, match="positions outside"):
        kernels.embed(weight, ids, t, pos + 9, 1.0, mask, 1.0)
    for bad in (pos.int(), pos[:-1].contiguous()):  # read as int64, one a row
        with pytest.raises(ValueError, match="int64 positions, one a row"):
            kernels.embed(weight, ids, t, bad, 1.0, mask, 1.0)
    with pytest.raises(ValueError, match="int64 ids"):
        kernels.embed(weight, ids.int(), t, pos, 1.0, mask, 1.0)
    with pytest.raises(ValueError, match="keep mask"):
        kernels.embed(weight, ids, t, pos, 1.0, mask[:, :16].contiguous(), 1.0)
    with pytest.raises(ValueError, match="multiple of 16"):
        kernels.embed(weight[:, :24].contiguous(), ids, t[:, :24].contiguous(), pos, 1.0, None, 1.0)
    with pytest.raises(ValueError, match="fp32 master"):
        kernels.embed_backward(g, ids, 1.0, mask, 1.0, torch.zeros(50, 32).bfloat16())
    with pytest.raises(ValueError, match="gradient"):
        kernels.embed_backward(g[:4].contiguous(), ids, 1.0, None, 1.0, torch.zeros(50, 32))
