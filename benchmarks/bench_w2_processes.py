"""W2 (the peers' translation benchmark) with each implementation in its own process.

The peers' harness (`../shared/peers/bench_infer.py`) times every variant in one process. There
CTranslate2's library binds torch's OpenMP runtime (`LD_DEBUG=bindings`: `GOMP_parallel` of
libctranslate2 resolves to torch/lib/libgomp.so.1, not to the libgomp CTranslate2 ships), so a
live CTranslate2 translator adds its worker team to torch's. libgomp then counts more threads
than CPUs and cuts every waiting thread's spin from ~300,000 turns to 100 (`do_spin`:
`gomp_throttled_spin_count_var` while `gomp_managed_threads > gomp_available_cpus`): each
parallel region's threads fall asleep between two products and have to be woken by the kernel.
On a 2-core Zen 5 a (64, 512) x (512, 512) product went from 198 to 282 us beside an idle
CTranslate2 translator, and a decoder's batched attention product from 49 to 103 us; with one
thread, or after the translator is deleted, nothing changes, and `GOMP_SPINCOUNT=100` alone
reproduces the slowdown (docs/performance.md, "Round eight"). No user runs two inference
libraries' decoders in one process to translate; this runs the same harness once per variant
instead, in interleaved rounds (the order reversed every other round), and merges the rounds:

    PYTHONPATH=src:benchmarks PY=/work/peers-venv/bin/python \\
        python benchmarks/bench_w2_processes.py --variants ct2:int8,ext:peers_adapter:Infer:int8 \\
        --beams 4 --reps 5 --rounds 2 --json OUT.json

Tokens/s are pooled over the rounds (median, min, max over every timed run); the last column is
each variant's median over the `--ratio-to` variant's (default ct2:int8). Token agreement
between variants needs them in one process: `bench_peers.sh` with W2_PROCESS=one gives it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

PEERS = Path(__file__).resolve().parents[2] / "shared" / "peers"


class Usage(Exception):
    """A bad argument or a failed harness run: one line, exit status 2."""


def stats(xs: list[float]) -> dict:
    """The harness's summary of a list of samples (bench_infer.stats' fields)."""
    return {
        "median": statistics.median(xs),
        "min": min(xs),
        "max": max(xs),
        "n": len(xs),
        "all": xs,
    }


def order(variants: list[str], rounds: int) -> list[list[str]]:
    """The variants of each round: as given, then reversed, and so on (A B, B A, A B...)."""
    return [variants if r % 2 == 0 else variants[::-1] for r in range(rounds)]


def add_common_args(p: argparse.ArgumentParser, reps: int, what: str) -> None:
    """The arguments W1's and W2's per-process runs share."""
    p.add_argument("--reps", type=int, default=reps, help=f"timed {what} per process")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=2, help="processes per variant, interleaved")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default="", help="write the merged result here")
    p.add_argument("--peers", type=Path, default=Path(os.environ.get("PEERS_DIR", PEERS)))
    p.add_argument("--python", default=os.environ.get("PY", sys.executable))


def checked_names(args: argparse.Namespace, flag: str, noun: str, harness: str) -> list[str]:
    """The distinct names `flag` gives (`noun`: what they are), after checking the shared
    arguments and that the harness exists (Usage)."""
    value = getattr(args, flag.removeprefix("--"))
    names = [v for v in value.split(",") if v]
    if not names or len(set(names)) != len(names):
        raise Usage(f"{flag}: distinct comma-separated {noun}, got {value!r}")
    if min(args.reps, args.rounds, args.threads) < 1 or args.warmup < 0:
        raise Usage("--reps, --rounds and --threads must be at least 1, --warmup at least 0")
    if not (args.peers / harness).is_file():
        raise Usage(f"{args.peers / harness}: not found (--peers or PEERS_DIR)")
    if args.json and not Path(args.json).resolve().parent.is_dir():
        raise Usage(f"--json: no directory {Path(args.json).resolve().parent}")
    return names


def run_rounds(names: list[str], rounds: int, run_one) -> list[dict]:
    """run_one(name, json_path) -> its harness JSON, for each name in its own process, in
    `rounds` interleaved rounds (`order`); each JSON gets its "round" and "variant"."""
    runs = []
    with tempfile.TemporaryDirectory(prefix="peers-") as tmp:
        for r, names_r in enumerate(order(names, rounds)):
            for i, name in enumerate(names_r):
                print(f"# round {r + 1}/{rounds}: {name} (its own process)", flush=True)
                run = run_one(name, Path(tmp) / f"{r}-{i}.json")
                run["round"], run["variant"] = r + 1, name
                runs.append(run)
    return runs


def run_all(script: str, args: argparse.Namespace, flag: str, noun: str, harness: str, run_harness):
    """Checks the arguments, then runs `run_harness(python, peers, name, args, json_path)` for
    each name `flag` gives, in its own processes (`run_rounds`). (names, runs), or the exit
    status after a one-line message: 2 for a bad argument or a failed run, 130 on Ctrl-C."""
    try:
        names = checked_names(args, flag, noun, harness)
        runs = run_rounds(names, args.rounds, lambda name, path: run_harness(
            args.python, args.peers, name, args, path))  # fmt: skip
    except Usage as e:
        print(f"{script}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the harness's process got it too, and has stopped
        print(f"{script}: interrupted", file=sys.stderr)
        return 130
    return names, runs


def merge(runs: list[dict], variants: list[str], ratio_to: str) -> dict:
    """One W2 result from per-process harness JSONs (`runs`, in the order they ran): every
    (variant, beam)'s timed runs pooled, the round medians kept, ratios to `ratio_to`."""
    results, failed = {}, {}
    for run in runs:
        failed.update(run.get("failed", {}))
        for r in run["results"]:
            key = (r["variant"], r["beam"])
            entry = results.setdefault(
                key,
                {
                    "variant": r["variant"],
                    "beam": r["beam"],
                    "seconds": [],
                    "round_medians": [],
                    "tok": [],
                    "note": r.get("note"),
                    "peak_rss_mib": [],
                },
            )
            entry["tok"] += r["tok_per_s"]["all"]
            entry["round_medians"].append(r["tok_per_s"]["median"])
            entry["seconds"] += r["seconds"]
            entry["peak_rss_mib"].append(run.get("peak_rss_mib"))
    rank = {v: i for i, v in enumerate(variants)}
    out = []
    for key in sorted(results, key=lambda k: (-k[1], rank.get(k[0], len(rank)))):  # beam 4 first
        e = results[key]
        out.append({**e, "tok_per_s": stats(e.pop("tok"))})
    for e in out:
        ref = next((r for r in out if r["variant"] == ratio_to and r["beam"] == e["beam"]), None)
        ratio = None if ref is None else e["tok_per_s"]["median"] / ref["tok_per_s"]["median"]
        e["vs_" + ratio_to] = ratio
    return {"results": out, "failed": failed}


def run_harness(
    py: str, peers: Path, variant: str, args: argparse.Namespace, json_path: Path
) -> dict:
    """One process of the peers' harness for one variant; its JSON, or Usage naming the run."""
    cmd = [
        py,
        str(peers / "bench_infer.py"),
        "--variants",
        variant,
        "--beams",
        args.beams,
        "--reps",
        str(args.reps),
        "--warmup",
        str(args.warmup),
        "--threads",
        str(args.threads),
        "--json",
        str(json_path),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    sys.stdout.write(
        "".join(
            f"  | {line}\n"
            for line in done.stdout.splitlines()
            if "tok/s" in line or line.lstrip().startswith(variant.split(":")[0])
        )
    )
    if done.returncode != 0 or not json_path.is_file():
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise Usage(f"{variant}: the harness exited with {done.returncode}: {tail}")
    return json.loads(json_path.read_text(encoding="utf-8"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", required=True, help="bench_infer.py variants, comma-separated")
    p.add_argument("--beams", default="4", help="bench_infer.py --beams (e.g. 4 or 4,1)")
    p.add_argument("--ratio-to", default="ct2:int8")
    add_common_args(p, reps=5, what="runs")
    args = p.parse_args(argv)
    done = run_all("bench_w2_processes.py", args, "--variants", "variants", "bench_infer.py",
                   run_harness)  # fmt: skip
    if isinstance(done, int):
        return done
    variants, runs = done
    merged = merge(runs, variants, args.ratio_to)
    ratio_key = "vs_" + args.ratio_to
    print(
        f"\n# W2, one process per variant, {args.rounds} interleaved rounds x {args.reps} runs, "
        f"threads={args.threads}; tokens/s pooled over the rounds"
    )
    print(
        f"{'variant':>30} {'beam':>4} {'tok/s med':>10} {'min':>8} {'max':>8} "
        f"{'round medians':>20} {'vs ' + args.ratio_to:>12}"
    )
    for e in merged["results"]:
        s, ratio = e["tok_per_s"], e[ratio_key]
        rounds = "/".join(f"{m:.0f}" for m in e["round_medians"])
        print(
            f"{e['variant']:>30} {e['beam']:>4} {s['median']:10.0f} {s['min']:8.0f} "
            f"{s['max']:8.0f} {rounds:>20} {'' if ratio is None else f'{ratio:.2f}x':>12}"
        )
    for k, v in merged["failed"].items():
        print(f"{k:>30} FAILED: {v}")
    if args.json:
        first = runs[0]
        out = {
            "env": first.get("env"),
            "cfg": first.get("cfg"),
            "src": first.get("src"),
            "args": {
                **first.get("args", {}),
                "variants": args.variants,
                "reps": args.reps,
                "json": args.json,
            },
            "mode": f"one process per variant, {args.rounds} interleaved rounds",
            "processes": [
                {
                    "round": r["round"],
                    "variant": r["variant"],
                    "peak_rss_mib": r.get("peak_rss_mib"),
                }
                for r in runs
            ],
            **merged,
        }
        Path(args.json).write_text(json.dumps(out, indent=1), encoding="utf-8")
    return 1 if merged["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
