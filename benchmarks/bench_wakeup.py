#!/usr/bin/env python
"""Where the kernel wakes a helper thread: alone, and beside one busy process.

A main thread does 24 one-thread (256, 256) matrix products an iteration and hands 8 more to a
helper on torch's inter-op thread (TorchScript `fork`: C++, no GIL), then waits for it. Modes:

    serial    all 32 on the main thread
    fork      the helper where the kernel puts it when it wakes
    steered   the helper's affinity set, before each job, to the CPUs the main thread is not on
              (`gradhelper.WeightGradHelper`'s own steering, on its pool thread)

Prints iterations/s and the cores the process used (CPU time / wall time), each mode in a fresh
process, alone and beside `python -c 'while True: pass'`. docs/performance.md, round nine: beside
a busy process the woken helper is queued on its waker's CPU (fork ~ serial, 1.0 cores) unless
steered (~1.33 cores).

    .venv/bin/python benchmarks/bench_wakeup.py
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Sequence
from contextlib import nullcontext

from bench_contention import busy_process, cpu_line  # this script's folder is on sys.path

MODES = ("serial", "fork", "steered")


def one(mode: str, seconds: float) -> None:
    """Run one mode in this process and print its rate."""
    import torch

    from transformer.gradhelper import WeightGradHelper

    torch.set_num_threads(1)
    helper = WeightGradHelper.for_this_process()  # the inter-op pool: one thread, found
    if helper is None:
        raise SystemExit("bench_wakeup.py: no helper thread here (fewer than 2 usable CPUs?)")
    a, b = torch.randn(256, 256), torch.randn(256, 256)

    @torch.jit.script
    def job(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        for _ in range(8):
            a = a @ b * 0.01
        return a

    @torch.jit.script
    def launch(a: torch.Tensor, b: torch.Tensor) -> torch.jit.Future[torch.Tensor]:
        return torch.jit.fork(job, a, b)

    def main_work() -> None:
        for _ in range(24):
            torch.mm(a, b)

    for _ in range(5):
        launch(a, b).wait()
    n, start, cpu = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - start < seconds:
        if mode == "serial":
            job(a, b)
            main_work()
        else:
            if mode == "steered":
                helper._steer()
            future = launch(a, b)
            main_work()
            future.wait()
        n += 1
    wall = time.perf_counter() - start
    print(f"{n / wall:.1f} {(time.process_time() - cpu) / wall:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--one", choices=MODES, help=argparse.SUPPRESS)  # a child process
    args = ap.parse_args()
    if args.one:
        one(args.one, args.seconds)
        return
    if args.seconds <= 0 or args.rounds < 1:
        ap.error("--seconds must be positive and --rounds at least 1")
    print(f"# {cpu_line()}; {args.rounds} rounds of {args.seconds:g} s, a fresh process each")
    run_fresh(__file__, MODES, args.rounds, ["--seconds", str(args.seconds)])


def run_fresh(script: str, modes: Sequence[str], rounds: int, args: list[str]) -> None:
    """Each mode in a fresh process (`script --one MODE *args`, which prints "rate cores"),
    the modes interleaved round by round, alone and then beside a busy process."""
    width = max(len(m) for m in modes)
    for busy in (False, True):
        where = "beside a busy process" if busy else "alone"
        with busy_process() if busy else nullcontext():
            for _ in range(rounds):
                for mode in modes:
                    out = subprocess.run(
                        [sys.executable, script, "--one", mode, *args],
                        capture_output=True, text=True, check=True,
                    ).stdout.split()  # fmt: skip
                    print(f"{mode:{width}s} {where:21s}: {float(out[0]):6.1f} iterations/s, "
                          f"{out[1]} cores", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
