"""§6.3 on the real treebank files: reading, printing and linearizing every tree of the NLTK
sample and section 22, and `prepare ptb`'s corpus built from them."""

from __future__ import annotations

import pytest

from transformer.parsing.corpus import write_parsing_corpus
from transformer.parsing.trees import delinearize, linearize, parse_tree, read_trees

pytestmark = pytest.mark.integration


def test_read_real_mrg_file(shared_data):
    trees = read_trees(shared_data / "ptb_sample" / "combined" / "wsj_0001.mrg")
    assert [str(t) for t in trees] == [
        "(TOP (S (NP (NP (NNP Pierre) (NNP Vinken)) (, ,) (ADJP (NP (CD 61) (NNS years))"
        " (JJ old)) (, ,)) (VP (MD will) (VP (VB join) (NP (DT the) (NN board)) (PP (IN as)"
        " (NP (DT a) (JJ nonexecutive) (NN director))) (NP (NNP Nov.) (CD 29)))) (. .)))",
        "(TOP (S (NP (NNP Mr.) (NNP Vinken)) (VP (VBZ is) (NP (NP (NN chairman)) (PP (IN of)"
        " (NP (NP (NNP Elsevier) (NNP N.V.)) (, ,) (NP (DT the) (NNP Dutch) (VBG publishing)"
        " (NN group)))))) (. .)))",
    ]


def test_read_real_one_per_line_file_prints_back_identically(shared_data):
    path = shared_data / "ptb_wsj" / "22.auto.clean"
    trees = read_trees(path)
    lines = path.read_text().splitlines()
    assert len(trees) == len(lines) == 1700  # README: 1,700 trees
    assert [str(t) for t in trees] == lines  # already clean: cleaning changes nothing


def test_round_trip_every_real_tree(shared_data):
    sample = sorted((shared_data / "ptb_sample" / "combined").glob("wsj_*.mrg"))
    trees = [t for path in sample for t in read_trees(path)]
    assert len(trees) == 3914  # README: 3,914 trees in combined/
    trees += read_trees(shared_data / "ptb_wsj" / "22.auto.clean")
    for tree in trees:
        words, tags = tree.leaves(), tree.pos()
        assert "-NONE-" not in tags
        assert str(delinearize(linearize(tree), words, tags)) == str(tree)
        assert str(delinearize(linearize(tree, leaves="pos"), words)) == str(tree)


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


def test_real_parsing_corpus_with_words_as_leaves(shared_data, tmp_path):
    from transformer.parsing.trees import delinearize, is_bracket

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
