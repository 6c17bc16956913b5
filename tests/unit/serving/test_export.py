"""serving/export.py: a CTranslate2 export of a tiny random model scores and decodes like ours."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fixtures import make_model_file, multi30k_lines
from transformer.modelfile import load_model
from transformer.search import greedy_search
from transformer.serving.export import ExportError, export_ctranslate2
from transformer.tokenizer import BOS_ID, EOS_ID, PAD_ID

ctranslate2 = pytest.importorskip("ctranslate2")
spm = pytest.importorskip("sentencepiece")


def _our_log_probs(model, src_ids: list[int], tgt_ids: list[int]) -> np.ndarray:
    """log P(y_t | y_<t, x) of tgt_ids + [EOS] under teacher forcing; (T+1,)."""
    src = torch.tensor([src_ids + [EOS_ID]])
    tgt = torch.tensor([[BOS_ID] + tgt_ids])
    gold = torch.tensor(tgt_ids + [EOS_ID])
    mask = torch.ones_like(src, dtype=torch.bool)
    with torch.no_grad():
        lprobs = F.log_softmax(model.decode(tgt, model.encode(src, mask), mask)[0], dim=-1)
    return lprobs.gather(1, gold[:, None])[:, 0].numpy()


def _ct2_log_probs(translator, sp, src: str, tgt: str) -> np.ndarray:
    result = translator.score_batch(
        [sp.encode(src, out_type=str) + ["</s>"]], [sp.encode(tgt, out_type=str)]
    )
    return np.array(result[0].log_probs)


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_model_file):
    out = tmp_path_factory.mktemp("export") / "ct2"
    return load_model(tiny_model_file), export_ctranslate2(tiny_model_file, out)


# Post-norm base architecture, then pre-norm, learned positions (Table 3 row E) and
# d_k * h != d_model (Table 3 row B1-like): each must export exactly.
VARIANTS = [{}, {"norm_first": True}, {"learned_pos": True}, {"d_k": 4, "d_v": 4}]


@pytest.mark.parametrize("overrides", VARIANTS, ids=lambda o: ",".join(o) or "base")
def test_scores_equal_ours_on_real_pairs(tmp_path, overrides):
    path = make_model_file(tmp_path / "model", **overrides)
    loaded = load_model(path)
    out = export_ctranslate2(path, tmp_path / "ct2")
    translator = ctranslate2.Translator(str(out), device="cpu", intra_threads=1)
    sp = spm.SentencePieceProcessor(model_proto=loaded.spm_proto)
    en = multi30k_lines("test_2016_flickr", "en", 8)
    de = multi30k_lines("test_2016_flickr", "de", 8)
    for src, tgt in zip(en, de, strict=True):
        ours = _our_log_probs(loaded.model, sp.encode(src), sp.encode(tgt))
        theirs = _ct2_log_probs(translator, sp, src, tgt)
        np.testing.assert_allclose(theirs, ours, atol=2e-4, rtol=1e-4)


def test_greedy_equals_ours_token_for_token(exported):
    """search.greedy_search on a padded batch of real sentences vs CT2's greedy decoding.

    Ours never emits PAD or BOS and counts the EOS in its maximum length a * |x| + b; CT2 gets
    the same rules through `suppress_sequences` and `max_decoding_length` = max length - 1.
    """
    loaded, out = exported
    translator = ctranslate2.Translator(str(out), device="cpu", intra_threads=1)
    sp = spm.SentencePieceProcessor(model_proto=loaded.spm_proto)
    lines = multi30k_lines("test_2016_flickr", "en", 20)
    ids = [sp.encode(x) + [EOS_ID] for x in lines]
    src = torch.full((len(ids), max(map(len, ids))), PAD_ID)
    for row, seq in enumerate(ids):
        src[row, : len(seq)] = torch.tensor(seq)
    max_len_b = 16
    ours = greedy_search(loaded.model, src, src != PAD_ID, max_len_a=0.0, max_len_b=max_len_b)
    results = translator.translate_batch(
        [sp.encode(x, out_type=str) + ["</s>"] for x in lines],
        beam_size=1,
        max_decoding_length=max_len_b - 1,
        suppress_sequences=[["<pad>"], ["<s>"]],
    )
    theirs = [[sp.piece_to_id(p) for p in r.hypotheses[0]] for r in results]
    assert theirs == ours


def test_ct2_default_positions_would_change_the_scores(exported, tmp_path):
    """CT2 and fairseq concatenate [sin | cos] halves; §3.5 interleaves them. With that table
    instead of ours the scores differ, so the equality tests above can fail."""
    from transformer.serving.export import build_spec, spm_pieces

    loaded, _ = exported
    spec = build_spec(loaded.model, spm_pieces(loaded.spm_proto))
    table = spec.encoder.position_encodings.encodings  # (max_len, D), ours
    halves = np.concatenate([table[:, 0::2], table[:, 1::2]], axis=1)  # [sin | cos]
    spec.encoder.position_encodings.encodings = halves
    spec.decoder.position_encodings.encodings = halves.copy()
    spec.validate()
    spec.optimize()
    spec.save(str(tmp_path))
    translator = ctranslate2.Translator(str(tmp_path), device="cpu", intra_threads=1)
    sp = spm.SentencePieceProcessor(model_proto=loaded.spm_proto)
    src = multi30k_lines("test_2016_flickr", "en", 1)[0]
    tgt = multi30k_lines("test_2016_flickr", "de", 1)[0]
    ours = _our_log_probs(loaded.model, sp.encode(src), sp.encode(tgt))
    assert not np.allclose(_ct2_log_probs(translator, sp, src, tgt), ours, atol=1e-2)


def test_int8_export_loads_and_translates(exported, tmp_path):
    loaded, _ = exported
    out = export_ctranslate2(loaded.path, tmp_path / "int8", quantization="int8")
    translator = ctranslate2.Translator(str(out), device="cpu", compute_type="int8")
    result = translator.translate_batch([["▁A", "▁man", "</s>"]], max_decoding_length=5)
    assert len(result[0].hypotheses[0]) <= 5
    assert (out / "shared_vocabulary.json").is_file() and (out / "spm.model").is_file()


def test_existing_output_dir_is_an_error_unless_forced(exported, tmp_path):
    loaded, _ = exported
    (tmp_path / "out").mkdir()
    with pytest.raises(ExportError, match="already exists"):
        export_ctranslate2(loaded.path, tmp_path / "out")
    assert (export_ctranslate2(loaded.path, tmp_path / "out", force=True) / "model.bin").is_file()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [({"d_k": 8, "d_v": 4}, "d_k=8 != d_v=4"), ({"attn_window": 3}, "attn_window=3")],
)
def test_unexportable_architecture_is_a_clear_error(tmp_path, overrides, message):
    path = make_model_file(tmp_path / "model", **overrides)
    with pytest.raises(ExportError, match=message):
        export_ctranslate2(path, tmp_path / "ct2")


def test_unknown_quantization_is_an_error(exported, tmp_path):
    loaded, _ = exported
    with pytest.raises(ExportError, match="quantization 'int3'"):
        export_ctranslate2(loaded.path, tmp_path / "q", quantization="int3")


def test_cli_export_writes_the_model_and_reports_errors_cleanly(exported, tmp_path, capsys):
    from transformer.cli import main

    loaded, _ = exported
    out = tmp_path / "cli"
    assert main(["export", str(loaded.path), "--to", "ctranslate2", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert (out / "model.bin").is_file()
    assert main(["export", str(tmp_path / "missing"), "--to", "ctranslate2", str(out)]) == 2
    assert "no such model file" in capsys.readouterr().err


def test_a_lowercase_model_exports_with_a_warning_to_lowercase_inputs(tmp_path, caplog):
    for lowercase in (False, True):
        path = make_model_file(tmp_path / f"model-{lowercase}", lowercase=lowercase)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="transformer.serving.export"):
            export_ctranslate2(path, tmp_path / f"ct2-{lowercase}")
        assert ("trained on lowercased text" in caplog.text) is lowercase
