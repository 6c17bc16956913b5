"""Data-parallel training across processes launched by `torchrun` (one node or many).

Each rank takes its own shard of the batches (`TokenBatchSampler(rank=, world_size=)`), runs
forward and backward on its model replica, and sums its gradients into fp32 master gradients
(optim.MixedPrecisionAdam). Once per optimizer step the ranks all-reduce those fp32 gradients
and their token counts in a few flat buckets, so every replica takes the identical step.

This is what DistributedDataParallel computes (a gradient all-reduce after backward), written out
because the reduction must happen after gradient accumulation, on the fp32 masters: DDP reduces
inside backward, in the parameters' dtype (bf16), and `no_sync` would leave the accumulation in
bf16. One reduction per step also means accumulation costs no extra communication.

`run_local` starts such a job on this machine without `torchrun` (`transformer train --procs
N`): N processes of one CPU thread each, which never wait for each other inside an op. On a
small CPU that is faster than one process with N threads for models whose ops are too short to
split well across threads, and it keeps its speed beside another busy process, where threads
that meet at a barrier in every op do not (docs/performance.md).
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from transformer import rankserver
from transformer.errors import JobError, UserError, out_of_memory

logger = logging.getLogger(__name__)

BUCKET_NUMEL = 32 * 1024 * 1024  # fp32 elements per all-reduce call (128 MB)


@dataclass(frozen=True)
class DistInfo:
    """This process's place in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_from_env(device: torch.device) -> DistInfo:
    """Join the process group that `torchrun` describes (RANK, WORLD_SIZE, LOCAL_RANK, ...).

    Without those variables (a plain `transformer train`) this is a single-process job.
    Backend: nccl on CUDA, gloo on CPU.
    """
    if "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) == 1:
        return DistInfo()
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend)
    info = DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)))
    logger.info("rank %d of %d (%s)", info.rank, info.world_size, backend)
    return info


def all_reduce_sum(tensors: list[torch.Tensor], info: DistInfo) -> None:
    """Sum tensors across ranks in place, in flat buckets of up to BUCKET_NUMEL elements."""
    if info.world_size == 1:
        return
    buckets: list[list[torch.Tensor]] = [[]]
    size = 0
    for t in tensors:
        if buckets[-1] and size + t.numel() > BUCKET_NUMEL:
            buckets.append([])
            size = 0
        buckets[-1].append(t)
        size += t.numel()
    for bucket in buckets:
        if not bucket:
            continue
        flat = torch.cat([t.reshape(-1) for t in bucket])  # (sum of numel,)
        dist.all_reduce(flat)
        parts = flat.split([t.numel() for t in bucket])
        torch._foreach_copy_(bucket, [p.view_as(t) for p, t in zip(parts, bucket, strict=True)])


def broadcast_parameters(tensors: list[torch.Tensor], info: DistInfo) -> None:
    """Give every rank rank 0's values (initial weights), as DDP does at construction.

    Outside autograd: c10d's broadcast has no autograd kernel, so on parameters that require
    grad it was recorded in their history, and every rank's first backward warned that this
    "may lead to silently incorrect behavior"."""
    if info.world_size == 1:
        return
    with torch.no_grad():
        for t in tensors:
            dist.broadcast(t, src=0)


def barrier(info: DistInfo) -> None:
    if info.world_size > 1:
        dist.barrier()


def shutdown(info: DistInfo) -> None:
    if info.world_size > 1 and dist.is_initialized():
        dist.destroy_process_group()


def run_local(nprocs: int, fn: Callable[..., Any], args: tuple = ()) -> Any:
    """Run `fn(*args)` as one data-parallel job of `nprocs` processes on this machine.

    Each process is rank r of `nprocs` (gloo, rendezvous through a file in a temporary
    directory: no port, nothing reachable from outside) with the environment `torchrun` gives
    (RANK, WORLD_SIZE, LOCAL_RANK), so `init_from_env` finds the job. The children are forked
    from a server process that has imported torch and `fn`'s module once (multiprocessing's
    forkserver, started at the first job and kept by this process), so no rank imports torch
    again (~2 s of CPU a rank on a Zen 3). `fn` and `args` must pickle; each rank runs in this
    process's environment, folder and sys.path as they are at the call. `train --procs N`
    starts the server before its own imports (rankserver.start).

    Returns rank 0's return value. If a rank fails, the others are stopped (they would wait
    for it in the next all-reduce) and its failure is raised here: a UserError as a UserError
    (its message alone), an OSError (disk full, ...) as an OSError, Ctrl-C as
    KeyboardInterrupt, a bug as a RuntimeError carrying the rank's traceback, and a rank out
    of memory (an allocation that failed) or one that ended without a report (killed by a
    signal: the out-of-memory killer's SIGKILL, a `kill`) as a JobError that says which.
    """
    if nprocs < 1:
        raise UserError(f"--procs: must be at least 1, got {nprocs}")
    ctx = rankserver.start(fn.__module__)
    interrupts = signal.getsignal(signal.SIGINT) is not signal.SIG_IGN  # the ranks take Ctrl-C
    environ = dict(os.environ)  # the server's is this process's at the first job
    tmp = Path(tempfile.mkdtemp(prefix="transformer-job-"))
    level = logging.getLogger("transformer").getEffectiveLevel()
    pipes = [ctx.Pipe(duplex=False) for _ in range(nprocs)]
    store = tmp / "store"
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(r, nprocs, store, level, environ, interrupts, pipes[r][1], fn, args),
        )
        for r in range(nprocs)
    ]
    reports: dict[int, tuple[str, Any]] = {}
    dead: dict[int, int] = {}  # rank -> exit code

    # A rank that reported "ok" has done its work: a crash in the interpreter's teardown after
    # it (gloo's threads can abort there: "terminate called without an active exception") does
    # not fail the job.
    def failed_ranks() -> list[int]:
        return [r for r, code in dead.items() if code != 0 and reports.get(r, ("",))[0] != "ok"]

    try:
        for p in procs:
            p.start()
        for _, writer in pipes:
            writer.close()  # the children hold theirs: a reader sees EOF when its child is gone
        waiting = {reader: r for r, (reader, _) in enumerate(pipes)}
        waiting.update({p.sentinel: r for r, p in enumerate(procs)})
        while waiting and not failed_ranks():
            for ready in multiprocessing.connection.wait(list(waiting)):
                rank = waiting.pop(ready)
                if isinstance(ready, int):  # a process sentinel: the process has ended
                    procs[rank].join()
                    dead[rank] = procs[rank].exitcode
                else:
                    _receive(ready, rank, reports)
        for ready, rank in waiting.items():  # a failed rank's report, sent just before it ended
            if not isinstance(ready, int) and ready.poll():
                _receive(ready, rank, reports)
    finally:
        stopped = [p for p in procs if p.is_alive()]
        for p in stopped:
            p.terminate()
        for p in procs:
            if p.pid is not None:  # not a process that Ctrl-C kept from starting
                p.join()
        if stopped:  # cut off mid-line, maybe (rank 0's progress bar): the error starts anew
            sys.stderr.write("\n")
        for reader, _ in pipes:
            reader.close()
        shutil.rmtree(tmp, ignore_errors=True)
    failed = failed_ranks()  # in the order they ended
    if not failed:
        return reports.get(0, ("ok", None))[1]
    for kind, payload in reports.values():
        if kind == "user":
            raise UserError(payload)
    for kind, _ in reports.values():
        if kind == "interrupt":
            raise KeyboardInterrupt
    first = failed[0]  # the others failed because it left the job
    kind = reports.get(first, ("",))[0]
    if kind == "os":
        raise OSError(*reports[first][1])
    if kind == "memory":
        raise JobError(f"process {first} of {nprocs} ran {reports[first][1]}: "
                       "smaller batches or fewer processes need less")  # fmt: skip
    if first in reports:
        raise RuntimeError(f"process {first} of {nprocs} failed:\n{reports[first][1]}")
    raise JobError(f"process {first} of {nprocs} {_how_it_ended(dead[first])}")


def _how_it_ended(exitcode: int) -> str:
    """A process's end without a report, from its exit code (-N: killed by signal N)."""
    if exitcode >= 0:
        return f"exited with code {exitcode} and no report"
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        name = f"signal {-exitcode}"
    if -exitcode == signal.SIGKILL:  # what the out-of-memory killer sends
        return (f"was killed by {name} (the kernel's out-of-memory killer sends it: "
                "`dmesg` says whether it did; fewer processes or smaller batches need less "
                "memory)")  # fmt: skip
    return f"was killed by {name}"


def _receive(conn, rank: int, reports: dict[int, tuple[str, Any]]) -> None:
    """A rank's report, if it sent one before its end of the pipe closed."""
    try:
        reports[rank] = conn.recv()
    except EOFError:
        pass


def _rank_main(
    rank: int, world: int, store: Path, level: int, environ: dict[str, str], interrupts: bool,
    conn, fn, args,
) -> None:  # fmt: skip
    """A child of `run_local`: join the job, run fn, send back its result or its failure.
    Ctrl-C raises KeyboardInterrupt here where `interrupts` (the job's process does not ignore
    it), as in any Python program: the server it forks from ignores it (rankserver.start)."""
    if interrupts:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s %(levelname)s [{rank}] %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world))  # fmt: skip
    loopback = _loopback_interface()
    if loopback and "GLOO_SOCKET_IFNAME" not in os.environ:
        os.environ["GLOO_SOCKET_IFNAME"] = loopback  # the ranks talk over 127.0.0.1 only
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    # Rank 0's progress bar: tqdm's default lock is a named semaphore for bars in several
    # processes, which a rank stopped by `run_local` (SIGTERM) leaves behind, and the resource
    # tracker then warns of a "leaked semaphore" under the job's error. One bar, one process:
    # a thread lock does.
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
    try:
        dist.init_process_group("gloo", init_method=store.as_uri(), rank=rank, world_size=world)
        # No rank goes on before every rank has joined: of each two, gloo has one connect to
        # the other, and that one has joined as soon as its connection is written, before the
        # other has taken it. With an fn that sends nothing it could end, closing its socket,
        # while the other was still joining, which then failed (once in CI: "Gloo
        # connectFullMesh failed with ... Connection closed by peer").
        dist.barrier()
        result = fn(*args)
    except UserError as e:
        conn.send(("user", str(e)))
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        conn.send(("interrupt", ""))
        raise SystemExit(130) from None
    except OSError as e:  # disk full, permission denied: the CLI prints these as one line
        conn.send(("os", (e.errno, e.strerror or str(e), e.filename)))
        raise SystemExit(1) from None
    except BaseException as e:
        what = out_of_memory(e)
        conn.send(("bug", traceback.format_exc()) if what is None else ("memory", what))
        raise SystemExit(1) from None
    conn.send(("ok", result if rank == 0 else None))


def _loopback_interface() -> str | None:
    """The loopback network interface's name ("lo" on Linux, "lo0" on macOS), if any."""
    for _, name in socket.if_nameindex():
        if name.startswith("lo"):
            return name
    return None


def _exit_with_parent() -> None:
    """End this process once the process that started the job is gone (killed, say, with
    SIGKILL or SIGTERM, which skip its clean-up): a rank must not train on, orphaned, into the
    run directory. The rank's parent is the forkserver, which lives on while its children do:
    the job's process is watched through the pipe it holds open to each rank until it ends."""
    multiprocessing.connection.wait([multiprocessing.parent_process().sentinel])
    os._exit(1)
