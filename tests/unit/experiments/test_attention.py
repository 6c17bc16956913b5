"""Figures 3-5: attention pictures from a tiny random model file."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("matplotlib")

from transformer.errors import UserError  # noqa: E402
from transformer.experiments.attention import _pick_word, plot_attention  # noqa: E402
from transformer.translate import Translator  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def model_file(tiny_model_file):
    return tiny_model_file


def test_sentence_attention_shapes_and_rows_sum_to_one(model_file) -> None:
    translator = Translator.from_path(model_file)
    tok = translator.tokenizer
    att = translator.attention_weights("A little girl.", "Ein kleines Mädchen.")
    S, T = len(att.source_pieces), len(att.target_input_pieces)
    assert S == len(tok.encode("A little girl.")) + 1 and att.source_pieces[-1] == "</s>"
    assert T == len(tok.encode("Ein kleines Mädchen.")) + 1
    assert att.target_input_pieces[0] == "<s>" and att.target_pieces[-1] == "</s>"
    H, N = translator.model.cfg.n_heads, translator.model.cfg.n_layers
    shapes = {"encoder": (H, S, S), "decoder": (H, T, T), "cross": (H, T, S)}
    for kind, shape in shapes.items():
        assert len(att.weights[kind]) == N
        for w in att.weights[kind]:
            assert w.shape == shape
            torch.testing.assert_close(w.sum(-1), torch.ones(shape[:2]))
    # Decoder self-attention is causal: no weight on later positions (§3.2.3).
    assert float(att.weights["decoder"][0].triu(1).abs().sum()) == 0.0


def test_plot_attention_writes_pngs(model_file, tmp_path) -> None:
    paths = plot_attention(model_file, "Two dogs run.", tmp_path, layer=1, head=2, word="0")
    names = sorted(p.name for p in paths)
    assert names == sorted(
        [
            "encoder_l1.png",
            "decoder_l1.png",
            "cross_l1.png",
            "encoder_l1_word0.png",
            "encoder_l1_head2.png",
        ]  # fmt: skip
    )
    for p in paths:
        assert p.read_bytes()[:8] == PNG_MAGIC


def test_default_layer_is_last_but_one_and_bad_arguments(model_file, tmp_path) -> None:
    # Figures 3-5 use layer 5 of 6; on this 2-layer model the last but one is layer 0.
    paths = plot_attention(model_file, "Two dogs.", tmp_path, kinds=("cross",))
    assert [p.name for p in paths] == ["cross_l0.png"]
    with pytest.raises(UserError, match="--layer 4"):
        plot_attention(model_file, "Two dogs.", tmp_path, layer=4)
    with pytest.raises(UserError, match="--head 9"):
        plot_attention(model_file, "Two dogs.", tmp_path, layer=0, head=9)


def test_pick_word() -> None:
    labels = ["▁The", "▁law", "▁will", "▁ne", "ver", "▁be", "▁perf", "ect", ",", "</s>"]
    assert _pick_word(labels, "law") == 1  # a subword
    assert _pick_word(labels, "never") == 3  # a whole word: its first subword
    assert _pick_word(labels, "perfect") == 6  # punctuation attached to the word is ignored
    assert _pick_word(labels, "4") == 4  # a position
    assert _pick_word(labels, None) == 6  # the longest word: "perfect,"
    with pytest.raises(UserError, match="not a token"):
        _pick_word(labels, "making")
