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
them in blocks of at most 32 MiB instead (`search.STEP_BLOCK_BYTES`). One arena for all threads
(M_ARENA_MAX 1) was tried: a lock shared beside a busy process, and +38% peak memory for
`translate` at that size (docs/performance.md, "Round twenty-one", "Round twenty-two").

Applied once per process, on Linux with glibc, by every decoder (`search.ModelStepper`) and by
CPU training (`train._setup_torch`). Not applied where the user chose: `MALLOC_MMAP_THRESHOLD_`
or `MALLOC_TRIM_THRESHOLD_` set, or `TRANSFORMER_MALLOC=system`.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

logger = logging.getLogger(__name__)

# glibc's <malloc.h>
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
LARGE = 1 << 30  # blocks up to 1 GiB come from the heap and stay there when freed

_applied: bool | None = None  # None: not tried yet


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
    if any(k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return False  # the user's own setting
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no tunable thresholds)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, LARGE) == 1 and mallopt(M_TRIM_THRESHOLD, LARGE) == 1
    logger.debug("malloc: large blocks kept for reuse: %s", ok)
    return ok
