"""Table 1 (§4): one self-attention layer, full versus restricted (window r), against length n.

Measures forward + backward time and peak memory of one multi-head self-attention layer
(W^Q, W^K, W^V, attention, W^O; d_model 512, h 8 by default) for:
  full    the paper's self-attention, PyTorch's fused kernel, no mask: O(n²·d);
  masked  restricted attention as the model implements `attn_window`: a |i-j|<=r mask on full
          attention, so still O(n²·d) work and an n² score matrix;
  banded  `transformer.experiments.banded.attention_banded`: O(r·n·d).
Each point runs in a fresh subprocess so that its peak RSS (CPU) or peak allocated memory (CUDA)
belongs to it alone.

    .venv/bin/python benchmarks/bench_attention_window.py --window 32 \
        --json docs/table1.json --plot docs/table1.png
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch

from transformer.experiments.banded import attention_banded
from transformer.model import MultiHeadAttention, attention, window_mask


def _layer_step(attn: MultiHeadAttention, x: torch.Tensor, impl: str, window: int) -> None:
    """One forward + backward pass of self-attention over x (B, N, D)."""
    B, N, _ = x.shape
    k, v = attn.project_kv(x)  # (B, H, N, K), (B, H, N, Vd)
    q = attn.w_q(x).view(B, N, attn.n_heads, attn.d_k).transpose(1, 2)  # (B, H, N, K)
    if impl == "full":
        out = attention(q, k, v, fused=True)
    elif impl == "masked":
        out = attention(q, k, v, window_mask(N, window, x.device), fused=True)
    else:
        out = attention_banded(q, k, v, window)
    out = attn.w_o(out.transpose(1, 2).reshape(B, N, -1))  # (B, N, D)
    out.sum().backward()


def measure_one(impl: str, n: int, window: int, d_model: int, heads: int, device: str, reps: int):
    """Time (median seconds) and peak memory (MiB above the set-up baseline) of one point."""
    torch.manual_seed(0)
    attn = MultiHeadAttention(d_model, heads, d_model // heads, d_model // heads).to(device)
    x = torch.randn(1, n, d_model, device=device, requires_grad=True)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    _layer_step(attn, x, impl, window)  # warm-up, and the memory peak
    sync()
    if device.startswith("cuda"):
        peak_mib = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        peak_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
    # CPU time of this (single-threaded) process is robust to other jobs sharing the cores;
    # wall time is what a user waits. Both are medians over the repetitions.
    wall, cpu = [], []
    for _ in range(reps):
        start, start_cpu = time.perf_counter(), time.process_time()
        _layer_step(attn, x, impl, window)
        sync()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return {"impl": impl, "n": n, "window": window, "seconds": statistics.median(wall),
            "cpu_seconds": statistics.median(cpu), "peak_mib": peak_mib}  # fmt: skip


def _sweep(args: argparse.Namespace) -> list[dict]:
    rows = []
    for n in args.lengths:
        for impl in ("full", "masked", "banded"):
            limit = {"full": args.max_full, "masked": args.max_masked}.get(impl, 10**9)
            if n > limit:
                continue
            cmd = [sys.executable, __file__, "--one", impl, str(n), "--window", str(args.window),
                   "--d-model", str(args.d_model), "--heads", str(args.heads),
                   "--device", args.device, "--threads", str(args.threads),
                   "--reps", str(args.reps)]  # fmt: skip
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            row = json.loads(out.strip().splitlines()[-1])
            rows.append(row)
            print(f"{impl:>7} n={n:>6} r={args.window}: {1000 * row['seconds']:9.1f} ms wall "
                  f"{1000 * row['cpu_seconds']:9.1f} ms cpu {row['peak_mib']:8.1f} MiB",
                  flush=True)  # fmt: skip
    return rows


def _plot(rows: list[dict], path: str, title: str, time_key: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for impl, style in (("full", "o-"), ("masked", "s--"), ("banded", "^-")):
        pts = [r for r in rows if r["impl"] == impl]
        n = [r["n"] for r in pts]
        axes[0].loglog(n, [1000 * r[time_key] for r in pts], style, label=impl, base=2)
        axes[1].loglog(n, [max(r["peak_mib"], 0.1) for r in pts], style, label=impl, base=2)
    time_label = f"forward+backward {'CPU' if time_key == 'cpu_seconds' else 'wall'} time (ms)"
    for ax, ylabel in zip(axes, (time_label, "peak memory above baseline (MiB)"), strict=True):
        ax.set_xlabel("sequence length n")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--one", nargs=2, metavar=("IMPL", "N"), help=argparse.SUPPRESS)
    p.add_argument("--lengths", type=int, nargs="+",
                   default=[128, 256, 512, 1024, 2048, 4096, 8192, 16384])  # fmt: skip
    p.add_argument("--window", type=int, default=32, help="r: neighbours on each side")
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--max-full", type=int, default=4096, help="longest n for full attention")
    p.add_argument("--max-masked", type=int, default=4096, help="longest n for masked attention")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--plot", help="write a PNG here (needs matplotlib)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.one:
        impl, n = args.one[0], int(args.one[1])
        row = measure_one(impl, n, args.window, args.d_model, args.heads, args.device, args.reps)
        print(json.dumps(row))
        return
    rows = _sweep(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": {k: v for k, v in vars(args).items() if k != "one"},
                       "rows": rows}, f, indent=1)  # fmt: skip
    if args.plot:
        title = (f"one self-attention layer, d_model={args.d_model}, h={args.heads}, "
                 f"r={args.window}, {args.device}, {args.threads} thread(s)")  # fmt: skip
        # On a shared CPU, plot process CPU time (single-threaded); on CUDA, wall time.
        _plot(rows, args.plot, title, "cpu_seconds" if args.device == "cpu" else "seconds")


if __name__ == "__main__":
    main()
