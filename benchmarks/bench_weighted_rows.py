#!/usr/bin/env python
"""A decoding step's weights-times-values product: the batched product (`w @ v`) against the
weighted sums of value rows (`model._weighted_rows`, embedding_bag), alone and inside W2.

products: each product alone at W2's shapes (64 sentences, 8 heads, d_v 64), over twelve
    buffers of each shape in turn so that, as in a real step, they are not in the cache:
    the encoder-decoder values (34 positions), a cache's prefix (40 of 64 positions) and beam
    search's grouped queries (4 a head against 124 positions); microseconds a call.
w2: bench_decode's W2 (a random Transformer-base, 64 sentences, 50 target tokens each) in this
    one process, the row sums on (the default) and off (`model.WEIGHTED_ROWS_MAX_QUERIES` 0:
    the batched product in fp32) in turn, the order flipped every round; median target
    tokens/s.

    .venv/bin/python benchmarks/bench_weighted_rows.py --what products,w2 --rounds 9
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import TYPE_CHECKING

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from transformer.cpuinfo import cpu_line  # noqa: E402

if TYPE_CHECKING:  # torch's import (~2.5 s) waits for the arguments' checks: see main
    import torch

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}  # torch's names


def per_call_us(fn, calls: int = 300) -> float:
    for _ in range(10):
        fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def in_turn(product, values: list[torch.Tensor]):
    """A call of `product` on the next of `values`, round and round."""
    turn = iter(range(10**9))
    return lambda: product(values[next(turn) % len(values)])


def products(dtypes: list[str]) -> None:
    import torch

    from transformer import model as model_module

    print("| product | dtype | w @ v (us) | row sums (us) | ratio |")
    print("|---|---|---:|---:|---:|")
    with torch.inference_mode():
        shapes = {  # name: (B, H, queries, positions, capacity)
            "encoder-decoder, 34 positions": (64, 8, 1, 34, 34),
            "cache prefix, 40 of 64": (64, 8, 1, 40, 64),
            "beam 4 grouped, 124 positions": (64, 8, 4, 124, 124),
        }
        for name, (B, H, Tq, L, cap) in shapes.items():
            for dtype in dtypes:
                dt = getattr(torch, DTYPES[dtype])
                vs = [torch.randn(B, H, cap, 64, dtype=dt)[:, :, :L] for _ in range(12)]
                w = torch.randn(B, H, Tq, L).softmax(-1).to(dt)
                assert model_module._weighted_rows_apply(w.float(), vs[0])
                a = per_call_us(in_turn(lambda v, w=w: w @ v, vs))
                b = per_call_us(in_turn(lambda v, w=w: model_module._weighted_rows(w, v), vs))
                print(f"| {name} | {dtype} | {a:.0f} | {b:.0f} | {a / b:.2f}x |", flush=True)


def w2(dtypes: list[str], beams: list[int], rounds: int, out_len: int) -> None:
    from bench_decode import base_model, run_ours, w2_source  # this script's folder
    from transformer import model as model_module

    src, src_mask = w2_source()
    on = model_module.WEIGHTED_ROWS_MAX_QUERIES
    print("\n| dtype | beam | off (tok/s) | on (tok/s) | change | on, rounds | off, rounds |")
    print("|---|---:|---:|---:|---:|---|---|")
    for dtype in dtypes:
        model = base_model(dtype)
        for beam in beams:
            rates: dict[str, list[float]] = {"on": [], "off": []}
            for r in range(rounds):
                for name in ("on", "off") if r % 2 == 0 else ("off", "on"):
                    model_module.WEIGHTED_ROWS_MAX_QUERIES = on if name == "on" else 0
                    run_ours(model, src, src_mask, beam, 4)  # warm: this setting's kernels
                    t0 = time.perf_counter()
                    n = run_ours(model, src, src_mask, beam, out_len)
                    rates[name].append(n / (time.perf_counter() - t0))
            model_module.WEIGHTED_ROWS_MAX_QUERIES = on
            off, new = statistics.median(rates["off"]), statistics.median(rates["on"])
            rounds_on = " ".join(f"{x:,.0f}" for x in rates["on"])
            rounds_off = " ".join(f"{x:,.0f}" for x in rates["off"])
            print(f"| {dtype} | {beam} | {off:,.0f} | {new:,.0f} | {new / off - 1:+.1%} "
                  f"| {rounds_on} | {rounds_off} |", flush=True)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--what", default="products,w2", help="products and/or w2")
    p.add_argument(
        "--dtypes",
        default="int8,bf16",
        help="some of fp32, bf16, int8 (products: int8 decodes its attention in fp32)",
    )
    p.add_argument("--beams", default="1,4")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out-len", type=int, default=50)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    what = args.what.split(",")
    dtypes = args.dtypes.split(",")
    if not set(what) <= {"products", "w2"}:
        p.error(f"--what: products and/or w2, got {args.what!r}")
    if not set(dtypes) <= {"fp32", "bf16", "int8"}:
        p.error(f"--dtypes: some of fp32, bf16, int8, got {args.dtypes!r}")
    try:
        beams = [int(b) for b in args.beams.split(",")]
    except ValueError:
        p.error(f"--beams: comma-separated beam sizes, got {args.beams!r}")
    if min(beams) < 1 or args.rounds < 1 or args.out_len < 1 or args.threads < 1:
        p.error("--beams, --rounds, --out-len and --threads must be at least 1")
    import torch

    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    print(f"# {cpu_line()}; torch {torch.__version__}, {args.threads} threads; load {load:.2f}")
    if "products" in what:
        products(sorted({"bf16" if d == "bf16" else "fp32" for d in dtypes}, reverse=True))
    if "w2" in what:
        w2(dtypes, beams, args.rounds, args.out_len)


if __name__ == "__main__":
    main()
