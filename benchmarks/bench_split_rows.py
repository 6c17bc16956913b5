"""A layer's linear products with some of their rows on the helper thread, alone and beside a busy
process (the forward pass of `gradhelper.WeightGradHelper.split_linear`).

One iteration is a Transformer layer's four products at one batch of rows (x W^Q|K|V, the
output projection, the two feed-forward products; bf16, ReLU between the last two). Modes, each
in a fresh process, one torch thread each unless said:

    one         every product on the main thread
    two         every product on two torch threads (OpenMP)
    split:F     the last F of each product's rows on the helper (steered off the main thread's
                CPU, as in training), joined after each product

    .venv/bin/python benchmarks/bench_split_rows.py --rounds 2
    .venv/bin/python benchmarks/bench_split_rows.py --d-model 256 --d-ff 1024   # quickstart's

Prints iterations/s and the cores the process used (CPU time / wall time).
"""

from __future__ import annotations

import argparse
import time

from bench_contention import cpu_line  # this script's folder is on sys.path
from bench_wakeup import run_fresh


def one(mode: str, rows: int, d_model: int, d_ff: int, seconds: float) -> None:
    """Run one mode in this process and print its rate and cores."""
    import torch

    from transformer.gradhelper import WeightGradHelper

    torch.set_num_threads(2 if mode == "two" else 1)
    helper = WeightGradHelper.for_this_process()
    if helper is None:
        raise SystemExit("bench_split_rows.py: no helper thread here (fewer than 2 usable CPUs?)")
    share = float(mode.split(":")[1]) if mode.startswith("split:") else 0.0
    torch.manual_seed(0)
    x = torch.randn(rows, d_model, dtype=torch.bfloat16)
    shapes = [(3 * d_model, d_model), (d_model, d_model), (d_ff, d_model), (d_model, d_ff)]
    weights = [torch.randn(o, i, dtype=torch.bfloat16) * 0.05 for o, i in shapes]
    theirs = int(rows * share) // 16 * 16

    def linear(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if not theirs:
            return a @ w.t()
        out = torch.empty(rows, w.shape[0], dtype=a.dtype)
        helper._steer()
        future = helper._launch_rows(a[rows - theirs :], w, None, out[rows - theirs :])
        torch.mm(a[: rows - theirs], w.t(), out=out[: rows - theirs])
        future.wait()
        return out

    def layer() -> None:
        qkv = linear(x, weights[0])
        h = linear(qkv[:, :d_model].contiguous(), weights[1])
        linear(torch.relu(linear(h, weights[2])), weights[3])

    for _ in range(5):
        layer()
    n, start, cpu = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - start < seconds:
        layer()
        n += 1
    wall = time.perf_counter() - start
    print(f"{n / wall:.1f} {(time.process_time() - cpu) / wall:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--modes", default="one,two,split:0.25,split:0.33,split:0.5")
    ap.add_argument("--rows", type=int, default=1024, help="rows (tokens) of each product")
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--d-ff", type=int, default=2048)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a child process: this mode
    args = ap.parse_args()
    if min(args.rows, args.d_model, args.d_ff, args.rounds) < 1 or args.seconds <= 0:
        ap.error("--rows, --d-model, --d-ff and --rounds must be at least 1, --seconds positive")
    modes = args.modes.split(",")
    for mode in modes:
        share = mode.removeprefix("split:")
        if mode not in ("one", "two") and not (
            mode.startswith("split:") and share.replace(".", "", 1).isdigit()
            and 0 < float(share) < 1
        ):  # fmt: skip
            ap.error(f"--modes: {mode!r} is not one, two or split:F with 0 < F < 1")
    if args.one:
        one(args.one, args.rows, args.d_model, args.d_ff, args.seconds)
        return
    print(f"# {cpu_line()}; rows {args.rows}, d_model {args.d_model}, d_ff {args.d_ff}, bf16; "
          f"{args.rounds} rounds of {args.seconds:g} s, a fresh process each")  # fmt: skip
    sizes = ["--rows", str(args.rows), "--d-model", str(args.d_model), "--d-ff", str(args.d_ff)]
    run_fresh(__file__, modes, args.rounds, ["--seconds", str(args.seconds), *sizes])


if __name__ == "__main__":
    main()
