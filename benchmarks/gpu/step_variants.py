"""Our bf16 training step in variants, interleaved in one process, at bench_gpu.py's shape on a
GPU (832 sentences x 30 tokens, V = 32,000; base and big):

  head        the step as it is; on CUDA `MixedPrecisionAdam.collect_grads` copies a step's
              bf16 gradients to the fp32 masters as one multi-tensor `_foreach_copy_` (on a CPU
              one at a time, as per-tensor: peak memory)
  per-tensor  collect_grads as before 2026-12-04 (and on a CPU): `batched_copies` off, one
              `p.grad.float()` per parameter (~260 launches of a few µs each in a base step)
  bias-mm     head, each layer's bias gradient a product, 1^T dY (`ProductBiasLinear`, here
              only), instead of autograd's dY.sum(0): the bf16 column reduction that took ~6% of
              a base step's kernel time on an H200 (docs/performance.md, "GPU")
  fused-norm  head, each post-norm sub-layer's LayerNorm(x + Dropout(f)) one function through
              `torch.compile(dynamic=True)` (one graph for every layer and batch shape; here
              only): layer norms, adds and dropout were ~20% of a base step's kernel time there

First the bias gradient's three ways alone on the step's (rows, width) shapes (dY.sum(0),
1^T dY, dY^T 1): median time (CUDA events) and the largest difference from an fp64 sum.
Then per preset each variant gets its own model and optimizer (same seeds), 3 warm-up steps,
then ROUNDS interleaved rounds of 2 timed steps; medians, and each variant's time against head.
`--device cpu` runs the same on the CPU (one thread; default 600 target tokens: a rehearsal).

    PYTHONPATH=src python3 -W ignore benchmarks/gpu/step_variants.py [--rounds 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
import bench_gpu  # noqa: E402
from transformer import gradhelper  # noqa: E402
from transformer.config import PRESETS, build_config  # noqa: E402
from transformer.model import _Residual  # noqa: E402
from transformer.optim import MixedPrecisionAdam  # noqa: E402

VARIANTS = ("head", "per-tensor", "bias-mm", "fused-norm")


class ProductBiasLinear(torch.autograd.Function):
    """y = x W^T + b (x 2-D) with addmm's backward products (dx = dY W, dW = dY^T x: the same
    calls autograd makes) and db = 1^T dY, a product, instead of dY.sum(0)."""

    @staticmethod
    def forward(ctx, x, weight, bias):  # noqa: D102
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):  # noqa: D102
        x, weight = ctx.saved_tensors
        dx = g @ weight if ctx.needs_input_grad[0] else None
        dw = g.t() @ x if ctx.needs_input_grad[1] else None
        db = (g.new_ones(1, g.size(0)) @ g).view(-1) if ctx.needs_input_grad[2] else None
        return dx, dw, db


PLAIN_FORWARD = gradhelper.Linear.forward


def product_bias_forward(self, x: torch.Tensor) -> torch.Tensor:
    """`gradhelper.Linear.forward` for the bias-mm variant."""
    if not torch.is_grad_enabled() or self.bias is None or not self.bias.requires_grad:
        return PLAIN_FORWARD(self, x)
    if x.dim() == 2:
        return ProductBiasLinear.apply(x, self.weight, self.bias)
    y = ProductBiasLinear.apply(x.reshape(-1, x.size(-1)), self.weight, self.bias)
    return y.view(*x.shape[:-1], y.size(-1))


def post_norm(x, f, weight, bias, p: float, eps: float):
    """§3.1, §5.4: LayerNorm(x + Dropout(f)) over the last dimension."""
    return F.layer_norm(x + F.dropout(f, p, True), (x.size(-1),), weight, bias, eps)


PLAIN_RESIDUAL = _Residual.forward
COMPILED_POST_NORM = None  # made on first use: torch.compile(post_norm, dynamic=True)


def fused_norm_forward(self, x: torch.Tensor, sublayer) -> torch.Tensor:
    """`model._Residual.forward` for the fused-norm variant (post-norm, training only)."""
    global COMPILED_POST_NORM
    if self.norm_first or not (self.training and torch.is_grad_enabled()):
        return PLAIN_RESIDUAL(self, x, sublayer)
    if COMPILED_POST_NORM is None:
        COMPILED_POST_NORM = torch.compile(post_norm, dynamic=True)
    norm = self.norm
    return COMPILED_POST_NORM(x, sublayer(x), norm.weight, norm.bias, self.p_drop, norm.eps)


def bias_sums(device: torch.device, rows: int) -> None:
    """The bias gradient's three ways alone: median time of 20 and error against fp64."""
    for width in (512, 1024, 2048, 4096):
        g = torch.randn(rows, width, device=device).to(torch.bfloat16)
        exact = g.double().sum(0)
        row, column = g.new_ones(1, rows), g.new_ones(rows)
        ways = {
            "sum(0)": lambda g=g: g.sum(0),
            "1^T dY": lambda g=g, o=row: (o @ g).view(-1),
            "dY^T 1": lambda g=g, o=column: g.t() @ o,
        }
        line = []
        for name, f in ways.items():
            for _ in range(3):
                f()
            times = []
            for _ in range(20):
                if device.type == "cuda":
                    a = torch.cuda.Event(enable_timing=True)
                    b = torch.cuda.Event(enable_timing=True)
                    a.record()
                    out = f()
                    b.record()
                    b.synchronize()
                    times.append(a.elapsed_time(b) * 1000)
                else:
                    start = time.perf_counter()
                    out = f()
                    times.append((time.perf_counter() - start) * 1e6)
            err = float((out.double() - exact).abs().max())
            line.append(f"{name} {statistics.median(times):7.1f} us (max err {err:.3g})")
        print(f"bias sum ({rows}, {width}) bf16: " + " | ".join(line), flush=True)


def build(cfg, body: torch.Tensor, variant: str):
    """bench_gpu.ours's step for one variant, run with that variant's code in place."""
    made: list[MixedPrecisionAdam] = []
    orig_init = MixedPrecisionAdam.__init__

    def init(self, *a, **k):
        orig_init(self, *a, **k)
        made.append(self)

    torch.manual_seed(1)
    MixedPrecisionAdam.__init__ = init
    try:
        step = bench_gpu.ours(cfg, body)
    finally:
        MixedPrecisionAdam.__init__ = orig_init
    if variant == "per-tensor":  # collect_grads' CPU way: one p.grad.float() per parameter
        made[0].batched_copies = False
    forward = product_bias_forward if variant == "bias-mm" else PLAIN_FORWARD
    residual = fused_norm_forward if variant == "fused-norm" else PLAIN_RESIDUAL

    def run() -> None:
        gradhelper.Linear.forward, _Residual.forward = forward, residual
        try:
            step()
        finally:
            gradhelper.Linear.forward, _Residual.forward = PLAIN_FORWARD, PLAIN_RESIDUAL

    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["base", "big"])
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--tokens", type=int, default=None, help="target tokens (25,000; CPU 600)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = p.parse_args()
    variants = args.variants.split(",")
    if set(variants) - set(VARIANTS) or args.rounds < 1:
        p.error(f"--variants: some of {','.join(VARIANTS)}; --rounds: at least 1")
    if set(args.presets) - set(PRESETS):
        p.error(f"--presets: some of {', '.join(PRESETS)}")
    if args.tokens is not None and args.tokens < 30:
        p.error("--tokens: at least 30 (one sentence of 30 tokens)")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: not run")
        return
    tokens = args.tokens or (25000 if device.type == "cuda" else 600)
    if device.type == "cpu":
        torch.set_num_threads(1)
    length = 30
    bias_sums(device, tokens // length * length)
    for preset in args.presets:
        cfg = build_config(preset, None, ["train.dtype=bf16"], vocab_size=32000)
        torch.manual_seed(0)
        body = torch.randint(4, 32000, (tokens // length, length - 1), device=device)
        steps = {}
        for v in variants:
            steps[v] = build(cfg, body, v)
            for _ in range(3):
                steps[v]()
            bench_gpu.sync(device)
        times = {v: [] for v in variants}
        for _ in range(args.rounds):
            for v in variants:
                for _ in range(2):
                    bench_gpu.sync(device)
                    start = time.perf_counter()
                    steps[v]()
                    bench_gpu.sync(device)
                    times[v].append(time.perf_counter() - start)
        ntok = body.numel() + body.size(0)  # each sentence and its EOS
        first = statistics.median(times[variants[0]])
        for v in variants:
            med = statistics.median(times[v])
            print(f"{preset:>5} {v:>10}: {ntok / med:9.0f} tgt tok/s  {med * 1000:.2f} ms/step "
                  f"(min {min(times[v]) * 1000:.2f} max {max(times[v]) * 1000:.2f})  "
                  f"time / {variants[0]}'s {med / first:.3f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
