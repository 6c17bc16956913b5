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


@pytest.mark.integration
def test_real_parsing_corpus(shared_data, tmp_path):
    result = write_parsing_corpus(tmp_path, shared_data)
    # 3,914 NLTK sample trees = 3,501 (wsj_0001-0169) + 413 (wsj_0170-0199); section 22: 1,700.
    counts = {k: result[k]["sentences"] for k in ("train", "dev", "test")}
    assert counts == {"train": 3501, "dev": 413, "test": 1700}
    for split in ("train", "dev", "test"):
        src = (tmp_path / f"{split}.src").read_text().splitlines()
        tgt = (tmp_path / f"{split}.tgt").read_text().splitlines()
        trees = (tmp_path / f"{split}.trees").read_text().splitlines()
        assert len(src) == len(tgt) == len(trees) == counts[split]
        too_long = 0
        for words, tokens in zip(src, tgt, strict=True):
            n_words, n_tokens = len(words.split()), len(tokens.split())
            assert n_words == tokens.split().count("XX")
            too_long += n_tokens > n_words + 300
        # §6.3 decodes at most input length + 300 tokens: only one train tree (249 words,
        # 573 tokens: wsj_0096.mrg tree 47, a long list of names) would not fit.
        assert too_long == (1 if split == "train" else 0)


@pytest.mark.integration
def test_real_parsing_corpus_with_words_as_leaves(shared_data, tmp_path):
    from transformer.parsing.trees import delinearize, is_bracket, parse_tree

    result = write_parsing_corpus(tmp_path, shared_data, leaves="words")
    for split in ("train", "dev", "test"):
        src = open(result[split]["src"], encoding="utf-8").read().splitlines()
        tgt = open(result[split]["tgt"], encoding="utf-8").read().splitlines()
        trees = open(result[split]["trees"], encoding="utf-8").read().splitlines()
        for words, tokens, tree in zip(src, tgt, trees, strict=True):
            tokens = tokens.split()
            # no treebank word looks like a bracket, so the leaves are exactly the words
            assert [t for t in tokens if not is_bracket(t)] == words.split()
            gold = parse_tree(tree)
            assert str(delinearize(tokens, gold.leaves(), gold.pos(), leaves="words")) == tree
