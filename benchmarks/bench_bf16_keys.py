#!/usr/bin/env python
"""A bf16 model's encoder-decoder keys as bf16 rows against fp32 K^T: before/after in ONE process.

On the CPU a decoding step's encoder-decoder keys are kept as a view of K^T in fp32, whose rows
a step's few queries weight and sum (`model._transposed_keys`); a bf16 model's were widened to
fp32 once per batch for it. Where a step's attention is `kernels.step_attention`, which widens
bf16 keys in registers as it reads them, they now stay bf16 rows (`model.bf16_key_rows`): a step
reads half the bytes (docs/performance.md, "Round forty-two"). This times both ways in one
process, switching `model.bf16_key_rows` between runs, in pairs whose order alternates
(`bench_int8_rows.paired`):

* `--what layers`: the encoder-decoder attention of a W2 greedy step (64 rows, 8 heads, 34 source
  positions padded to 48), cycling over six layers' keys and values;
* `--what w2`: the peers' W2 in bf16 (a random Transformer-base, 64 sentences forced to 50
  tokens), greedy and beam 4;
* `--what real --model M --src FILE`: a real model translating a file's lines in bf16.

    .venv/bin/python benchmarks/bench_bf16_keys.py --what w2 --pairs 8
    .venv/bin/python benchmarks/bench_bf16_keys.py --what real --model QS/model.safetensors \
        --src QS/data/test.en.txt --threads 2 --pairs 6
"""

from __future__ import annotations

import math
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)

import bench_int8_rows as ab  # noqa: E402
import transformer.model as M  # noqa: E402
from transformer import kernels  # noqa: E402
from transformer.cpuinfo import cpu_line  # noqa: E402

SWITCH = (M, "bf16_key_rows")
LABELS = ("fp32 K^T", "bf16 rows")


def layers(args) -> None:
    g = torch.Generator().manual_seed(0)
    B, H, S, d = 64, 8, 48, 64
    heads = []
    for _ in range(6):
        k = torch.randn(B, H, S, d, generator=g).bfloat16()
        v = torch.randn(B, H, S, d, generator=g).bfloat16()
        kt = k.float().transpose(-2, -1).contiguous().transpose(-2, -1)
        heads.append((k, kt, v))
    q = torch.randn(B, H, 1, d, generator=g)
    bias = torch.zeros(B, 1, 1, S)
    bias[:, :, :, 34:] = float("-inf")
    per = 60

    def calls() -> None:
        rows = M.bf16_key_rows()
        for i in range(per):
            k, kt, v = heads[i % len(heads)]
            kernels.step_attention(q, k if rows else kt, v, bias, math.sqrt(d))

    calls()
    ab.paired(f"({B}, {H}, 1, {d}) x {S} keys", calls, args.pairs, per, switch=SWITCH,
              labels=LABELS)  # fmt: skip


def main() -> None:
    args = ab.arguments(__doc__.split("\n")[0])
    if not M.step_attention_kernel():
        sys.exit("bench_bf16_keys.py: the step attention kernel does not run here (no AVX-512 "
                 "or AVX2, or the library does not build: `python -c 'from transformer import "
                 "kernels; print(kernels.unavailable())'`)")  # fmt: skip
    print(f"# {cpu_line()}; torch {torch.__version__}, threads {args.threads}, {args.pairs} pairs")
    if args.what == "layers":
        layers(args)
    elif args.what == "w2":
        ab.w2(args, switch=SWITCH, dtype="bf16", labels=LABELS)
    else:
        ab.real(args, switch=SWITCH, dtype="bf16", labels=LABELS)


if __name__ == "__main__":
    main()
