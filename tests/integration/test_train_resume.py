"""Resume to the bit: SIGKILL a deterministic run mid-way, resume it, compare with a straight run.

Real Multi30k data (a slice), the tiny preset, the real CLI in subprocesses.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fixtures import prepare_slice
from transformer import checkpoint

pytestmark = pytest.mark.integration

STEPS = 25
COMMON = [
    "--preset", "tiny", "--max-steps", str(STEPS),
    "train.max_tokens=600", "train.deterministic=true", "train.save_every_steps=5",
    "train.save_every_minutes=1000", "train.valid_every_steps=100000", "train.keep_last=3",
    "train.warmup_steps=20",
]  # fmt: skip


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "transformer", *args]


def _final_params(run: Path) -> dict[str, torch.Tensor]:
    ckpt = checkpoint.load_checkpoint(checkpoint.latest_checkpoint(run))
    assert ckpt["step"] == STEPS
    return {**ckpt["model"], "__adam_exp_avg_sq_0": ckpt["optimizer"]["state"][0]["exp_avg_sq"]}


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_sigkill_then_resume_is_bit_identical(shared_data, tmp_path, dtype):
    data = prepare_slice(tmp_path, shared_data / "multi30k", n_train=1500, vocab_size=500)
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    args = [*COMMON, f"train.dtype={dtype}"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    subprocess.run(_cli("train", str(data), "--out", str(straight), *args), check=True, env=env)

    proc = subprocess.Popen(_cli("train", str(data), "--out", str(killed), *args), env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        latest = checkpoint.latest_checkpoint(killed) if (killed / "checkpoints").is_dir() else None
        if latest is not None and int(latest.stem.split("_")[1]) >= 10:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "the run ended before it could be killed mid-way"
    stopped_at = int(checkpoint.latest_checkpoint(killed).stem.split("_")[1])
    assert 10 <= stopped_at < STEPS

    subprocess.run(_cli("train", "--resume", str(killed)), check=True, env=env)
    a, b = _final_params(straight), _final_params(killed)
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"resumed run differs in {different}"
