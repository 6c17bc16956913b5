"""Training throughput and MFU of the base and big presets on one CUDA GPU, bf16.

The paper's ~25k-token batches (§5.1: ~25,000 source + ~25,000 target tokens), synthetic
sentences of ~30 tokens, V = 32,000 tied; the full step is ours (bf16 parameters, fp32 master
Adam, chunked non-pad loss); attention on CUDA takes PyTorch's fused kernels (model.attention).
MFU = analytic model FLOPs (experiments.flops.training_flops) / step time / the measured bf16
matrix-product rate of the same GPU. Without CUDA it says so and exits 0.

    .venv/bin/python benchmarks/bench_gpu.py                       # base and big
    .venv/bin/python benchmarks/bench_gpu.py --presets base --tokens 25000 --steps 10
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from transformer.config import build_config
from transformer.experiments.flops import measure_matmul_tflops, training_flops
from transformer.loss import chunked_label_smoothed_loss
from transformer.optim import MixedPrecisionAdam
from transformer.tokenizer import BOS_ID, EOS_ID, PAD_ID
from transformer.train import build_model


def run(preset: str, tokens: int, length: int, steps: int, vocab: int) -> dict:
    cfg = build_config(preset, None, ["train.dtype=bf16"], vocab_size=vocab)
    device = torch.device("cuda")
    model = build_model(cfg, device).train()
    opt = MixedPrecisionAdam(model.parameters(), (0.9, 0.98), 1e-9)
    n = tokens // length
    body = torch.randint(4, vocab, (n, length - 1), device=device)
    src = torch.cat([body, torch.full((n, 1), EOS_ID, device=device)], 1)  # (B, S)
    tgt_in = torch.cat([torch.full((n, 1), BOS_ID, device=device), body], 1)  # (B, T)
    keep = src != PAD_ID
    times = []
    for i in range(steps + 2):  # two warm-up steps
        torch.cuda.synchronize()
        start = time.perf_counter()
        hidden = model(src, keep, tgt_in)
        loss, _ = chunked_label_smoothed_loss(hidden[keep], model.output_weight(), src[keep], 0.1)
        loss.backward()
        opt.collect_grads()
        opt.step(1e-4, 1.0 / int(keep.sum()))
        torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - start)
    step = statistics.median(times)
    flops = training_flops(cfg.model, src.numel(), src.numel(), length, length)
    return {"preset": preset, "tgt_tokens": src.numel(), "s_per_step": step,
            "tok_per_s": src.numel() / step, "tflops": flops / step / 1e12,
            "peak_mem_GiB": torch.cuda.max_memory_allocated() / 2**30}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["base", "big"])
    p.add_argument("--tokens", type=int, default=25000, help="target tokens per batch")
    p.add_argument("--length", type=int, default=30)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--vocab", type=int, default=32000)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: GPU benchmark not run (not measured)")
        return
    peak = measure_matmul_tflops("bf16", size=8192, seconds=2.0)
    print(f"{torch.cuda.get_device_name()}: bf16 matmul {peak:.0f} TFLOP/s (8192^3)")
    for preset in args.presets:
        r = run(preset, args.tokens, args.length, args.steps, args.vocab)
        print(f"{preset:>5}: {r['tok_per_s']:9.0f} tgt tok/s  {r['s_per_step']:.3f} s/step  "
              f"{r['tflops']:.0f} TFLOP/s model = MFU {r['tflops'] / peak:.1%}  "
              f"peak mem {r['peak_mem_GiB']:.1f} GiB")  # fmt: skip


if __name__ == "__main__":
    main()
