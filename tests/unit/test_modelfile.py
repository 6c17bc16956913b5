"""The self-contained model file: round trip, tied weights stored once, clear errors."""

from __future__ import annotations

import json
import struct
import tracemalloc
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

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
    with pytest.raises(UserError, match="model.n_layers=3, the tensors hold 2 encoder_layers"):
        load_model(path)


# --- issue 18, item 4: the header is checked before anything is allocated; checksums ---------


def _saved(tmp_path: Path, **overrides) -> tuple[Path, dict, dict]:
    cfg = build_config("tiny", vocab_size=50)
    path = save_model(tmp_path / "m.safetensors", Transformer(cfg.model), cfg, b"", "en", "de")
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    return path, load_file(str(path)), meta


def _forge(path: Path, tensors: dict, meta: dict, **changes) -> Path:
    meta = {**meta, **changes}
    save_file(tensors, str(path), metadata={k: v for k, v in meta.items() if v is not None})
    return path


def _refuse_tensor_loading(monkeypatch) -> None:
    """Fail the test if a model's tensors are read or a model is built off the meta device."""
    import safetensors.torch

    def refuse(*args, **kwargs):
        raise AssertionError("tensors were loaded before the header was refused")

    monkeypatch.setattr(safetensors.torch, "load_file", refuse)
    real_init = Transformer.__init__

    def meta_only(self, cfg):
        assert torch.empty(0).device.type == "meta", "a model was built on a real device"
        real_init(self, cfg)

    monkeypatch.setattr(Transformer, "__init__", meta_only)


def _config_with(meta: dict, **model) -> str:
    raw = json.loads(meta["config"])
    raw["model"].update(model)
    return json.dumps(raw)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"src_lang": None}, "the header lacks metadata src_lang"),
        ({"config": None, "spm_model": None}, "the header lacks metadata config, spm_model"),
        ({"config": "{not json"}, "the header's config is not valid JSON"),
        ({"config": '{"model": 3}'}, "not a mapping of sections"),
        ({"config": '{"model": {"d_model": "wide"}}'}, "model.d_model: expected int"),
        ({"spm_model": "not base64!"}, "the header's spm_model is not valid base64"),
    ],
)
def test_a_bad_header_is_one_clean_error(tmp_path, monkeypatch, change, match) -> None:
    path, tensors, meta = _saved(tmp_path)
    _forge(path, tensors, meta, **change)
    _refuse_tensor_loading(monkeypatch)
    with pytest.raises(UserError, match=match):
        load_model(path)


@pytest.mark.parametrize(
    ("model", "match"),
    [
        (
            {"d_model": 64, "d_k": 16, "d_v": 16},
            r"has shape \[64\], the header.s config \(d_model=64",
        ),
        ({"vocab_size": 10**9}, r"src_embed.weight has shape \[50, 32\].*needs \[1000000000, 32\]"),
        ({"max_len": 10**9}, r"model.max_len=1000000000 needs 119.2 GiB of positional"),
        ({"n_layers": 10**9}, r"n_layers=1000000000, the tensors hold 2 encoder_layers"),
    ],
)
def test_a_header_that_disagrees_with_its_tensors_is_refused_without_allocating(
    tmp_path, monkeypatch, model, match
) -> None:
    path, tensors, meta = _saved(tmp_path)
    _forge(path, tensors, meta, config=_config_with(meta, **model))
    _refuse_tensor_loading(monkeypatch)
    with pytest.raises(UserError, match=match):
        load_model(path)


def test_a_header_whose_tensors_would_need_terabytes_is_refused(tmp_path) -> None:
    header = {
        "__metadata__": {"format": "transformer-model/1"},
        "src_embed.weight": {"dtype": "F32", "shape": [10**9, 10**6],
                             "data_offsets": [0, 4 * 10**15]},
    }  # fmt: skip
    raw = json.dumps(header).encode()
    path = tmp_path / "forged.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 64)
    tracemalloc.start()
    with pytest.raises(UserError, match="forged.safetensors: not a readable safetensors"):
        load_model(path)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 10 * 2**20  # Python-side allocations; the tensors were never read


def test_flipped_tensor_bytes_fail_the_checksum_unless_not_verified(tmp_path) -> None:
    path, _, _ = _saved(tmp_path)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40  # a bit of the last tensor
    path.write_bytes(bytes(data))
    with pytest.raises(UserError, match="does not match the file's checksum"):
        load_model(path)
    assert load_model(path, verify=False).config.model.vocab_size == 50


def test_an_old_file_without_checksum_loads_with_a_warning(tmp_path, caplog) -> None:
    path, tensors, meta = _saved(tmp_path)
    _forge(path, tensors, meta, tensors_sha256=None)
    loaded = load_model(path)
    assert loaded.config.model.vocab_size == 50
    assert "no checksum" in caplog.text


def test_disk_full_while_saving_leaves_no_temporary(tmp_path, monkeypatch) -> None:
    import errno

    import safetensors.torch

    def full(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"part")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    cfg = build_config("tiny", vocab_size=50)
    with pytest.raises(UserError, match=r"m\.safetensors: cannot write the model file: No space"):
        save_model(tmp_path / "m.safetensors", Transformer(cfg.model), cfg, b"", "en", "de")
    assert list(tmp_path.iterdir()) == []


def test_an_unwritable_place_is_one_clean_error() -> None:
    # safetensors raises its own SafetensorError for I/O errors, not OSError: /proc refuses new
    # files even to root
    cfg = build_config("tiny", vocab_size=50)
    with pytest.raises(UserError, match=r"/proc/m\.safetensors: cannot write the model file"):
        save_model(Path("/proc/m.safetensors"), Transformer(cfg.model), cfg, b"", "en", "de")
