"""Training streams, measured and not kept (docs/performance.md, "Training streams: tried, not
kept"): one bf16 training step of Transformer-base at the peers' W1 shape (128 pairs, ~3.8k
target tokens), run as

    one  the whole batch, 2 torch threads (what `transformer train` does on 2 free cores)
    t1   the whole batch, 1 torch thread
    sN   the batch cut into N row blocks, their forward+backward at once in N Python threads
         with one torch thread each, gradients adding up in .grad; then one Adam step

Target tokens/s per mode, rounds interleaved, in one process; run it alone and beside
`python -c 'while True: pass'` to see the contention figures. Timing only: the streams here
draw dropout masks from torch's one generator in whichever order the threads reach it.

    PYTHONPATH=benchmarks:../shared/peers .venv/bin/python benchmarks/bench_train_streams.py \\
        --modes one,t1,s2,s3,s4 --reps 3
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from common import make_mt_batch  # ../shared/peers
from train_adapters import PAPER_BASE  # ../shared/peers

from bench_contention import cpu_line
from peers_adapter import OurTrain


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--modes", default="one,t1,s2")
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    cfg = dict(PAPER_BASE)
    batch = make_mt_batch(128, 30, 30, 4, cfg["vocab"], seed=0)
    ours = OurTrain(cfg)
    model, opt = ours._run("bf16")
    full = ours.prepare(batch)
    keys = ("src", "tgt_in", "tgt_out")

    def parts(n: int) -> list[dict]:
        rows = 128 // n
        cuts = [(i * rows, 128 if i == n - 1 else (i + 1) * rows) for i in range(n)]
        return [ours.prepare({k: batch[k][a:b] for k in keys}) for a, b in cuts]

    def forward_backward(prep: dict) -> None:
        hidden = model(prep["src"], prep["src_mask"], prep["tgt_in"])
        loss, _ = ours.loss_fn(hidden[prep["keep"]], model.output_weight(), prep["target"], 0.1)
        loss.backward()

    def whole(threads: int):
        def step() -> None:
            torch.set_num_threads(threads)
            forward_backward(full)
            opt.collect_grads()
            opt.step(1e-4, 1.0 / full["ntokens"])

        return step

    def streams(n: int):
        blocks, pool = parts(n), ThreadPoolExecutor(n)

        def step() -> None:
            torch.set_num_threads(1)  # threads created or first used now take one
            list(pool.map(forward_backward, blocks))
            torch.set_num_threads(2)
            opt.collect_grads()
            opt.step(1e-4, 1.0 / full["ntokens"])

        return step

    modes = {"one": whole(2), "t1": whole(1)}
    for name in args.modes.split(","):
        if name.startswith("s"):
            modes[name] = streams(int(name[1:]))
    order = args.modes.split(",")
    print(f"# {cpu_line()}; batch {full['ntokens']} target tokens", flush=True)
    for name in order:
        modes[name]()  # warm-up
    rates: dict[str, list[float]] = {name: [] for name in order}
    for _ in range(args.reps):
        for name in order:
            start = time.perf_counter()
            modes[name]()
            rates[name].append(full["ntokens"] / (time.perf_counter() - start))
    for name in order:
        print(f"{name:>4}: " + " ".join(f"{r:6.0f}" for r in rates[name]) + " tok/s", flush=True)


if __name__ == "__main__":
    main()
