#!/usr/bin/env python
"""`Int8Linear`'s rows by the compiled kernels against torch's ops: before/after in ONE process.

`translate.Int8Linear` scales each input row to its own 8-bit range before fbgemm's product and
each output row back after it: in torch's ops five passes before (|x|, the row maxima, a clamp,
their inverses, the scaling) and two after (the scale, the bias); `kernels.int8_rows_in` and
`kernels.int8_rows_out_` do each side in one pass, the same bits. This times both ways in one
process, switching `translate.int8_row_kernels` between runs, in pairs whose order alternates
(the host's speed drifts by more than the change between processes: docs/performance.md,
"Round thirty-seven"), and prints each pair's speed-up and their median:

* `--what layers`: one `Int8Linear` call at a W2 decoder step's shapes (64 rows: greedy; 256:
  beam 4, d_model 512, FFN 2,048, V 32,000);
* `--what w2`: the peers' W2 (bench_decode.py: a random Transformer-base in int8, 64 sentences
  forced to 50 tokens), greedy and beam 4;
* `--what real --model M --src FILE`: a real model translating a file's lines (the
  `Translator`, with --threads as `transformer translate` takes them: N or auto).

    .venv/bin/python benchmarks/bench_int8_rows.py --what w2 --pairs 8
    .venv/bin/python benchmarks/bench_int8_rows.py --what real --model QS/model.safetensors \
        --src QS/data/test.en.txt --threads 2 --pairs 10
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)

import transformer.translate as T  # noqa: E402
from transformer.cpuinfo import cpu_line  # noqa: E402

LAYERS = [  # rows, inputs, outputs, ReLU inputs, bias
    (64, 512, 1536, False, True), (64, 512, 512, False, True), (64, 512, 2048, False, True),
    (64, 2048, 512, True, True), (64, 512, 32000, False, False), (256, 512, 1536, False, True),
    (256, 512, 2048, False, True), (256, 2048, 512, True, True), (256, 512, 32000, False, False),
]  # fmt: skip


def paired(name: str, run, pairs: int, per: int = 1, switch=None, labels=None) -> None:
    """Time `run()` with the kernels and with torch's ops, `pairs` times each, order alternating;
    `per`: the calls one run makes (the times printed are per call). switch: (module, name) of
    the function that says whether the kernels run (default `translate.int8_row_kernels`);
    labels: what the two ways are called (default torch's ops, kernels)."""
    off_name, on_name = labels or ("torch's ops", "kernels")
    owner, attr = switch or (T, "int8_row_kernels")
    times: dict[bool, list[float]] = {False: [], True: []}
    real = getattr(owner, attr)
    try:
        for i in range(pairs):
            for on in (False, True) if i % 2 == 0 else (True, False):
                setattr(owner, attr, lambda on=on: on)
                start = time.perf_counter()
                run()
                times[on].append(time.perf_counter() - start)
    finally:
        setattr(owner, attr, real)
    before, after = statistics.median(times[False]) / per, statistics.median(times[True]) / per
    gains = [100 * (b - a) / b for b, a in zip(times[False], times[True], strict=True)]
    unit, scale = ("us", 1e6) if before < 0.01 else ("s", 1.0)
    print(f"{name:34s} {off_name} {before * scale:9.3f} {unit}, {on_name} {after * scale:9.3f} "
          f"{unit}: {100 * (before - after) / before:5.1f}% less; paired median "
          f"{statistics.median(gains):5.1f}%, faster in {sum(g > 0 for g in gains)} of {pairs}",
          flush=True)  # fmt: skip


def layers(args) -> None:
    g = torch.Generator().manual_seed(0)
    for rows, k, n, relu, bias in LAYERS:
        q = T.Int8Linear(torch.randn(n, k, generator=g) * 0.05,
                         torch.randn(n, generator=g) if bias else None, False,
                         nonnegative_inputs=relu)  # fmt: skip
        x = torch.randn(rows, k, generator=g)
        x = x.relu() if relu else x

        per = max(4, 2_000_000 // (rows * n))

        def calls(q=q, x=x, per=per) -> None:
            for _ in range(per):
                q(x)

        calls()
        paired(f"layer ({rows}, {k}) -> {n}", calls, args.pairs, per)


def w2(args, switch=None, dtype: str = "int8", labels=None) -> None:
    import bench_decode  # this script's folder is on sys.path

    src, src_mask = bench_decode.w2_source()
    model = bench_decode.base_model(dtype)
    for beam in (1, 4):
        bench_decode.run_ours(model, src, src_mask, beam, 4)  # the shapes' kernels built
        paired(f"W2 {dtype} beam {beam}", lambda b=beam: bench_decode.run_ours(
            model, src, src_mask, b, args.out_len), args.pairs, switch=switch,
            labels=labels)  # fmt: skip


def real(args, switch=None, dtype: str = "int8", labels=None) -> None:
    threads = args.threads if args.threads == "auto" else int(args.threads)
    tr = T.Translator.from_path(args.model, dtype=dtype, threads=threads)
    with open(args.src, encoding="utf-8") as f:
        lines = f.read().splitlines()
    tr.translate(lines[:200], beam_size=4)
    print(f"# {args.src}: {len(lines)} lines, threads {args.threads}")
    for beam in (1, 4):
        paired(f"{os.path.basename(args.src)} {dtype} beam {beam}",
               lambda b=beam: tr.translate(lines, beam_size=b), args.pairs,
               switch=switch, labels=labels)  # fmt: skip


def arguments(description: str, dtypes: bool = False, more=None) -> argparse.Namespace:
    """This script's options (also `bench_step_attention.py`'s, with `dtypes`: --dtype for
    --what w2 / real; `more(parser)` adds a script's own), checked; torch's threads set."""
    ap = argparse.ArgumentParser(description=description)
    if more is not None:
        more(ap)
    ap.add_argument("--what", choices=("layers", "w2", "real"), default="w2")
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--threads", default="2", help="torch threads (real: N or auto)")
    ap.add_argument("--out-len", type=int, default=50)
    ap.add_argument("--model", help="--what real: a model file or run directory")
    ap.add_argument("--src", help="--what real: source lines to translate")
    if dtypes:
        ap.add_argument("--dtype", choices=("int8", "fp32", "bf16"), default="int8",
                        help="--what w2 / real: the model's")  # fmt: skip
    args = ap.parse_args()
    if args.pairs < 1 or args.out_len < 1:
        ap.error("--pairs and --out-len must be at least 1")
    auto = args.what == "real" and args.threads == "auto"
    if not auto and not (args.threads.isdigit() and int(args.threads) >= 1):
        ap.error(
            f"--threads: a count of at least 1 (or auto with --what real), not {args.threads!r}"
        )
    if args.what == "real":
        if not (args.model and args.src):
            ap.error("--what real needs --model and --src")
        for flag, path in (("--model", args.model), ("--src", args.src)):
            if not os.path.exists(path):
                ap.error(f"{flag}: no such file or directory: {path}")
    if not auto:
        torch.set_num_threads(int(args.threads))
    return args


def main() -> None:
    args = arguments(__doc__.split("\n")[0])
    if not T.int8_row_kernels():
        sys.exit("bench_int8_rows.py: the row kernels do not run here (no AVX-512 or AVX2, or the "
                 "library does not build: `python -c 'from transformer import kernels; "
                 "print(kernels.unavailable())'`)")  # fmt: skip
    print(f"# {cpu_line()}; torch {torch.__version__}, threads {args.threads}, {args.pairs} pairs")
    {"layers": layers, "w2": w2, "real": real}[args.what](args)


if __name__ == "__main__":
    main()
