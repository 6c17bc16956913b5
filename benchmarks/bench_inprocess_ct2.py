"""Does a live CTranslate2 translator slow our decoding in the same process? (issue 19)

The peers' W2 harness (`../shared/peers/bench_infer.py`) times every variant in ONE process,
CTranslate2's translators included, alive for the whole run. This times our decoder (the W2
model and batch, `peers_adapter.Infer`) before a CTranslate2 translator exists, after it has
translated the same batch, and after it is deleted, printing tokens/s and the CPU time of each
thread during our run (CTranslate2's idle threads take none).

    PYTHONPATH=benchmarks /work/peers-venv/bin/python benchmarks/bench_inprocess_ct2.py \
        --variant int8 --beam 4      # needs /tmp/peers-w2 from one bench_infer.py run
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch

PEERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "peers")


def thread_ticks() -> dict[str, int]:
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[tid] = int(fields[11]) + int(fields[12])  # utime + stime
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", default="int8", help="peers_adapter.Infer variant")
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--workdir", default="/tmp/peers-w2", help="bench_infer.py's --workdir")
    p.add_argument("--peers", default=PEERS)
    args = p.parse_args()
    sys.path.insert(0, args.peers)
    from bench_infer import CT2Infer, make_src  # the harness's batch and CTranslate2 adapter

    import peers_adapter

    torch.set_num_threads(2)
    ctx = {"hf_dir": f"{args.workdir}/hf", "ct2_dir": f"{args.workdir}/ct2", "threads": 2}
    src, lens = make_src(64, 30, 4, 32000)
    ours = peers_adapter.Infer(args.variant, ctx)
    prepared = ours.prepare(src, lens)

    def timed(label: str) -> None:
        ours.run(prepared, args.beam, 50)  # warm
        before = thread_ticks()
        start = time.perf_counter()
        n = ours.run(prepared, args.beam, 50)
        seconds = time.perf_counter() - start
        after = thread_ticks()
        busy = sorted((t - before.get(k, 0) for k, t in after.items() if t > before.get(k, 0)))
        print(f"{label:34s} {n / seconds:7.0f} tok/s   CPU ticks per busy thread: {busy}")

    timed("ours, no CTranslate2 yet")
    ct2 = CT2Infer("int8", ctx)  # as the harness builds it: its own threads, alive until del
    ct2.run(ct2.prepare(src, lens), args.beam, 50)
    timed("ours, CTranslate2 alive (idle)")
    timed("ours, CTranslate2 alive (again)")
    del ct2
    gc.collect()
    timed("ours, CTranslate2 deleted")
    timed("ours, CTranslate2 deleted (again)")


if __name__ == "__main__":
    main()
