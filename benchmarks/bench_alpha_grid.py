#!/usr/bin/env python
"""Choosing α on a dev set (§6.1, `experiments/valchoice.py`): one beam search per α against one
search for every α (`Translator.translate_alphas`). Same model and sentences, both ways back to
back in one process, alternating the order over `--reps` rounds; prints the best wall time of
each way, their ratio, the decoder rows each stepped, and checks that every α's translations
and scores are the same both ways, in every precision (int8 too: its inputs are quantized per
row, docs/decoding.md, "Several α in one search").

    python benchmarks/bench_alpha_grid.py --model QS/model.safetensors \\
        --src ../shared/data/multi30k/val.en --ref ../shared/data/multi30k/val.de --dtype bf16
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from bench_stop_rules import CountingStepper  # noqa: E402  (this script's own folder)
from transformer import search  # noqa: E402
from transformer.bleu import corpus_bleu  # noqa: E402
from transformer.data import read_lines  # noqa: E402
from transformer.translate import Translator, cpu_flags  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--src", required=True)
    parser.add_argument("--ref", required=True)
    parser.add_argument("--alphas", default="0.6,0.8,1.0,1.2,1.4,1.6,1.8")
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--dtype", default="auto", help="fp32, bf16, int8 or auto")
    parser.add_argument("--threads", default="auto", help="a number, or auto (tuned)")
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()

    threads = args.threads if args.threads == "auto" else int(args.threads)
    alphas = [float(a) for a in args.alphas.split(",")]
    src, refs = list(read_lines(args.src)), list(read_lines(args.ref))
    tr = Translator.from_path(args.model, dtype=args.dtype, threads=threads)
    search.ModelStepper = CountingStepper  # the search builds its stepper by this name
    isa = sorted(f for f in cpu_flags() if f.startswith(("amx", "avx512_bf16", "avx512_vnni")))
    print(f"CPU {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"{' '.join(isa) or 'no AMX/AVX-512 BF16/VNNI'}; load {os.getloadavg()[0]:.2f}; "
          f"dtype {tr.dtype_name}; beam {args.beam}; {len(src)} sentences; α {alphas}")  # fmt: skip

    def one_per_alpha():
        return [tr.translate(src, beam_size=args.beam, length_penalty=a) for a in alphas]

    def all_at_once():
        return tr.translate_alphas(src, alphas, beam_size=args.beam)

    ways = {"one search per α": one_per_alpha, "one search for all α": all_at_once}
    best = {name: float("inf") for name in ways}
    rows, outputs = {}, {}
    for rep in range(args.reps):
        for name in list(ways)[:: 1 if rep % 2 == 0 else -1]:
            CountingStepper.rows = 0
            start = time.perf_counter()
            outputs[name] = ways[name]()
            best[name] = min(best[name], time.perf_counter() - start)
            rows[name] = CountingStepper.rows
    apart, together = outputs["one search per α"], outputs["one search for all α"]
    same = apart == together
    for name in ways:
        print(f"{name:22s} best {best[name]:7.1f} s  decoder rows {rows[name]:,}")
    print(f"time ratio {best['one search per α'] / best['one search for all α']:.2f}x; "
          f"outputs and scores identical for every α: {same}")  # fmt: skip
    for alpha, one, all_ in zip(alphas, apart, together, strict=True):
        bleu = [corpus_bleu([nbest[0].text for nbest in out], refs).score for out in (one, all_)]
        differ = sum(a[0].text != b[0].text for a, b in zip(one, all_, strict=True))
        print(f"  α {alpha}: sacreBLEU {bleu[0]:.2f} one search per α, {bleu[1]:.2f} one for "
              f"all; {differ} translation(s) differ")  # fmt: skip
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
