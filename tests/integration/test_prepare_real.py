"""Prepare the real corpora in ../shared/data end to end (Multi30k, Tatoeba De-En)."""

from __future__ import annotations

import pytest

from transformer.batching import TokenBatchSampler
from transformer.corpora import tatoeba_bucket
from transformer.data import DataError, collate, load_prepared
from transformer.prepare import prepare_corpus
from transformer.tokenizer import EOS_ID

pytestmark = pytest.mark.integration


def _round_trip_report(data, split):
    """(exact, whitespace-only differences, real differences) of decode(encode(line))."""
    tok, sp = data.tokenizer, data.split(split)
    counts = [0, 0, 0]
    for lang in (data.src_lang, data.tgt_lang):
        lines = sp.text(lang)
        for line, back in zip(lines, tok.decode_batch(tok.encode_batch(lines)), strict=True):
            k = 0 if back == line else 1 if back == " ".join(line.split()) else 2
            counts[k] += 1
    return counts


_PREPARED: dict = {}  # prepare Multi30k once per session (`shared_data` is function-scoped)


@pytest.fixture
def multi30k(shared_data, tmp_path_factory):
    if "multi30k" not in _PREPARED:
        out = tmp_path_factory.mktemp("prep") / "multi30k_en_de"
        manifest = prepare_corpus(
            "multi30k", "en", "de", out, from_dir=shared_data / "multi30k", num_threads=2
        )
        _PREPARED["multi30k"] = (manifest, out)
    return _PREPARED["multi30k"]


def test_multi30k_counts_and_provenance(multi30k):
    m, out = multi30k
    # line counts from shared/data/multi30k/README.md
    assert {k: v["pairs"] for k, v in m.splits.items()} == {
        "train": 29000,
        "valid": 1014,
        "test": 1000,
    }
    assert m.splits["test"]["source"] == "test_2016_flickr"
    assert m.filters["train"] == {"empty": 0, "too_long": 0, "length_ratio": 0}
    assert all(entry["verified"] is True for entry in m.inputs.values())
    data = load_prepared(out)
    assert data.tokenizer.vocab_size == 8000
    # the raw references are the untouched test set (byte-identical to the input file)
    shared = m.inputs["test.de"]["path"]
    with open(shared, encoding="utf-8") as f:
        assert data.split("test").text("de") == f.read().split("\n")[:-1]


def test_multi30k_round_trip(multi30k):
    _, out = multi30k
    data = load_prepared(out)
    for split in data.split_names:
        exact, whitespace, other = _round_trip_report(data, split)
        assert other == 0  # only stray/double spaces differ (collapsed by sentencepiece)
        assert whitespace <= 130  # README: 40 trailing-space lines in train.de, a few double spaces


def test_multi30k_batches(multi30k):
    _, out = multi30k
    train = load_prepared(out).split("train")
    sampler = TokenBatchSampler(train.src_lens, train.tgt_lens, max_tokens=4096, seed=1)
    seen = 0
    for i, indices in enumerate(sampler):
        if i < 5:
            b = collate(train, indices)
            assert b.src.numel() <= 4096 and b.tgt_out.numel() <= 4096
            assert (b.tgt_out == EOS_ID).sum() == len(indices)
        seen += len(indices)
    assert seen == 29000


def test_reuse_is_instant(multi30k, shared_data):
    m, out = multi30k
    stamp = (out / "train.en.bin").stat().st_mtime_ns
    again = prepare_corpus("multi30k", "en", "de", out, from_dir=shared_data / "multi30k")
    assert again == m and (out / "train.en.bin").stat().st_mtime_ns == stamp


def test_tatoeba_de_en(shared_data, tmp_path):
    m = prepare_corpus(
        "tatoeba",
        "de",
        "en",
        tmp_path / "tat",
        from_dir=shared_data / "tatoeba_deu_eng",
        num_threads=2,
    )
    assert m.splits["train"]["input_pairs"] == 166411 and m.splits["valid"]["pairs"] == 1702
    assert "test" not in m.splits  # hidden
    assert all(entry["verified"] is True for entry in m.inputs.values())
    data = load_prepared(tmp_path / "tat")
    assert (data.src_lang, data.tgt_lang) == ("de", "en")
    # the registry's split rule reproduces the shared split exactly
    assert {tatoeba_bucket(e) for e in data.split("valid").text("en")} == {1}
    assert not {tatoeba_bucket(e) for e in data.split("train").text("en")} & {0, 1}
    assert _round_trip_report(data, "valid")[1:] == [0, 0]


def test_wmt14_without_training_data_is_a_clear_error(shared_data, tmp_path):
    with pytest.raises(DataError, match=r"wmt14 train split: missing train\.en\[\.gz\]"):
        prepare_corpus("wmt14", "en", "de", tmp_path / "w", from_dir=shared_data / "wmt14_en_de")
