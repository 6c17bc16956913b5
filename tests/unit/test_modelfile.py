"""The self-contained model file: round trip, tied weights stored once, clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from transformer.config import build_config
from transformer.errors import UserError
from transformer.model import Transformer
from transformer.modelfile import load_model, save_model


def test_round_trip_keeps_weights_config_tokenizer_bytes_and_tying(tmp_path: Path) -> None:
    cfg = build_config("tiny", vocab_size=50, overrides=["decode.beam_size=5"])
    model = Transformer(cfg.model)
    path = save_model(tmp_path / "m.safetensors", model, cfg, b"\x00spm", "en", "de")
    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
    assert "src_embed.weight" in keys and "tgt_embed.weight" not in keys  # stored once
    loaded = load_model(path)
    assert loaded.config == cfg and loaded.spm_proto == b"\x00spm"
    assert (loaded.src_lang, loaded.tgt_lang) == ("en", "de")
    assert loaded.model.tgt_embed.weight is loaded.model.src_embed.weight
    for (name, a), b in zip(
        model.state_dict().items(), loaded.model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name
    assert not loaded.model.training
    assert not list(tmp_path.glob("*.tmp"))


def test_separate_vocabularies_round_trip(tmp_path: Path) -> None:
    overrides = ["model.share_embeddings=false", "model.tgt_vocab_size=40"]
    cfg = build_config("tiny", vocab_size=50, overrides=overrides)
    model = Transformer(cfg.model)
    loaded = load_model(save_model(tmp_path / "m.safetensors", model, cfg, b"", "en", "de"))
    assert torch.equal(loaded.model.tgt_embed.weight, model.tgt_embed.weight)
    assert loaded.model.output_weight().shape == (40, cfg.model.d_model)


def test_files_of_earlier_versions_with_retired_options_load(tmp_path: Path) -> None:
    from transformer.config import from_dict, to_dict

    raw = to_dict(build_config("tiny", vocab_size=50))
    raw["model"].update(tie_output=True, p_relu_drop=0.0)  # as every earlier file holds them
    assert from_dict(raw) == build_config("tiny", vocab_size=50)
    raw["model"]["tie_output"] = False  # a value no version could use: still an error
    with pytest.raises(UserError, match="tie_output"):
        from_dict(raw)


def test_bad_files_give_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="no such model file"):
        load_model(tmp_path / "missing.safetensors")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a model")
    with pytest.raises(UserError, match="junk.safetensors: not a readable safetensors"):
        load_model(junk)
    cfg = build_config("tiny", vocab_size=50)
    path = save_model(tmp_path / "m.safetensors", Transformer(cfg.model), cfg, b"", "en", "de")
    bigger = build_config("tiny", vocab_size=50, overrides=["model.n_layers=3"])
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    import json

    from transformer.config import to_dict

    meta["config"] = json.dumps(to_dict(bigger))
    save_file(tensors, str(path), metadata=meta)
    with pytest.raises(UserError, match="weights do not match the config"):
        load_model(path)
