"""Benchmark reading the §6.3 treebank as `prepare ptb` does: the NLTK sample's 3,914 trees and
section 22's 1,700 (`parsing.corpus.load_parsing_splits`), with torch imported first so the
heap is the CLI's (Python's cycle collector walks all of it; see `trees.paused_gc`).

    .venv/bin/python benchmarks/bench_read_trees.py --data ../shared/data --reps 5

Prints the median and the fastest of the repetitions, trees per second and the CPU. No peer
reads PTB trees (fairseq has no parsing pipeline), so no ratio is printed; compare commits by
running it at each.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=Path("../shared/data"),
                        help="the shared data root (ptb_sample/, ptb_wsj/)")  # fmt: skip
    parser.add_argument("--reps", type=int, default=5, help="repetitions (default 5)")
    parser.add_argument("--no-torch", action="store_true", help="do not import torch first")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error(f"argument --reps: at least 1, not {args.reps}")
    for part in ("ptb_sample/combined", "ptb_wsj/22.auto.clean"):
        if not (args.data / part).exists():
            parser.error(f"argument --data: {args.data / part} not found")

    if not args.no_torch:
        import torch  # noqa: F401  (the CLI's heap)
    from transformer.cpuinfo import cpu_line
    from transformer.parsing.corpus import load_parsing_splits

    times, n = [], 0
    for _ in range(args.reps):
        start = time.perf_counter()
        splits = load_parsing_splits(args.data)
        times.append(time.perf_counter() - start)
        n = sum(map(len, splits.values()))
        del splits
    median = statistics.median(times)
    print(f"# {cpu_line()}")
    heap = "" if args.no_torch else ", torch imported"
    print(f"read {n} trees: median {median:.3f} s, fastest {min(times):.3f} s over {args.reps} "
          f"runs ({n / median:,.0f} trees/s){heap}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
