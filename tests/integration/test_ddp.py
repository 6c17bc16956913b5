"""Data parallel: 2 gloo processes (torchrun), each with half of every batch, take the same
steps as 1 process that accumulates both halves.

The sampler gives rank r the batches r, r + 2, ... of the epoch's shuffled order, so rank 0 and
rank 1 together see exactly the two batches that a single process with accum_steps=2 sees.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fixtures import prepare_slice
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


def test_two_gloo_ranks_equal_one_process_with_both_halves(shared_data, tmp_path):
    data = prepare_slice(tmp_path, shared_data / "multi30k", n_train=600, vocab_size=500)
    one, two = tmp_path / "one", tmp_path / "two"
    base = ["-m", "transformer", "train", str(data)]
    subprocess.run(
        [sys.executable, *base, "--out", str(one), *COMMON, "train.accum_steps=2"], check=True
    )
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    torchrun += ["--standalone", "--no-python", sys.executable]
    subprocess.run([*torchrun, *base, "--out", str(two), *COMMON], check=True)

    a = checkpoint.load_checkpoint(checkpoint.latest_checkpoint(one))
    b = checkpoint.load_checkpoint(checkpoint.latest_checkpoint(two))
    assert a["step"] == b["step"] == 4 and a["counters"]["tokens"] == b["counters"]["tokens"]
    assert _losses(one) == pytest.approx(_losses(two), rel=1e-5)
    for k in a["model"]:
        torch.testing.assert_close(a["model"][k], b["model"][k], rtol=1e-4, atol=1e-5, msg=k)
