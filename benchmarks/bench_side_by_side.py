"""Several `transformer translate` jobs started together on one machine (a file split in
shards, a batch system's jobs): the wall time until all are done, for this tree's code and for
another tree's (`--before SRC`), against the same jobs on one thread each (`--threads 1`, what
a user who knows the machine is shared would ask for) and against one job of all their input
(docs/performance.md, round forty-seven).

    git worktree add /tmp/before 8e335d8
    .venv/bin/python benchmarks/bench_side_by_side.py --jobs 2 --rounds 4 \\
        --before /tmp/before/src MODEL INPUT -- --beam 4

Each job translates INPUT (`python -m transformer translate MODEL INPUT ARGS`); a round runs,
in turn: the jobs with each tree's `--threads auto` (the default), the jobs with `--threads 1`
(this tree), and one job of INPUT repeated `--jobs` times (this tree, auto). Every job's
output must equal the first's (the one job's: the concatenation), else the script fails.
Prints the CPU, the load average, each round and the medians, and each tree's jobs against
`--threads 1`'s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_translate_stream import parse_with_options


class RunFailed(Exception):
    """A job that did not end with status 0."""


def run_together(src: Path | None, model: str, inputs: list[str], extra: list[str]) -> tuple:
    """The jobs (one per input) started together: (wall seconds until all end, outputs)."""
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = f"{src}{os.pathsep}{env.get('PYTHONPATH', '')}"
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        outs = [Path(tmp) / f"{i}.out" for i in range(len(inputs))]
        procs = []
        for path, out in zip(inputs, outs, strict=True):
            with open(out, "wb") as f:
                cmd = [sys.executable, "-m", "transformer", "translate", model, path, *extra]
                procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.DEVNULL, env=env))
        codes = [p.wait() for p in procs]
        wall = time.perf_counter() - start
        if any(codes):
            raise RunFailed(f"`transformer translate {model} ... {' '.join(extra)}` failed {codes}")
        return wall, [out.read_bytes() for out in outs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("input")
    parser.add_argument("--jobs", type=int, default=2, help="jobs started together (default 2)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--before", type=Path, help="another tree's src folder, run alternately")
    parser.usage = (
        "%(prog)s [-h] [--jobs N] [--rounds N] [--before SRC] MODEL INPUT [-- TRANSLATE OPTIONS]"
    )
    args, extra, words = parse_with_options(parser, argv)
    if args.jobs < 2 or args.rounds < 1:
        parser.error(
            f"--jobs at least 2 and --rounds at least 1, not {args.jobs} and {args.rounds}"
        )
    if "--threads" in extra:
        parser.error("--threads: the script sets it (auto, then 1)")
    text = Path(args.input).read_bytes()

    from transformer.cpuinfo import cpu_line

    variants = {"before": args.before, "after": None} if args.before else {"after": None}
    walls: dict[str, list[float]] = {name: [] for name in [*variants, "threads 1", "one job"]}
    print(f"# {cpu_line()}; load average {os.getloadavg()[0]:.2f}; {args.jobs} jobs of "
          f"{words:,} source words each; translate {' '.join(extra)}; "
          f"{args.rounds} rounds")  # fmt: skip
    expected = None
    with tempfile.TemporaryDirectory() as tmp:
        joined = Path(tmp) / "all.txt"
        joined.write_bytes((text if text.endswith(b"\n") else text + b"\n") * args.jobs)
        runs = [(name, src, [args.input] * args.jobs, extra) for name, src in variants.items()]
        runs += [("threads 1", None, [args.input] * args.jobs, [*extra, "--threads", "1"]),
                 ("one job", None, [str(joined)], extra)]  # fmt: skip
        for r in range(args.rounds):
            line = []
            for name, src, inputs, options in runs:
                try:
                    wall, outs = run_together(src, args.model, inputs, options)
                except RunFailed as e:
                    print(f"bench_side_by_side: {e}", file=sys.stderr)
                    return 2
                outs = [b"".join(outs)] if name != "one job" else outs
                expected = expected if expected is not None else outs[0]
                if outs[0] != expected:
                    print(f"bench_side_by_side: {name}'s output differs", file=sys.stderr)
                    return 1
                walls[name].append(wall)
                line.append(f"{name} {wall:.2f} s")
            print(f"round {r + 1}: " + ", ".join(line) + f" (load {os.getloadavg()[0]:.2f})",
                  flush=True)  # fmt: skip
    total = words * args.jobs
    base = statistics.median(walls["threads 1"])
    for name, values in walls.items():
        wall = statistics.median(values)
        print(f"{name}: {wall:.2f} s, {total / wall:,.0f} words/s ({base / wall:.1%} of "
              f"--threads 1's rate) (medians)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
