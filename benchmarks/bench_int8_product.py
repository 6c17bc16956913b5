#!/usr/bin/env python
"""`Int8Linear`'s products against each other (oneDNN's, fbgemm's, the library's AVX2 one):
before/after in ONE process.

`translate.Int8Linear` multiplied each row's 8-bit inputs by the int8 weights through fbgemm
(`quantized::linear_with_input_q_dq_qweight_dq_output_fp32`, which quantizes the fp32 rows
`kernels.int8_rows_in` scaled); where `translate.int8_onednn()` holds it multiplies through
oneDNN's `onednn::qlinear_pointwise` on the u8 rows that `kernels.int8_rows_u8` writes in the
pass that finds their ranges (docs/performance.md, "Round forty-one"); where
`translate.int8_avx2()` holds (no VNNI) through the library's exact AVX2 product with 8-bit
weights (`kernels.int8_product`, "Round sixty-eight"). The choice is made when a layer is
built, so this builds the model twice, once with each of the two `--products` (default
fbgemm,onednn), and times the two in one process in pairs whose order alternates
(`bench_int8_rows.paired`). `--fbgemm-bits 7` gives fbgemm the 7-bit weights a CPU without VNNI
gives it (`int8_narrow_weights`); with `FBGEMM_ENABLE_INSTRUCTIONS=AVX2` fbgemm runs its AVX2
kernels (`vpmaddubsw`), as on such a CPU, and `ONEDNN_MAX_CPU_ISA=AVX2` holds oneDNN to AVX2:
a VNNI CPU then times a Zen 3's int8 products in the same instructions:

* `--what layers`: one `Int8Linear` call at a W2 decoder step's shapes (64 rows: greedy; 256:
  beam 4) and an encoder's;
* `--what w2`: the peers' W2 (a random Transformer-base in int8, 64 sentences forced to 50
  tokens), greedy and beam 4;
* `--what real --model M --src FILE`: a real model translating a file's lines.

    .venv/bin/python benchmarks/bench_int8_product.py --what w2 --pairs 8
    FBGEMM_ENABLE_INSTRUCTIONS=AVX2 .venv/bin/python benchmarks/bench_int8_product.py \\
        --products fbgemm,avx2 --fbgemm-bits 7 --what layers --pairs 8
    .venv/bin/python benchmarks/bench_int8_product.py --what real --model QS/model.safetensors \\
        --src QS/data/test.en.txt --threads 2 --pairs 10
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)

import bench_int8_rows as ab  # noqa: E402
import transformer.translate as T  # noqa: E402
from transformer.cpuinfo import cpu_line  # noqa: E402

PRODUCTS = {"fbgemm": "fbgemm", "onednn": "oneDNN", "avx2": "AVX2 exact"}
SWITCH = (sys.modules[__name__], "second")
LABELS: tuple[str, str] = ("fbgemm", "oneDNN")  # the two products' names, set by `main`
CHOSEN: tuple[str, str] = ("fbgemm", "onednn")
FBGEMM_NARROW = False  # --fbgemm-bits 7


def second() -> bool:
    """Which of the two builds a timed call takes (`paired` switches it): the second's."""
    return True


def _both(build):
    """`build()` once with each product: {False: the first of `CHOSEN`, True: the second}."""
    names = ("int8_onednn", "int8_avx2", "int8_narrow_weights")
    saved, built = {n: getattr(T, n) for n in names}, {}
    try:
        for on, product in zip((False, True), CHOSEN, strict=True):
            T.int8_onednn = lambda p=product: p == "onednn"
            T.int8_avx2 = lambda p=product: p == "avx2"
            if product == "fbgemm" and FBGEMM_NARROW:
                T.int8_narrow_weights = lambda flags=None: True
            else:
                T.int8_narrow_weights = saved["int8_narrow_weights"]
            built[on] = build()
    finally:
        for name, value in saved.items():
            setattr(T, name, value)
    return built


def layers(args) -> None:
    g = torch.Generator().manual_seed(0)
    for rows, k, n, relu, bias in ab.LAYERS + [(3000, 512, 2048, False, True)]:
        w, b = torch.randn(n, k, generator=g) * 0.05, torch.randn(n, generator=g) if bias else None
        layer = _both(
            lambda w=w, b=b, relu=relu: T.Int8Linear(
                w, b, T.int8_narrow_weights(), nonnegative_inputs=relu
            )
        )
        x = torch.randn(rows, k, generator=g)
        x = x.relu() if relu else x
        per = max(4, 2_000_000 // (rows * n))

        def calls(layer=layer, x=x, per=per) -> None:
            for _ in range(per):
                layer[second()](x)

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
            model[second()], src, src_mask, b, args.out_len), args.pairs, switch=SWITCH,
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
                  lambda b=beam: tr[second()].translate(lines, beam_size=b), args.pairs,
                  switch=SWITCH, labels=LABELS)  # fmt: skip


def _products(value: str) -> tuple[str, str]:
    """--products: two of PRODUCTS, comma-separated."""
    chosen = tuple(value.split(","))
    if len(chosen) != 2 or len(set(chosen)) != 2 or not set(chosen) <= set(PRODUCTS):
        raise argparse.ArgumentTypeError(
            f"two of {', '.join(PRODUCTS)}, comma-separated, not {value!r}"
        )
    return chosen  # type: ignore[return-value]


def _bits(value: str) -> int:
    """--fbgemm-bits: 7 or 8."""
    if value not in ("7", "8"):
        raise argparse.ArgumentTypeError(f"7 or 8, not {value!r}")
    return int(value)


def _options(ap: argparse.ArgumentParser) -> None:
    """This script's own options, beside `bench_int8_rows.arguments`'."""
    ap.add_argument(
        "--products",
        type=_products,
        default=("fbgemm", "onednn"),
        help="the two products timed, comma-separated (fbgemm, onednn, avx2)",
    )
    ap.add_argument("--fbgemm-bits", type=_bits, default=8,
                    help="fbgemm's weights: 7 as on a CPU without VNNI, or 8")  # fmt: skip


def main() -> None:
    global CHOSEN, LABELS, FBGEMM_NARROW
    args = ab.arguments(__doc__.split("\n")[0], more=_options)
    CHOSEN, FBGEMM_NARROW = args.products, args.fbgemm_bits == 7
    LABELS = (PRODUCTS[CHOSEN[0]], PRODUCTS[CHOSEN[1]])
    runs = {"onednn": T.int8_onednn, "avx2": T.kernels.int8_product_supported}
    for product in CHOSEN:
        if product != "fbgemm" and not runs[product]():
            why = {"onednn": "no VNNI, no onednn::qlinear_pointwise in this torch, or its "
                             "check failed",
                   "avx2": "no AVX2, or the library does not build"}  # fmt: skip
            sys.exit(f"bench_int8_product.py: the {PRODUCTS[product]} int8 product does not run "
                     f"here ({why[product]})")  # fmt: skip
    isas = {v: os.environ.get(v, "its own choice")
            for v in ("FBGEMM_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")}  # fmt: skip
    print(
        f"# {cpu_line()}; torch {torch.__version__}, threads {args.threads}, "
        f"{args.pairs} pairs; {LABELS[0]} then {LABELS[1]}; fbgemm's weights "
        f"{7 if FBGEMM_NARROW else 8}-bit; " + ", ".join(f"{k}: {v}" for k, v in isas.items())
    )
    {"layers": layers, "w2": w2, "real": real}[args.what](args)


if __name__ == "__main__":
    main()
