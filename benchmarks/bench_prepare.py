"""Benchmark `prepare_corpus` on a synthetic WMT-sized corpus (default 4.5M pairs, §5.1).

Shows that preparation streams: peak RSS stays far below the corpus size. The corpus is made of
Zipf-distributed synthetic words (about 22 per sentence, like WMT14 En-De), written once and
cached. Preparation runs in a child process so its peak RSS is measured alone.

    .venv/bin/python benchmarks/bench_prepare.py --pairs 4500000 --threads 2
    .venv/bin/python benchmarks/bench_prepare.py --multi30k ../shared/data/multi30k

No peer toolkit (fairseq-preprocess) is installed here, so no ratio is printed.
"""

from __future__ import annotations

import argparse
import json
import resource
import string
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

_CHUNK = 100_000


def _words(rng: np.random.Generator, n: int) -> np.ndarray:
    letters = np.array(list(string.ascii_lowercase + "äöüé"))
    lengths = rng.integers(2, 11, n)
    return np.array(["".join(rng.choice(letters, k)) for k in lengths])


def _pool(rng: np.random.Generator, n: int) -> tuple[list[str], list[str]]:
    """n aligned synthetic (source, target) sentence halves of Zipf-distributed words."""
    src_words, tgt_words = _words(rng, 50_000), _words(rng, 50_000)
    lens = np.clip(rng.gamma(2.0, 5.5, n).astype(int), 1, 75)
    tgt_lens = np.clip((lens * rng.uniform(0.8, 1.3, n)).astype(int), 1, None)
    ids = np.minimum(rng.zipf(1.2, lens.sum()), 50_000) - 1
    tids = np.minimum(rng.zipf(1.2, tgt_lens.sum()), 50_000) - 1
    src = [" ".join(w) for w in np.split(src_words[ids], np.cumsum(lens)[:-1])]
    tgt = [" ".join(w) for w in np.split(tgt_words[tids], np.cumsum(tgt_lens)[:-1])]
    return src, tgt


def generate(directory: Path, pairs: int, seed: int = 0) -> tuple[Path, Path]:
    """Write `train.src`/`train.tgt` (+ 3,000-pair valid) with `pairs` synthetic pairs.

    Each pair joins two random halves from pools of 100,000 (so pairs are distinct and about 22
    words long on average) — fast to generate, and realistic enough for sentencepiece.
    """
    directory.mkdir(parents=True, exist_ok=True)
    src, tgt = directory / "train.src", directory / "train.tgt"
    stamp = directory / f"done-{pairs}"
    if stamp.exists():
        return src, tgt
    rng = np.random.default_rng(seed)
    a_src, a_tgt = _pool(rng, 100_000)
    b_src, b_tgt = _pool(rng, 100_000)
    with open(src, "w", encoding="utf-8") as fs, open(tgt, "w", encoding="utf-8") as ft:
        for start in range(0, pairs, _CHUNK):
            n = min(_CHUNK, pairs - start)
            i, j = rng.integers(0, 100_000, n).tolist(), rng.integers(0, 100_000, n).tolist()
            fs.write("".join(f"{a_src[x]} {b_src[y]}\n" for x, y in zip(i, j, strict=True)))
            ft.write("".join(f"{a_tgt[x]} {b_tgt[y]}\n" for x, y in zip(i, j, strict=True)))
    for name, path in (("valid.src", src), ("valid.tgt", tgt)):
        with open(path, encoding="utf-8") as f, open(directory / name, "w") as out:
            out.writelines(line for _, line in zip(range(3000), f, strict=False))
    stamp.touch()
    return src, tgt


def _child(args: argparse.Namespace) -> None:
    from transformer.prepare import prepare_corpus

    d = args.workdir
    start = time.perf_counter()
    m = prepare_corpus(
        "custom",
        "src",
        "tgt",
        d / "prepared",
        train_files=(d / "train.src", d / "train.tgt"),
        valid_files=(d / "valid.src", d / "valid.tgt"),
        vocab_size=args.vocab_size,
        spm_type="bpe",
        num_threads=args.threads,
        spm_sample=args.spm_sample,
        force=True,
    )
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "splits": m.splits, "filters": m.filters}))


def _run_child(extra: list[str]) -> tuple[dict, float]:
    out = subprocess.run(
        [sys.executable, __file__, "--child", *extra], check=True, capture_output=True, text=True
    ).stdout
    peak_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return json.loads(out.strip().splitlines()[-1]), peak_mib


def _multi30k(directory: Path, threads: int) -> None:
    from transformer.prepare import prepare_corpus

    out = Path("/tmp/bench_prepare_multi30k")
    start = time.perf_counter()
    prepare_corpus("multi30k", "en", "de", out, from_dir=directory, num_threads=threads, force=True)
    print(f"multi30k en-de prepare: {time.perf_counter() - start:.1f} s (threads={threads})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=4_500_000)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/bench_prepare"))
    p.add_argument("--vocab-size", type=int, default=37000)
    p.add_argument("--spm-sample", type=int, default=1_000_000)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--multi30k", type=Path, help="also time Multi30k from this directory")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        _child(args)
        return
    if args.multi30k:
        _multi30k(args.multi30k, args.threads)
    start = time.perf_counter()
    src, tgt = generate(args.workdir, args.pairs)
    size = (src.stat().st_size + tgt.stat().st_size) / 2**20
    print(f"corpus: {args.pairs} pairs, {size:.0f} MiB ({time.perf_counter() - start:.0f} s)")
    extra = [
        "--workdir",
        str(args.workdir),
        "--vocab-size",
        str(args.vocab_size),
        "--spm-sample",
        str(args.spm_sample),
        "--threads",
        str(args.threads),
    ]
    result, peak = _run_child(extra)
    train = result["splits"]["train"]
    print(
        f"prepare: {result['seconds']:.0f} s, {train['pairs'] / result['seconds']:.0f} pairs/s, "
        f"peak RSS {peak:.0f} MiB ({peak / size:.2f} x corpus size)"
    )
    print(
        f"train: {train['pairs']} pairs kept, {train['src_tokens']} + {train['tgt_tokens']} "
        f"subwords; filters {result['filters']['train']}"
    )


if __name__ == "__main__":
    main()
