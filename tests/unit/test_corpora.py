"""Named-corpus registry: pairs, layouts, checksums, Tatoeba split, WMT sgm."""

from __future__ import annotations

import gzip

import pytest

from transformer import corpora
from transformer.data import DataError


@pytest.mark.parametrize(
    ("name", "src", "tgt", "vocab", "kind", "valid", "test"),
    [
        ("multi30k", "en", "de", 8000, "bpe", "val", "test_2016_flickr"),
        ("multi30k", "fr", "cs", 8000, "bpe", "val", "test_2016_flickr"),
        ("tatoeba", "de", "en", 16000, "bpe", "valid", "test"),
        ("tatoeba", "en", "fr", 16000, "bpe", "valid", "test"),
        ("iwslt14", "de", "en", 10000, "bpe", "valid", "test"),
        ("wmt14", "en", "de", 37000, "bpe", "newstest2013", "newstest2014"),  # §5.1
        ("wmt14", "en", "fr", 32000, "unigram", "newstest2013", "newstest2014"),  # §5.1
    ],
)
def test_resolve(name, src, tgt, vocab, kind, valid, test):
    r = corpora.resolve(name, src, tgt)
    assert (r.vocab_size, r.spm_type) == (vocab, kind)
    assert r.splits == {"train": "train", "valid": valid, "test": test}
    assert r.downloads and all(d.url.startswith("https://") for d in r.downloads)
    assert all(d.sha256 is None or len(d.sha256) == 64 for d in r.downloads)


@pytest.mark.parametrize(
    ("name", "src", "tgt"),
    [
        ("multi30k", "en", "ja"),
        ("multi30k", "en", "en"),
        ("tatoeba", "de", "fr"),
        ("iwslt14", "en", "fr"),
        ("wmt14", "de", "fr"),
        ("europarl", "en", "de"),
    ],
)
def test_unavailable_pairs_and_names_are_errors(name, src, tgt):
    with pytest.raises(DataError, match="not available|unknown corpus"):
        corpora.resolve(name, src, tgt)


def test_multi30k_checksums_cover_every_shared_file():
    r = corpora.resolve("multi30k", "en", "de")
    assert len(r.text_sha256) == 12
    assert {d.name for d in r.downloads} == {
        f"{s}.{lang}.gz" for s in ("train", "val", "test_2016_flickr") for lang in ("en", "de")
    }


def test_find_prefers_plain_and_accepts_gz(tmp_path):
    r = corpora.resolve("multi30k", "en", "de")
    (tmp_path / "val.en.gz").write_bytes(gzip.compress(b"x\n"))
    assert r.find(tmp_path, "valid", "en") == tmp_path / "val.en.gz"
    (tmp_path / "val.en").write_text("x\n")
    assert r.find(tmp_path, "valid", "en") == tmp_path / "val.en"
    assert r.find(tmp_path, "valid", "de") is None


def test_tatoeba_split_is_by_english_sentence(tmp_path):
    lines = [f"Sentence {i}.\tSatz {i}.\n" for i in range(500)]
    lines += ["Sentence 7.\tAnderer Satz 7.\n"]  # same English, another translation
    counts = corpora.split_tatoeba(lines, tmp_path, "de")
    assert sum(counts.values()) == 501 and all(counts.values())
    for split in ("train", "valid", "test"):
        en = (tmp_path / f"{split}.en").read_text().splitlines()
        de = (tmp_path / f"{split}.de").read_text().splitlines()
        assert len(en) == len(de) == counts[split]
        want = {"test": {0}, "valid": {1}}.get(split)
        buckets = {corpora.tatoeba_bucket(e) for e in en}
        assert buckets <= want if want else not buckets & {0, 1}
    train = (tmp_path / "train.en").read_text().splitlines()
    assert train.count("Sentence 7.") in (0, 2)


def test_tatoeba_line_without_tab_is_an_error(tmp_path):
    with pytest.raises(DataError, match="line 2 has no tab"):
        corpora.split_tatoeba(["a\tb\n", "no tab here\n"], tmp_path, "de")


def test_sgm_lines():
    sgm = (
        '<srcset>\n<doc docid="x">\n<seg id="1">Hello, world.</seg>\n<seg id="2"> A &amp; B</seg>\n'
    )
    assert corpora.sgm_lines(sgm) == ["Hello, world.", "A &amp; B"]  # stripped
