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
from transformer.config import ModelConfig, RunConfig, to_dict
from transformer.model import Transformer
from transformer.modelfile import load_model
from transformer.rundir import average_run


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


def test_average_run_writes_model_file(tmp_path):
    cfg = RunConfig(
        model=ModelConfig(vocab_size=20, n_layers=1, d_model=8, d_ff=16, n_heads=2, d_k=4, d_v=4)
    )
    states = []
    for step in (1, 2, 3):
        torch.manual_seed(step)
        model_state = {k: v.clone() for k, v in Transformer(cfg.model).state_dict().items()}
        states.append(model_state)
        ckpt = {
            "step": step,
            "model": model_state,
            "config": to_dict(cfg),
            "data": {
                "spm_proto": torch.tensor([1, 2, 3], dtype=torch.uint8),
                "src": "en",
                "tgt": "de",
            },
        }
        save_checkpoint(tmp_path, step, ckpt, keep_last=5)
    out = average_run(tmp_path, last=2)
    loaded = load_model(out)
    expected = (
        states[1]["encoder_layers.0.ffn.w_1.weight"] + states[2]["encoder_layers.0.ffn.w_1.weight"]
    ) / 2
    torch.testing.assert_close(loaded.model.encoder_layers[0].ffn.w_1.weight, expected)
    assert loaded.spm_proto == bytes([1, 2, 3]) and loaded.src_lang == "en"
    with pytest.raises(CheckpointError, match="--last 4"):
        average_run(tmp_path, last=4)
    # --upper-bound: the last N of the checkpoints up to a step
    bounded = load_model(average_run(tmp_path, last=2, upper_bound=2))
    expected = (
        states[0]["encoder_layers.0.ffn.w_1.weight"] + states[1]["encoder_layers.0.ffn.w_1.weight"]
    ) / 2
    torch.testing.assert_close(bounded.model.encoder_layers[0].ffn.w_1.weight, expected)
    assert (tmp_path / "average_last2_upto2.safetensors").is_file()
    with pytest.raises(CheckpointError, match="--last 2 asked, 1 checkpoints present up to step 1"):
        average_run(tmp_path, last=2, upper_bound=1)
