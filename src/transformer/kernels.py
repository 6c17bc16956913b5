"""A compiled CPU kernel torch lacks: a fast transposing copy of a 16-bit (bf16) matrix.

Not in the paper. On an AMX CPU, oneDNN multiplies bf16 at ~2,000 GFLOP/s when its left
operand is row-major, but at half that when the operand is a transposed view, as it is in every
weight gradient of y = x W^T: dW = dy^T x, a reduction over the batch's rows, which both
operands hold as their leading dimension (docs/performance.md, "Round twenty-five"). From a
row-major copy of dy^T (or of x^T) the same product runs at the full rate, but torch's
transposing copies of bf16 run at 4-12 GB/s, which eats the gain; this module's copy runs at
15-27 GB/s on two threads (cache-blocked 8 x 8 transposes in SSE2, which every x86-64 CPU has).

The kernel is C, compiled on first use with the system's C compiler (`$CC`, else `cc`, `gcc`
or `clang`) into a cache folder (`$TRANSFORMER_KERNELS`, else `$XDG_CACHE_HOME/transformer`,
else `~/.cache/transformer`), keyed by the source's and compiler's hash, and loaded with
ctypes; it is checked against torch's copy once before it is used. Where it cannot be built
(no compiler, another architecture, a read-only home) `transposed` is torch's own copy, and
`unavailable()` says why. Nothing in a model file reaches this code.

    out = transposed(x)      # (C, R) contiguous, the same values as x.t().contiguous()
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# OpenMP's threads share out the copy's 32 x 32 tiles; below this many elements one thread
# does it all (a guard against waking the pool for tiny copies; the threshold not tuned).
MIN_THREADED = 1 << 16

_SOURCE = r"""
#include <stdint.h>
#include <emmintrin.h>

/* an 8 x 8 block of 16-bit values: s (row stride ls) -> d (row stride ld), transposed */
static inline void t8x8(const uint16_t *s, int64_t ls, uint16_t *d, int64_t ld) {
  __m128i r0 = _mm_loadu_si128((const __m128i *)(s + 0 * ls));
  __m128i r1 = _mm_loadu_si128((const __m128i *)(s + 1 * ls));
  __m128i r2 = _mm_loadu_si128((const __m128i *)(s + 2 * ls));
  __m128i r3 = _mm_loadu_si128((const __m128i *)(s + 3 * ls));
  __m128i r4 = _mm_loadu_si128((const __m128i *)(s + 4 * ls));
  __m128i r5 = _mm_loadu_si128((const __m128i *)(s + 5 * ls));
  __m128i r6 = _mm_loadu_si128((const __m128i *)(s + 6 * ls));
  __m128i r7 = _mm_loadu_si128((const __m128i *)(s + 7 * ls));
  __m128i a0 = _mm_unpacklo_epi16(r0, r1), a1 = _mm_unpackhi_epi16(r0, r1);
  __m128i a2 = _mm_unpacklo_epi16(r2, r3), a3 = _mm_unpackhi_epi16(r2, r3);
  __m128i a4 = _mm_unpacklo_epi16(r4, r5), a5 = _mm_unpackhi_epi16(r4, r5);
  __m128i a6 = _mm_unpacklo_epi16(r6, r7), a7 = _mm_unpackhi_epi16(r6, r7);
  __m128i b0 = _mm_unpacklo_epi32(a0, a2), b1 = _mm_unpackhi_epi32(a0, a2);
  __m128i b2 = _mm_unpacklo_epi32(a1, a3), b3 = _mm_unpackhi_epi32(a1, a3);
  __m128i b4 = _mm_unpacklo_epi32(a4, a6), b5 = _mm_unpackhi_epi32(a4, a6);
  __m128i b6 = _mm_unpacklo_epi32(a5, a7), b7 = _mm_unpackhi_epi32(a5, a7);
  _mm_storeu_si128((__m128i *)(d + 0 * ld), _mm_unpacklo_epi64(b0, b4));
  _mm_storeu_si128((__m128i *)(d + 1 * ld), _mm_unpackhi_epi64(b0, b4));
  _mm_storeu_si128((__m128i *)(d + 2 * ld), _mm_unpacklo_epi64(b1, b5));
  _mm_storeu_si128((__m128i *)(d + 3 * ld), _mm_unpackhi_epi64(b1, b5));
  _mm_storeu_si128((__m128i *)(d + 4 * ld), _mm_unpacklo_epi64(b2, b6));
  _mm_storeu_si128((__m128i *)(d + 5 * ld), _mm_unpackhi_epi64(b2, b6));
  _mm_storeu_si128((__m128i *)(d + 6 * ld), _mm_unpacklo_epi64(b3, b7));
  _mm_storeu_si128((__m128i *)(d + 7 * ld), _mm_unpackhi_epi64(b3, b7));
}

/* d (cols x rows, contiguous) = s (rows x cols, row stride ls) transposed, in 32 x 32 tiles
   shared out among nthreads OpenMP threads (torch's own pool: the process has one libgomp) */
int transpose16(const uint16_t *s, uint16_t *d, int64_t rows, int64_t cols, int64_t ls,
                int nthreads) {
  const int64_t T = 32, R = rows, nr = (rows + T - 1) / T, nc = (cols + T - 1) / T;
#pragma omp parallel for collapse(2) schedule(static) num_threads(nthreads)
  for (int64_t bi = 0; bi < nr; ++bi)
    for (int64_t bj = 0; bj < nc; ++bj) {
      int64_t i0 = bi * T, c0 = bj * T;
      int64_t i1 = i0 + T < rows ? i0 + T : rows, c1 = c0 + T < cols ? c0 + T : cols, i = i0;
      for (; i + 8 <= i1; i += 8) {
        int64_t c = c0;
        for (; c + 8 <= c1; c += 8) t8x8(s + i * ls + c, ls, d + c * R + i, R);
        for (; c < c1; ++c)
          for (int64_t k = i; k < i + 8; ++k) d[c * R + k] = s[k * ls + c];
      }
      for (; i < i1; ++i)
        for (int64_t c = c0; c < c1; ++c) d[c * R + i] = s[i * ls + c];
    }
  return 0;
}
"""

_FLAGS = ["-O2", "-shared", "-fPIC", "-fopenmp"]
_LIB: ctypes.PyDLL | None = None
_WHY: str | None = None  # why there is no library, once `_library` has tried
_TRIED = False


def cache_dir() -> Path:
    """Where built kernels are kept: $TRANSFORMER_KERNELS, else the user's cache folder."""
    if os.environ.get("TRANSFORMER_KERNELS"):
        return Path(os.environ["TRANSFORMER_KERNELS"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "transformer"


def _compiler() -> str | None:
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc)
    return next((p for p in map(shutil.which, ("cc", "gcc", "clang")) if p), None)


def _build(cc: str) -> Path:
    """The shared library for this source and compiler, compiled once into the cache folder."""
    key = hashlib.sha256("\0".join([_SOURCE, os.path.realpath(cc), *_FLAGS]).encode())
    folder = cache_dir()
    path = folder / f"transpose16-{key.hexdigest()[:16]}.so"
    if path.exists():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "transpose16.c"
        src.write_text(_SOURCE)
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
        os.close(fd)
        part = Path(name)
        try:
            done = subprocess.run(
                [cc, *_FLAGS, "-o", str(part), str(src)],
                capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            if done.returncode != 0:
                raise OSError(f"{cc} failed: {done.stderr.strip().splitlines()[:1]}")
            os.replace(part, path)  # whole or not at all: another process may be loading it
        finally:
            part.unlink(missing_ok=True)
    return path


def _check(lib: ctypes.PyDLL) -> None:
    """Raise unless the library's copy equals torch's on shapes with every kind of edge."""
    for rows, cols in ((1, 1), (8, 8), (37, 70), (300, 260)):
        x = torch.arange(rows * cols, dtype=torch.int16).reshape(rows, cols)
        out = torch.empty((cols, rows), dtype=torch.int16)
        lib.transpose16(x.data_ptr(), out.data_ptr(), rows, cols, cols, 2)
        if not torch.equal(out, x.t()):
            raise OSError("its transposing copy differs from torch's")


def _gomp() -> set[str]:
    """The OpenMP runtimes mapped into this process (torch's, and any a package bundles)."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return set()
    return {line.split()[-1] for line in maps if "libgomp" in line or "libomp" in line}


def _library() -> ctypes.PyDLL | None:
    global _LIB, _WHY, _TRIED
    if _TRIED:
        return _LIB
    _TRIED = True
    try:
        if platform.machine().lower() not in ("x86_64", "amd64"):
            raise OSError(f"the kernel is for x86-64, this CPU is {platform.machine()}")
        cc = _compiler()
        if cc is None:
            raise OSError("no C compiler ($CC, cc, gcc or clang) on PATH")
        path = _build(cc)
        before = _gomp()
        try:
            lib = ctypes.PyDLL(str(path))  # holds the GIL: a wait for it costs more than the copy
        except OSError:  # a damaged file in the cache (a full disk, a copy cut short): again
            path.unlink(missing_ok=True)
            lib = ctypes.PyDLL(str(_build(cc)))
        added = _gomp() - before
        if added:  # its threads would spin beside torch's: slower than torch's own copy
            raise OSError(f"it loaded a second OpenMP runtime ({', '.join(sorted(added))})")
        lib.transpose16.argtypes = [ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 3
        lib.transpose16.argtypes += [ctypes.c_int]
        lib.transpose16.restype = ctypes.c_int
        _check(lib)
        _LIB = lib
    except (OSError, subprocess.SubprocessError) as e:
        _WHY = str(e)
        logger.info("transformer.kernels: torch's transposing copies (%s)", _WHY)
    return _LIB


def unavailable() -> str | None:
    """None when the compiled kernel is in use, else why not (builds it on first call)."""
    _library()
    return _WHY


def transposed(x: torch.Tensor) -> torch.Tensor:
    """x (R, C) -> a contiguous (C, R) copy of x^T: the compiled kernel for a CPU tensor of
    2-byte elements whose rows are contiguous, torch's copy otherwise (the same values)."""
    ok = x.dim() == 2 and x.device.type == "cpu" and x.element_size() == 2
    if not (ok and x.stride(1) == 1 and x.stride(0) >= x.size(1)) or _library() is None:
        return x.t().contiguous()
    rows, cols = x.shape
    out = torch.empty((cols, rows), dtype=x.dtype)
    if x.numel():
        threads = torch.get_num_threads() if x.numel() >= MIN_THREADED else 1
        _LIB.transpose16(x.data_ptr(), out.data_ptr(), rows, cols, x.stride(0), threads)
    return out
