"""Where a training step's GPU time goes: torch.profiler over 3 of our bf16 steps (base, big) at
bench_gpu.py's shape (832 sentences x 30 tokens, V = 32,000), after 3 warm-up steps; prints the
30 heaviest ops and kernels by self CUDA time.

    PYTHONPATH=src python3 -W ignore benchmarks/gpu/profile_step.py    # on the GPU machine
"""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, "benchmarks")
import bench_gpu  # noqa: E402
from transformer.config import build_config  # noqa: E402

STEPS = 3
if not torch.cuda.is_available():
    sys.exit("profile_step.py: no CUDA device: not run")

for preset in ["base", "big"]:
    cfg = build_config(preset, None, ["train.dtype=bf16"], vocab_size=32000)
    torch.manual_seed(0)
    body = torch.randint(4, 32000, (25000 // 30, 29), device="cuda")
    step = bench_gpu.ours(cfg, body)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            step()
        torch.cuda.synchronize()
    print("=====", preset)
    table = prof.key_averages().table(
        sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=70
    )
    print(table)
