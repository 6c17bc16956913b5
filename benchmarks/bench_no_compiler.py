"""`transformer translate` on a machine without a C compiler: words/s with the compiled kernels
built on first use (a compiler on PATH), without them (no compiler, nothing built ahead: torch's
ops), and with a library built ahead by `transformer kernels --into DIR` (no compiler), in
alternating fresh processes (docs/performance.md, round forty-seven).

    .venv/bin/python benchmarks/bench_no_compiler.py --runs 3 MODEL INPUT -- --beam 4

"No compiler" is `CC` naming a program that is not there, which `kernels._compiler` reads as
none; each mode has a cache folder of its own (`TRANSFORMER_KERNELS`). The package's own folder
of libraries built ahead (`kernels.PREBUILT`) must hold none for this source, else the second
mode would load it: the script says so and stops. Prints the CPU, the load average, each run
and per mode the medians, and whether the outputs of the runs with kernels are identical (torch's
ops give a decoding step's attention torch's roundings, not the kernel's: their output may
differ in a few lines, which are counted).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

from bench_translate_stream import RunFailed, parse_with_options, run_once

MODES = ("compiler", "no compiler", "built ahead")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("input")
    parser.add_argument("--runs", type=int, default=3, help="runs per mode (default 3)")
    parser.usage = "%(prog)s [-h] [--runs N] MODEL INPUT [-- TRANSLATE OPTIONS]"
    args, extra, words = parse_with_options(parser, argv)
    if args.runs < 1:
        parser.error(f"argument --runs: at least 1, not {args.runs}")

    from transformer import kernels
    from transformer.cpuinfo import cpu_line

    ahead = list(kernels.PREBUILT.glob(f"kernels-{kernels._source_key()}-*.so"))
    if ahead:
        parser.error(f"{ahead[0]}: a library built ahead; move it away for the 'no compiler' runs")
    with tempfile.TemporaryDirectory() as tmp:
        folders = {mode: Path(tmp) / str(i) for i, mode in enumerate(MODES)}
        envs = {mode: dict(os.environ, TRANSFORMER_KERNELS=str(folders[mode])) for mode in MODES}
        for mode in MODES[1:]:
            envs[mode]["CC"] = str(Path(tmp) / "no-such-compiler")
        os.environ["TRANSFORMER_KERNELS"] = str(folders["compiler"])
        kernels.build_ahead(folders["built ahead"])  # here, where there is a compiler
        results: dict[str, list[dict]] = {mode: [] for mode in MODES}
        print(f"# {cpu_line()}; load average {os.getloadavg()[0]:.2f}; {words:,} source words; "
              f"translate {' '.join(extra)}; {args.runs} runs per mode, alternating")  # fmt: skip
        for run in range(args.runs):
            for mode in MODES:
                try:
                    r = run_once(None, args.model, args.input, extra, envs[mode])
                except RunFailed as e:
                    print(f"bench_no_compiler: {e}", file=sys.stderr)
                    return 2
                results[mode].append(r)
                print(f"run {run + 1} {mode}: {r['wall']:.2f} s, {words / r['wall']:,.0f} "
                      f"words/s, peak RSS {r['rss_mib']:,.0f} MiB", flush=True)  # fmt: skip
    kept = {r["output"] for mode in ("compiler", "built ahead") for r in results[mode]}
    if len(kept) != 1:
        print("bench_no_compiler: the runs with the kernels differ", file=sys.stderr)
        return 1
    with_kernels = next(iter(kept)).splitlines()
    walls = {mode: statistics.median(r["wall"] for r in runs) for mode, runs in results.items()}
    for mode, wall in walls.items():
        lines = {r["output"] for r in results[mode]}
        differ = sum(
            a != b for a, b in zip(next(iter(lines)).splitlines(), with_kernels, strict=True)
        )
        print(f"{mode}: {wall:.2f} s, {words / wall:,.0f} words/s "
              f"({walls['compiler'] / wall:.1%} of the compiler's), peak RSS "
              f"{statistics.median(r['rss_mib'] for r in results[mode]):,.0f} MiB, "
              f"{differ} lines differ from the kernels' (medians)")  # fmt: skip
    print(f"# load average at the end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
