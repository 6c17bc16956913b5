"""Throughput alone and beside one busy process: training and translation, as a user runs them.

A machine is often not idle: an editor, a second job, a test run. With one other busy process
on 2 cores, PyTorch's default threading collapses (two threads that spin-wait for each other
while the other process holds a core). This runs each workload in a fresh subprocess, exactly as
the CLI runs it (same thread choice), first alone and then beside `python -c 'while True: pass'`,
and prints tokens/s and the ratio, with the CPU model and ISA beside them.

    .venv/bin/python benchmarks/bench_contention.py --data data/m30k --model MODEL
    .venv/bin/python benchmarks/bench_contention.py --data data/m30k --model MODEL --threads 2

--threads N passes `--threads N` to the CLI (the behaviour a fixed thread count gets); without it
the CLI chooses (docs/performance.md, "A machine that is not idle"). --procs N trains with
`--procs N` (N one-thread processes); --preset picks the training model (default quickstart);
--only train|translate runs one of the two workloads; --rounds R repeats each alone/beside
pair R times and prints the median of the rounds' ratios as well; --json PATH writes the pairs
and medians (benchmarks/issue19_summary.py reads them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from transformer.cpuinfo import cpu_line  # torch-free: this parent only starts CLI processes


def _cli(args: list[str], env: dict | None = None) -> tuple[float, str]:
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "transformer", *args], capture_output=True, text=True,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"transformer {args[0]} failed:\n{done.stderr[-2000:]}")
    return time.perf_counter() - start, done.stdout


@contextmanager
def busy_process() -> Iterator[None]:
    """`python -c 'while True: pass'` running beside the block (given a second to start)."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(1.0)
        yield
    finally:
        busy.kill()
        busy.wait()


class RunFailed(Exception):
    """A benchmark's run that did not end with status 0, or too short to have a rate."""


def steady_rate(run: Path) -> float:
    """Target tokens/s of a training run's metrics after their first window (the first steps
    warm up)."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("kind") == "train"][1:]
    pairs = list(zip(train, train[1:], strict=False))
    tokens = sum(r["tokens"] - p["tokens"] for p, r in pairs)
    seconds = sum((r["tokens"] - p["tokens"]) / r["tokens_per_s"] for p, r in pairs)
    if seconds <= 0:
        raise RunFailed("a run of fewer than 3 metric windows (10 steps each): no rate past the "
                        "first; --max-steps 30 or more")  # fmt: skip
    return tokens / seconds


def train_rate(data: Path, steps: int, threads: list[str], preset: str = "quickstart") -> float:
    """Target tokens/s of a preset over `steps` steps (the metrics' own rate), no validation."""
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        _cli(["train", str(data), "--preset", preset, "--out", str(run), "--max-steps",
              str(steps), "train.save_every_minutes=1000", "train.save_every_steps=1000000",
              "train.valid_every_steps=1000000", "train.log_every_steps=10",
              *threads])  # fmt: skip
        return steady_rate(run)


def translate_rate(
    model: Path, src: Path, lines: int, threads: list[str], repeat: int = 1
) -> float:
    """Output tokens/s of beam 4 over the first `lines` lines, `repeat` times over (wall time of
    the whole command minus the time to load the model and read the input, measured with an
    empty input)."""
    with tempfile.TemporaryDirectory() as tmp:
        part = Path(tmp) / "src.txt"
        text = src.read_text(encoding="utf-8").splitlines()[:lines] * repeat
        part.write_text("\n".join(text) + "\n", encoding="utf-8")
        empty = Path(tmp) / "empty.txt"
        empty.write_text("", encoding="utf-8")
        overhead, _ = _cli(["translate", str(model), str(empty), *threads])
        seconds, out = _cli(["translate", str(model), str(part), "--beam", "4", *threads])
        words = sum(len(line.split()) for line in out.splitlines())
        return words / max(seconds - overhead, 1e-6)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data", type=Path, required=True, help="a prepared Multi30k directory")
    p.add_argument("--model", type=Path, required=True, help="a trained en->de model file")
    p.add_argument("--src", type=Path, default=Path("../shared/data/multi30k/val.en"))
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--lines", type=int, default=300)
    # The recipe's model translates val's 1,014 lines in ~1.5 s alone on a Zen 5, within the
    # noise of the model's load time subtracted from it (one such run kept "46.6%" where five
    # times the lines kept 68.8%): repeat the input to time several seconds.
    p.add_argument("--repeat", type=int, default=1, help="translate the lines this many times")
    p.add_argument("--threads", type=int, help="pass --threads N to the CLI")
    p.add_argument("--procs", type=int, help="train with --procs N (data-parallel processes)")
    p.add_argument("--preset", default="quickstart", help="the training preset")
    p.add_argument("--only", choices=("train", "translate"), help="run one workload")
    # One pair of runs moves by a few points from the host alone (70.1%, 69.8%, 70.7% for the
    # same translation, docs/performance.md): rounds of alone-then-beside pairs give a median.
    p.add_argument("--rounds", type=int, default=1, help="alone/beside pairs per workload")
    p.add_argument("--json", type=Path, help="write the pairs and their medians to this file")
    args = p.parse_args()
    if args.repeat < 1:
        p.error(f"--repeat must be at least 1, got {args.repeat}")
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.json and not args.json.parent.is_dir():  # before minutes of runs, not after
        p.error(f"--json: no directory {args.json.parent}")
    threads = ["--threads", str(args.threads)] if args.threads else []
    procs = ["--procs", str(args.procs)] if args.procs else []
    record = {"cpu": cpu_line(), "load_average": os.getloadavg()[0], "threads": args.threads,
              "procs": args.procs, "preset": args.preset, "workloads": {}}  # fmt: skip
    print(f"# {record['cpu']}; load average {record['load_average']:.2f} at start")
    print(f"# thread choice: {'--threads ' + str(args.threads) if threads else 'the CLI default'}"
          f"{'; training with --procs ' + str(args.procs) if procs else ''}; "
          f"training preset {args.preset}")  # fmt: skip
    for name, run in (
        ("train tok/s", lambda: train_rate(args.data, args.steps, threads + procs, args.preset)),
        (
            "translate words/s",
            lambda: translate_rate(args.model, args.src, args.lines, threads, args.repeat),
        ),
    ):
        if args.only and not name.startswith(args.only):
            continue
        pairs = []
        for _ in range(args.rounds):
            alone = run()
            with busy_process():
                beside = run()
            pairs.append((alone, beside))
            print(f"{name:>18}: alone {alone:8.0f}   beside a busy process {beside:8.0f}   "
                  f"kept {beside / alone:6.1%}", flush=True)  # fmt: skip
        kept = statistics.median(b / a for a, b in pairs)
        alone_m = statistics.median(a for a, _ in pairs)
        beside_m = statistics.median(b for _, b in pairs)
        record["workloads"][name.split()[0]] = {
            "unit": name.split()[1], "pairs": pairs, "alone": alone_m, "beside": beside_m,
            "kept": kept,  # the median of the rounds' ratios
        }  # fmt: skip
        if len(pairs) > 1:
            print(
                f"{name:>18}: median of {len(pairs)} rounds: alone {alone_m:8.0f}   beside "
                f"{beside_m:8.0f}   kept {kept:6.1%} (median of the rounds' ratios)",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
