#!/usr/bin/env python
"""ATen ops dispatched per decoder step, greedy and beam search, on a real model and test set.

A decoder step's CPU cost at sentence lengths is mostly per-op overhead (dispatch, Python, small
kernels), so the number of ops per step is a load-independent proxy for its speed: it can be
measured on a busy machine, where timings mean nothing. Every op called from Python is counted
by a `TorchDispatchMode`; search runs under `torch.inference_mode`, where composite ops such
as `linear` and `matmul` count once (what they call inside, `addmm`, `bmm` or a contiguous
copy, does not). Each op is attributed to the phase it ran in:

* ``step``: `ModelStepper.step` (embedding, the decoder layers, the output projection, the
  log-softmax);
* ``reorder``: `ModelStepper.reorder` (beam parents, finished rows dropped);
* ``search``: everything else inside the search loop (masking, top-k, finalizing, bookkeeping);
* ``encode``: the encoder, once per batch (not per step);
* ``setup``: collating a batch and its maximum lengths (not per step).

Per step = the phase's ops over all batches / the number of `step` calls. `--copies` also
counts, with torch.profiler (every level), the `clone` (a `contiguous` copy, e.g. inside a bf16
`bmm` whose operand is neither contiguous nor transposed) and `cat` kernels per step of the
whole translation, encoder included.

    python benchmarks/count_ops.py --model /work/models/multi30k_ende.safetensors \\
        --data /work/main/data/m30k --limit 100 --beams 1,4 [--top 20]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from transformer.search import (  # noqa: E402
    ModelStepper,
    beam_steps,
    greedy_steps,
    max_output_lengths,
)
from transformer.translate import Translator  # noqa: E402

PHASES = ("step", "reorder", "search", "encode", "setup")
PER_STEP = ("step", "reorder", "search")


class _OpCounter(TorchDispatchMode):
    """Counts (phase, op name) of every ATen op dispatched while active."""

    def __init__(self):
        super().__init__()
        self.phase = "search"
        self.ops: Counter[tuple[str, str]] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[self.phase, str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


class _PhaseStepper:
    """A `Stepper` around a ModelStepper that tells the counter which phase runs."""

    def __init__(self, inner: ModelStepper, counter: _OpCounter):
        self.inner, self.counter, self.steps = inner, counter, 0

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        self.counter.phase = "step"
        try:
            return self.inner.step(tokens)
        finally:
            self.counter.phase = "search"

    def reorder(self, index: torch.Tensor, same_sentences: bool = False) -> None:
        self.counter.phase = "reorder"
        try:
            self.inner.reorder(index, same_sentences)
        finally:
            self.counter.phase = "search"


@dataclass
class OpCount:
    """Ops of one search over some sentences: per phase and op name, and the steps taken."""

    ops: Counter  # (phase, op name) -> count
    steps: int
    outputs: list[list[int]]  # the best token ids per sentence (for exactness checks)

    def per_step(self, phase: str) -> float:
        return sum(n for (p, _), n in self.ops.items() if p == phase) / max(self.steps, 1)

    def total_per_step(self) -> float:
        """Ops per step of the whole search loop (step + reorder + search)."""
        return sum(self.per_step(p) for p in PER_STEP)


@torch.inference_mode()
def count_ops(translator: Translator, lines: list[str], beam: int) -> OpCount:
    """Run the translator's search (greedy for beam 1, else beam search with its decode
    config) over `lines`, batched as `Translator.translate` batches them, counting ops."""
    cfg = translator.options(beam_size=beam)
    sources = translator.encode(lines)
    counter = _OpCounter()
    steps = 0
    outputs: list[list[int]] = [[] for _ in lines]
    with counter:
        for batch in translator.batches(sources):
            counter.phase = "setup"
            src, src_mask = translator._collate([sources[i] for i in batch])
            limit = translator.model.cfg.max_len
            max_lens = max_output_lengths(src_mask.sum(1), cfg.max_len_a, cfg.max_len_b, limit)
            counter.phase = "encode"
            inner = ModelStepper(translator.model, src, src_mask, log_probs=beam > 1)
            counter.phase = "search"
            stepper = _PhaseStepper(inner, counter)
            if beam == 1:
                found = greedy_steps(stepper, max_lens)
            else:
                hyps = beam_steps(stepper, max_lens, beam, cfg.length_penalty, 1, cfg.stop)
                found = [h[0].tokens for h in hyps]
            for i, tokens in zip(batch, found, strict=True):
                outputs[i] = tokens
            steps += stepper.steps
    return OpCount(counter.ops, steps, outputs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="a model file or run directory")
    ap.add_argument("--data", required=True, help="its prepared data directory")
    ap.add_argument("--split", default="test")
    ap.add_argument("--limit", type=int, default=100, help="first N sentences of the split")
    ap.add_argument("--beams", default="1,4")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "int8"])
    ap.add_argument("--max-tokens", type=int, help="source tokens per batch")
    ap.add_argument("--top", type=int, default=0, help="also list the N most frequent step ops")
    ap.add_argument("--copies", action="store_true", help="clone and cat kernels per step")
    args = ap.parse_args()
    from transformer.data import load_prepared

    data = load_prepared(args.data)
    lines = data.split(args.split).text(data.src_lang)[: args.limit]
    translator = Translator.from_path(args.model, dtype=args.dtype)
    translator.decode = translator.options(max_tokens=args.max_tokens)
    print(f"# torch {torch.__version__}; {args.model}, {args.split} first {len(lines)} lines, "
          f"{args.dtype}, max_tokens {translator.decode.max_tokens}")  # fmt: skip
    print("\n| search | steps | step | reorder | search | total per step | encoder per batch |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    counts = {}
    for beam in [int(b) for b in args.beams.split(",")]:
        c = counts[beam] = count_ops(translator, lines, beam)
        n_batches = len(list(translator.batches(translator.encode(lines))))
        enc = sum(n for (p, _), n in c.ops.items() if p == "encode") / n_batches
        name = "greedy" if beam == 1 else f"beam {beam}"
        print(f"| {name} | {c.steps} | {c.per_step('step'):.1f} | {c.per_step('reorder'):.1f} "
              f"| {c.per_step('search'):.1f} | {c.total_per_step():.1f} | {enc:.0f} |")  # fmt: skip
    for beam, c in counts.items() if args.copies else ():
        with torch.profiler.profile() as prof:
            translator.translate(lines, beam_size=beam)
        n = Counter(e.name for e in prof.events() if e.name in ("aten::clone", "aten::cat"))
        print(f"\nbeam {beam}: per step, clone {n['aten::clone'] / c.steps:.1f}, "
              f"cat {n['aten::cat'] / c.steps:.1f} (all levels, encoder included)")  # fmt: skip
    for beam, c in counts.items() if args.top else ():
        print(f"\nbeam {beam}: the {args.top} most frequent ops per step (step, reorder, search)")
        per_op = Counter()
        for (phase, op), n in c.ops.items():
            if phase in PER_STEP:
                per_op[f"{phase}:{op}"] += n
        for op, n in per_op.most_common(args.top):
            print(f"  {n / c.steps:7.2f}  {op}")


if __name__ == "__main__":
    main()
