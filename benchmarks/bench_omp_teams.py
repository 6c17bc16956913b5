"""Two OpenMP teams in one process: what GNU OpenMP's throttled spin-wait costs torch's ops.

Torch's CPU threads are an OpenMP team per Python thread that runs a parallel op. When the
teams of a process hold more threads than there are CPUs, GNU OpenMP (torch's libgomp) cuts
the spin of every thread waiting at a barrier or for work from ~300,000 turns to 100
(`do_spin`: `gomp_throttled_spin_count_var` while `gomp_managed_threads >
gomp_available_cpus`), so between two ops the threads sleep and the kernel wakes them. This
times, each case in a fresh process with every core's thread count:

- `one team`: the ops on the main thread only (what `translate` does);
- `two teams`: a parallel op on the main thread first, then the ops on a worker thread (what
  `serve` did before 7b6e0dc: the model built on the main thread, decoded on a worker);
- `GOMP_SPINCOUNT=100`: one team, its spin cut to the throttled count by the environment;
- `CTranslate2 alive` (with --ct2-dir, a CTranslate2 model directory): a CTranslate2
  translator that has translated once and sits idle, as in the peers' W2 harness run in one
  process (libctranslate2's GOMP_parallel binds to torch's libgomp; `LD_DEBUG=bindings`).

    .venv/bin/python benchmarks/bench_omp_teams.py [--ct2-dir /tmp/peers-w2/ct2]

The ops: a decoder step's (64, 512) x (512, 512) product and a batched attention product
(512 heads x 1 query x 64) x (64 x 34 keys). docs/performance.md, "Round eight".
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CASES = ("one team", "two teams", "GOMP_SPINCOUNT=100", "CTranslate2 alive")


def time_ops(reps: int) -> dict[str, float]:
    """Microseconds per op of the two products on the calling thread (median of 5 blocks)."""
    import statistics
    import time

    import torch

    a, w = torch.randn(64, 512), torch.randn(512, 512)
    q, k = torch.randn(512, 1, 64), torch.randn(512, 34, 64)
    ops = {"(64,512)x(512,512)": lambda: a @ w, "bmm (512,1,64)x(512,64,34)": lambda: q @ k.mT}
    out = {}
    for name, op in ops.items():
        for _ in range(reps // 10):
            op()
        blocks = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(reps):
                op()
            blocks.append((time.perf_counter() - start) / reps * 1e6)
        out[name] = statistics.median(blocks)
    return out


def child(case: str, reps: int, ct2_dir: str | None) -> dict[str, float]:
    """One case, in this (fresh) process."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    if case == "two teams":
        torch.randn(256, 256) @ torch.randn(256, 256)  # the main thread's team
        with ThreadPoolExecutor(1) as worker:
            return worker.submit(time_ops, reps).result()
    if case == "CTranslate2 alive":
        import ctranslate2

        tr = ctranslate2.Translator(
            ct2_dir, device="cpu", inter_threads=1, intra_threads=torch.get_num_threads()
        )
        tr.translate_batch([["w5", "w7"]], max_decoding_length=4)  # W2-style tokens
        result = time_ops(reps)
        del tr
        return result
    return time_ops(reps)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=2000, help="ops per timed block")
    p.add_argument("--ct2-dir", help="a CTranslate2 model directory: time the last case too")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.reps < 10:
        print("bench_omp_teams.py: --reps must be at least 10", file=sys.stderr)
        return 2
    if args.child:
        print(json.dumps(child(args.child, args.reps, args.ct2_dir)))
        return 0
    if args.ct2_dir and not os.path.isfile(os.path.join(args.ct2_dir, "model.bin")):
        print(f"bench_omp_teams.py: {args.ct2_dir}: no model.bin (a CTranslate2 model directory)",
              file=sys.stderr)  # fmt: skip
        return 2
    from transformer.cpuinfo import cpu_line

    print(f"# {cpu_line()}; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    rows = {}
    for case in CASES if args.ct2_dir else CASES[:3]:
        env = dict(os.environ)
        env.pop("OMP_NUM_THREADS", None)
        if case.startswith("GOMP_SPINCOUNT="):
            env["GOMP_SPINCOUNT"] = case.split("=")[1]
        cmd = [sys.executable, __file__, "--child", case, "--reps", str(args.reps)]
        if args.ct2_dir:
            cmd += ["--ct2-dir", args.ct2_dir]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            print(f"bench_omp_teams.py: case {case!r} failed: {last}", file=sys.stderr)
            return 1
        rows[case] = json.loads(done.stdout.strip().splitlines()[-1])
    ops = list(rows["one team"])
    print(f"| case | {' | '.join(ops)} |\n|---|{'---:|' * len(ops)}")
    for case, us in rows.items():
        cells = [f"{us[o]:.0f} us ({us[o] / rows['one team'][o]:.2f}x)" for o in ops]
        print(f"| {case} | {' | '.join(cells)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
