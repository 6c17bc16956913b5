"""Decoding streams: words/s of `Translator.translate` with 2, 3, 4 ... streams, alone and beside
one busy process, in one process, rounds interleaved (docs/performance.md, "Decoding streams").

    .venv/bin/python benchmarks/bench_streams.py --model MODEL --rounds 8
    .venv/bin/python benchmarks/bench_streams.py --model MODEL --streams 2,3 --dtype int8

The CLI sets the count itself (`Translator.from_path` with `--threads auto`: one stream per core
and one more); this sets `Translator.streams` per run to compare counts on the same job. A count
written "3p" runs as the CLI does: where other processes keep a quarter core busy, the streams
keep to a CPU each and one more runs (`Translator.load`); "3" never does:

    .venv/bin/python benchmarks/bench_streams.py --model MODEL --streams 3,3p --rounds 4
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import nullcontext
from pathlib import Path

from bench_contention import busy_process, cpu_line  # this script's folder is on sys.path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True, help="a trained model file")
    p.add_argument("--src", type=Path, default=Path("../shared/data/multi30k/val.en"))
    p.add_argument("--repeat", type=int, default=2, help="translate the lines this many times")
    p.add_argument("--streams", default="3,3p")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--beam", type=int, help="default: the model's")
    args = p.parse_args()
    for path in (args.model, args.src):
        if not path.is_file():
            p.error(f"{path}: no such file")
    lines = args.src.read_text(encoding="utf-8").splitlines() * args.repeat
    counts = args.streams.split(",")
    for c in counts:
        if not c.removesuffix("p").isdigit() or int(c.removesuffix("p")) < 1:
            p.error(f"--streams: {c!r} is not a count (N, or Np: pinned beside a busy process)")
    from transformer.threads import OtherLoad  # torch's import (~2.5 s) after the checks
    from transformer.translate import Translator

    tr = Translator.from_path(args.model, dtype=args.dtype, threads="auto")
    tr.translate(lines[:200], beam_size=args.beam)  # warm-up
    print(f"# {cpu_line()}; {len(lines)} lines, dtype {tr.dtype_name}, {args.rounds} rounds")

    load = OtherLoad()  # one for the whole run: its windows follow each other

    def rate(streams: str) -> float:
        tr.streams = int(streams.removesuffix("p"))
        tr.load = load if streams.endswith("p") else None
        start = time.perf_counter()
        out = tr.translate(lines, beam_size=args.beam)
        return sum(len(n[0].text.split()) for n in out) / (time.perf_counter() - start)

    medians = {}
    for busy in (False, True):
        rates: dict[str, list[float]] = {n: [] for n in counts}
        with busy_process() if busy else nullcontext():
            for _ in range(args.rounds):
                for n in counts:
                    rates[n].append(rate(n))
        for n, r in rates.items():
            medians[busy, n] = statistics.median(r)
            where = "beside a busy process" if busy else "alone"
            print(f"{n} streams, {where:21s}: median {medians[busy, n]:6.0f} words/s "
                  f"({min(r):.0f}-{max(r):.0f})", flush=True)  # fmt: skip
    for n in counts:
        print(f"{n} streams: kept {100 * medians[True, n] / medians[False, n]:.1f}% of its own "
              f"alone rate")  # fmt: skip


if __name__ == "__main__":
    main()
