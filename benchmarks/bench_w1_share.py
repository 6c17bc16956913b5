"""W1's share of W0 with both measured in the same minutes: W0's products and our W1 steps
alternated in one process.

Issue 19's AMX target asks a W1 step to run at >= 65% of the measured bf16 matmul rate. The
table's first reading of it divides the harness's W1 step (bench_train.py: ours beside four
peers in one process) by the W0 rate bench_matmul.py measured minutes before. On a KVM guest
whose speed moves by a third within half an hour that quotient reads the host's drift as much
as the step: in round fifty-three's table W0 ran at 1,588 GFLOP/s at 04:58 and our step took
1.94 s at 05:00; at 06:28 the same harness gave 1.33 s with every peer ~1.5x faster too
(docs/performance.md, "Round fifty-four").

Here each round times W0's products (bench_matmul.py's own shapes and torch.mm, `--min-time`
seconds each) and then `--steps` of our W1 steps (bench_train.py's batch and our adapter) in
the same process, so each round's share compares two rates measured seconds apart:

    share = step FLOPs / step seconds / median over W0's shapes of their GFLOP/s

W0 here runs in a process where our adapter has set glibc to keep large freed blocks
(allocator.keep_large_blocks, as `transformer train` does): bench_matmul.py's own process maps
and faults in the 262 MB output of its 4096 x 512 x 32,000 shape on every call, which there
runs at ~840 GFLOP/s and here at ~2,300, as the other three shapes run. W0's median is then ~3%
higher than bench_matmul.py's in the same minutes, and the share that much lower.

The step's FLOPs are issue19_summary.step_flops (the analytic count of a Transformer-base step
on the batch's real tokens). Run it alone on the machine, in the harness's Python:

    PYTHONPATH=src:benchmarks PY=/work/peers-venv/bin/python \\
        python benchmarks/bench_w1_share.py --rounds 8 --json OUT/w1_share.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

from bench_w2_processes import PEERS, Usage, stats
from issue19_summary import step_flops

OURS = "ext:peers_adapter:make_train"
W0_SHAPES = "4096x512x2048,4096x2048x512,4096x512x32000,2048x2048x2048"  # bench_matmul's


def harness(peers: Path):
    """The peers' modules this needs: common, bench_matmul, train_adapters (Usage if absent)."""
    for name in ("common.py", "bench_matmul.py", "train_adapters.py"):
        if not (peers / name).is_file():
            raise Usage(f"{peers / name}: not found (--peers or PEERS_DIR)")
    sys.path.insert(0, str(peers))
    return (importlib.import_module(m) for m in ("common", "bench_matmul", "train_adapters"))


def shapes(text: str) -> list[tuple[int, int, int]]:
    out = []
    for item in text.split(","):
        dims = item.split("x")
        if len(dims) != 3 or not all(d.isdigit() and int(d) > 0 for d in dims):
            raise Usage(f"--shapes: comma-separated MxKxN of positive integers, got {item!r}")
        out.append(tuple(int(d) for d in dims))
    return out


def check(args: argparse.Namespace) -> list[tuple[int, int, int]]:
    if min(args.rounds, args.steps, args.threads) < 1 or args.warmup < 0:
        raise Usage("--rounds, --steps and --threads must be at least 1, --warmup at least 0")
    if not args.min_time > 0:
        raise Usage(f"--min-time: seconds above 0, got {args.min_time}")
    if args.json and not Path(args.json).resolve().parent.is_dir():
        raise Usage(f"--json: no directory {Path(args.json).resolve().parent}")
    return shapes(args.shapes)


def timed_products(cases: list[dict], min_time: float) -> dict[str, float]:
    """Each W0 case's GFLOP/s over at least min_time seconds of calls."""
    rates = {}
    for c in cases:
        n, t0 = 0, time.perf_counter()
        while True:
            c["fn"]()
            n += 1
            dt = time.perf_counter() - t0
            if dt >= min_time:
                break
        rates[c["shape"]] = c["flop"] * n / dt / 1e9
    return rates


def run(args: argparse.Namespace) -> dict:
    dims = check(args)
    common, bench_matmul, train_adapters = harness(args.peers)
    common.setup_threads(args.threads)
    import torch  # noqa: PLC0415  (after the harness's threads, as bench_train.py orders it)

    amp = {"bf16": torch.bfloat16, "fp32": None}[args.dtype]
    cfg = dict(train_adapters.PAPER_BASE)
    batch = common.make_mt_batch(args.sents, args.src_len, args.tgt_len, args.jitter,
                                 cfg["vocab"], seed=0)  # fmt: skip
    flops = step_flops(batch["shape"])
    cases = [{"shape": f"{m}x{k}x{n}", "flop": 2.0 * m * k * n,
              "fn": bench_matmul.make_case(args.dtype, m, k, n)} for m, k, n in dims]  # fmt: skip
    try:
        adapter = train_adapters.get_adapter(args.impl, cfg)
        prepared = adapter.prepare(batch)
    except Exception as e:  # noqa: BLE001 -- as bench_train.py reports a build that failed
        raise Usage(f"{args.impl}: not built: {type(e).__name__}: {e}") from e
    print(f"# batch: {batch['shape']}; {flops / 1e12:.3f} TFLOP a step; {args.impl}: "
          f"{adapter.notes}", flush=True)  # fmt: skip
    timed_products(cases, min(args.min_time, 0.1))  # each product's first call, warm
    for _ in range(args.warmup):
        adapter.step(prepared, amp)
    rounds = []
    for r in range(args.rounds):
        w0 = timed_products(cases, args.min_time)
        steps = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            adapter.step(prepared, amp)
            steps.append(time.perf_counter() - t0)
        w0_median = statistics.median(w0.values())
        step_s = statistics.median(steps)
        share = flops / step_s / 1e9 / w0_median
        rounds.append({"w0_gflops": w0, "w0_median": w0_median, "step_s": steps,
                       "step_gflops": flops / step_s / 1e9, "share": share})  # fmt: skip
        print(f"# round {r}: W0 {' / '.join(f'{v:,.0f}' for v in w0.values())} GFLOP/s "
              f"(median {w0_median:,.0f}); step {step_s:.3f} s = {flops / step_s / 1e9:,.0f} "
              f"GFLOP/s: {share:.1%}", flush=True)  # fmt: skip
    share = stats([r["share"] for r in rounds])
    print(f"\n# W1 share of W0 ({args.dtype}), {args.rounds} rounds, each W0's {len(cases)} "
          f"shapes then {args.steps} step(s), threads={torch.get_num_threads()}: median "
          f"{share['median']:.1%} ({share['min']:.1%}-{share['max']:.1%})")  # fmt: skip
    return {
        "env": common.env_info(), "args": {**vars(args), "peers": str(args.peers)},
        "batch": batch["shape"], "step_flops": flops, "impl": args.impl, "dtype": args.dtype,
        "rounds": rounds, "share": share,
        "w0_median": stats([r["w0_median"] for r in rounds]),
        "step_s": stats([s for r in rounds for s in r["step_s"]]),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--impl", default=OURS, help="the bench_train.py implementation to time")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"),
                   help="the step's and W0's precision")  # fmt: skip
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=2, help="timed steps a round")
    p.add_argument("--warmup", type=int, default=2, help="steps before the first round")
    p.add_argument("--min-time", type=float, default=0.3, help="seconds of each W0 shape a round")
    p.add_argument("--shapes", default=W0_SHAPES, help="W0's MxKxN, comma-separated")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--sents", type=int, default=128, help="bench_train.py's batch")
    p.add_argument("--src-len", type=int, default=30)
    p.add_argument("--tgt-len", type=int, default=30)
    p.add_argument("--jitter", type=int, default=4)
    p.add_argument("--json", default="", help="write the rounds and the share here")
    p.add_argument("--peers", type=Path, default=Path(os.environ.get("PEERS_DIR", PEERS)))
    args = p.parse_args(argv)
    try:
        out = run(args)
    except Usage as e:
        print(f"bench_w1_share.py: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("bench_w1_share.py: interrupted", file=sys.stderr)
        return 130
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
