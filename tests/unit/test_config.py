"""Config: presets, YAML, overrides, and the errors that name the source and the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from transformer.config import (
    PRESETS,
    ConfigError,
    DecodeConfig,
    ModelConfig,
    RunConfig,
    TrainConfig,
    build_config,
    from_dict,
    to_dict,
)


def test_defaults_are_the_papers_base_model_and_recipe() -> None:
    m, t, d = ModelConfig(), TrainConfig(), DecodeConfig()
    assert (m.n_layers, m.d_model, m.d_ff, m.n_heads, m.d_k, m.d_v) == (6, 512, 2048, 8, 64, 64)
    assert (m.p_drop, m.share_embeddings, m.norm_first) == (0.1, True, False)
    assert (t.beta1, t.beta2, t.adam_eps, t.warmup_steps, t.eps_ls) == (0.9, 0.98, 1e-9, 4000, 0.1)
    assert (d.beam_size, d.length_penalty, d.max_len_a, d.max_len_b) == (4, 0.6, 1.0, 50)
    assert d.stop == "t2t"  # §6.1 "terminating early when possible", tensor2tensor's rule


def test_decode_stop_takes_only_the_two_rules() -> None:
    assert DecodeConfig(stop="fairseq").stop == "fairseq"
    with pytest.raises(ConfigError, match="decode.stop: must be 't2t' or 'fairseq'"):
        DecodeConfig(stop="early")


def test_table3_rows_change_only_their_columns() -> None:
    base = build_config("base").model
    a1 = build_config("A1").model
    assert (a1.n_heads, a1.d_k, a1.d_v) == (1, 512, 512)
    assert (a1.n_layers, a1.d_model, a1.d_ff) == (base.n_layers, base.d_model, base.d_ff)
    assert build_config("D3").train.eps_ls == 0.0
    assert build_config("D4").train.eps_ls == 0.2
    assert build_config("E").model.learned_pos
    big = build_config("big")
    assert (big.model.d_model, big.model.n_heads, big.model.p_drop) == (1024, 16, 0.3)
    assert (big.train.max_steps, big.train.keep_last) == (300000, 20)
    parsing = build_config("parsing").model
    assert (parsing.n_layers, parsing.d_model) == (4, 1024)
    for name in ["A1", "A2", "A3", "A4", "B1", "B2"] + [f"C{i}" for i in range(1, 8)]:
        assert name in PRESETS
    assert {"D1", "D2", "D3", "D4", "E", "base", "big", "parsing"} <= set(PRESETS)


def test_order_preset_then_yaml_then_overrides(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("preset: cpu-small\nmodel:\n  d_ff: 512\ntrain:\n  warmup_steps: 123\n")
    cfg = build_config(yaml_path=path, overrides=["train.warmup_steps=77", "model.p_drop=0.3"])
    assert cfg.model.d_model == 256  # from the preset
    assert cfg.model.d_ff == 512  # YAML over preset
    assert cfg.train.warmup_steps == 77  # override over YAML
    assert cfg.model.p_drop == 0.3
    assert build_config("base", vocab_size=8000).model.vocab_size == 8000


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.d_modle=3", "unknown key model.'d_modle'"),
        ("optim.lr=3", "unknown key 'optim.lr'"),
        ("model.d_model=big", "model.d_model: expected int"),
        ("train.compile=1", "train.compile: expected bool"),
        ("train.dtype=fp16", "train.dtype"),
        ("model.p_drop=1.5", "model.p_drop"),
        ("train.cooldown=1.5", "train.cooldown: must be in"),
        ("train.cooldown=-0.1", "train.cooldown: must be in"),
        ("train.procs=0", "train.procs: must be positive"),
        ("decode.n_best=9", "decode.n_best"),
        ("model.d_model", "expected section.key=value"),
        ("train.seed=[", "the value is not valid YAML"),  # issue 18: was a YAML traceback
    ],
)
def test_bad_overrides_name_the_key(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")) as err:
        build_config(overrides=[override])
    assert "override" in str(err.value)


def test_floats_in_exponent_notation_are_floats(tmp_path: Path) -> None:
    """PyYAML (YAML 1.1) reads 1e-4 as a string; a float field takes it as the number."""
    cfg = build_config(overrides=["train.lr_scale=5e-1", "train.max_minutes=1E3"])
    assert cfg.train.lr_scale == 0.5 and cfg.train.max_minutes == 1000.0
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  save_every_minutes: 2e1\n")
    assert build_config(yaml_path=path).train.save_every_minutes == 20.0
    with pytest.raises(ConfigError, match="expected int"):  # not an int field's value
        build_config(overrides=["train.max_steps=1e3"])
    with pytest.raises(ConfigError, match="expected float"):
        build_config(overrides=["train.lr_scale=e5"])


@pytest.mark.parametrize(
    ("tokens", "accum", "procs", "per_process"),
    [
        (8192, 1, 1, (8192, 1)),
        (2731, 3, 3, (2731, 1)),  # multi30k-full with --procs 3: one of the 3 batches each
        (1000, 4, 2, (1000, 2)),
        (1000, 1, 2, (500, 1)),  # 1 batch a step: split between the processes
        (1001, 2, 3, (334, 2)),  # 3 does not divide 2: every batch split, rounded up
    ],
)
def test_procs_share_out_the_steps_batches_before_splitting_them(
    tokens: int, accum: int, procs: int, per_process: tuple[int, int]
) -> None:
    t = TrainConfig(max_tokens=tokens, accum_steps=accum, procs=procs)
    assert t.per_process() == per_process


def test_bad_yaml_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  n_heads: eight\n")
    with pytest.raises(ConfigError, match=rf"{path}: model.n_heads: expected int"):
        build_config(yaml_path=path)
    path.write_text("model: [1, 2]\n")
    with pytest.raises(ConfigError, match="section 'model' must be a mapping"):
        build_config(yaml_path=path)
    path.write_text("model: {d_model: 8\n")
    with pytest.raises(ConfigError, match="cannot read config"):
        build_config(yaml_path=path)
    with pytest.raises(ConfigError, match="unknown preset 'huge'"):
        build_config("huge")
    path.write_bytes(b"# Gr\xfc\xdfe\nmodel: {d_model: 8}\n")  # Latin-1, not UTF-8
    with pytest.raises(ConfigError, match=rf"{path}: cannot read config: 'utf-8' codec"):
        build_config(yaml_path=path)


def test_shared_embeddings_need_one_vocabulary() -> None:
    with pytest.raises(ConfigError, match="joint"):
        ModelConfig(vocab_size=100, tgt_vocab_size=90)
    assert (
        ModelConfig(vocab_size=100, tgt_vocab_size=90, share_embeddings=False).target_vocab_size
        == 90
    )
    assert ModelConfig(vocab_size=100).target_vocab_size == 100


def test_float_fields_accept_ints_and_none_where_optional() -> None:
    cfg = build_config(
        overrides=["train.lr_scale=2", "train.max_minutes=null", "model.attn_window=3"]
    )
    assert cfg.train.lr_scale == 2.0 and isinstance(cfg.train.lr_scale, float)
    assert cfg.train.max_minutes is None
    assert cfg.model.attn_window == 3


def test_round_trip_through_a_dict() -> None:
    cfg = build_config("C4", overrides=["train.accum_steps=3", "decode.beam_size=21"])
    assert from_dict(to_dict(cfg)) == cfg
    assert isinstance(from_dict(to_dict(RunConfig())), RunConfig)


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"length_penalty": float("nan")}, "decode.length_penalty: must be in [0, 10.0], got nan"),
        ({"length_penalty": float("inf")}, "decode.length_penalty"),
        ({"length_penalty": -1.0}, "decode.length_penalty: must be in [0, 10.0], got -1.0"),
        ({"beam_size": 10_000}, "decode.beam_size: must be in [1, 64], got 10000"),
        ({"beam_size": 0}, "decode.beam_size"),
        ({"beam_size": True}, "decode.beam_size: must be an integer, got True"),
        ({"beam_size": 2, "n_best": 3}, "decode.n_best: must be in [1, 2], got 3"),
        ({"max_len_a": -0.5}, "decode.max_len_a"),
        ({"max_len_b": -1}, "decode.max_len_b"),
        ({"max_len_b": 2.5}, "decode.max_len_b: must be an integer"),
        ({"max_tokens": 0}, "decode.max_tokens"),
    ],
)
def test_decode_config_bounds_every_search_option(changes, needle):
    with pytest.raises(ConfigError) as e:
        DecodeConfig(**changes)
    assert needle in str(e.value)


def test_decode_config_bounds_admit_the_papers_settings_and_the_extremes():
    from transformer.config import MAX_BEAM_SIZE

    assert DecodeConfig(beam_size=21, length_penalty=0.3).beam_size == 21  # §6.3
    edge = DecodeConfig(MAX_BEAM_SIZE, 0, 0, 0, n_best=MAX_BEAM_SIZE, max_tokens=1)
    assert (edge.beam_size, edge.n_best, edge.length_penalty) == (64, 64, 0)
