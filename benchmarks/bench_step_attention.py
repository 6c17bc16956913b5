#!/usr/bin/env python
"""A decoding step's attention, compiled kernel against torch's ops: before/after in ONE process.

On the CPU a decoding step's eq. (1) (`model._attention_rowwise`) is four torch passes over the
step's keys and values (the scores as a batched product or as sums of K^T's rows, the softmax,
the values as weighted row sums), each (batch, head) a tiny product; `kernels.step_attention`
does each (batch, head) in one pass, fetching the next head's keys and values meanwhile and not
reading the keys a beam's or a source's mask leaves out (docs/performance.md, "Round
thirty-eight"). This times both ways in one process, switching `model.step_attention_kernel`
between runs, in pairs whose order alternates (`bench_int8_rows.paired`), and prints each pair's
speed-up and their median:

* `--what layers`: one call at a W2 step's shapes (Transformer-base, 64 sentences; greedy and
  beam 4, self-attention at 8, 24 and 48 positions, cross-attention over 34 source tokens in
  blocks of 16), six layers' caches in turn as a step reads them;
* `--what w2`: the peers' W2 (a random Transformer-base, 64 sentences forced to 50 tokens),
  greedy and beam 4, in --dtype (int8, auto's choice without AMX; fp32; bf16);
* `--what real --model M --src FILE`: a real model translating a file's lines.

    .venv/bin/python benchmarks/bench_step_attention.py --what w2 --pairs 8
    .venv/bin/python benchmarks/bench_step_attention.py --what real --model QS/model.safetensors \
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

SWITCH = (M, "step_attention_kernel")
B, H, D = 64, 8, 64  # W2: Transformer-base's heads, 64 sentences
LAYERS = 6


def _bias(masked: torch.Tensor) -> torch.Tensor:
    return torch.zeros(masked.shape).masked_fill_(masked, float("-inf"))


def _cases(g: torch.Generator):
    """(name, six layers' (q, k, v, bias)) at a W2 step's shapes, laid out as decoding has them."""
    for t in (8, 24, 48):  # greedy self-attention: (B, H, capacity 64, D) caches, no mask
        qkv = [torch.randn(B, 1, 3 * H * D, generator=g) for _ in range(LAYERS)]
        yield f"greedy self, {t} positions", [
            (x[..., : H * D].view(B, 1, H, D).transpose(1, 2),
             torch.randn(B, H, 64, D, generator=g)[:, :, :t],
             torch.randn(B, H, 64, D, generator=g)[:, :, :t], None) for x in qkv]  # fmt: skip
    lens = torch.randint(26, 35, (B,), generator=g)
    pad = _bias(torch.arange(48)[None, :] >= lens[:, None]).view(B, 1, 1, 48)
    for beams in (1, 4):  # cross-attention: K^T, 34 tokens at most in blocks of 16
        yield f"{'greedy' if beams == 1 else 'beam 4'} cross, 48 keys", [
            (torch.randn(B, H, beams, D, generator=g),
             M._transposed_keys(torch.randn(B, H, 48, D, generator=g)),
             torch.randn(B, H, 48, D, generator=g), pad) for _ in range(LAYERS)]  # fmt: skip
    for t in (8, 24, 48):  # beam 4 self-attention: every beam's history, a mask per beam
        hist = torch.randint(0, 4, (B, 4, t + 1), generator=g)
        hist[:, :, t] = torch.arange(4)
        bias = _bias(hist[..., None] != torch.arange(4)).view(B, 1, 4, (t + 1) * 4)
        L = (t + 1) * 4
        yield f"beam 4 self, {t + 1} positions", [
            (torch.randn(B, H, 4, D, generator=g), torch.randn(B, H, L, D, generator=g),
             torch.randn(B, H, L, D, generator=g), bias) for _ in range(LAYERS)]  # fmt: skip


def layers(args) -> None:
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for name, steps in _cases(g):
            per = 4 * LAYERS

            def calls(steps=steps, per=per) -> None:
                for i in range(per):
                    q, k, v, bias = steps[i % LAYERS]
                    M._attention_rowwise(q, k, v, bias, None, True, aligned=True)

            calls()
            ab.paired(name, calls, args.pairs, per, switch=SWITCH)


def main() -> None:
    args = ab.arguments(__doc__.split("\n")[0], dtypes=True)
    if not M.step_attention_kernel():
        sys.exit("bench_step_attention.py: the kernel does not run here (no AVX-512, or the "
                 "library does not build: `python -c 'from transformer import kernels; "
                 "print(kernels.unavailable())'`)")  # fmt: skip
    print(f"# {cpu_line()}; torch {torch.__version__}, threads {args.threads}, {args.pairs} pairs")
    if args.what == "layers":
        print(f"# {B} x {H} heads of {D}, {LAYERS} layers' tensors in turn")
        layers(args)
    elif args.what == "w2":
        ab.w2(args, switch=SWITCH, dtype=args.dtype)
    else:
        ab.real(args, switch=SWITCH, dtype=args.dtype)


if __name__ == "__main__":
    main()
