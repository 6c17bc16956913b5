#!/usr/bin/env python
"""`Int8Linear`'s product by oneDNN against fbgemm's: before/after in ONE process.

`translate.Int8Linear` multiplied each row's 8-bit inputs by the int8 weights through fbgemm
(`quantized::linear_with_input_q_dq_qweight_dq_output_fp32`, which quantizes the fp32 rows
`kernels.int8_rows_in` scaled); where `translate.int8_onednn()` holds it multiplies through
oneDNN's `onednn::qlinear_pointwise` on the u8 rows that `kernels.int8_rows_u8` writes in the
pass that finds their ranges (docs/performance.md, "Round forty-one"). The choice is made when
a layer is built, so this builds the model twice, once each way, and times the two in one
process in pairs whose order alternates (`bench_int8_rows.paired`):

* `--what layers`: one `Int8Linear` call at a W2 decoder step's shapes (64 rows: greedy; 256:
  beam 4) and an encoder's;
* `--what w2`: the peers' W2 (a random Transformer-base in int8, 64 sentences forced to 50
  tokens), greedy and beam 4;
* `--what real --model M --src FILE`: a real model translating a file's lines.

    .venv/bin/python benchmarks/bench_int8_product.py --what w2 --pairs 8
    .venv/bin/python benchmarks/bench_int8_product.py --what real --model QS/model.safetensors \\
        --src QS/data/test.en.txt --threads 2 --pairs 10
"""

from __future__ import annotations

import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)

import bench_int8_rows as ab  # noqa: E402
import transformer.translate as T  # noqa: E402
from transformer.cpuinfo import cpu_line  # noqa: E402

SWITCH = (T, "int8_onednn")
LABELS = ("fbgemm", "oneDNN")


def _both(build):
    """`build()` once with each product: {False: fbgemm's, True: oneDNN's}."""
    real, built = T.int8_onednn, {}
    try:
        for on in (False, True):
            T.int8_onednn = lambda on=on: on
            built[on] = build()
    finally:
        T.int8_onednn = real
    return built


def layers(args) -> None:
    g = torch.Generator().manual_seed(0)
    for rows, k, n, relu, bias in ab.LAYERS + [(3000, 512, 2048, False, True)]:
        w, b = torch.randn(n, k, generator=g) * 0.05, torch.randn(n, generator=g) if bias else None
        layer = _both(
            lambda w=w, b=b, relu=relu: T.Int8Linear(w, b, False, nonnegative_inputs=relu)
        )
        x = torch.randn(rows, k, generator=g)
        x = x.relu() if relu else x
        per = max(4, 2_000_000 // (rows * n))

        def calls(layer=layer, x=x, per=per) -> None:
            for _ in range(per):
                layer[T.int8_onednn()](x)

        calls()
        ab.paired(f"layer ({rows}, {k}) -> {n}", calls, args.pairs, per, switch=SWITCH,
                  labels=LABELS)  # fmt: skip


def w2(args) -> None:
    import bench_decode  # this script's folder is on sys.path

    src, src_mask = bench_decode.w2_source()
    model = _both(lambda: bench_decode.base_model("int8"))
    for beam in (1, 4):
        for m in model.values():
            bench_decode.run_ours(m, src, src_mask, beam, args.out_len)  # the heap faulted in
        ab.paired(f"W2 int8 beam {beam}", lambda b=beam: bench_decode.run_ours(
            model[T.int8_onednn()], src, src_mask, b, args.out_len), args.pairs, switch=SWITCH,
            labels=LABELS)  # fmt: skip


def real(args) -> None:
    threads = args.threads if args.threads == "auto" else int(args.threads)
    tr = _both(lambda: T.Translator.from_path(args.model, dtype="int8", threads=threads))
    with open(args.src, encoding="utf-8") as f:
        lines = f.read().splitlines()
    for t in tr.values():
        t.translate(lines, beam_size=4)
    print(f"# {args.src}: {len(lines)} lines, threads {args.threads}")
    for beam in (1, 4):
        ab.paired(f"{os.path.basename(args.src)} int8 beam {beam}",
                  lambda b=beam: tr[T.int8_onednn()].translate(lines, beam_size=b), args.pairs,
                  switch=SWITCH, labels=LABELS)  # fmt: skip


def main() -> None:
    args = ab.arguments(__doc__.split("\n")[0])
    if not T.int8_onednn():
        sys.exit("bench_int8_product.py: oneDNN's int8 product does not run here (no VNNI, "
                 "no onednn::qlinear_pointwise in this torch, or its check failed)")  # fmt: skip
    print(f"# {cpu_line()}; torch {torch.__version__}, threads {args.threads}, {args.pairs} pairs")
    {"layers": layers, "w2": w2, "real": real}[args.what](args)


if __name__ == "__main__":
    main()
