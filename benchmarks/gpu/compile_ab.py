"""Our bf16 training step eager against `torch.compile(model)` (what `train.compile=true` does),
base and big at bench_gpu.py's shape (832 sentences x 30 tokens, V = 32,000): 3 warm-up steps
each (the compile inside them, its time printed), then 5 interleaved rounds of 2 timed steps;
medians. One fixed shape: a real run's batches change shape and recompile (not measured here).

    PYTHONPATH=src python3 -W ignore benchmarks/gpu/compile_ab.py    # on the GPU machine
"""

import statistics
import sys
import time

import torch

sys.path.insert(0, "benchmarks")
import bench_gpu  # noqa: E402
from transformer.config import build_config  # noqa: E402

for preset in ["base", "big"]:
    cfg = build_config(preset, None, ["train.dtype=bf16"], vocab_size=32000)
    torch.manual_seed(0)
    body = torch.randint(4, 32000, (25000 // 30, 29), device="cuda")
    steps = {}
    for compiled in (False, True):
        start = time.perf_counter()
        steps[compiled] = bench_gpu.ours(cfg, body, compiled)
        for _ in range(3):
            steps[compiled]()
        torch.cuda.synchronize()
        name = "compiled" if compiled else "eager"
        print(f"{preset} {name} warm-up s {time.perf_counter() - start:.1f}", flush=True)
    times = {False: [], True: []}
    for _ in range(5):
        for compiled in (False, True):
            for _ in range(2):
                torch.cuda.synchronize()
                start = time.perf_counter()
                steps[compiled]()
                torch.cuda.synchronize()
                times[compiled].append(time.perf_counter() - start)
    for compiled in (False, True):
        med = statistics.median(times[compiled])
        name = "compiled" if compiled else "eager"
        ntok = body.numel() + body.size(0)  # each sentence and its EOS
        print(f"{preset} {name}: {ntok / med:9.0f} tgt tok/s {med:.4f} s/step", flush=True)
