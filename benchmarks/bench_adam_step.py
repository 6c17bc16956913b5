#!/usr/bin/env python
"""The bf16 training step's Adam in one pass against torch's five: before/after in ONE process.

With bf16 parameters `optim.MixedPrecisionAdam` took torch's five passes over every parameter
after a step's backward: each bf16 gradient copied to fp32, the copies scaled by 1 / tokens, their
norm, `torch._fused_adam_` on the fp32 masters and moments, the masters copied back to bf16. Now
(`optim.one_pass_adam`, `kernels.adam_update`) the bf16 gradients are read as they are, twice:
once for the norm, once for the update, which scales each as it is read and writes the master,
both moments and the bf16 parameter; the same bits (docs/performance.md, "Round thirty-nine").
This times both ways in one process, switching `optim.one_pass_adam` between runs, in pairs whose
order alternates (`bench_int8_rows.paired`):

* `--what w1`: the peers' W1 step (Transformer-base, bf16, 128 pairs of ~30 tokens, V 32,000);
* `--what quickstart`: the quickstart preset's model (N 3, d_model 256, V 8,000) on batches of
  ~960 target tokens, the size the preset trains on;
* `--what optimizer`: each model's optimizer alone (`collect_grads` and `step` on a step's real
  bf16 gradients, set again before each call).

    .venv/bin/python benchmarks/bench_adam_step.py --what w1 --pairs 10
    .venv/bin/python benchmarks/bench_adam_step.py --what optimizer --pairs 20
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)
sys.path.insert(0, os.environ.get("PEERS_DIR", os.path.join(HERE, "..", "..", "shared", "peers")))

from common import make_mt_batch  # noqa: E402  (the peers' harness)
from train_adapters import PAPER_BASE  # noqa: E402

import bench_int8_rows as ab  # noqa: E402
import peers_adapter  # noqa: E402
import transformer.optim as O  # noqa: E402
from transformer.cpuinfo import cpu_line  # noqa: E402

SWITCH = (O, "one_pass_adam")
SHAPES = {  # name: (the model's config, pairs in a batch, tokens a sentence)
    "w1": (dict(PAPER_BASE), 128, 30),
    "quickstart": (dict(PAPER_BASE, vocab=8000, d_model=256, d_ff=1024, heads=4, layers=3), 32, 30),
}


def _adapter(name: str):
    cfg, pairs, length = SHAPES[name]
    train = peers_adapter.make_train(cfg)
    batch = train.prepare(make_mt_batch(pairs, length, length, 4, cfg["vocab"], seed=0))
    for _ in range(2):  # warm: the model, its optimizer and the kernels built
        train.step(batch, torch.bfloat16)
    return train, batch, sum(p.numel() for p in train.model.parameters())


def steps(name: str, args) -> None:
    train, batch, n = _adapter(name)
    print(f"{name}: {n / 1e6:.1f}M parameters, whole training steps", flush=True)
    ab.paired(f"{name} step", lambda: train.step(batch, torch.bfloat16), args.pairs, switch=SWITCH)


def optimizer(args) -> None:
    for name in SHAPES:
        train, batch, n = _adapter(name)
        opt = train.runs["bf16"][1]
        grads = _gradients(train, batch)

        def run(opt=opt, grads=grads) -> None:
            for p, m, (g, master) in zip(opt.params, opt.masters, grads, strict=True):
                p.grad = g
                m.grad = None if master is None else master.clone()  # the torch path scales it
            opt.collect_grads()
            opt.step(1e-4, grad_scale=1 / 3826)

        run()
        ab.paired(f"{name} optimizer ({n / 1e6:.1f}M)", run, args.pairs, switch=SWITCH)


def _gradients(train, batch) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
    """A step's gradients of the adapter's model: each parameter's (bf16) and each master's
    (fp32: the tied weight's, which go there directly), as they stand after the backward."""
    opt = train.runs["bf16"][1]
    real = O.MixedPrecisionAdam.step
    O.MixedPrecisionAdam.step = lambda self, *a, **k: 0.0  # collect, do not step
    try:
        train.step(batch, torch.bfloat16)
    finally:
        O.MixedPrecisionAdam.step = real
    out = []
    for i, m in enumerate(opt.masters):
        held = opt.held[i]
        out.append((held, None if m.grad is None else m.grad.clone()))
    opt.zero_grad()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--what", choices=["w1", "quickstart", "optimizer"], default="w1")
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.pairs < 1 or args.threads < 1:
        parser.error("--pairs and --threads must be at least 1")
    torch.set_num_threads(args.threads)
    print(cpu_line(), f"| torch {torch.__version__} | {args.threads} threads", flush=True)
    if not O.one_pass_adam():
        sys.exit("the one-pass Adam does not run here (no AVX-512, or TRANSFORMER_FUSED_KERNELS=0)")
    if args.what == "optimizer":
        optimizer(args)
    else:
        steps(args.what, args)


if __name__ == "__main__":
    main()
