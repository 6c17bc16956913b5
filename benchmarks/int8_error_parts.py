#!/usr/bin/env python
"""Which part of int8 decoding costs BLEU: each quantization simulated alone, in fp32.

`quantize_int8` rounds two things: the weights (one scale per output row, 127 levels, or 63
where the CPU lacks VNNI) and each product's input (fbgemm's dynamic quantization: 8 bits
over the whole input tensor, asymmetric). This script simulates each in fp32 ("fake
quantization": round to the int8 grid, multiply back), alone and together, on every
nn.Linear and on the tied pre-softmax projection separately, decodes a real split with each
variant and prints sacreBLEU beside fp32's and the real int8 kernels'. The simulated "63 /
tensor / tensor" variant is what the kernels compute, up to their accumulation order.

A variant is WEIGHT_LEVELS:LAYER_INPUTS:PROJECTION_INPUTS, e.g. 63:tensor:tensor. Inputs:
none (fp32), tensor (8 bits per tensor), token (8 bits per row), or for the projection also
fp32 (no quantization at all, weights included).

    python benchmarks/int8_error_parts.py --model runs/q/model.safetensors --data runs/q/data \
        --split test --alpha 1.4 63:none:none 63:tensor:tensor 63:token:token 63:tensor:fp32
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from transformer.bleu import corpus_bleu  # noqa: E402
from transformer.data import load_prepared  # noqa: E402
from transformer.translate import Translator, quantize_int8  # noqa: E402

INPUT_MODES = ("none", "tensor", "token")


def fake_quantize_inputs(x: torch.Tensor, mode: str) -> torch.Tensor:
    """x rounded to an asymmetric 8-bit grid (zero exactly representable, as fbgemm's) whose
    range is the whole tensor's ("tensor") or each row's ("token"); "none": x."""
    if mode == "none":
        return x
    if mode == "tensor":
        lo, hi = x.min().clamp(max=0), x.max().clamp(min=0)
    else:
        lo = x.amin(-1, keepdim=True).clamp(max=0)
        hi = x.amax(-1, keepdim=True).clamp(min=0)
    scale = ((hi - lo) / 255).clamp(min=1e-12)
    zero = (-lo / scale).round()
    return ((x / scale).round() + zero).clamp(0, 255).sub(zero) * scale


class FakeInt8Linear(nn.Module):
    """y = q(x) q(W)^T + b in fp32, q rounding to the int8 grids described above."""

    def __init__(self, weight, bias, levels: float | None, inputs: str):
        super().__init__()
        w = weight.detach().float()
        if levels is not None:
            scale = (w.abs().amax(1, keepdim=True) / levels).clamp(min=1e-12)
            w = (w / scale).round().clamp(-levels, levels) * scale
        self.weight, self.inputs = w, inputs
        self.bias = None if bias is None else bias.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(fake_quantize_inputs(x.float(), self.inputs), self.weight, self.bias)


def variant(model: nn.Module, spec: str) -> nn.Module:
    """A copy of `model` with every nn.Linear and the projection quantized as `spec` says."""
    parts = spec.split(":")
    ok = len(parts) == 3 and parts[0].isdigit() and 1 <= int(parts[0]) <= 127
    if not ok or parts[1] not in INPUT_MODES or parts[2] not in (*INPUT_MODES, "fp32"):
        raise SystemExit(
            f"error: bad variant {spec!r}: want LEVELS:LAYER_INPUTS:PROJECTION_INPUTS, LEVELS "
            f"1-127, inputs one of {', '.join(INPUT_MODES)} (projection also fp32), e.g. "
            "63:tensor:tensor"
        )
    levels, layer_inputs, proj_inputs = parts
    model = copy.deepcopy(model)
    for name, linear in [(n, m) for n, m in model.named_modules() if type(m) is nn.Linear]:
        parent, _, attr = name.rpartition(".")
        q = FakeInt8Linear(linear.weight, linear.bias, float(levels), layer_inputs)
        setattr(model.get_submodule(parent) if parent else model, attr, q)
    if proj_inputs == "fp32":
        model.projection = FakeInt8Linear(model.output_weight(), None, None, "none")
    else:
        model.projection = FakeInt8Linear(model.output_weight(), None, float(levels), proj_inputs)
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True, help="a prepared data directory")
    ap.add_argument("--split", default="test")
    ap.add_argument("--alpha", type=float, default=0.6, help="length penalty")
    ap.add_argument("--beams", default="4,1")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("variants", nargs="*", default=["63:tensor:tensor"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    data = load_prepared(args.data)
    split = data.split(args.split)
    sources, refs = split.text(data.src_lang), split.text(data.tgt_lang)
    tr = Translator.from_path(args.model, dtype="fp32")
    fp32 = tr.model
    beams = [int(b) for b in args.beams.split(",")]
    print(f"{args.model} on {args.split} ({len(sources)} sentences), alpha {args.alpha}\n")
    print("| variant | " + " | ".join(f"beam {b}" for b in beams) + " |")
    print("|---|" + "---:|" * len(beams))
    models = [("fp32", fp32), ("int8 kernels", quantize_int8(fp32))]
    models += [(spec, variant(fp32, spec)) for spec in args.variants]
    for name, model in models:
        tr.model = model
        scores = []
        for beam in beams:
            out = tr.translate(sources, beam_size=beam, length_penalty=args.alpha)
            scores.append(corpus_bleu([n[0].text for n in out], refs).score)
        print(f"| {name} | " + " | ".join(f"{s:.2f}" for s in scores) + " |", flush=True)


if __name__ == "__main__":
    main()
