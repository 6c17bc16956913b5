"""`transformer translate` on a large input: words/s, peak memory and the time to the first output
line, for this tree's code and for another tree's (`--before SRC`, e.g. a `git worktree` of an
older commit's `src`), in alternating fresh processes (docs/performance.md, round thirty-five).

    git worktree add /tmp/old dda5a83
    .venv/bin/python benchmarks/bench_translate_stream.py --runs 3 --before /tmp/old/src \
        MODEL INPUT -- --beam 4

Each run is `python -m transformer translate MODEL INPUT ARGS`, stdout read through a pipe (the
time to its first byte is the first output's), its peak RSS from the kernel (`os.wait4`). The
outputs of every run must be byte-identical, else the script fails. Prints the CPU, the load
average, and per tree the medians: wall seconds, source words/s, peak RSS, first output.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


class RunFailed(Exception):
    """A run of `transformer translate` that did not end with status 0."""


def run_once(
    src: Path | None, model: str, input_path: str, extra: list[str], env: dict | None = None
) -> dict:
    """One `transformer translate` in a fresh process (the tree at `src`, or this one's; in
    `env`, else this process's environment)."""
    env = dict(os.environ if env is None else env)
    if src is not None:
        env["PYTHONPATH"] = f"{src}{os.pathsep}{env.get('PYTHONPATH', '')}"
    cmd = [sys.executable, "-m", "transformer", "translate", model, input_path, *extra]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    first = proc.stdout.read(1)
    first_s = time.perf_counter() - start if first else None
    output = first + proc.stdout.read()
    proc.stdout.close()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise RunFailed(f"`transformer translate {' '.join(cmd[4:])}` failed ({code})")
    return {"wall": wall, "first": first_s, "rss_mib": usage.ru_maxrss / 1024, "output": output}


def parse_with_options(
    parser: argparse.ArgumentParser, argv: list[str] | None
) -> tuple[argparse.Namespace, list[str], int]:
    """`parser`'s arguments before "--", translate's own options after it, and the words of
    INPUT (`args.input`); the parser's error for an input that is not a file or has no words,
    and for a --before tree without the package (where the parser has --before)."""
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)  # after it: translate's own options
    args, extra = parser.parse_args(argv[:cut]), argv[cut + 1 :]
    before = getattr(args, "before", None)
    if before is not None and not (before / "transformer").is_dir():
        parser.error(f"argument --before: {before} holds no transformer package")
    if not Path(args.input).is_file():
        parser.error(f"{args.input}: not a file")
    with open(args.input, "rb") as f:
        words = sum(len(line.split()) for line in f)
    if words == 0:  # no output to time: no first byte, no words/s
        parser.error(f"{args.input}: no words to translate")
    return args, extra, words


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("input")
    parser.add_argument("--runs", type=int, default=3, help="runs per tree (default 3)")
    parser.add_argument("--before", type=Path, help="another tree's src folder, run alternately")
    parser.usage = "%(prog)s [-h] [--runs N] [--before SRC] MODEL INPUT [-- TRANSLATE OPTIONS]"
    args, extra, words = parse_with_options(parser, argv)
    if args.runs < 1:
        parser.error(f"argument --runs: at least 1, not {args.runs}")

    from transformer.cpuinfo import cpu_line

    trees = {"before": args.before, "after": None} if args.before else {"after": None}
    results: dict[str, list[dict]] = {name: [] for name in trees}
    print(f"# {cpu_line()}; load average {os.getloadavg()[0]:.2f}; {words:,} source words; "
          f"translate {' '.join(extra)}; {args.runs} runs per tree, alternating")  # fmt: skip
    for run in range(args.runs):
        for name, src in trees.items():
            try:
                r = run_once(src, args.model, args.input, extra)
            except RunFailed as e:
                print(f"bench_translate_stream: {e}", file=sys.stderr)
                return 2
            results[name].append(r)
            print(f"run {run + 1} {name}: {r['wall']:.1f} s, {words / r['wall']:,.0f} words/s, "
                  f"peak RSS {r['rss_mib']:,.0f} MiB, first output at {r['first']:.1f} s",
                  flush=True)  # fmt: skip
    outputs = {r["output"] for runs in results.values() for r in runs}
    if len(outputs) != 1:
        print("bench_translate_stream: the runs' outputs differ", file=sys.stderr)
        return 1
    for name, runs in results.items():
        wall = statistics.median(r["wall"] for r in runs)
        print(f"{name}: {wall:.1f} s, {words / wall:,.0f} words/s, peak RSS "
              f"{statistics.median(r['rss_mib'] for r in runs):,.0f} MiB, first output at "
              f"{statistics.median(r['first'] for r in runs):.1f} s (medians)")  # fmt: skip
    print(f"# load average at the end {os.getloadavg()[0]:.2f}; outputs identical")
    return 0


if __name__ == "__main__":
    sys.exit(main())
