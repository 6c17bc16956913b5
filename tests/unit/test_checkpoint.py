"""Atomic checkpoints, keep-last-K, RNG state round trip, §6.1 averaging."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from transformer import checkpoint
from transformer.checkpoint import (
    CheckpointError,
    average_checkpoints,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)


def test_save_keeps_last_k_and_points_latest(tmp_path):
    for step in (1, 2, 3, 10):
        save_checkpoint(tmp_path, step, {"step": step}, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt_3.pt", "ckpt_10.pt"]
    assert latest_checkpoint(tmp_path).name == "ckpt_10.pt"
    assert load_checkpoint(latest_checkpoint(tmp_path))["step"] == 10


def test_crash_during_write_leaves_previous_latest(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 1, {"w": torch.ones(3)}, keep_last=5)

    def crash(obj, f):
        f.write(b"half a checkpoint")
        raise KeyboardInterrupt  # as if killed in the middle of the write

    monkeypatch.setattr(checkpoint.torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 2, {"w": torch.zeros(3)}, keep_last=5)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt_1.pt"]
    assert torch.equal(load_checkpoint(latest_checkpoint(tmp_path))["w"], torch.ones(3))


def test_no_checkpoint_and_unreadable_checkpoint(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    bad = tmp_path / "ckpt_5.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="ckpt_5.pt"):
        load_checkpoint(bad)


def test_rng_state_roundtrip_through_weights_only_file(tmp_path):
    torch.manual_seed(3)
    np.random.seed(3)
    random.seed(3)
    np.random.normal()  # leaves a cached gaussian in numpy's state
    save_checkpoint(tmp_path, 1, {"rng": checkpoint.rng_state()}, keep_last=1)
    expected = (torch.rand(4), np.random.rand(4), np.random.normal(), random.random())
    torch.manual_seed(99)
    np.random.seed(99)
    random.seed(99)
    checkpoint.set_rng_state(load_checkpoint(latest_checkpoint(tmp_path))["rng"])
    got = (torch.rand(4), np.random.rand(4), np.random.normal(), random.random())
    assert torch.equal(expected[0], got[0])
    assert np.array_equal(expected[1], got[1])
    assert expected[2:] == got[2:]


def test_average_identical_is_identity():
    state = {"w": torch.randn(3, 2), "b": torch.randn(2), "n": torch.tensor(7)}
    out = average_checkpoints([state, state, state])
    for k in state:
        assert torch.equal(out[k], state[k])


def test_average_is_elementwise_mean():
    a = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(1)}
    b = {"w": torch.tensor([3.0, 6.0]), "n": torch.tensor(2)}
    out = average_checkpoints([a, b])
    assert torch.equal(out["w"], torch.tensor([2.0, 4.0]))  # (1+3)/2, (2+6)/2
    assert out["n"].item() == 2  # non-float entries come from the newest


def test_average_rejects_mismatched_or_empty():
    with pytest.raises(ValueError):
        average_checkpoints([])
    with pytest.raises(ValueError, match="different keys"):
        average_checkpoints([{"a": torch.ones(1)}, {"b": torch.ones(1)}])
