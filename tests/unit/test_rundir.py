"""rundir.py: the run directory's files, its readers, and any path -> a model."""

from __future__ import annotations

import pytest
import torch

from transformer import checkpoint, rundir
from transformer.config import ModelConfig, RunConfig, to_dict
from transformer.errors import UserError
from transformer.model import Transformer
from transformer.modelfile import load_model, save_model

TINY = ModelConfig(vocab_size=30, d_model=16, d_ff=32, n_heads=2, n_layers=1, max_len=32)


def _checkpoint(run, step: int, config: RunConfig) -> None:
    model = Transformer(config.model)
    spm = torch.frombuffer(bytearray(b"spm-bytes"), dtype=torch.uint8)
    state = {"model": model.state_dict(), "config": to_dict(config),
             "data": {"spm_proto": spm, "src": "en", "tgt": "de"}}  # fmt: skip
    checkpoint.save_checkpoint(run, step, state, keep_last=5)


def test_run_files_round_trip(tmp_path):
    config = RunConfig(model=TINY)
    rundir.write_run_files(tmp_path, config, tmp_path / "data")
    assert rundir.read_config(tmp_path) == config
    assert rundir.read_data_dir(tmp_path) == tmp_path / "data"


def test_missing_or_broken_run_files_name_the_file(tmp_path):
    with pytest.raises(UserError, match=r"config.yaml: not found"):
        rundir.read_config(tmp_path)
    (tmp_path / rundir.CONFIG).write_text("model: [", encoding="utf-8")
    with pytest.raises(UserError, match=r"config.yaml: cannot parse YAML"):
        rundir.read_config(tmp_path)
    (tmp_path / rundir.RUN_INFO).write_text("{}", encoding="utf-8")
    with pytest.raises(UserError, match=r"run.json: cannot read the run's data directory"):
        rundir.read_data_dir(tmp_path)


def test_metrics_append_read_and_totals(tmp_path):
    rundir.append_metrics(tmp_path, {"kind": "train", "step": 10, "tokens": 1000,
                                     "tokens_per_s": 500.0})  # fmt: skip
    rundir.append_metrics(tmp_path, {"kind": "valid", "step": 10, "ppl": 9.0})
    rundir.append_metrics(tmp_path, {"kind": "train", "step": 20, "tokens": 3000,
                                     "tokens_per_s": 1000.0})  # fmt: skip
    assert [r["step"] for _, r in rundir.read_metrics(tmp_path, "valid")] == [10]
    totals = rundir.training_totals(tmp_path)
    assert totals == {"step": 20, "tgt_tokens": 3000.0, "elapsed_s": 4.0}
    with open(tmp_path / rundir.METRICS, "a", encoding="utf-8") as f:
        f.write("not json\n")
    with pytest.raises(UserError, match=r"metrics.jsonl:4: not a JSON line"):
        list(rundir.read_metrics(tmp_path))


def test_resolve_model_from_any_path_the_product_wrote(tmp_path):
    config = RunConfig(model=TINY)
    run = tmp_path / "quickstart" / rundir.QUICKSTART_RUN
    run.mkdir(parents=True)
    rundir.write_run_files(run, config, tmp_path / "data")
    with pytest.raises(UserError, match="no model file"):
        rundir.resolve_model(run)
    _checkpoint(run, 3, config)
    _checkpoint(run, 7, config)
    assert rundir.resolve_model(run).path.name == "ckpt_7.pt"  # the latest checkpoint
    assert rundir.resolve_model(tmp_path / "quickstart").path.name == "ckpt_7.pt"
    averaged = rundir.average_run(run, last=2)
    assert rundir.resolve_model(run).path == averaged
    loaded = rundir.resolve_model(averaged)
    top = save_model(tmp_path / "quickstart" / rundir.MODEL, loaded.model, config,
                     loaded.spm_proto, "en", "de")  # fmt: skip
    assert rundir.resolve_model(tmp_path / "quickstart").path == top
    assert rundir.resolve_model(top).src_lang == "en"


def test_a_model_from_the_latest_checkpoint_is_its_weights_and_keeps_no_mapping(tmp_path):
    """The checkpoint is mapped, so that Adam's moments are not read, and the model's tensors
    copied: the model outlives a file that training may rewrite."""
    from pathlib import Path

    config = RunConfig(model=TINY)
    rundir.write_run_files(tmp_path, config, tmp_path / "data")
    _checkpoint(tmp_path, 3, config)
    path = checkpoint.latest_checkpoint(tmp_path)
    want = checkpoint.load_checkpoint(path)["model"]
    loaded = rundir.resolve_model(tmp_path)
    assert str(path) not in Path("/proc/self/maps").read_text()
    got = loaded.model.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    assert loaded.model.output_weight() is loaded.model.src_embed.weight  # still tied


def test_a_checkpoint_whose_weights_are_not_the_configs_is_one_error_naming_them(tmp_path):
    config = RunConfig(model=TINY)
    rundir.write_run_files(tmp_path, config, tmp_path / "data")
    _checkpoint(tmp_path, 3, config)
    path = checkpoint.latest_checkpoint(tmp_path)
    state = checkpoint.load_checkpoint(path)
    del state["model"]["decoder_layers.0.ffn.w_1.bias"]
    state["model"]["extra.weight"] = torch.zeros(2)
    torch.save(state, path)
    with pytest.raises(
        UserError,
        match=r"ckpt_3\.pt: weights do not match the config \(missing "
        r"\['decoder_layers\.0\.ffn\.w_1\.bias'\], unexpected \['extra\.weight'\]\)",
    ):
        rundir.resolve_model(tmp_path)


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
        checkpoint.save_checkpoint(tmp_path, step, ckpt, keep_last=5)
    out = rundir.average_run(tmp_path, last=2)
    loaded = load_model(out)
    expected = (
        states[1]["encoder_layers.0.ffn.w_1.weight"] + states[2]["encoder_layers.0.ffn.w_1.weight"]
    ) / 2
    torch.testing.assert_close(loaded.model.encoder_layers[0].ffn.w_1.weight, expected)
    assert loaded.spm_proto == bytes([1, 2, 3]) and loaded.src_lang == "en"
    with pytest.raises(checkpoint.CheckpointError, match="--last 4"):
        rundir.average_run(tmp_path, last=4)
    # --upper-bound: the last N of the checkpoints up to a step
    bounded = load_model(rundir.average_run(tmp_path, last=2, upper_bound=2))
    expected = (
        states[0]["encoder_layers.0.ffn.w_1.weight"] + states[1]["encoder_layers.0.ffn.w_1.weight"]
    ) / 2
    torch.testing.assert_close(bounded.model.encoder_layers[0].ffn.w_1.weight, expected)
    assert out == tmp_path / rundir.MODEL  # the run's model, by its one name
    with pytest.raises(
        checkpoint.CheckpointError, match="--last 2 asked, 1 checkpoints present up to step 1"
    ):
        rundir.average_run(tmp_path, last=2, upper_bound=1)
