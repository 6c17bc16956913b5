#!/usr/bin/env python
"""Speed of our exported CTranslate2 model (float32, int8) next to ours (fp32, int8).

The same model file is translated by `translate.Translator` and, after
`transformer export --to ctranslate2`, by `ctranslate2.Translator`, on the same Multi30k test
sentences with the same threads, beam sizes and maximum lengths. Also prints how many greedy
outputs agree token for token (fp32 vs float32 must be all of them; int8 may differ).

    python benchmarks/bench_export.py --model runs/x/model.safetensors
    python benchmarks/bench_export.py --random-preset cpu-small --limit 200

A random model rarely emits EOS, so its outputs run to the maximum length: equal work for all.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "multi30k"


def run_ours(translator, lines: list[str], beam: int) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    out = translator.translate(lines, beam_size=beam)
    return time.perf_counter() - t0, [n[0].tokens for n in out]


def run_ct2(translator, sp, lines: list[str], beam: int, cfg) -> tuple[float, list[list[int]]]:
    """CTranslate2 with our rules: no PAD/BOS, max length a * (|x| + EOS) + b with EOS counted.

    CT2 takes one maximum length per batch: batches of 64, longest first, use their longest
    sentence's and each output is cut to its own maximum (exact for greedy; for beam search
    CT2 may do a few extra steps on the shorter sentences of a batch, which can only slow it).
    """
    pieces = [sp.encode(x, out_type=str) for x in lines]
    limit = [int(cfg.max_len_a * (len(p) + 1)) + cfg.max_len_b - 1 for p in pieces]
    order = sorted(range(len(lines)), key=lambda i: -len(pieces[i]))  # like ours: longest first
    out: list[list[int]] = [[] for _ in lines]
    t0 = time.perf_counter()
    for start in range(0, len(order), 64):
        idx = order[start : start + 64]
        results = translator.translate_batch(
            [pieces[i] + ["</s>"] for i in idx],
            beam_size=beam,
            length_penalty=cfg.length_penalty,
            max_decoding_length=max(limit[i] for i in idx),
            suppress_sequences=[["<pad>"], ["<s>"]],
        )
        for i, r in zip(idx, results, strict=True):
            out[i] = [sp.piece_to_id(p) for p in r.hypotheses[0][: limit[i]]]
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=Path, help="a model file")
    src.add_argument("--random-preset", help="a random model of this preset (e.g. cpu-small)")
    ap.add_argument("--limit", type=int, default=200, help="first N test sentences")
    ap.add_argument("--beams", default="4,1")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import ctranslate2
    import sentencepiece as spm

    sys.path.insert(0, str(Path(__file__).parent))
    from bench_serve_load import random_model
    from transformer.serving.export import export_ctranslate2
    from transformer.translate import Translator

    torch.set_num_threads(args.threads)
    lines = (DATA / "test_2016_flickr.en").read_text(encoding="utf-8").splitlines()[: args.limit]
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or random_model(args.random_preset, Path(tmp), max_len_b=50)
        out = export_ctranslate2(model, Path(tmp) / "ct2")
        sp = spm.SentencePieceProcessor(model_file=str(out / "spm.model"))
        ours = {d: Translator.from_path(model, dtype=d) for d in ("fp32", "int8")}
        cfg = ours["fp32"].decode
        peers = {
            ct: ctranslate2.Translator(str(out), compute_type=ct, intra_threads=args.threads)
            for ct in ("float32", "int8")
        }
        runners = {f"ours:{d}": (lambda x, b, t=t: run_ours(t, x, b)) for d, t in ours.items()}
        for ct, t in peers.items():
            runners[f"ct2:{ct}"] = lambda x, b, t=t: run_ct2(t, sp, x, b, cfg)
        m = ours["fp32"].model.cfg
        print(f"\n{len(lines)} Multi30k test sentences, model N={m.n_layers} "
              f"d_model={m.d_model} V={m.vocab_size}, threads={args.threads}, "
              f"max length |x|+{cfg.max_len_b}\n")  # fmt: skip
        print("| engine | beam | sent/s | target tok/s | seconds | greedy = ours:fp32 |")
        print("|---|---:|---:|---:|---:|---:|")
        for beam in [int(b) for b in args.beams.split(",")]:
            reference = None
            for name, run in runners.items():
                run(lines[:16], beam)  # warm-up
                sec, tokens = run(lines, beam)
                reference = tokens if reference is None else reference
                same = sum(a == b for a, b in zip(tokens, reference, strict=True))
                n_tok = sum(len(t) + 1 for t in tokens)
                agree = f"{same}/{len(lines)}" if beam == 1 else "-"
                print(f"| {name} | {beam} | {len(lines) / sec:.1f} | {n_tok / sec:,.0f} "
                      f"| {sec:.2f} | {agree} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
