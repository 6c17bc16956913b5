"""W1 (the peers' training benchmark) with each implementation in its own process.

The peers' harness (`../shared/peers/bench_train.py`) builds every implementation in one process
and times their steps interleaved. There the peers slow each other down: on the 2-core Zen 5
(2026-11-27, docs/performance.md "Round sixteen") fairseq, OpenNMT-py and nn.Transformer ran at
842, 858 and 774 target tokens/s each alone in the harness and at 687, 561 and 658 beside one
another (ours 1,736 alone, 1,712 beside them): a ratio taken there reads ~15-20% in our favour.
No user trains two toolkits' models in one process; this runs the same harness once per
implementation instead, in interleaved rounds (the order reversed every other round), and
merges the rounds into the harness's own JSON format (each implementation's samples pooled,
`round_medians` added), which `issue19_summary.py` reads beside the one-process table:

    PYTHONPATH=src:benchmarks PY=/work/peers-venv/bin/python \\
        python benchmarks/bench_w1_processes.py --impl fairseq,onmt,ext:peers_adapter:make_train \\
        --dtype bf16 --reps 3 --rounds 2 --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from bench_w2_processes import Usage, add_common_args, run_all, stats


def merge(runs: list[dict], impls: list[str]) -> dict:
    """One W1 result from per-process harness JSONs (`runs`, in the order they ran): every
    implementation's samples pooled in order, each process's median kept."""
    results: dict[str, dict] = {}
    failed: dict[str, str] = {}
    for run in runs:
        failed.update(run.get("failed", {}))
        for r in run["results"]:
            entry = results.setdefault(r["impl"], {
                "impl": r["impl"], "dtype": r["dtype"], "samples": [], "round_medians": [],
                "params": r.get("params"), "notes": r.get("notes"), "losses": [],
                "peak_rss_mib": [],
            })  # fmt: skip
            entry["samples"] += r["tok_per_s"]["all"]
            entry["round_medians"].append(r["tok_per_s"]["median"])
            entry["losses"] += r.get("losses", [])
            entry["peak_rss_mib"].append(run.get("peak_rss_mib_process"))
    rank = {v: i for i, v in enumerate(impls)}
    out = [
        {**e, "tok_per_s": stats(e.pop("samples"))}
        for _, e in sorted(results.items(), key=lambda kv: rank.get(kv[0], len(rank)))
    ]
    return {"results": out, "failed": failed}


def run_harness(py: str, peers: Path, impl: str, args: argparse.Namespace, json_path: Path):
    """One process of the peers' harness for one implementation; its JSON, or Usage."""
    cmd = [py, str(peers / "bench_train.py"), "--impl", impl, "--dtype", args.dtype,
           "--reps", str(args.reps), "--warmup", str(args.warmup), "--threads", str(args.threads),
           "--json", str(json_path)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    sys.stdout.write("".join(f"  | {line}\n" for line in done.stdout.splitlines()
                             if line.startswith("# rep ")))  # fmt: skip
    if done.returncode != 0 or not json_path.is_file():
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise Usage(f"{impl}: the harness exited with {done.returncode}: {tail}")
    data = json.loads(json_path.read_text(encoding="utf-8"))
    if data.get("failed"):
        raise Usage(f"{impl}: the harness could not build it: {data['failed']}")
    return data


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--impl", required=True, help="bench_train.py implementations, comma-separated")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    add_common_args(p, reps=3, what="steps")
    args = p.parse_args(argv)
    done = run_all("bench_w1_processes.py", args, "--impl", "implementations", "bench_train.py",
                   run_harness)  # fmt: skip
    if isinstance(done, int):
        return done
    impls, runs = done
    merged = merge(runs, impls)
    best = max(e["tok_per_s"]["median"] for e in merged["results"])
    print(f"\n# W1 train {args.dtype}, one process per implementation, {args.rounds} interleaved "
          f"rounds x {args.reps} steps, threads={args.threads}")  # fmt: skip
    print(f"{'impl':>30} {'median tok/s':>13} {'min':>8} {'max':>8} {'round medians':>16} "
          f"{'vs best':>8}")  # fmt: skip
    for e in merged["results"]:
        s = e["tok_per_s"]
        rounds = "/".join(f"{m:.0f}" for m in e["round_medians"])
        print(f"{e['impl']:>30} {s['median']:13.0f} {s['min']:8.0f} {s['max']:8.0f} "
              f"{rounds:>16} {s['median'] / best:8.2f}")  # fmt: skip
    if args.json:
        first = runs[0]
        out = {
            "env": first.get("env"), "batch": first.get("batch"), "cfg": first.get("cfg"),
            "args": {**first.get("args", {}), "impl": args.impl, "rounds": args.rounds,
                     "json": args.json},
            "mode": f"one process per implementation, {args.rounds} interleaved rounds",
            **merged,
        }  # fmt: skip
        Path(args.json).write_text(json.dumps(out, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
