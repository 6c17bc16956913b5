from __future__ import annotations

import math

import pytest

from transformer.bleu import (
    corpus_bleu,
    corpus_chrf,
    multi_bleu,
    split_compounds,
    tokenized_bleu_compound_split,
)
from transformer.errors import UserError


def test_split_compounds_is_perls_non_overlapping_substitution():
    assert split_compounds("Computer-Spiele .") == "Computer ##AT##-##AT## Spiele ."
    # perl's s///g resumes after the consumed "b", so the second hyphen stays (same in re.sub)
    assert split_compounds("a-b-c") == "a ##AT##-##AT## b-c"
    assert split_compounds("a - b") == "a - b"


def test_multi_bleu_hand_computed():
    # 1-grams 4/5, 2-grams 3/4, 3-grams 2/3, 4-grams 1/2, equal lengths (BP = 1):
    # BLEU = (4/5 * 3/4 * 2/3 * 1/2)^(1/4) = (1/5)^(1/4) = 0.668740 -> 66.87 (worked by hand).
    res = multi_bleu(["Der Mann spielt Computer-Spiele ."], ["Ein Mann spielt Computer-Spiele ."])
    assert res.score == pytest.approx(100 * 0.2**0.25)
    assert res.precisions == pytest.approx([80.0, 75.0, 200 / 3, 50.0])
    assert res.brevity_penalty == 1.0


def test_multi_bleu_brevity_penalty_and_zero_precision():
    # hyp 4 words, ref 5: BP = exp(1 - 5/4); precisions 4/4, 3/3, 2/2, 1/1 (worked by hand)
    res = multi_bleu(["a b c d"], ["a b c d e"])
    assert res.score == pytest.approx(100 * math.exp(1 - 5 / 4))
    # no 4-gram match: multi-bleu.perl takes log(0) as -9999999999, i.e. BLEU 0 (no smoothing)
    assert multi_bleu(["a b c x"], ["a b c d"]).score == 0.0


def test_multi_bleu_equals_sacrebleu_without_tokenization_or_smoothing():
    from sacrebleu.metrics import BLEU

    hyps = ["the cat sat on the mat", "a dog runs in the park today", "hello there"]
    refs = ["the cat sat on a mat", "the dog runs in the park", "hello there my friend"]
    want = BLEU(tokenize="none", smooth_method="none").corpus_score(hyps, [refs]).score
    assert multi_bleu(hyps, refs).score == pytest.approx(want, abs=1e-9)


def test_paper_bleu_known_example():
    pytest.importorskip("sacremoses")
    # Moses tokenization splits the final "." and "," ; compound splitting turns
    # "Computer-Spiele" into 3 tokens, so both sides have 7 tokens and the precisions are
    # 6/7, 5/6, 4/5, 3/4: BLEU = (3/7)^(1/4) = 0.809107 (worked by hand), instead of
    # (1/5)^(1/4) without the compound split (see test_multi_bleu_hand_computed).
    res = tokenized_bleu_compound_split(
        ["Der Mann spielt Computer-Spiele."], ["Ein Mann spielt Computer-Spiele."]
    )
    assert res.score == pytest.approx(100 * (3 / 7) ** 0.25)
    assert (res.hyp_len, res.ref_len) == (7, 7)
    assert "multi-bleu" in res.signature and "moses-de" in res.signature


def test_sacrebleu_and_chrf_carry_signatures():
    hyps, refs = ["The cat sat on the mat."], ["The cat sat on the mat."]
    bleu = corpus_bleu(hyps, refs)
    assert bleu.score == pytest.approx(100.0)
    assert "tok:13a" in bleu.signature and "nrefs:1" in bleu.signature
    assert corpus_bleu(["completely different words"], refs).score < 10
    chrf = corpus_chrf(hyps, refs)
    assert chrf.score == pytest.approx(100.0) and "nc:6" in chrf.signature


def test_mismatched_lengths_are_a_user_error():
    with pytest.raises(UserError, match="2 hypotheses but 1 references"):
        corpus_bleu(["a", "b"], ["a"])
