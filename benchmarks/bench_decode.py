#!/usr/bin/env python
"""Decoding speed: sentences/s and target tokens/s, beam 4 and greedy, fp32 / bf16 / int8.

Two workloads:

* W2 (as /work/shared/peers/bench_infer.py): a random Transformer-base (6+6 layers, d_model 512,
  V 32,000), 64 source sentences of 26-34 tokens, exactly 50 decoder steps per sentence (EOS is
  masked until step 50, where it is forced), so every variant does the same work. CTranslate2
  and HuggingFace run in the same process when installed (`--peers ct2:int8,hf:fp32`), with
  their own random weights of the same shapes (speed only, no output agreement).
* A real model on a real test set (`--model FILE --data DIR --split test`): normal search with
  early stopping, and for each dtype the sacreBLEU of its output (int8's BLEU cost), the lines
  that differ from the first dtype's and the spread of the BLEU change over paired bootstrap
  resamples (the noise of comparing the two on this set). --json PATH writes them, with what
  `--dtype auto` picks for this model on this machine (benchmarks/issue19_summary.py reads it).

    python benchmarks/bench_decode.py --w2 --reps 1
    python benchmarks/bench_decode.py --model runs/x/model.safetensors --data data/ende
    python benchmarks/bench_decode.py --w2 --profile fp32:4     # torch.profiler table
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from transformer.config import ModelConfig  # noqa: E402
from transformer.model import Transformer  # noqa: E402
from transformer.search import ModelStepper, beam_steps, greedy_steps  # noqa: E402
from transformer.tokenizer import EOS_ID, PAD_ID  # noqa: E402
from transformer.translate import (  # noqa: E402
    auto_dtype,
    packed_bf16,
    packed_projection,
    quantize_int8,
)

PEERS_DIR = "/work/shared/peers"


class ForcedLengthStepper(ModelStepper):
    """W2's fixed work: EOS is impossible before step `n_out`, where search forces it."""

    def __init__(self, model, src, src_mask, n_out: int, log_probs: bool = True):
        super().__init__(model, src, src_mask, log_probs=log_probs)
        self.n_out, self.t = n_out, 0

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        self.t += 1
        lprobs = super().step(tokens)
        if self.t < self.n_out:
            lprobs[:, EOS_ID] = float("-inf")
        return lprobs


def base_model(dtype: str) -> Transformer:
    if dtype == "auto":  # what `transformer translate` picks here (bf16 with AMX, else fp32)
        dtype = auto_dtype("cpu")[0]
        print(f"# auto: {dtype}")
    torch.manual_seed(1)
    model = Transformer(ModelConfig(vocab_size=32000, max_len=256)).eval()
    if dtype == "bf16":  # every linear layer packed for oneDNN, as `transformer translate`
        return packed_bf16(model)
    if dtype == "bf16-unpacked":  # F.linear, as before packed_bf16
        return model.to(torch.bfloat16)
    if dtype == "int8":
        return quantize_int8(model)
    if dtype == "fp32-unpacked":  # F.linear (MKL) for the projection, as before PackedLinear
        return model
    return packed_projection(model)  # fp32 as `transformer translate` decodes it


def w2_source(n: int = 64, length: int = 30, jitter: int = 4, vocab: int = 32000):
    """64 sentences, lengths (with EOS) uniform in [26, 34], right-padded (as peers' W2)."""
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(length - jitter, length + jitter + 1, (n,), generator=g)
    src = torch.full((n, int(lens.max())), PAD_ID, dtype=torch.long)
    for i, L in enumerate(lens.tolist()):
        src[i, : L - 1] = torch.randint(4, vocab, (L - 1,), generator=g)
        src[i, L - 1] = EOS_ID
    return src, src != PAD_ID


@torch.inference_mode()
def run_ours(model, src, src_mask, beam: int, n_out: int) -> int:
    # greedy on the logits, as `greedy_search` (their argmax is the log-probabilities')
    stepper = ForcedLengthStepper(model, src, src_mask, n_out, log_probs=beam > 1)
    max_lens = torch.full((src.size(0),), n_out)
    if beam == 1:
        out = greedy_steps(stepper, max_lens)
        return sum(len(t) + 1 for t in out)
    out = beam_steps(stepper, max_lens, beam, 0.6)
    return sum(len(h[0].tokens) + 1 for h in out)


def peer_runner(spec: str, threads: int):
    """A CT2 / HF runner from the peers' W2 script (their weights, same shapes)."""
    sys.path.insert(0, PEERS_DIR)
    import bench_infer as peers  # noqa: PLC0415

    workdir = "/tmp/peers-w2"
    hf_dir = peers.build_marian_dir(workdir)
    ctx = {"hf_dir": hf_dir, "threads": threads}
    if spec.startswith("ct2"):
        ctx["ct2_dir"] = peers.convert_ct2(hf_dir, workdir)
    impl, variant = spec.split(":")
    adapter = peers.INFER_ADAPTERS[impl](variant, ctx)
    psrc, plens = peers.make_src(64, 30, 4, peers.CFG["vocab"])
    prepared = adapter.prepare(psrc, plens)
    return lambda beam, n_out: adapter.run(prepared, beam, n_out)


def bench_w2(args) -> None:
    src, src_mask = w2_source()
    runners = {}
    for dtype in args.dtypes.split(","):
        model = base_model(dtype)
        runners[f"ours:{dtype}"] = lambda b, n, m=model: run_ours(m, src, src_mask, b, n)
    for spec in filter(None, args.peers.split(",")):
        try:
            runners[spec] = peer_runner(spec, args.threads)
        except Exception as e:  # noqa: BLE001 - a missing optional peer is reported, not fatal
            print(f"# peer {spec} unavailable: {type(e).__name__}: {e}")
    beams = [int(b) for b in args.beams.split(",")]
    for run in runners.values():  # warm-up on the full batch: oneDNN primitives, caches
        for beam in beams:
            run(beam, 4)
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.reps):  # interleaved, as the peers' W2
        for beam in beams:
            for name, run in runners.items():
                t0 = time.perf_counter()
                n = run(beam, args.out_len)
                times.setdefault((name, beam), []).append(time.perf_counter() - t0)
                assert n == 64 * args.out_len, (name, beam, n)
                print(f"# {name} beam {beam}: {times[name, beam][-1]:.2f} s", flush=True)
    print(f"\nW2: 64 sentences, {int(src_mask.sum())} source tokens, {args.out_len} target tokens")
    print(f"each, threads={args.threads}, reps={args.reps} (median)\n")
    print("| variant | beam | target tok/s | sent/s | s/batch | vs ct2:int8 |")
    print("|---|---:|---:|---:|---:|---:|")
    for beam in beams:
        ref = times.get(("ct2:int8", beam))
        for name in runners:
            sec = statistics.median(times[name, beam])
            ratio = f"{statistics.median(ref) / sec:.2f}" if ref else "-"
            tps = 64 * args.out_len / sec
            print(f"| {name} | {beam} | {tps:,.0f} | {64 / sec:.2f} | {sec:.2f} | {ratio} |")


def bench_real(args) -> None:
    import numpy as np

    from transformer.bleu import corpus_bleu, paired_bootstrap, sentence_stats
    from transformer.data import load_prepared
    from transformer.rundir import resolve_model
    from transformer.translate import Translator

    data = load_prepared(args.data)
    split = data.split(args.split)
    sources, refs = split.text(data.src_lang), split.text(data.tgt_lang)
    if args.limit:
        sources, refs = sources[: args.limit], refs[: args.limit]
    print(f"\n{args.model} on {args.data} {args.split}: {len(sources)} sentences\n")
    record = {"model": str(args.model), "data": str(args.data), "split": args.split,
              "sentences": len(sources), "alpha": args.alpha, "runs": [],
              "changes": []}  # fmt: skip
    print("| dtype | beam | sent/s | target tok/s | seconds | sacreBLEU |")
    print("|---|---:|---:|---:|---:|---:|")
    dtypes, beams = args.dtypes.split(","), [int(b) for b in args.beams.split(",")]
    hyps: dict[tuple[str, int], list[str]] = {}
    bleus: dict[tuple[str, int], float] = {}
    # What `--dtype auto` picks: the file's int8 grids count (an int8 Translator keeps none).
    record["auto"], record["auto_why"] = auto_dtype("cpu", list(resolve_model(args.model).int8))
    for dtype in dtypes:
        tr = Translator.from_path(args.model, dtype=dtype)
        tr.translate(sources[:16])  # warm-up
        for beam in beams:
            t0 = time.perf_counter()
            out = tr.translate(sources, beam_size=beam, length_penalty=args.alpha)
            sec = time.perf_counter() - t0
            n_tok = sum(len(n[0].tokens) + 1 for n in out)
            hyps[dtype, beam] = [n[0].text for n in out]
            bleus[dtype, beam] = corpus_bleu(hyps[dtype, beam], refs).score
            record["runs"].append(
                {"dtype": dtype, "beam": beam, "seconds": sec, "tok_per_s": n_tok / sec,
                 "bleu": bleus[dtype, beam]}
            )  # fmt: skip
            print(f"| {dtype} | {beam} | {len(out) / sec:.1f} | {n_tok / sec:,.0f} | {sec:.1f} "
                  f"| {bleus[dtype, beam]:.2f} |", flush=True)  # fmt: skip
    print(f"\n# --dtype auto on this CPU: {record['auto']} ({record['auto_why']})")
    if len(dtypes) < 2:
        _write_json(args.json, record)
        return
    # Each dtype's BLEU change from the first one, with the spread of that change over paired
    # bootstrap resamples of the sentences: the noise of comparing the two on this set.
    base = dtypes[0]
    print(f"\n| dtype | beam | lines != {base} | BLEU change | 2.5th..97.5th percentile |")
    print("|---|---:|---:|---:|---:|")
    for beam in beams:
        stats = [sentence_stats(hyps[d, beam], refs) for d in dtypes]
        scores = [np.asarray(s) for s in paired_bootstrap(stats)]
        for i, dtype in enumerate(dtypes[1:], start=1):
            changed = sum(a != b for a, b in zip(hyps[dtype, beam], hyps[base, beam], strict=True))
            change = bleus[dtype, beam] - bleus[base, beam]
            low, high = np.percentile(scores[i] - scores[0], [2.5, 97.5])
            print(f"| {dtype} | {beam} | {changed} | {change:+.2f} | {low:+.2f}..{high:+.2f} |")
            record["changes"].append({"dtype": dtype, "base": base, "beam": beam,
                                      "lines_changed": changed, "bleu_change": change,
                                      "low": float(low), "high": float(high)})  # fmt: skip
    _write_json(args.json, record)


def _write_json(path: str | None, record: dict) -> None:
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)
            f.write("\n")


def profile(args) -> None:
    dtype, beam = args.profile.split(":")
    src, src_mask = w2_source()
    model = base_model(dtype)
    # Two whole searches first: a process's first one faults in the heap as the cache's buffers
    # grow (~119,000 minor faults for the quickstart model's test set against ~1,000 later),
    # which a profile charges to the ops that first write them (`copy_`; docs/performance.md,
    # "Round forty-one").
    for _ in range(2):
        run_ours(model, src, src_mask, int(beam), args.out_len)
    with torch.profiler.profile() as prof:
        run_ours(model, src, src_mask, int(beam), args.out_len)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--w2", action="store_true", help="the peers' W2 workload")
    ap.add_argument("--model", help="a real model file or run directory")
    ap.add_argument("--data", help="its prepared data directory")
    ap.add_argument("--split", default="test")
    ap.add_argument("--limit", type=int, help="first N sentences of the split")
    ap.add_argument(
        "--dtypes",
        default="fp32,bf16,int8",
        help="any of auto,fp32,bf16,int8 (W2 also fp32-unpacked, bf16-unpacked)",
    )
    ap.add_argument("--beams", default="4,1")
    ap.add_argument("--alpha", type=float, help="length penalty (default: the model's)")
    ap.add_argument("--peers", default="ct2:int8", help="e.g. ct2:int8,ct2:float32,hf:fp32")
    ap.add_argument("--out-len", type=int, default=50)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", help="DTYPE:BEAM, print a torch.profiler table of one W2 run")
    ap.add_argument("--json", help="write the real model's runs and BLEU changes to this file")
    args = ap.parse_args()
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        ap.error(f"--json: no directory {os.path.dirname(os.path.abspath(args.json))}")
    torch.set_num_threads(args.threads)
    print(f"# torch {torch.__version__}, threads {torch.get_num_threads()}")
    if args.profile:
        profile(args)
    if args.w2:
        bench_w2(args)
    if args.model:
        bench_real(args)


if __name__ == "__main__":
    main()
