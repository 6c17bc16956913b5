#!/usr/bin/env python
"""Beam search's candidates by the compiled kernel against torch's ops: before/after in ONE process.

At every step beam search takes each live row's best 2K tokens (`search._rows_best`). In torch's
ops (`search._row_top`) that is the maxima of blocks of columns, a topk over them, a gather of the
best blocks' columns and a topk over those: four passes, and topk over a few hundred maxima falls
on torch's slow path (a full sort, not a partial one). `kernels.row_top` takes each row in one
pass: a vector compare against the n-th best so far, the rare column that beats it inserted in
order (docs/performance.md, "Round forty-one"). This times both ways in one process, switching
`search.row_top_kernel` between runs, in pairs whose order alternates (`bench_int8_rows.paired`);
greedy search (beam 1), which takes an argmax instead, is the control:

* `--what layers`: one call at beam 4's shapes: the quickstart's vocabulary (8,000) and W2's
  (32,000), 256 and 64 rows;
* `--what w2`: the peers' W2 (a random Transformer-base, 64 sentences forced to 50 tokens);
* `--what real --model M --src FILE`: a real model translating a file's lines.

    .venv/bin/python benchmarks/bench_row_top.py --what layers --pairs 20
    .venv/bin/python benchmarks/bench_row_top.py --what real --model QS/model.safetensors \
        --src QS/data/test.en.txt --threads 2 --pairs 10
"""

from __future__ import annotations

import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)

import bench_int8_rows as ab  # noqa: E402
import transformer.search as S  # noqa: E402
from transformer.cpuinfo import cpu_line  # noqa: E402

SWITCH = (S, "row_top_kernel")
LABELS = ("torch's ops", "kernel")
SHAPES = [(262, 8000), (64, 8000), (256, 32000), (64, 32000)]  # (rows, V), n = 8 (beam 4)


def layers(args) -> None:
    g = torch.Generator().manual_seed(0)
    for rows, V in SHAPES:
        x = torch.randn(rows, V, generator=g).log_softmax(-1)
        per = max(4, 20_000_000 // (rows * V))

        def calls(x=x, per=per) -> None:
            for _ in range(per):
                S._rows_best(x, 4)

        calls()
        ab.paired(f"({rows}, {V}) best 8", calls, args.pairs, per, switch=SWITCH, labels=LABELS)


def main() -> None:
    args = ab.arguments(__doc__.split("\n")[0], dtypes=True)
    if not S.row_top_kernel():
        sys.exit("bench_row_top.py: the kernel does not run here (no AVX-512 or AVX2, or the "
                 "library does not build: `python -c 'from transformer import kernels; "
                 "print(kernels.unavailable())'`)")  # fmt: skip
    print(f"# {cpu_line()}; torch {torch.__version__}, threads {args.threads}, {args.pairs} pairs")
    if args.what == "layers":
        layers(args)
    elif args.what == "w2":
        ab.w2(args, switch=SWITCH, dtype=args.dtype, labels=LABELS)
    else:
        ab.real(args, switch=SWITCH, dtype=args.dtype, labels=LABELS)


if __name__ == "__main__":
    main()
