#!/usr/bin/env python
"""Training beside a busy process: one thread, two threads, and one thread with the
weight-gradient helper (gradhelper.py), with and without its CPU steering.

The quickstart's training step on real batches of a prepared corpus (forward, chunked §5.4 loss,
backward, fp32-master Adam: `transformer train`'s step), each mode in turn for `--batches`
batches, rounds interleaved, in one process; alone and beside `python -c 'while True: pass'`.
Prints target tokens/s (median of the rounds, each round's figure) and the cores the process
used (CPU time / wall time), with the CPU model and ISA. Modes:

    one        torch.set_num_threads(1): the tuner's choice beside a busy process before
    two        two threads: the choice alone
    helper     one thread, the helper active (the tuner's "1+helper")
    unsteered  the same, the helper's thread left where the kernel wakes it (no affinity)

    .venv/bin/python benchmarks/bench_grad_helper.py --data RUN/data --rounds 6
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import nullcontext

from bench_contention import busy_process  # this script's folder is on sys.path
from bench_step_phases import training_setup
from transformer.allocator import keep_large_blocks
from transformer.cpuinfo import cpu_line
from transformer.errors import UserError
from transformer.tokenizer import PAD_ID

MODES = ("one", "two", "helper", "unsteered")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--data", required=True, help="a prepared corpus (`transformer prepare`)")
    ap.add_argument("--preset", default="quickstart")
    ap.add_argument("--modes", default="one,helper", help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--batches", type=int, default=40, help="timed batches per mode and round")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--where", default="busy", choices=("busy", "alone", "both"))
    ap.add_argument("--no-helper", action="store_true",
                    help="make no helper (its idle thread's cost to the other modes)")  # fmt: skip
    args = ap.parse_args()
    modes = args.modes.split(",")
    if not set(modes) <= set(MODES) or min(args.batches, args.rounds) < 1:
        ap.error(f"--modes: some of {', '.join(MODES)}; --batches and --rounds at least 1")
    import torch  # (~2.5 s) after the arguments' checks

    from transformer import gradhelper
    from transformer.loss import chunked_label_smoothed_loss

    keep_large_blocks()  # as `transformer train`
    helper = None if args.no_helper else gradhelper.WeightGradHelper.for_this_process()
    if helper is None and {"helper", "unsteered"} & set(modes):
        ap.error("no weight-gradient helper here (fewer than 2 usable CPUs?)")
    try:
        config, model, opt, batches = training_setup(args.data, args.preset, [])
    except UserError as e:
        ap.error(str(e))
    steer = helper._steer if helper is not None else None

    def step() -> int:
        b = next(batches)
        keep = b.tgt_out != PAD_ID
        hidden = model(b.src, b.src_mask, b.tgt_in, keep)
        target = b.tgt_out[keep]
        loss, _ = chunked_label_smoothed_loss(hidden, model.output_weight(), target,
                                              config.train.eps_ls)  # fmt: skip
        loss.backward()
        gradhelper.finish()
        opt.collect_grads()
        opt.step(1e-4, grad_scale=1.0 / target.numel())
        return target.numel()

    def run(mode: str) -> tuple[float, float]:
        torch.set_num_threads(2 if mode == "two" else 1)
        if helper is not None:
            helper.active = mode in ("helper", "unsteered")
            helper._steer = steer if mode == "helper" else (lambda: None)
        for _ in range(5):  # the mode's first steps untimed
            step()
        tokens, start, cpu = 0, time.perf_counter(), time.process_time()
        for _ in range(args.batches):
            tokens += step()
        wall = time.perf_counter() - start
        return tokens / wall, (time.process_time() - cpu) / wall

    dtype = next(model.parameters()).dtype
    print(f"# {cpu_line()}; torch {torch.__version__}; preset {args.preset}, {dtype}; "
          f"{args.rounds} rounds x {args.batches} batches")  # fmt: skip
    wheres = {"busy": [True], "alone": [False], "both": [False, True]}[args.where]
    medians = {}
    for busy in wheres:
        rates: dict[str, list[float]] = {m: [] for m in modes}
        cores: dict[str, list[float]] = {m: [] for m in modes}
        with busy_process() if busy else nullcontext():
            for _ in range(args.rounds):
                for m in modes:
                    rate, used = run(m)
                    rates[m].append(rate)
                    cores[m].append(used)
        where = "beside a busy process" if busy else "alone"
        for m in modes:
            medians[busy, m] = statistics.median(rates[m])
            each = " ".join(f"{r:.0f}" for r in rates[m])
            print(f"{m:9s} {where:21s}: {medians[busy, m]:6.0f} target tok/s ({each}), "
                  f"{statistics.median(cores[m]):.2f} cores", flush=True)  # fmt: skip
        if "one" in modes:
            for m in modes:
                ratio = medians[busy, m] / medians[busy, "one"]
                print(f"{m:9s} {where:21s}: {ratio:.3f}x one thread")


if __name__ == "__main__":
    main()
