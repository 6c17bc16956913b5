"""Several `transformer train` runs started together on one machine (a sweep's runs started by
hand, a batch system's jobs): the wall time until all have ended and the sum of their target
tokens/s, for this tree's code and for another tree's (`--before SRC`), against the same runs on
one thread each (`--threads 1`, what a user who knows the machine is shared would ask for)
(docs/performance.md, "Round sixty").

    git worktree add /tmp/before 8972553
    .venv/bin/python benchmarks/bench_train_side_by_side.py --jobs 2 --rounds 3 \\
        --before /tmp/before/src DATA -- --preset quickstart --max-steps 150

Each run is `python -m transformer train DATA --out TMP ARGS` with its metrics every 10 steps
and no validation; its rate is that of its metrics after the first window (the first steps
warm up; bench_contention.steady_rate); once one run has ended the others run alone, so the
wall time is the figure to compare. A round runs, in turn: the runs with each tree's `--threads
auto` (the default) and with `--threads 1` (this tree), each way first in turn (the host's
speed moves within minutes). Prints the CPU, the load average, each round and the medians, and
each way's against `--threads 1`'s.
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

from bench_contention import RunFailed, steady_rate  # this script's folder is on sys.path

# Metrics every 10 steps, no validation and no checkpoint but the last: the runs' own work.
QUIET = ["train.log_every_steps=10", "train.valid_every_steps=1000000",
         "train.save_every_steps=1000000", "train.save_every_minutes=1000"]  # fmt: skip


def run_together(src: Path | None, data: str, jobs: int, extra: list[str]) -> tuple[float, list]:
    """`jobs` runs started together: (wall seconds until all have ended, each one's rate)."""
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = f"{src}{os.pathsep}{env.get('PYTHONPATH', '')}"
    with tempfile.TemporaryDirectory() as tmp:
        runs = [Path(tmp) / f"run{i}" for i in range(jobs)]
        logs = [Path(tmp) / f"run{i}.err" for i in range(jobs)]  # a file: no pipe to fill
        start = time.perf_counter()
        procs = []
        for run, log in zip(runs, logs, strict=True):
            with open(log, "wb") as err:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "transformer", "train", data, "--out", str(run),
                     *extra, *QUIET],
                    stdout=subprocess.DEVNULL, stderr=err, env=env,
                ))  # fmt: skip
        codes = [p.wait() for p in procs]
        wall = time.perf_counter() - start
        if any(codes):
            last = next(log for log, c in zip(logs, codes, strict=True) if c)
            why = last.read_text(errors="replace").strip().splitlines()[-1:] or [""]
            command = f"transformer train {data} {' '.join(extra)}"
            raise RunFailed(f"`{command}` failed {codes}: {why[0]}")
        return wall, [steady_rate(run) for run in runs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data", help="a prepared corpus (`transformer prepare`)")
    parser.add_argument("--jobs", type=int, default=2, help="runs started together (default 2)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--before", type=Path, help="another tree's src folder, run alternately")
    parser.usage = "%(prog)s [-h] [--jobs N] [--rounds N] [--before SRC] DATA [-- TRAIN OPTIONS]"
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    extra = argv[split + 1 :] or ["--preset", "quickstart", "--max-steps", "150"]
    if args.jobs < 2 or args.rounds < 1:
        parser.error(
            f"--jobs at least 2 and --rounds at least 1, not {args.jobs} and {args.rounds}"
        )
    if "--threads" in extra or "--out" in extra:
        parser.error("--threads and --out: the script sets them")
    if not (Path(args.data) / "manifest.json").is_file():
        parser.error(f"{args.data}: not a prepared corpus (no manifest.json)")
    if args.before is not None and not (args.before / "transformer" / "__init__.py").is_file():
        parser.error(f"--before {args.before}: holds no transformer package")

    from transformer.cpuinfo import cpu_line

    variants = {"before": args.before, "after": None} if args.before else {"after": None}
    ways = [(name, src, extra) for name, src in variants.items()]
    ways.append(("threads 1", None, [*extra, "--threads", "1"]))
    walls: dict[str, list[float]] = {name: [] for name, _, _ in ways}
    rates: dict[str, list[float]] = {name: [] for name, _, _ in ways}
    print(f"# {cpu_line()}; load average {os.getloadavg()[0]:.2f}; {args.jobs} runs of "
          f"`transformer train {args.data} {' '.join(extra)}`; {args.rounds} rounds")  # fmt: skip
    for r in range(args.rounds):
        line = []
        for name, src, options in ways[r % len(ways) :] + ways[: r % len(ways)]:  # each first
            try:
                wall, each = run_together(src, args.data, args.jobs, options)
            except RunFailed as e:
                print(f"bench_train_side_by_side: {e}", file=sys.stderr)
                return 2
            walls[name].append(wall)
            rates[name].append(sum(each))
            shown = " + ".join(f"{x:,.0f}" for x in each)
            line.append(f"{name} {wall:.2f} s ({shown} tok/s)")
        print(f"round {r + 1}: " + ", ".join(line) + f" (load {os.getloadavg()[0]:.2f})",
              flush=True)  # fmt: skip
    base_wall = statistics.median(walls["threads 1"])
    base_rate = statistics.median(rates["threads 1"])
    for name, _, _ in ways:
        wall, rate = statistics.median(walls[name]), statistics.median(rates[name])
        print(f"{name}: {wall:.2f} s until all ended ({base_wall / wall:.1%} of --threads 1's "
              f"pace), {rate:,.0f} target tok/s in all ({rate / base_rate:.1%} of --threads "
              f"1's) (medians)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
