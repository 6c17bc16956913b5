from __future__ import annotations

import pytest

from transformer.parsing.corpus import split_sample_files, write_parsing_corpus

TREE = "( (S (NP-SBJ (NNP {name})) (VP (VBD left)) (. .)))\n"


def _fake_data_root(tmp_path):
    combined = tmp_path / "ptb_sample" / "combined"
    combined.mkdir(parents=True)
    for number in (1, 2, 169, 170, 199):
        (combined / f"wsj_{number:04d}.mrg").write_text(TREE.format(name=f"N{number}"))
    (combined / "README.combined.txt").write_text("not a tree")
    (tmp_path / "ptb_wsj").mkdir()
    (tmp_path / "ptb_wsj" / "22.auto.clean").write_text(
        "(TOP (S (NP (NNP Ann)) (VP (VBZ sings)) (. .)))\n"
    )
    return tmp_path


def test_split_is_by_file_number(tmp_path):
    root = _fake_data_root(tmp_path)
    train, dev = split_sample_files(root / "ptb_sample" / "combined")
    assert [p.name for p in train] == ["wsj_0001.mrg", "wsj_0002.mrg", "wsj_0169.mrg"]
    assert [p.name for p in dev] == ["wsj_0170.mrg", "wsj_0199.mrg"]


def test_split_of_a_directory_without_mrg_files_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no wsj_NNNN.mrg files"):
        split_sample_files(tmp_path)


def test_write_parsing_corpus_writes_parallel_files(tmp_path):
    root = _fake_data_root(tmp_path / "data")
    result = write_parsing_corpus(tmp_path / "out", root)
    assert {k: result[k]["sentences"] for k in ("train", "dev", "test")} == {
        "train": 3,
        "dev": 2,
        "test": 1,
    }
    out = tmp_path / "out"
    assert (out / "train.src").read_text().splitlines()[0] == "N1 left ."
    assert (out / "train.tgt").read_text().splitlines()[0] == "(S (NP XX )NP (VP XX )VP XX )S"
    assert (out / "test.src").read_text() == "Ann sings .\n"
    assert (out / "dev.trees").read_text().splitlines()[1] == (
        "(TOP (S (NP (NNP N199)) (VP (VBD left)) (. .)))"
    )
    assert (out / "tgt_symbols.txt").read_text().split() == [
        "XX", "(S", "(NP", ")NP", "(VP", ")VP", ")S"
    ]  # fmt: skip
    tagged = write_parsing_corpus(tmp_path / "tagged", root, leaves="pos")
    assert open(tagged["test"]["tgt"]).read() == "(S (NP NNP )NP (VP VBZ )VP . )S\n"


def test_words_as_leaves_keep_only_brackets_as_symbols(tmp_path):
    root = _fake_data_root(tmp_path / "data")
    result = write_parsing_corpus(tmp_path / "words", root, leaves="words")
    assert open(result["test"]["tgt"]).read() == "(S (NP Ann )NP (VP sings )VP . )S\n"
    # the words are ordinary text for the subword model; only the brackets are kept whole
    assert open(result["tgt_symbols"]).read().split() == ["(S", "(NP", ")NP", "(VP", ")VP", ")S"]


def test_prepare_ptb_rejects_an_unknown_leaf_mode(tmp_path):
    from transformer.data import DataError
    from transformer.parsing.corpus import prepare_parsing

    with pytest.raises(DataError, match="--leaves must be one of xx, pos, words"):
        prepare_parsing(tmp_path / "out", _fake_data_root(tmp_path / "data"), leaves="tags")
