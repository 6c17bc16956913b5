"""Training throughput (target tokens/s) and peak memory, fp32 vs bf16, on synthetic batches.

Each (preset, dtype) runs in its own subprocess, so peak RSS is that configuration's alone.
A step is the full training step: forward, chunked §5.4 loss, backward, fp32-master Adam.

    .venv/bin/python benchmarks/bench_train.py                      # cpu-small and base
    .venv/bin/python benchmarks/bench_train.py --presets base --tokens 4000 --steps 3
    .venv/bin/python benchmarks/bench_train.py --profile cpu-small:bf16   # where time goes
    .venv/bin/python benchmarks/bench_train.py --interleaved --steps 6    # fair bf16/fp32 ratio
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

from transformer.config import build_config
from transformer.loss import chunked_label_smoothed_loss
from transformer.optim import MixedPrecisionAdam, learning_rate
from transformer.tokenizer import BOS_ID, EOS_ID, PAD_ID
from transformer.train import build_model


def synthetic_batch(tokens: int, length: int, vocab: int, seed: int = 0):
    """B = tokens // length sentences of `length` subwords (Multi30k-like ~ 15-30), no padding."""
    g = torch.Generator().manual_seed(seed)
    n = max(1, tokens // length)
    body = torch.randint(4, vocab, (n, length - 1), generator=g)
    src = torch.cat([body, torch.full((n, 1), EOS_ID)], 1)  # (B, S)
    tgt_in = torch.cat([torch.full((n, 1), BOS_ID), body], 1)  # (B, T)
    tgt_out = src.clone()  # (B, T)
    return src, torch.ones_like(src, dtype=torch.bool), tgt_in, tgt_out


def make_step(preset: str, dtype: str, tokens: int, length: int, vocab: int):
    """A closure running one full training step on a fixed synthetic batch; and the model."""
    cfg = build_config(preset, None, [f"train.dtype={dtype}"], vocab_size=vocab)
    model = build_model(cfg, torch.device("cpu")).train()
    opt = MixedPrecisionAdam(model.parameters(), (0.9, 0.98), 1e-9)
    src, src_mask, tgt_in, tgt_out = synthetic_batch(tokens, length, vocab)

    def step(i: int) -> None:
        hidden = model(src, src_mask, tgt_in)  # (B, T, D)
        keep = tgt_out != PAD_ID
        loss, _ = chunked_label_smoothed_loss(
            hidden[keep], model.output_weight(), tgt_out[keep], 0.1
        )
        loss.backward()
        opt.collect_grads()
        opt.step(learning_rate(i + 1, cfg.model.d_model, 4000), 1.0 / tgt_out.numel())

    return step, model, tgt_out.numel()


def run_one(preset: str, dtype: str, tokens: int, length: int, steps: int, vocab: int) -> dict:
    step, model, n_tgt = make_step(preset, dtype, tokens, length, vocab)
    step(0)  # warm-up: allocations, kernel selection
    start = time.perf_counter()
    for i in range(steps):
        step(i + 1)
    elapsed = time.perf_counter() - start
    return {
        "preset": preset,
        "dtype": dtype,
        "params_M": model.num_parameters() / 1e6,
        "batch_tgt_tokens": n_tgt,
        "s_per_step": elapsed / steps,
        "tgt_tokens_per_s": n_tgt * steps / elapsed,
        "peak_rss_GiB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }


def interleaved(preset: str, tokens: int, length: int, steps: int, vocab: int) -> None:
    """fp32 and bf16 steps alternated in one process: on a shared machine both see the same
    load, so their ratio is fair even when absolute numbers are not."""
    runs = {d: make_step(preset, d, tokens, length, vocab) for d in ("fp32", "bf16")}
    times: dict[str, list[float]] = {d: [] for d in runs}
    for step, _, _ in runs.values():
        step(0)  # warm-up
    for i in range(steps):
        for d, (step, _, _) in runs.items():
            start = time.perf_counter()
            step(i + 1)
            times[d].append(time.perf_counter() - start)
    n_tgt = runs["fp32"][2]
    for d, t in times.items():
        best, med = min(t), sorted(t)[len(t) // 2]
        print(f"{preset:>10} {d:>5}  median {med:7.3f} s/step ({n_tgt / med:6.0f} tgt tok/s), "
              f"best {best:7.3f} s/step ({n_tgt / best:6.0f} tgt tok/s)")  # fmt: skip
    ratio = sorted(times["fp32"])[steps // 2] / sorted(times["bf16"])[steps // 2]
    print(f"{preset}: bf16 / fp32 throughput (medians, interleaved) = {ratio:.2f}x")


def profile(preset: str, dtype: str, tokens: int, length: int, vocab: int) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    cfg = build_config(preset, None, [f"train.dtype={dtype}"], vocab_size=vocab)
    model = build_model(cfg, torch.device("cpu")).train()
    opt = MixedPrecisionAdam(model.parameters(), (0.9, 0.98), 1e-9)
    src, src_mask, tgt_in, tgt_out = synthetic_batch(tokens, length, vocab)
    for _ in range(2):  # the second step is profiled
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            hidden = model(src, src_mask, tgt_in)
            keep = tgt_out != PAD_ID
            w = model.output_weight()
            loss, _ = chunked_label_smoothed_loss(hidden[keep], w, tgt_out[keep], 0.1)
            loss.backward()
            opt.collect_grads()
            opt.step(1e-4, 1.0 / tgt_out.numel())
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["cpu-small", "base"])
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"])
    p.add_argument("--tokens", type=int, default=4000, help="target tokens per batch")
    p.add_argument("--length", type=int, default=25, help="sentence length in subwords")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--vocab", type=int, default=8000, help="8000 = the Multi30k preparation")
    p.add_argument("--threads", type=int, default=0, help="0 = all cores")
    p.add_argument("--profile", metavar="PRESET:DTYPE", help="profile one step instead")
    p.add_argument("--interleaved", action="store_true", help="alternate fp32/bf16 steps")
    p.add_argument("--one", nargs=2, metavar=("PRESET", "DTYPE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.profile:
        preset, dtype = args.profile.split(":")
        profile(preset, dtype, args.tokens, args.length, args.vocab)
        return
    if args.interleaved:
        for preset in args.presets:
            interleaved(preset, args.tokens, args.length, args.steps, args.vocab)
        return
    if args.one:
        res = run_one(*args.one, args.tokens, args.length, args.steps, args.vocab)
        print(json.dumps(res))
        return
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch {args.tokens} "
        f"target tokens of length {args.length}, V={args.vocab}"
    )
    rows = []
    for preset in args.presets:
        for dtype in args.dtypes:
            cmd = [sys.executable, __file__, "--one", preset, dtype, "--tokens", str(args.tokens),
                   "--length", str(args.length), "--steps", str(args.steps),
                   "--vocab", str(args.vocab), "--threads", str(args.threads)]  # fmt: skip
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
            r = rows[-1]
            print(f"{preset:>10} {dtype:>5}  {r['params_M']:6.1f}M params  "
                  f"{r['s_per_step']:7.3f} s/step  {r['tgt_tokens_per_s']:8.0f} tgt tok/s  "
                  f"peak RSS {r['peak_rss_GiB']:.2f} GiB")  # fmt: skip
    for preset in args.presets:
        by = {r["dtype"]: r for r in rows if r["preset"] == preset}
        if "fp32" in by and "bf16" in by:
            ratio = by["bf16"]["tgt_tokens_per_s"] / by["fp32"]["tgt_tokens_per_s"]
            print(f"{preset}: bf16 / fp32 throughput = {ratio:.2f}x")


if __name__ == "__main__":
    main()
