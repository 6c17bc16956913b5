"""The C allocator's handling of large blocks, for the tensors CPU decoding and training make
every step.

Not in the paper. PyTorch's CPU tensors come from malloc. glibc serves a block larger than its
mmap threshold (dynamic, at most 32 MiB) with a fresh `mmap` and returns it with `munmap` when
freed, so a tensor of that size made at every decoder step is faulted in page by page, every
step. Beam search makes several: the self-attention cache after each reorder, (N, rows, H, t,
K), 72 MiB in bf16 at 256 rows and t = 45 for the base model, and the (rows, V) scores, 33 MiB in
fp32 at V = 32,000. Filling such a fresh 72 MiB buffer took 28 ms here against 8 ms for one
already mapped (Intel Xeon with AMX, 2 threads).

`keep_large_blocks` raises the mmap threshold to 1 GiB and the trim threshold likewise, so
that a freed block stays in the heap and the next step's tensor of the same size reuses its
pages. Measured on the peers' harness (docs/performance.md): beam 4 +21%, training +30% and
more, greedy unchanged. The cost is that freed memory is kept by the process for reuse rather
than returned to the system (what jemalloc and tcmalloc do too); peak memory of a training step
changed by -0.1% at ~4k tokens and +2.7% at ~16k (W3).

A thread other than the main one allocates from an arena of its own, whose heaps hold at most
64 MiB: a larger block there is its own mmap whatever the threshold. A decoding stream's (rows,
V) scores above 64 MiB made beam 4 27-34% slower in a thread at a WMT-size batch; search makes
them in blocks of at most 8 MiB instead (`search.STEP_BLOCK_BYTES`). One arena for all threads
(M_ARENA_MAX 1) was tried: a lock shared beside a busy process, and +38% peak memory for
`translate` at that size (docs/performance.md, "Round twenty-one", "Round twenty-two").

Such an arena deletes a heap (munmap) as soon as the blocks in it are freed, unless the heap
before it has the top pad's room free, and the trim threshold does not stop it: a decoding
thread made and deleted a 64 MiB heap about twice a step at that size, each faulted in afresh
(520,000-870,000 minor faults a 30-step search, ~10 in the main thread). The top pad is
therefore set to a whole heap (64 MiB), which glibc's `heap_trim` never finds room for: a
thread's heaps stay, as the main arena's pages do. In the main arena the pad only makes each
`sbrk` ask for 64 MiB more address space, not touched until used; a new thread arena's heap is
64 MiB of read-write address space from the start (not resident until touched; under strict
overcommit, `vm.overcommit_memory=2`, it counts against the commit limit). Measured: beam 4 at that
batch in a long-lived second thread 9.36 / 9.16 -> 8.27 / 8.13 s (the main thread's 7.9-8.0),
`translate` of 800 newstest2014 lines 4% faster (93.7 against 97.6 s, five alternated pairs).
Each decoding stream's arena then keeps its own largest heaps: peak memory +0.5 GB of 5.4 with
32 MiB score blocks, and as it was (5.38 GB) with the 8 MiB ones that search now makes
(docs/performance.md, "Round twenty-three").

Applied once per process, on Linux with glibc, by every decoder (`search.ModelStepper`) and by
CPU training (`train._setup_torch`). Not applied where the user chose: `MALLOC_MMAP_THRESHOLD_`
or `MALLOC_TRIM_THRESHOLD_` set (or either in `GLIBC_TUNABLES`), or `TRANSFORMER_MALLOC=system`;
`MALLOC_TOP_PAD_` (or `glibc.malloc.top_pad`) set leaves the top pad alone.

**2 MB pages** (`huge_pages_exec`). A training step works in a heap of gigabytes (the base model
at ~4k tokens: ~2.2 GB of parameters, Adam's moments and activations), reused step after step,
in 4 KiB pages: ~550,000 of them against a TLB of ~2,000 entries. With the kernel's transparent
huge pages in `madvise` mode (the common default) only memory asked for them gets 2 MB pages, and
glibc asks for its heap and its mmaps where `GLIBC_TUNABLES` holds `glibc.malloc.hugetlb=1`
(glibc >= 2.35), read once, when a process starts. `transformer train` therefore runs itself
again with it before anything is imported (`cli.main`). Measured on an AMX Xeon (2 threads, the
base preset at ~4k-token batches; docs/performance.md, "Round fifty-five"): 300 steps in 349-360
s against 356-360, its steps from the 150th on 1.03x-1.05x faster (three pairs), the first ~50
slower (each first touch of 2 MB zeroes 2 MB and compacts memory for it: 40 steps took 55-57 s
against 50), so a run breaks even after ~300 steps; peak memory within 2%; a fixed W1 batch
1.03x-1.05x. A late `madvise` of the heap (pages already faulted in stay 4 KiB until
`MADV_COLLAPSE` copies them, ~7 s for 2.4 GB) or torch's `THP_MEM_ALLOC_ENABLE` (read when torch
is imported, blocks of 2 MB or more only) gave less. Not done where THP is `always`
(nothing to gain) or `never`, where `GLIBC_TUNABLES` already names `glibc.malloc.hugetlb` (a
user's `=0` included), or with `TRANSFORMER_MALLOC=system`. A process that runs the training
itself (the peers' harness with our adapter) keeps its 4 KiB pages.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

logger = logging.getLogger(__name__)

# glibc's <malloc.h>
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
LARGE = 1 << 30  # blocks up to 1 GiB come from the heap and stay there when freed
HEAP_MAX = 64 << 20  # a thread arena's heap on 64-bit glibc (2 x its largest mmap threshold)

_applied: bool | None = None  # None: not tried yet

HUGETLB = "glibc.malloc.hugetlb"
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def keep_large_blocks() -> bool:
    """Keep large freed blocks for reuse (see the module docstring); True if in effect. Safe
    to call often: only the first call in a process does anything."""
    global _applied
    if _applied is None:
        _applied = _apply()
    return _applied


def _apply() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    if os.environ.get("TRANSFORMER_MALLOC") == "system":
        return False
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if any(k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")) or any(
        f"glibc.malloc.{k}_threshold" in tunables for k in ("mmap", "trim")
    ):
        return False  # the user's own setting
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no tunable thresholds)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, LARGE) == 1 and mallopt(M_TRIM_THRESHOLD, LARGE) == 1
    if ok and "MALLOC_TOP_PAD_" not in os.environ and "glibc.malloc.top_pad" not in tunables:
        ok = mallopt(M_TOP_PAD, HEAP_MAX) == 1  # a thread arena's heaps are kept
    logger.debug("malloc: large blocks kept for reuse: %s; 2 MB pages asked for: %s", ok,
                 f"{HUGETLB}=1" in tunables)  # fmt: skip
    return ok


def huge_pages_exec(
    environ: dict[str, str] | None = None, thp: str | None = None, glibc: str | None = None
) -> tuple[str, list[str], dict[str, str]] | None:
    """How to run this program again with glibc's heap in 2 MB pages (the module docstring):
    (executable, argv, environment) for `os.execve`, or None where that gains nothing or the
    user chose otherwise. `environ` defaults to os.environ; `thp` (the kernel's THP mode line)
    and `glibc` (its version string) are read from the system when None."""
    env = dict(os.environ if environ is None else environ)
    tunables = env.get("GLIBC_TUNABLES", "")
    if not sys.platform.startswith("linux") or env.get("TRANSFORMER_MALLOC") == "system":
        return None
    if HUGETLB in tunables:  # the user's choice, or this is the run again
        return None
    if not sys.executable or len(getattr(sys, "orig_argv", ())) < 2:  # nothing to run again
        return None
    if glibc is None:
        try:
            glibc = os.confstr("CS_GNU_LIBC_VERSION") or ""
        except (ValueError, OSError):  # not glibc
            return None
    name, _, version = glibc.partition(" ")
    try:
        major, minor = (int(x) for x in version.split(".")[:2])
    except ValueError:
        return None
    if name != "glibc" or (major, minor) < (2, 35):  # the tunable came with glibc 2.35
        return None
    if thp is None:
        try:
            with open(THP_ENABLED, encoding="ascii") as f:
                thp = f.read()
        except (OSError, UnicodeDecodeError):  # no transparent huge pages in this kernel
            return None
    if "[madvise]" not in thp:  # `always`: large mappings have them anyway; `never`: none can
        return None
    env["GLIBC_TUNABLES"] = f"{tunables}:{HUGETLB}=1" if tunables else f"{HUGETLB}=1"
    return sys.executable, [sys.executable, *sys.orig_argv[1:]], env
