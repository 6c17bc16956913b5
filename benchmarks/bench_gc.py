"""Seconds a `transformer` command spends in Python's cycle collector, with and without the
CLI's `gc.freeze()` of what the imports made (`cli.main`; docs/performance.md, round
thirty-four). The command runs as the program does (`python -m transformer ARGS`, argv from
sys.argv), in a fresh process per run, alternating the two modes; the collector's time comes from
`gc.callbacks`, which does not depend on the host's speed as much as wall time does.

    .venv/bin/python benchmarks/bench_gc.py --runs 3 -- \
        prepare ptb --from ../shared/data --out /tmp/ptb{run}

`{run}` in the arguments is replaced by the run's number (for an --out that must not exist);
an --out path is removed after each run. Prints per mode the median collector seconds (and per
generation), the median wall time and the CPU.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# Run in the child: time each collection, optionally make gc.freeze a no-op, run the CLI.
_CHILD = r"""
import atexit, gc, json, runpy, sys, time
spent = {0: 0.0, 1: 0.0, 2: 0.0}
count = {0: 0, 1: 0, 2: 0}
began = [0.0]
def timed(phase, info):
    if phase == "start":
        began[0] = time.perf_counter()
    else:
        spent[info["generation"]] += time.perf_counter() - began[0]
        count[info["generation"]] += 1
gc.callbacks.append(timed)
if sys.argv[1] == "off":
    gc.freeze = lambda: None
start = time.perf_counter()
report = sys.argv[2]
def write():
    with open(report, "w") as f:
        json.dump({"wall": time.perf_counter() - start, "spent": spent, "count": count,
                   "frozen": gc.get_freeze_count()}, f)
atexit.register(write)
sys.argv = ["transformer", *sys.argv[3:]]
runpy.run_module("transformer", run_name="__main__")
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="runs per mode (default 3)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="-- the transformer command")
    args = parser.parse_args(argv)
    command = args.args[1:] if args.args[:1] == ["--"] else args.args
    if args.runs < 1:
        parser.error(f"argument --runs: at least 1, not {args.runs}")
    if not command:
        parser.error("give the transformer command after --, e.g. -- prepare ptb --from DIR ...")

    from transformer.cpuinfo import cpu_line

    results: dict[str, list[dict]] = {"off": [], "on": []}
    folder = tempfile.TemporaryDirectory(prefix="bench_gc_")  # each run's report, removed at exit
    report = Path(folder.name) / "report.json"
    for run in range(args.runs):
        for mode in ("off", "on"):
            cmd = [a.replace("{run}", str(run)) for a in command]
            child = [sys.executable, "-c", _CHILD, mode, str(report), *cmd]
            done = subprocess.run(child, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  text=True)  # fmt: skip
            if done.returncode != 0:
                tail = done.stderr.strip().splitlines()[-1:] or ["(no output)"]
                print(f"bench_gc: `transformer {' '.join(cmd)}` failed ({done.returncode}): "
                      f"{tail[0]}", file=sys.stderr)  # fmt: skip
                return 2
            results[mode].append(json.loads(report.read_text()))
            if "--out" in cmd:
                out = Path(cmd[cmd.index("--out") + 1])
                shutil.rmtree(out, ignore_errors=True)
                shutil.rmtree(out.with_name(out.name + ".text"), ignore_errors=True)
    folder.cleanup()

    print(f"# {cpu_line()}; transformer {' '.join(command)}; {args.runs} runs per mode")
    for mode, label in (("off", "without gc.freeze"), ("on", "with gc.freeze (the CLI)")):
        runs = results[mode]
        total = statistics.median(sum(r["spent"].values()) for r in runs)
        wall = statistics.median(r["wall"] for r in runs)
        gens = ", ".join(
            f"gen{g} {statistics.median(r['count'][g] for r in runs):.0f}x "
            f"{statistics.median(r['spent'][g] for r in runs):.2f} s"
            for g in ("0", "1", "2")
        )
        print(f"{label}: collecting {total:.2f} s of {wall:.2f} s ({gens}; "
              f"{runs[-1]['frozen']:,} objects frozen)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
