"""Before/after: the training step and decoding of an earlier revision against the working tree.

model.py and loss.py of `--rev` are loaded from git into side modules, so both versions run in
ONE process, interleaved (round-robin, median), on the peers' shapes (benchmarks/peers_adapter.py):
a base-preset bf16 training step on 128 pairs x ~30 tokens (V = 32,000), and greedy / beam-4
decoding of 64 sentences forced to 50 tokens with the shared Marian weights.

    .venv/bin/python benchmarks/bench_before_after.py --rev 9c19587
    .venv/bin/python benchmarks/bench_before_after.py --rev 9c19587 --what decode --reps 3
    .venv/bin/python benchmarks/bench_before_after.py --rev 242feec --what real \
        --data QS/data --preset quickstart --batches 40

`--switch attention_bf16` (or `weight_grad_amx`, `project_amx`): a kernel switch
(`transformer.kernels.`'s function of that name) off before each 'before' call and on before
each 'after' one; with `--rev HEAD` the same code either side (a switch that changes the
numbers, as project_amx's fp32 logits, prints how many decoded outputs differ):

    .venv/bin/python benchmarks/bench_before_after.py --rev HEAD --switch attention_bf16 \
        --what train,real --data QS/data --reps 12

`--kernels`: the 'before' side also runs the compiled library of `--rev`'s kernels.py (its C
source, built as that revision built it), the Python wrappers the working tree's either side: for
a change inside the C functions that keeps their arguments (the library is swapped before each
call, as a switch is):

    .venv/bin/python benchmarks/bench_before_after.py --rev HEAD --kernels --what train --reps 12

`--what real`: training steps on the first batches of a prepared training split (the preset's
batch size, length-sorted as `transformer train` makes them, bf16 with fp32-master Adam), each
batch stepped before, after, after, before (the second step of a shape finds its oneDNN kernels
built: a fixed order favoured the version that ran second); the median of the per-batch
speed-ups is robust to a host whose speed drifts. One process holds both versions' kernels, so
a change to how many shapes a run makes (model.ROW_ALIGN) is measured with `transformer train`
in separate processes instead.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peers_adapter import Infer, OurTrain, train_step  # noqa: E402
from transformer.loss import chunked_label_smoothed_loss  # noqa: E402
from transformer.model import Transformer  # noqa: E402

PEERS = os.environ.get("PEERS_DIR", os.path.join(os.path.dirname(__file__), "../../shared/peers"))


def module_at(rev: str, path: str, name: str) -> types.ModuleType:
    """A module made from `path` as it was at git revision `rev`."""
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    done = subprocess.run(["git", "-C", root, "show", f"{rev}:{path}"],
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0:  # an unknown revision, or the file not in it: git's own line
        lines = done.stderr.strip().splitlines() or [f"git show failed ({done.returncode})"]
        sys.exit(f"bench_before_after.py: --rev {rev}: {lines[0]}")
    source = done.stdout
    module = types.ModuleType(name)
    module.__file__ = os.path.join(root, path)  # where the working tree's copy lies
    sys.modules[name] = module  # dataclasses look their module up while the source runs
    exec(compile(source, f"{rev}:{path}", "exec"), module.__dict__)  # noqa: S102
    return module


# `--switch`: the kernel switch set off for 'before' and on for 'after' (`switched`).
SWITCH = None


# `--kernels`: each side's compiled library, (`_LIB`, `_NOGIL`) of `transformer.kernels`.
LIBRARIES: dict[str, tuple] = {}


def switched(k: str) -> None:
    """Set `SWITCH` for the side k ('before': off, 'after': on), where there is one, and that
    side's library (`LIBRARIES`)."""
    if SWITCH is not None:
        SWITCH(k == "after")
    if LIBRARIES:
        from transformer import kernels

        kernels._LIB, kernels._NOGIL = LIBRARIES[k]


def interleave(runs: dict, reps: int) -> dict[str, float]:
    """Median seconds per call of each zero-argument function, calls round-robin."""
    for k, f in runs.items():
        switched(k)
        f()  # warm-up
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(reps):
        for k, f in runs.items():
            switched(k)
            start = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rev", required=True, help="the 'before' git revision")
    p.add_argument("--what", default="train,decode")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--variants", default="bf16,fp32", help="decoding dtypes")
    p.add_argument(
        "--train-dtype",
        choices=["auto", "bf16", "fp32"],
        default="auto",
        help="the training step's dtype (auto: bf16 where the CPU multiplies it natively, "
        "fp32 elsewhere, as train.dtype=auto)",
    )
    p.add_argument("--beams", default="1,4")
    p.add_argument("--data", help="prepared data directory (--what real)")
    p.add_argument("--preset", default="quickstart", help="model preset (--what real)")
    p.add_argument("--batches", type=int, default=40, help="training batches (--what real)")
    p.add_argument(
        "--switch",
        choices=["attention_bf16", "weight_grad_amx", "project_amx"],
        help="a kernel switch: off before, on after",
    )
    p.add_argument(
        "--kernels", action="store_true", help="before: the compiled library of --rev's kernels.py"
    )
    args = p.parse_args()
    if "real" in args.what and not args.data:
        p.error("--what real needs --data DIR (a prepared-data directory)")
    torch.set_num_threads(args.threads)
    global SWITCH
    if args.switch:
        from transformer import kernels

        SWITCH = getattr(kernels, args.switch)
        if not SWITCH(True):
            sys.exit(f"bench_before_after.py: {args.switch} cannot be switched on here")
    if args.kernels:
        from transformer import kernels

        old = module_at(args.rev, "src/transformer/kernels.py", "before_kernels")
        if kernels._library() is None or old._library() is None:
            why = kernels._WHY or old._WHY
            sys.exit(f"bench_before_after.py: --kernels: no compiled library ({why})")
        LIBRARIES.update(before=(old._LIB, old._NOGIL), after=(kernels._LIB, kernels._NOGIL))
        print(f"kernels: before {old._PATH.name}, after {kernels._PATH.name}")
    old_model = module_at(args.rev, "src/transformer/model.py", "before_model")
    old_loss = module_at(args.rev, "src/transformer/loss.py", "before_loss")
    off, on = (f" ({args.switch} off)", f" ({args.switch} on)") if args.switch else ("", "")
    if args.kernels:
        off += " (its compiled kernels)"
    from transformer.cpuinfo import cpu_line

    print(cpu_line())
    print(f"torch {torch.__version__}, {args.threads} threads, before = {args.rev}{off}, "
          f"after = working tree{on}; load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    if "train" in args.what:
        sys.path.insert(0, PEERS)
        from common import make_mt_batch
        from train_adapters import PAPER_BASE

        cfg = dict(PAPER_BASE)
        batch = make_mt_batch(128, 30, 30, 4, cfg["vocab"], seed=0)
        before = OurTrain(cfg, old_model.Transformer, old_loss.chunked_label_smoothed_loss)
        after = OurTrain(cfg, Transformer, chunked_label_smoothed_loss)
        pb, pa = before.prepare(batch), after.prepare(batch)
        name = args.train_dtype
        if name == "auto":
            from transformer.cpuinfo import native_bf16

            name = "bf16" if native_bf16() else "fp32"
        amp = None if name == "fp32" else torch.bfloat16  # the harness's fp32: no amp
        med = interleave(
            {
                "before": lambda: before.step(pb, amp),
                "after": lambda: after.step(pa, amp),
            },
            args.reps,
        )
        n = batch["ntokens"]
        for k, s in med.items():
            print(f"train base {name} {k:>6}: {s:6.2f} s/step  {n / s:6.0f} tgt tok/s")
        print(f"train speed-up after/before: {med['before'] / med['after']:.2f}x")
    if "real" in args.what:
        from transformer.errors import UserError

        try:
            real_batches(args, old_model, old_loss)
        except UserError as e:  # unreadable data: one line, no traceback
            sys.exit(f"bench_before_after.py: {e}")
    if "decode" in args.what:
        sys.path.insert(0, PEERS)
        from bench_infer import build_marian_dir, make_src

        ctx = {"hf_dir": build_marian_dir("/tmp/peers-w2")}
        src, lens = make_src(64, 30, 4, 32000)
        for variant in args.variants.split(","):
            before = Infer(variant, ctx, old_model.Transformer)
            after = Infer(variant, ctx, Transformer)
            pb, pa = before.prepare(src, lens), after.prepare(src, lens)
            for beam in map(int, args.beams.split(",")):
                runs = {
                    "before": lambda b=beam, m=before, x=pb: m.run(x, b, 50),
                    "after": lambda b=beam, m=after, x=pa: m.run(x, b, 50),
                }
                med = interleave(runs, args.reps)
                if SWITCH is None:  # the same decoding, faster or not
                    assert before.last == after.last, "outputs differ"
                else:  # a switch may change the numbers (project_amx: fp32 logits)
                    differ = sum(a != b for a, b in zip(before.last, after.last, strict=True))
                    print(f"decode {variant} beam {beam}: {differ} of {len(after.last)} "
                          f"outputs differ between the sides")  # fmt: skip
                for k, s in med.items():
                    print(f"decode {variant} beam {beam} {k:>6}: {3200 / s:6.0f} tgt tok/s")
                print(f"decode {variant} beam {beam} speed-up: {med['before'] / med['after']:.2f}x")


def real_batches(args, old_model: types.ModuleType, old_loss: types.ModuleType) -> None:
    """Before/after training steps on real batches, alternating batch by batch."""
    from transformer.allocator import keep_large_blocks
    from transformer.batching import TokenBatchSampler
    from transformer.config import build_config
    from transformer.data import collate, load_prepared
    from transformer.optim import MixedPrecisionAdam
    from transformer.tokenizer import PAD_ID

    keep_large_blocks()  # as `transformer train`
    data = load_prepared(args.data)
    split = data.split("train")
    config = build_config(args.preset, None, [], vocab_size=data.tokenizer.vocab_size)
    sampler = TokenBatchSampler(split.src_lens, split.tgt_lens, config.train.max_tokens, seed=1)
    batches = [collate(split, idx) for _, idx in zip(range(args.batches), sampler, strict=False)]

    def trainer(model_cls: type, loss_fn):
        torch.manual_seed(0)
        model = model_cls(config.model).train()
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16)
        opt = MixedPrecisionAdam(model.parameters(), (0.9, 0.98), 1e-9)

        def step(b) -> None:
            keep = b.tgt_out != PAD_ID
            batch = {"src": b.src, "src_mask": b.src_mask, "tgt_in": b.tgt_in, "keep": keep,
                     "target": b.tgt_out[keep]}  # fmt: skip
            train_step(model, opt, loss_fn, batch, 0.1, 1e-4)

        return step

    steps = {
        "before": trainer(old_model.Transformer, old_loss.chunked_label_smoothed_loss),
        "after": trainer(Transformer, chunked_label_smoothed_loss),
    }
    for k, step in steps.items():  # warm-up
        switched(k)
        for b in batches[:3]:
            step(b)
    seconds = {k: 0.0 for k in steps}
    ratios = []
    # Each batch four times, before-after-after-before: the first step of a new batch shape
    # builds oneDNN kernels that a second step of the same shape finds cached (~10% of a
    # quickstart step), so a fixed order favoured whichever version ran second (the same code
    # against itself read 1.10x).
    for _ in range(args.reps):
        for b in batches:
            took = dict.fromkeys(steps, 0.0)
            for k in ("before", "after", "after", "before"):
                switched(k)
                start = time.perf_counter()
                steps[k](b)
                took[k] += time.perf_counter() - start
            for k in steps:
                seconds[k] += took[k]
            ratios.append(took["before"] / took["after"])
    tokens = 2 * args.reps * sum(int((b.tgt_out != PAD_ID).sum()) for b in batches)
    for k, s in seconds.items():
        print(f"train {args.preset} real batches {k:>6}: {tokens / s:7.0f} tgt tok/s")
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    print(f"train {args.preset} speed-up after/before: median {statistics.median(ratios):.3f} per "
          f"batch (quartiles {q1:.3f}-{q3:.3f}, {len(ratios)} batches)")  # fmt: skip


if __name__ == "__main__":
    main()
