from __future__ import annotations

from fractions import Fraction

import pytest

from transformer.parsing.evalb import ERROR, OK, SKIP, evaluate_parses, score_sentence
from transformer.parsing.trees import Tree, delinearize, linearize, parse_tree

# Gold, after deleting "." (EVALB deletes punctuation words before computing spans):
#   The(0) cat(1) sat(2) on(3) the(4) mat(5)
#   brackets S(0,6) NP(0,2) VP(2,6) PP(3,6) NP(4,6): 5; TOP is a DELETE_LABEL, not counted.
GOLD = parse_tree(
    "(TOP (S (NP (DT The) (NN cat)) (VP (VBD sat) (PP (IN on) (NP (DT the) (NN mat)))) (. .)))"
)
# Test: S(0,6) NP(0,2) VP(2,6) match; PP(3,5) does not: 4 brackets, 3 matched.
TEST = parse_tree(
    "(TOP (S (NP (DT The) (NN cat)) (VP (VBD sat) (PP (IN on) (DT the)) (NN mat)) (. .)))"
)


def test_hand_worked_precision_recall_f1():
    score = score_sentence(GOLD, TEST)
    assert (score.status, score.matched, score.gold, score.test) == (OK, 3, 5, 4)
    assert score.precision == pytest.approx(3 / 4)
    assert score.recall == pytest.approx(3 / 5)
    # F1 = 2PR / (P + R) = 2 * 3/4 * 3/5 / (3/4 + 3/5) = (18/20) / (27/20) = 2/3
    assert score.f1 == pytest.approx(2 / 3)
    # PP(3,5) crosses the gold NP(4,6): 3 < 4 < 5 < 6.
    assert score.crossing == 1
    assert score.words == 6  # the "." is not a word for EVALB
    assert score.length == 7  # but it counts for the len<=40 cut (only -NONE- does not)
    assert not score.exact_match


def test_identical_trees_score_100():
    result = evaluate_parses([GOLD], [GOLD])
    assert (result["f1"], result["exact_match"], result["matched"]) == (100.0, 100.0, 5)


def test_punctuation_is_ignored_wherever_it_is_attached():
    # The "." inside VP and a comma-only constituent: spans without punctuation are unchanged,
    # and a bracket covering only punctuation has an empty span, so it is not counted.
    test = parse_tree(
        "(TOP (S (NP (DT The) (NN cat)) (VP (VBD sat) (PP (IN on) (NP (DT the) (NN mat)))"
        " (PRN (. .)))))"
    )
    score = score_sentence(GOLD, test)
    assert (score.matched, score.gold, score.test) == (5, 5, 5)
    assert score.exact_match


def test_all_five_punctuation_tags_are_deleted_and_others_are_not():
    # Gold words: a b (5 punctuation tags deleted). Brackets: S(0,2), NP(0,1); TOP not counted.
    gold = parse_tree("(TOP (S (`` ``) (NP (NN a)) (, ,) (: ;) (VB b) ('' '') (. .)))")
    # The test moves every punctuation mark: no effect.
    test = parse_tree("(TOP (S (NP (`` ``) (NN a) (, ,) (: ;)) (VB b) ('' '') (. .)))")
    score = score_sentence(gold, test)
    assert (score.matched, score.gold, score.test, score.words) == (2, 2, 2, 2)
    # "$", "#", -LRB- and -RRB- are not punctuation for COLLINS.prm: the NP grows by one word.
    gold = parse_tree("(TOP (S (NP ($ $) (CD 5)) (VB b)))")
    test = parse_tree("(TOP (S ($ $) (NP (CD 5)) (VB b)))")
    score = score_sentence(gold, test)
    # gold S(0,3) NP(0,2); test S(0,3) NP(1,2): 1 of 2 matched, P = R = 1/2
    assert (score.matched, score.gold, score.test) == (1, 2, 2)


def test_advp_and_prt_are_equivalent():
    gold = parse_tree("(TOP (S (NP (PRP He)) (VP (VBD gave) (PRT (RP up)))))")
    test = parse_tree("(TOP (S (NP (PRP He)) (VP (VBD gave) (ADVP (RP up)))))")
    assert score_sentence(gold, test).matched == 4  # S, NP, VP, PRT = ADVP
    other = parse_tree("(TOP (S (NP (PRP He)) (VP (VBD gave) (PP (RP up)))))")
    assert score_sentence(gold, other).matched == 3  # PRT != PP


def test_root_bracket_not_counted_but_s_under_it_is():
    gold = parse_tree("(TOP (S (NP (PRP He)) (VP (VBD left))))")
    # A flat test tree has only the TOP bracket, which is deleted: 0 test brackets.
    flat = parse_tree("(TOP (PRP He) (VBD left))")
    score = score_sentence(gold, flat)
    assert (score.matched, score.gold, score.test) == (0, 3, 0)
    assert (score.precision, score.recall, score.f1) == (0.0, 0.0, 0.0)
    # A test tree with an S root spanning the sentence earns the S bracket.
    s_only = parse_tree("(TOP (S (PRP He) (VBD left)))")
    assert score_sentence(gold, s_only).matched == 1


def test_unlabelled_root_is_counted_as_evalb_does():
    # evalb.c counts a bracket with an empty label, e.g. the root of "( (S ...))".
    # (Our readers rename it TOP, so this only matters for hand-built trees.)
    s = Tree("S", [Tree("NN", word="a"), Tree("VP", [Tree("VB", word="b")])])
    score = score_sentence(Tree("", [s]), Tree("", [s]))
    assert (score.matched, score.gold) == (3, 3)  # "", S, VP


def test_function_tags_and_indices_are_cut_from_labels():
    gold = parse_tree("(TOP (S-1 (NP-SBJ=2 (PRP He)) (VP (VBD left))))", clean=False)
    test = parse_tree("(TOP (S (NP (PRP He)) (VP-TPC-3 (VBD left))))", clean=False)
    assert score_sentence(gold, test).matched == 3


def test_none_elements_are_deleted_and_do_not_count_for_length():
    gold = parse_tree(
        "(TOP (S (NP-SBJ (-NONE- *)) (VP (VB Go)) (. !)))", clean=False
    )  # NP has an empty span: not counted. Brackets S(0,1), VP(0,1).
    test = parse_tree("(TOP (S (VP (VB Go)) (. !)))")
    score = score_sentence(gold, test)
    assert (score.matched, score.gold, score.test, score.length) == (2, 2, 2, 2)


def test_duplicate_brackets_are_matched_as_a_multiset():
    # Gold has NP(0,1) twice (a unary chain NP -> NP), the test once: matched 1 of 2 gold.
    gold = parse_tree("(TOP (S (NP (NP (PRP He))) (VP (VBD left))))")
    test = parse_tree("(TOP (S (NP (PRP He)) (VP (VBD left))))")
    score = score_sentence(gold, test)
    assert (score.matched, score.gold, score.test) == (3, 4, 3)
    assert score_sentence(test, gold).matched == 3  # and 3 of 4 test brackets


def test_length_and_word_mismatch_are_errors_and_empty_test_is_skipped():
    gold = parse_tree("(TOP (S (NP (PRP He)) (VP (VBD left))))")
    shorter = parse_tree("(TOP (S (NP (PRP He))))")
    other_words = parse_tree("(TOP (S (NP (PRP She)) (VP (VBD left))))")
    only_punct = parse_tree("(TOP (S (. .)))")
    assert score_sentence(gold, shorter).status == ERROR
    assert score_sentence(gold, other_words).status == ERROR
    assert score_sentence(gold, only_punct).status == SKIP
    result = evaluate_parses([gold, gold, gold, GOLD], [shorter, other_words, only_punct, TEST])
    # Only the last pair is valid, so the totals are its 3 / 5 / 4.
    assert (result["sentences"], result["error_sentences"], result["skip_sentences"]) == (4, 2, 1)
    assert (result["matched"], result["gold_brackets"], result["test_brackets"]) == (3, 5, 4)
    assert result["f1"] == pytest.approx(100 * 2 / 3)


def test_corpus_scores_are_micro_averaged():
    second = parse_tree("(TOP (S (NP (PRP He)) (VB left)))")  # 2 brackets, exact match
    result = evaluate_parses([GOLD, second], [TEST, second])
    # matched 3 + 2 = 5, gold 5 + 2 = 7, test 4 + 2 = 6:
    # R = 5/7, P = 5/6, F1 = 2 * 5/6 * 5/7 / (5/6 + 5/7) = (50/42) / (65/42) = 10/13
    assert result["recall"] == pytest.approx(100 * 5 / 7)
    assert result["precision"] == pytest.approx(100 * 5 / 6)
    assert result["f1"] == pytest.approx(100 * float(Fraction(10, 13)))
    # not the mean of the sentence F1s (2/3 and 1): 0.8333...
    assert result["f1"] != pytest.approx(100 * (2 / 3 + 1) / 2)
    assert result["exact_match"] == 50.0
    assert result["average_crossing"] == 0.5


def test_len_40_cut_counts_punctuation_but_not_none():
    def flat(n_words: int, extra: str) -> Tree:
        leaves = " ".join(f"(NN w{i})" for i in range(n_words))
        return parse_tree(f"(TOP (S (NP {leaves}) {extra}))", clean=False)

    long_by_punct = flat(40, "(. .)")  # 41 words with the "."
    ok_with_none = flat(40, "(NP (-NONE- *))")  # 40 words; -NONE- does not count
    result = evaluate_parses([long_by_punct, ok_with_none], [long_by_punct, ok_with_none])
    assert result["sentences"] == 2
    assert result["len<=40"]["sentences"] == 1
    assert result["len<=40"]["gold_brackets"] == 2  # S and NP of the second tree
    assert (
        evaluate_parses([long_by_punct], [long_by_punct], cutoff_len=41)["len<=41"]["sentences"]
        == 1
    )


def test_tagging_accuracy_on_kept_words():
    test = parse_tree(
        "(TOP (S (NP (DT The) (NN cat)) (VP (VBN sat) (PP (IN on) (NP (DT the) (NN mat)))) (. .)))"
    )
    assert score_sentence(GOLD, test).correct_tags == 5  # 6 words without ".", VBD != VBN
    assert evaluate_parses([GOLD], [test])["tagging_accuracy"] == pytest.approx(100 * 5 / 6)


def test_delinearized_xx_trees_need_the_input_tags_for_punctuation():
    # With XX tags the "." is not deleted from the test tree: EVALB reports a length error.
    xx = delinearize(linearize(GOLD), GOLD.leaves())
    assert score_sentence(GOLD, xx).status == ERROR
    tagged = delinearize(linearize(GOLD), GOLD.leaves(), GOLD.pos())
    assert score_sentence(GOLD, tagged).exact_match


def test_mismatched_corpus_sizes_are_an_error():
    with pytest.raises(ValueError, match="1 predicted trees for 2 gold trees"):
        evaluate_parses([GOLD, GOLD], [GOLD])
