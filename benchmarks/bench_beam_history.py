#!/usr/bin/env python
"""bf16 beam search over back-pointers against reordered copies: before/after in ONE process.

Beam search reorders its hypotheses at every step. In fp32 and int8 the cache keeps each
hypothesis's keys and values where they were computed and follows back-pointers
(`cache.BeamHistory`); bf16 copied the reordered prefix of every layer's keys and values at
every step instead, since through torch's ops the back-pointers' K x (t + 1) keys were widened
to fp32 every layer and step (0.95x, round twenty-three). Where a step's attention is
`kernels.step_attention`, which reads bf16 keys in place and skips the masked ones, bf16 now
follows the back-pointers too (`model.bf16_beam_history`; docs/performance.md, "Round forty").
This times both ways in one process, switching `model.bf16_beam_history` between runs, in pairs
whose order alternates (`bench_int8_rows.paired`); greedy search (beam 1), which never
reorders, is the control:

* `--what w2`: the peers' W2 (a random Transformer-base, 64 sentences forced to 50 tokens);
* `--what real --model M --src FILE`: a real model translating a file's lines.

    .venv/bin/python benchmarks/bench_beam_history.py --what w2 --pairs 10
    .venv/bin/python benchmarks/bench_beam_history.py --what real --model QS/model.safetensors \
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
import transformer.model as M  # noqa: E402
from transformer.cpuinfo import cpu_line  # noqa: E402

SWITCH = (M, "bf16_beam_history")
LABELS = ("copies", "back-pointers")


def main() -> None:
    args = ab.arguments(__doc__.split("\n")[0], dtypes=True)
    if args.what == "layers":
        sys.exit("bench_beam_history.py: --what w2 or real (whole searches)")
    if args.dtype != "bf16":
        sys.exit("bench_beam_history.py: --dtype bf16 (fp32 and int8 always take back-pointers)")
    if not M.bf16_beam_history():
        sys.exit("bench_beam_history.py: bf16 takes the copies here (no compiled step "
                 "attention: `python -c 'from transformer import kernels; "
                 "print(kernels.unavailable())'`)")  # fmt: skip
    print(f"# {cpu_line()}; torch {torch.__version__}, threads {args.threads}, {args.pairs} pairs")
    if args.what == "w2":
        ab.w2(args, switch=SWITCH, dtype="bf16", labels=LABELS)
    else:
        ab.real(args, switch=SWITCH, dtype="bf16", labels=LABELS)


if __name__ == "__main__":
    main()
