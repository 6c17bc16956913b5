"""Data parallel: 2 gloo processes (torchrun), each with half of every batch, take the same
steps as 1 process that accumulates both halves.

The sampler gives rank r the batches r, r + 2, ... of the epoch's shuffled order, so rank 0 and
rank 1 together see exactly the two batches that a single process with accum_steps=2 sees.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fixtures import built_once, prepare_slice
from transformer import checkpoint

pytestmark = pytest.mark.integration

COMMON = [
    "--preset", "tiny", "--max-steps", "4", "train.max_tokens=500", "train.dtype=fp32",
    "model.p_drop=0.0", "train.deterministic=true", "train.log_every_steps=1",
    "train.valid_every_steps=100000", "train.warmup_steps=4",
    # Adam's first steps are sign-like (m / sqrt(v) = g / |g|): a larger eps keeps gradients at
    # rounding-noise level (different summation order across ranks) from flipping whole updates.
    "train.adam_eps=1.0e-6",
]  # fmt: skip


def _losses(run: Path) -> list[float]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x)["loss"] for x in lines if json.loads(x)["kind"] == "train"]


def _batches_per_epoch(run: Path) -> int:
    """The "N train batches per epoch and rank" that train.log reports."""
    found = re.search(r"(\d+) train batches per epoch and rank", (run / "train.log").read_text())
    assert found, run
    return int(found.group(1))


def _assert_same_steps(one: Path, two: Path) -> None:
    """Two runs took the same 4 steps: tokens, losses and parameters (up to summation order)."""
    a = checkpoint.load_checkpoint(checkpoint.latest_checkpoint(one))
    b = checkpoint.load_checkpoint(checkpoint.latest_checkpoint(two))
    assert a["step"] == b["step"] == 4 and a["counters"]["tokens"] == b["counters"]["tokens"]
    assert _losses(one) == pytest.approx(_losses(two), rel=1e-5)
    for k in a["model"]:
        torch.testing.assert_close(a["model"][k], b["model"][k], rtol=1e-4, atol=1e-5, msg=k)


@pytest.fixture
def baseline(shared_data, tmp_path_factory) -> tuple[Path, Path]:
    """(prepared data, run): 600 Multi30k pairs and 4 steps of one process accumulating two
    batches a step, which every launcher below must equal; built once for the tests."""

    def build(out: Path) -> None:
        data = prepare_slice(out, shared_data / "multi30k", n_train=600, vocab_size=500)
        subprocess.run(
            [sys.executable, "-m", "transformer", "train", str(data), "--out", str(out / "one"),
             *COMMON, "train.accum_steps=2"],
            check=True, capture_output=True,
        )  # fmt: skip

    out = built_once(tmp_path_factory, "ddp-baseline", build)
    return out / "prepared", out / "one"


def test_two_gloo_ranks_equal_one_process_with_both_halves(baseline, tmp_path):
    data, one = baseline
    two = tmp_path / "two"
    base = ["-m", "transformer", "train", str(data)]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    torchrun += ["--standalone", "--no-python", sys.executable]
    subprocess.run([*torchrun, *base, "--out", str(two), *COMMON], check=True)

    _assert_same_steps(one, two)


def test_procs_equal_one_process_with_both_halves(baseline, tmp_path):
    """`train --procs 2` (train.procs: distributed.run_local, no torchrun) with one batch a
    step splits train.max_tokens between its processes: the same steps as one process taking
    two half-size batches per step."""
    data, one = baseline
    two = tmp_path / "two"
    base = [sys.executable, "-m", "transformer", "train", str(data)]
    run = subprocess.run(
        [*base, "--out", str(two), *COMMON, "train.max_tokens=1000", "--procs", "2"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    assert "rank 1 of 2 (gloo)" in run.stderr

    _assert_same_steps(one, two)

    # Where train.procs divides train.accum_steps the processes share out a step's batches,
    # each of train.max_tokens (the multi30k-full preset's three with --procs 3), instead of
    # splitting every batch again: the same steps as `one` too.
    shared = tmp_path / "shared"
    subprocess.run(
        [*base, "--out", str(shared), *COMMON, "train.accum_steps=2", "--procs", "2"],
        check=True, capture_output=True,
    )  # fmt: skip
    _assert_same_steps(one, shared)
    per_epoch = [_batches_per_epoch(run) for run in (one, shared)]
    assert per_epoch[1] == per_epoch[0] // 2, per_epoch  # each rank: half the same batches

    # Resumed with another process count, the batches would not line up: one clean line.
    resume = [sys.executable, "-m", "transformer", "train", "--resume", str(two)]
    again = subprocess.run([*resume, "--max-steps", "6", "--procs", "1"], capture_output=True,
                           text=True)  # fmt: skip
    assert again.returncode == 2 and "Traceback" not in again.stderr, again.stderr
    assert "trained by 2 process(es), resumed by 1" in again.stderr
    assert "procs: 2" in (two / "config.yaml").read_text()  # the refused resume changed nothing
    # The run's config keeps train.procs: a plain resume starts both processes again.
    subprocess.run([*resume, "--max-steps", "6"], check=True, capture_output=True)
    assert checkpoint.load_checkpoint(checkpoint.latest_checkpoint(two))["step"] == 6


def test_procs_share_the_validation_and_agree_on_it(shared_data, tmp_path):
    """With --procs 2 each process validates half of the valid batches (loss and greedy BLEU)
    and the totals are gathered: the record equals one process validating the same weights.
    And a pair too long for a process's share of the batch is refused with its line."""
    from transformer.bleu import corpus_bleu
    from transformer.config import from_dict
    from transformer.data import load_prepared
    from transformer.model import Transformer
    from transformer.search import greedy_search
    from transformer.trainer import evaluate_loss

    data = prepare_slice(tmp_path, shared_data / "multi30k", n_train=600, n_valid=120,
                         vocab_size=500)  # fmt: skip
    run = tmp_path / "two"
    subprocess.run(
        [sys.executable, "-m", "transformer", "train", str(data), "--out", str(run), *COMMON,
         "train.max_tokens=1000", "train.valid_every_steps=4", "--procs", "2"],
        check=True, capture_output=True,
    )  # fmt: skip
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    (logged,) = [x for x in lines if x["kind"] == "valid"]

    ckpt = checkpoint.load_checkpoint(checkpoint.latest_checkpoint(run))
    assert ckpt["step"] == 4
    config = from_dict(ckpt["config"])
    model = Transformer(config.model)
    model.load_state_dict(ckpt["model"], strict=False)
    prepared = load_prepared(data)
    valid = prepared.split("valid")
    hyps: dict[int, str] = {}

    def decode(b) -> None:
        for i, ids in zip(b.indices, greedy_search(model, b.src, b.src_mask), strict=True):
            hyps[i] = prepared.tokenizer.decode(ids)

    # validation batches hold train.max_tokens (not a process's share: no gradients to keep)
    alone = evaluate_loss(model, valid, config.train.max_tokens, config.train.eps_ls, each=decode)
    assert alone["tokens"] > 2 * config.train.max_tokens  # 3+ batches: both processes had some
    assert logged["ppl"] == pytest.approx(alone["ppl"], rel=1e-9)
    assert logged["loss"] == pytest.approx(alone["loss"], rel=1e-9)
    refs = [valid.tgt_text(i) for i in range(len(valid))]
    assert len(hyps) == len(valid)
    assert logged["bleu"] == corpus_bleu([hyps[i] for i in range(len(valid))], refs).score

    # A pair longer than a process's share of the batch is named before any training.
    short = subprocess.run(
        [sys.executable, "-m", "transformer", "train", str(data), "--out", str(tmp_path / "r"),
         *COMMON, "train.max_tokens=60", "--procs", "2"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert short.returncode == 2 and "Traceback" not in short.stderr, short.stderr
    assert "exceed train.max_tokens / train.procs 2=30" in short.stderr
