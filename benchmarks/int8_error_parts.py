#!/usr/bin/env python
"""Which part of int8 decoding costs BLEU: each quantization simulated alone, in fp32.

`quantize_int8` rounds two things: the weights (one scale per output row, 127 levels, or 63
where the CPU lacks VNNI) and each product's input (8 bits, each row on its own range:
`Int8Linear`). This script simulates each in fp32 ("fake
quantization": round to the int8 grid, multiply back), alone and together, on every
nn.Linear and on the tied pre-softmax projection separately, decodes a real split with each
variant and prints sacreBLEU beside fp32's and the real int8 kernels'. The simulated "63 /
row / row" variant (127 with VNNI) is what the kernels compute, up to their accumulation
order; "tensor" is what they computed before per-row inputs (fbgemm's dynamic quantization).

A variant is WEIGHT_LEVELS:LAYER_INPUTS:PROJECTION_INPUTS, e.g. 63:tensor:tensor. Levels
ending in g (63g) round the weights by GPTQ (`transformer.gptq`; column by column, each
rounding error spread over the columns not yet rounded through the inverse of X^T X, X the
layer's inputs over --calib-sentences of --calib-split, teacher-forced in fp32) instead of
to the nearest level: the same grid, so the same kernels. Inputs: none (fp32), row (the
kernels': 8 bits per row, symmetric), tensor (8 bits per tensor, asymmetric), token (8 bits
per row, asymmetric), rownorm (each row divided by its largest |x|, then 8 bits per tensor,
then multiplied back), or for the projection also fp32 (no quantization at all, weights
included).

BLEU moves by a few tenths between variants on 1,000 sentences, which is the noise of one test
set; --kl prints instead a smooth measure of the same damage, teacher-forced on the split:
KL(fp32 || variant) of the next-token distributions per target token, the share of positions
whose most probable token is unchanged, and the reference's NLL (seconds per variant).

    python benchmarks/int8_error_parts.py --model runs/q/model.safetensors --data runs/q/data \
        --split test --alpha 1.4 63:none:none 63:row:row 63:tensor:tensor 63:row:fp32
    python benchmarks/int8_error_parts.py --model runs/q/model.safetensors --data runs/q/data \
        --split valid --kl 127:row:row 127g:row:row 127g:tensor:tensor 127g:none:none
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
from transformer.data import PAD_ID, ParallelSplit, collate, load_prepared  # noqa: E402
from transformer.gptq import PROJECTION, gptq_round, input_moments, row_scales  # noqa: E402
from transformer.gradhelper import is_linear  # noqa: E402
from transformer.translate import (  # noqa: E402
    TINY,
    Translator,
    quantize_int8,
    relu_input_layers,
)

INPUT_MODES = ("none", "row", "tensor", "token", "rownorm")


def fake_quantize_inputs(x: torch.Tensor, mode: str, nonneg: bool = False) -> torch.Tensor:
    """x rounded to 8 bits. "row": what `Int8Linear` does, each row on [-m, m] in 254 steps, m
    its largest |x|, or on [0, m] in 255 where the layer's inputs are never negative (`nonneg`:
    the FFN's second layer). The others on an asymmetric grid (zero exactly representable, as
    fbgemm's dynamic quantization) whose range is the whole tensor's ("tensor", the kernels
    before per-row inputs) or each row's ("token"), or the whole tensor's after each row is
    divided by its largest |x| ("rownorm"); "none": x."""
    if mode == "none":
        return x
    if mode == "row":
        top = x.abs().amax(-1, keepdim=True).clamp(min=TINY)
        steps = 255 if nonneg else 127
        return (x / top * steps).round().clamp(0 if nonneg else -127, steps) * (top / steps)
    if mode == "rownorm":
        s = x.abs().amax(-1, keepdim=True).clamp(min=1e-12)
        return fake_quantize_inputs(x / s, "tensor") * s
    if mode == "tensor":
        lo, hi = x.min().clamp(max=0), x.max().clamp(min=0)
    else:
        lo = x.amin(-1, keepdim=True).clamp(max=0)
        hi = x.amax(-1, keepdim=True).clamp(min=0)
    scale = ((hi - lo) / 255).clamp(min=1e-12)
    zero = (-lo / scale).round()
    return ((x / scale).round() + zero).clamp(0, 255).sub(zero) * scale


class FakeInt8Linear(nn.Module):
    """y = q(x) q(W)^T + b in fp32, q rounding to the int8 grids described above; the weights
    by GPTQ (`gptq.gptq_round`) when `hessian` (X^T X of the layer's inputs) is given."""

    def __init__(self, weight, bias, levels: float | None, inputs: str, hessian=None, nonneg=False):
        super().__init__()
        w = weight.detach().float()
        if levels is not None and hessian is not None:
            scales = row_scales(w, levels)
            w = (gptq_round(w, scales, levels, hessian) * scales[:, None]).float()
        elif levels is not None:
            scale = (w.abs().amax(1, keepdim=True) / levels).clamp(min=1e-12)
            w = (w / scale).round().clamp(-levels, levels) * scale
        self.weight, self.inputs, self.nonneg = w, inputs, nonneg
        self.bias = None if bias is None else bias.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = fake_quantize_inputs(x.float(), self.inputs, self.nonneg)
        return F.linear(x, self.weight, self.bias)


def parse_variant(spec: str) -> tuple[float, bool, str, str]:
    """(levels, GPTQ?, layer inputs, projection inputs) of a variant; SystemExit if malformed."""
    parts = spec.split(":")
    levels = parts[0].removesuffix("g") if parts else ""
    ok = len(parts) == 3 and levels.isdigit() and 1 <= int(levels) <= 127
    if not ok or parts[1] not in INPUT_MODES or parts[2] not in (*INPUT_MODES, "fp32"):
        raise SystemExit(
            f"error: bad variant {spec!r}: want LEVELS[g]:LAYER_INPUTS:PROJECTION_INPUTS, "
            f"LEVELS 1-127 (g: rounded by GPTQ), inputs one of {', '.join(INPUT_MODES)} "
            "(projection also fp32), e.g. 63:tensor:tensor"
        )
    return float(levels), parts[0].endswith("g"), parts[1], parts[2]


def variant(model: nn.Module, spec: str, hessians: dict | None = None) -> nn.Module:
    """A copy of `model` with every nn.Linear and the projection quantized as `spec` says
    (GPTQ variants need `hessians`: `gptq.input_moments` of `model`)."""
    levels, gptq, layer_inputs, proj_inputs = parse_variant(spec)
    if gptq and hessians is None:
        raise ValueError(f"variant {spec}: GPTQ needs the layers' input moments (hessians)")
    model = copy.deepcopy(model)
    relu_inputs = relu_input_layers(model)
    for name, linear in [(n, m) for n, m in model.named_modules() if is_linear(m)]:
        parent, _, attr = name.rpartition(".")
        h = hessians[name] if gptq else None
        q = FakeInt8Linear(linear.weight, linear.bias, levels, layer_inputs, h,
                           nonneg=name in relu_inputs)  # fmt: skip
        setattr(model.get_submodule(parent) if parent else model, attr, q)
    if proj_inputs == "fp32":
        model.projection = FakeInt8Linear(model.output_weight(), None, None, "none")
    else:
        h = hessians[PROJECTION] if gptq else None
        weight = model.output_weight()
        model.projection = FakeInt8Linear(weight, None, levels, proj_inputs, h)
    return model


def _batches(split: ParallelSplit, n: int | None = None, rows: int = 64) -> list:
    """The first n pairs of `split` (all: None), by source length, in batches of `rows`."""
    order = sorted(range(min(n or len(split), len(split))), key=lambda i: len(split.src_tokens(i)))
    return [collate(split, order[i : i + rows]) for i in range(0, len(order), rows)]


@torch.no_grad()
def divergence(reference: nn.Module, model: nn.Module, batches: list) -> dict[str, float]:
    """Teacher-forced on `batches`, per target token: KL(reference || model) of the next-token
    distributions, the share of positions whose most probable token is the reference's, and
    the model's NLL of the reference translation."""
    kl = nll = 0.0
    same = tokens = 0
    for b in batches:
        keep = b.tgt_out != PAD_ID
        p = reference.project(reference(b.src, b.src_mask, b.tgt_in, keep)).log_softmax(-1)
        q = model.project(model(b.src, b.src_mask, b.tgt_in, keep)).float().log_softmax(-1)
        kl += float((p.exp() * (p - q)).sum())
        same += int((p.argmax(-1) == q.argmax(-1)).sum())
        nll -= float(q.gather(1, b.tgt_out[keep][:, None]).sum())
        tokens += int(keep.sum())
    return {"kl": kl / tokens, "top1": same / tokens, "nll": nll / tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True, help="a prepared data directory")
    ap.add_argument("--split", default="test")
    ap.add_argument("--alpha", type=float, default=0.6, help="length penalty")
    ap.add_argument("--beams", default="4,1")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kl", action="store_true", help="teacher-forced divergence, not BLEU")
    ap.add_argument("--calib-split", default="train", help="GPTQ's inputs (never --split)")
    ap.add_argument("--calib-sentences", type=int, default=2000)
    ap.add_argument("variants", nargs="*", default=["63:row:row"])
    args = ap.parse_args()
    for spec in args.variants:
        parse_variant(spec)  # a malformed one stops here, before any work
    torch.set_num_threads(args.threads)
    data = load_prepared(args.data)
    split = data.split(args.split)
    sources, refs = split.text(data.src_lang), split.text(data.tgt_lang)
    tr = Translator.from_path(args.model, dtype="fp32")
    fp32 = tr.loaded.model.float().eval()  # the plain model (tr.model packs the projection)
    hessians = None
    if any(parse_variant(spec)[1] for spec in args.variants):
        if args.calib_split == args.split:
            raise SystemExit(f"error: --calib-split {args.calib_split} is the measured split")
        calib = data.split(args.calib_split)
        hessians = input_moments(fp32, calib, args.calib_sentences)
        print(f"GPTQ calibrated on the first {args.calib_sentences} pairs of {args.calib_split}")
    gptq_kernels = []  # the int8 kernels with GPTQ's weights (`quantize_int8(moments=...)`)
    if hessians is not None:
        gptq_kernels = [("int8 kernels, GPTQ", quantize_int8(fp32, moments=hessians))]
    if args.kl:
        batches = _batches(split)
        nll = divergence(fp32, fp32, batches)["nll"]
        print(f"{args.model} on {args.split} ({len(sources)} sentences), teacher-forced\n")
        print(
            "| variant | KL(fp32 ‖ variant) per token | top-1 as fp32 | NLL (fp32 "
            + f"{nll:.4f}) |"
        )
        print("|---|---:|---:|---:|")
        models = [("int8 kernels", quantize_int8(fp32))] + gptq_kernels
        models += [(spec, variant(fp32, spec, hessians)) for spec in args.variants]
        for name, model in models:
            d = divergence(fp32, model, batches)
            print(f"| {name} | {d['kl']:.3e} | {d['top1']:.4f} | {d['nll']:.4f} |", flush=True)
        return
    beams = [int(b) for b in args.beams.split(",")]
    print(f"{args.model} on {args.split} ({len(sources)} sentences), alpha {args.alpha}\n")
    print("| variant | " + " | ".join(f"beam {b}" for b in beams) + " |")
    print("|---|" + "---:|" * len(beams))
    models = [("fp32", fp32), ("int8 kernels", quantize_int8(fp32)), *gptq_kernels]
    models += [(spec, variant(fp32, spec, hessians)) for spec in args.variants]
    for name, model in models:
        tr.model = model
        scores = []
        for beam in beams:
            out = tr.translate(sources, beam_size=beam, length_penalty=args.alpha)
            scores.append(corpus_bleu([n[0].text for n in out], refs).score)
        print(f"| {name} | " + " | ".join(f"{s:.2f}" for s in scores) + " |", flush=True)


if __name__ == "__main__":
    main()
