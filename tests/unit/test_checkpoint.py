"""Atomic checkpoints, keep-last-K, RNG state round trip, §6.1 averaging."""

from __future__ import annotations

import errno
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from fixtures import dead_pid
from transformer import checkpoint
from transformer.checkpoint import (
    CheckpointError,
    average_checkpoints,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_latest,
    save_checkpoint,
)
from transformer.cli import main
from transformer.config import ModelConfig, RunConfig, to_dict
from transformer.model import Transformer


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
    for mmap in (False, True):  # `average` maps them: torch's reason would be mmap's
        with pytest.raises(CheckpointError, match="ckpt_5.pt") as error:
            load_checkpoint(bad, mmap=mmap)
        assert "mmap" not in str(error.value)
        bad.write_bytes(b"")
        with pytest.raises(
            CheckpointError, match=r"ckpt_5\.pt: not a readable checkpoint: the file is empty"
        ):
            load_checkpoint(bad, mmap=mmap)
        bad.write_bytes(b"not a checkpoint")


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


def test_average_takes_one_state_at_a_time_and_sums_in_their_order():
    """The paper's big model averages 20 checkpoints (§6.1): all of them in memory at once
    would be 20 x (0.86 GB of weights + Adam's moments). A state is let go before the next
    is asked for, and the sums are the ones a list of all of them gave (fp64, in order)."""
    import gc
    import weakref

    torch.manual_seed(0)
    states = [{"w": torch.randn(50, 7) * 10**i, "n": torch.tensor(i)} for i in range(4)]
    alive: list = []

    def one_at_a_time():
        for state in states:
            copy = {k: v.clone() for k, v in state.items()}
            gc.collect()
            assert all(ref() is None for ref in alive)  # the previous one was let go
            alive.append(weakref.ref(copy["w"]))
            yield copy
            del copy

    out = average_checkpoints(one_at_a_time())
    total = torch.zeros(50, 7, dtype=torch.float64)
    for state in states:
        total += state["w"].double()
    assert torch.equal(out["w"], (total / 4).float()) and out["n"].item() == 3


def test_averaging_files_reads_one_checkpoint_at_a_time_and_no_optimizer(tmp_path, monkeypatch):
    import gc
    import weakref

    from transformer import rundir
    from transformer.modelfile import load_model

    cfg = RunConfig(
        model=ModelConfig(vocab_size=20, n_layers=1, d_model=8, d_ff=16, n_heads=2, d_k=4, d_v=4)
    )
    data = {"spm_proto": torch.tensor([1], dtype=torch.uint8), "src": "en", "tgt": "de"}
    models = []
    for step in (1, 2, 3):
        torch.manual_seed(step)
        models.append(Transformer(cfg.model).state_dict())
        moments = {k: [torch.randn_like(v), torch.rand_like(v)] for k, v in models[-1].items()}
        state = {"model": models[-1], "optimizer": moments, "config": to_dict(cfg), "data": data}
        save_checkpoint(tmp_path, step, state, keep_last=5)
    loads: list = []
    real = checkpoint.load_checkpoint

    def one_at_a_time(path, mmap=False):
        gc.collect()
        assert all(ref() is None for ref in loads)  # the previous one's model was let go
        state = real(path, mmap=mmap)
        loads.append(weakref.ref(state["model"]["src_embed.weight"]))
        return state

    monkeypatch.setattr(checkpoint, "load_checkpoint", one_at_a_time)
    out = rundir.average_files(list_checkpoints(tmp_path), tmp_path / "avg.safetensors")
    assert len(loads) == 3
    averaged = load_model(out).model.state_dict()
    want = average_checkpoints(models)
    assert all(torch.equal(averaged[k], want[k]) for k in averaged)


def test_average_rejects_mismatched_or_empty():
    with pytest.raises(ValueError):
        average_checkpoints([])
    with pytest.raises(ValueError, match="different keys"):
        average_checkpoints([{"a": torch.ones(1)}, {"b": torch.ones(1)}])


def test_average_removes_what_a_killed_average_left(tmp_path):
    cfg = RunConfig(
        model=ModelConfig(vocab_size=20, n_layers=1, d_model=8, d_ff=16, n_heads=2, d_k=4, d_v=4)
    )
    data = {"spm_proto": torch.tensor([1], dtype=torch.uint8), "src": "en", "tgt": "de"}
    state = {"model": Transformer(cfg.model).state_dict(), "config": to_dict(cfg), "data": data}
    save_checkpoint(tmp_path, 1, state, keep_last=5)
    killed = tmp_path / f".model.safetensors.tmp-{dead_pid()}"
    killed.write_bytes(b"half a model file")
    assert main(["average", str(tmp_path), "--last", "1"]) == 0
    assert not killed.exists() and (tmp_path / "model.safetensors").is_file()


# --- issue 18: full disks, damaged checkpoints, leftovers of killed runs ---------------------


def test_disk_full_during_a_save_is_one_error_and_leaves_no_temporary(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 1, {"w": torch.ones(3)}, keep_last=5)

    def full(obj, f):
        f.write(b"half a checkpoint")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint.torch, "save", full)
    with pytest.raises(CheckpointError, match=r"ckpt_2\.pt: cannot save the checkpoint: No space"):
        save_checkpoint(tmp_path, 2, {"w": torch.zeros(3)}, keep_last=5)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["ckpt_1.pt", "latest"]


def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, caplog):
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, {"step": step}, keep_last=5)
    path = latest_checkpoint(tmp_path)
    path.write_bytes(path.read_bytes()[:100])  # truncated after it was written
    found, state = load_latest(tmp_path)
    assert found.name == "ckpt_2.pt" and state["step"] == 2
    assert "using" in caplog.text and "ckpt_3.pt" in caplog.text
    for p in list_checkpoints(tmp_path):
        p.write_bytes(b"")
    with pytest.raises(CheckpointError, match="no readable checkpoint"):
        load_latest(tmp_path)
    assert load_latest(tmp_path / "elsewhere") is None


def test_average_on_a_full_disk_is_one_clean_cli_error(tmp_path, monkeypatch, capsys):
    import safetensors.torch

    cfg = RunConfig(
        model=ModelConfig(vocab_size=20, n_layers=1, d_model=8, d_ff=16, n_heads=2, d_k=4, d_v=4)
    )
    spm = torch.tensor([1], dtype=torch.uint8)
    data = {"spm_proto": spm, "src": "en", "tgt": "de"}
    state = {"model": Transformer(cfg.model).state_dict(), "config": to_dict(cfg), "data": data}
    save_checkpoint(tmp_path, 1, state, keep_last=5)

    def full(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"part")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    assert main(["average", str(tmp_path), "--last", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "model.safetensors: cannot write the model file: No space left" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints"]
