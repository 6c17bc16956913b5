#!/usr/bin/env python
"""Where a training step's time goes on real batches, and what one process can keep beside a
busy one.

Times the pieces of `transformer train`'s step one by one (forward on the real tokens, the
chunked §5.4 loss with its gradient, backward, the fp32-master Adam update) on a preset's
model and length-sorted batches of a prepared corpus, at each thread count asked, in this
one process, thread counts interleaved round by round. Every batch is a step here (an update
after each; `train.accum_steps` is not applied), the preset's `train.max_tokens` a batch.
The last line is the bound of one process beside one busy process on 2 cores
(docs/performance.md): the tuner's one thread keeps one core, so training keeps at most
(one thread's rate) / (two threads' rate).

    .venv/bin/python benchmarks/bench_step_phases.py --data RUN/data --preset quickstart
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from transformer.allocator import keep_large_blocks
from transformer.batching import TokenBatchSampler
from transformer.config import RunConfig, build_config
from transformer.cpuinfo import cpu_line
from transformer.errors import UserError
from transformer.tokenizer import PAD_ID

if TYPE_CHECKING:  # torch's modules: imported where used, after the arguments' checks (~2.5 s)
    from transformer.data import Batch
    from transformer.model import Transformer
    from transformer.optim import MixedPrecisionAdam

PHASES = ("forward", "loss", "backward", "optimizer")


def training_setup(
    data_dir: str, preset: str, overrides: list[str]
) -> tuple[RunConfig, Transformer, MixedPrecisionAdam, Iterator[Batch]]:
    """A preset's model (seed 1, training mode), its optimizer, and its train split's batches,
    endlessly: what `transformer train` steps through. Raises UserError for a missing corpus,
    an unknown preset or override."""
    import torch

    from transformer.data import load_prepared
    from transformer.optim import MixedPrecisionAdam
    from transformer.train import build_model

    data = load_prepared(data_dir)
    split = data.split("train")
    config = build_config(preset, None, overrides, vocab_size=data.tokenizer.vocab_size)
    torch.manual_seed(1)
    model = build_model(config, torch.device("cpu")).train()
    opt = MixedPrecisionAdam(model.parameters(), (0.9, 0.98), 1e-9)
    opt.reserve_state()  # as train._run, before the first batch
    sampler = TokenBatchSampler(split.src_lens, split.tgt_lens, config.train.max_tokens, seed=1)
    return config, model, opt, endless_batches(sampler, split)


def endless_batches(sampler: TokenBatchSampler, split) -> Iterator[Batch]:
    """The sampler's batches, collated, epoch after epoch (a timed loop never runs dry)."""
    from transformer.data import collate

    while True:
        for indices in sampler:
            yield collate(split, indices)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--data", required=True, help="a prepared corpus (`transformer prepare`)")
    ap.add_argument("--preset", default="quickstart")
    ap.add_argument("--dtype", default="auto", help="train.dtype: auto, fp32 or bf16")
    ap.add_argument("--threads", default="1,2", help="thread counts to compare")
    ap.add_argument("--batches", type=int, default=50, help="timed batches per round")
    ap.add_argument("--warmup", type=int, default=15, help="untimed batches first")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    try:
        counts = [int(t) for t in args.threads.split(",")]
    except ValueError:
        ap.error(f"--threads: comma-separated thread counts, got {args.threads!r}")
    if min(counts) < 1 or min(args.batches, args.rounds) < 1 or args.warmup < 0:
        ap.error("--threads, --batches and --rounds must be at least 1, --warmup at least 0")
    import torch

    from transformer.loss import chunked_label_smoothed_loss

    keep_large_blocks()  # as `transformer train` (train._setup_torch)
    try:
        config, model, opt, batches = training_setup(args.data, args.preset,
                                                     [f"train.dtype={args.dtype}"])  # fmt: skip
    except UserError as e:  # a missing corpus, an unknown preset or dtype
        ap.error(str(e))
    totals = {t: dict.fromkeys(PHASES, 0.0) for t in counts}
    tokens = dict.fromkeys(counts, 0)

    def step(timed: dict | None) -> int:
        b = next(batches)
        marks = [time.perf_counter()]
        keep = b.tgt_out != PAD_ID
        hidden = model(b.src, b.src_mask, b.tgt_in, keep)
        marks.append(time.perf_counter())
        target = b.tgt_out[keep]
        loss, _ = chunked_label_smoothed_loss(hidden, model.output_weight(), target,
                                              config.train.eps_ls)  # fmt: skip
        marks.append(time.perf_counter())
        loss.backward()
        marks.append(time.perf_counter())
        opt.collect_grads()
        opt.step(1e-4, grad_scale=1.0 / target.numel())
        marks.append(time.perf_counter())
        if timed is not None:
            for phase, start, stop in zip(PHASES, marks, marks[1:], strict=False):
                timed[phase] += stop - start
        return target.numel()

    print(f"# {cpu_line()}; torch {torch.__version__}; preset {args.preset}, "
          f"train.dtype {config.train.dtype} -> {next(model.parameters()).dtype}")  # fmt: skip
    for _ in range(args.rounds):
        for t in counts:
            torch.set_num_threads(t)
            for _ in range(args.warmup):
                step(None)
            for _ in range(args.batches):
                tokens[t] += step(totals[t])
    rates = {}
    for t in counts:
        seconds = sum(totals[t].values())
        rates[t] = tokens[t] / seconds
        shares = ", ".join(f"{p} {totals[t][p] / seconds:.0%}" for p in PHASES)
        per_step = seconds / (args.rounds * args.batches) * 1e3
        print(f"threads {t}: {rates[t]:8.0f} target tok/s, {per_step:6.1f} ms a step ({shares})")
    if 1 in rates and 2 in rates:
        print(f"one process beside a busy one on 2 cores keeps at most {rates[1] / rates[2]:.1%}"
              " (one thread's rate / two threads')")  # fmt: skip


if __name__ == "__main__":
    main()
