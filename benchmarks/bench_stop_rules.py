#!/usr/bin/env python
"""§6.1 stopping rules side by side: tensor2tensor's ("t2t", the default: a sentence ends when no
live hypothesis can beat the best finished one) against fairseq's (it ends once K hypotheses
have finished). Same model, same sentences, back to back in one process, alternating the order
over `--reps` rounds; prints each rule's sacreBLEU, decoder steps and best wall time, the time
ratio, and how many outputs differ.

    OMP_NUM_THREADS=1 python benchmarks/bench_stop_rules.py \\
        --model /work/models/multi30k_ende.safetensors \\
        --src ../shared/data/multi30k/val.en --ref ../shared/data/multi30k/val.de
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from transformer import search  # noqa: E402
from transformer.bleu import corpus_bleu  # noqa: E402
from transformer.data import read_lines  # noqa: E402
from transformer.translate import Translator  # noqa: E402


class CountingStepper(search.ModelStepper):
    """ModelStepper that counts decoder rows stepped (the search's work)."""

    rows = 0

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        CountingStepper.rows += tokens.numel()
        return super().step(tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--src", required=True)
    ap.add_argument("--ref", required=True)
    ap.add_argument("--beam", type=int, default=4)
    ap.add_argument("--alpha", type=float, default=0.6)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    search.ModelStepper = CountingStepper  # beam_search builds its stepper by this name
    sources, refs = list(read_lines(args.src)), list(read_lines(args.ref))
    tr = Translator.from_path(args.model)
    times: dict[str, list[float]] = {"t2t": [], "fairseq": []}
    outs, rows = {}, {}
    for rep in range(args.reps):
        for stop in ("t2t", "fairseq") if rep % 2 == 0 else ("fairseq", "t2t"):
            tr.decode = tr.options(args.beam, args.alpha, stop=stop)
            CountingStepper.rows = 0
            start = time.perf_counter()
            outs[stop] = tr.translate_lines(sources)
            times[stop].append(time.perf_counter() - start)
            rows[stop] = CountingStepper.rows
    print(f"{args.src}: {len(sources)} sentences, beam {args.beam}, alpha {args.alpha}, "
          f"{torch.get_num_threads()} thread, best of {args.reps}")  # fmt: skip
    for stop in ("t2t", "fairseq"):
        bleu = corpus_bleu(outs[stop], refs)
        each = ", ".join(f"{t:.1f}" for t in times[stop])
        print(f"  {stop:8s} sacreBLEU {bleu.score:.2f}  decoder rows {rows[stop]}  "
              f"best {min(times[stop]):.1f} s  all {each}")  # fmt: skip
    diff = sum(a != b for a, b in zip(outs["t2t"], outs["fairseq"], strict=True))
    print(
        f"  t2t / fairseq time {min(times['t2t']) / min(times['fairseq']):.3f}  "
        f"decoder rows {rows['t2t'] / rows['fairseq']:.3f}  outputs that differ {diff}"
    )
    print(f"  {bleu.signature}")


if __name__ == "__main__":
    main()
