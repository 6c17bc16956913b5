"""The server that the processes of `train --procs N` fork from (`distributed.run_local`).

Python's forkserver, with torch and the job's modules imported once, so that no rank imports
them again. This module imports no torch: the CLI starts the server as soon as `--procs N`
asks for one, and the server's imports of torch then run beside the CLI's own (~2 s each on a
Zen 3) instead of after them.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import signal


def start(module: str) -> multiprocessing.context.ForkServerContext:
    """The forkserver context whose server imports torch, `torch.distributed`,
    `transformer.distributed` and `module` (the job function's) as it starts; the server
    started now, without waiting for its imports, or found running (one per process, kept for
    later jobs). It starts with Ctrl-C ignored: a Ctrl-C to the job's process group midway
    through its imports would end it there with a traceback, before it ignores Ctrl-C itself.
    The job's process stops the ranks on Ctrl-C, and each rank takes Ctrl-C again as the job's
    process does (distributed.run_local)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(
        ["__main__", "torch", "torch.distributed", "transformer.distributed", module]
    )
    try:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread, where the handler is set: as it is
        multiprocessing.forkserver.ensure_running()
        return ctx
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGINT, signal.SIG_DFL if previous is None else previous)
    return ctx
