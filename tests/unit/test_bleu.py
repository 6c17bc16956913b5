from __future__ import annotations

import math

import pytest

from transformer.bleu import (
    check_detokenized,
    corpus_bleu,
    corpus_chrf,
    moses_tokenize,
    multi_bleu,
    paper_bleu,
    score_files,
    split_compounds,
    tokenized_bleu_compound_split,
    tokenized_reason,
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


# ---- the paper's metric for En-Fr, tokenized-text detection, `score` on files --------------


def test_paper_bleu_splits_compounds_for_german_only():
    pytest.importorskip("sacremoses")
    hyp, ref = ["Der Mann spielt Computer-Spiele."], ["Ein Mann spielt Computer-Spiele."]
    # de: 7 tokens each side, BLEU (3/7)^(1/4) (test_paper_bleu_known_example); fr: no split,
    # 5 tokens each side, precisions 4/5, 3/4, 2/3, 1/2 -> (1/5)^(1/4) (worked by hand).
    assert paper_bleu(hyp, ref, "de").score == pytest.approx(100 * (3 / 7) ** 0.25)
    fr = paper_bleu(hyp, ref, "fr")
    assert fr.score == pytest.approx(100 * 0.2**0.25)
    assert "split" not in fr.signature and "moses-fr" in fr.signature


def test_moses_tokenize_splits_the_period_of_a_lines_last_word_like_tokenizer_perl():
    pytest.importorskip("sacremoses")
    # "28" is a German non-breaking prefix; tokenizer.perl still splits the last word's period
    # (newstest2014.de line 209; tests/integration/test_paper_bleu_perl.py runs the perl).
    assert moses_tokenize(["am 27. und 28."], "de") == ["am 27. und 28 ."]
    assert moses_tokenize(["am 28. Mai"], "de") == ["am 28. Mai"]


def test_tokenized_reason_tells_moses_output_from_raw_text():
    raw = ["Ein Mann spielt Computer-Spiele.", 'Er sagt: "Nein!"', "Wer ist das?"]
    assert tokenized_reason(raw) is None
    stanford = ["Ein Mann spielt Computer ##AT##-##AT## Spiele .", "Er sagt : &quot; Nein ! &quot;"]
    assert "##AT##-##AT##" in tokenized_reason(stanford)
    assert "split off by a space" in tokenized_reason(["Ein Mann spielt .", "Wer ist das ?"])
    assert tokenized_reason(["Ein Mann spielt .", "Wer ist das ?"], punctuation=False) is None
    assert tokenized_reason(stanford, punctuation=False) is not None


def test_check_detokenized_refuses_tokenized_against_raw_either_way():
    raw, tok = ["Ein Mann spielt Computer-Spiele."], ["Ein Mann spielt Computer-Spiele ."]
    with pytest.raises(UserError, match=r"hyp\.txt looks tokenized .* but ref\.txt does not"):
        check_detokenized(tok, raw, "hyp.txt", "ref.txt")
    with pytest.raises(UserError, match=r"ref\.txt looks tokenized .* but hyp\.txt does not"):
        check_detokenized(raw, tok, "hyp.txt", "ref.txt")
    assert check_detokenized(raw, raw, "h", "r") is False
    assert check_detokenized(tok, tok, "h", "r") is True


def _write(path, data: bytes):
    path.write_bytes(data)
    return path


def test_score_files_reports_every_metric(tmp_path):
    pytest.importorskip("sacremoses")
    hyp = _write(tmp_path / "hyp", b"Der Mann spielt Computer-Spiele.\n")
    ref = _write(tmp_path / "ref", b"Ein Mann spielt Computer-Spiele.\n")
    d = score_files(hyp, ref, "de").as_dict()
    assert d["paper"]["score"] == pytest.approx(100 * (3 / 7) ** 0.25)
    assert (
        d["sacrebleu"]["score"]
        == corpus_bleu([hyp.read_text().strip()], ["Ein Mann spielt Computer-Spiele."]).score
    )
    assert "tok:13a" in d["sacrebleu"]["signature"] and "nc:6" in d["chrf"]["signature"]
    assert d["lines"] == 1


@pytest.mark.parametrize(
    ("hyp", "ref", "message"),
    [
        (b"a b c.\nd e f.\n", b"a b c.\n", r"hyp has 2 lines but .*ref has 1"),
        (b"a b c.\n", b"ok.\n\xff\xfe bad\n", r"ref:2: invalid UTF-8 at byte 0"),
        (b"", b"a b c.\n", r"hyp: empty file"),
        (b"\n\n", b"a\nb\n", r"hyp: empty file"),
        (b"Ein Mann spielt .\n", b"Ein Mann spielt.\n", r"hyp looks tokenized"),
        (b"Ein Mann spielt .\n", b"Ein Mann spielt .\n", r"both look tokenized"),
    ],
)
def test_score_files_bad_input_names_the_file(tmp_path, hyp, ref, message):
    pytest.importorskip("sacremoses")
    with pytest.raises(UserError, match=message):
        score_files(_write(tmp_path / "hyp", hyp), _write(tmp_path / "ref", ref), "de")


def test_score_files_missing_file(tmp_path):
    with pytest.raises(UserError, match=r"nope: no such file"):
        score_files(tmp_path / "nope", tmp_path / "nope", "de")


def test_lowercased_bleu_ignores_case_and_says_so():
    from transformer.bleu import corpus_bleu, tokenized_bleu_lc

    hyps, refs = ["Ein Mann fährt Rad ."], ["ein mann fährt rad ."]
    assert corpus_bleu(hyps, refs).score < 100.0
    lc = corpus_bleu(hyps, refs, lowercase=True)
    assert lc.score == pytest.approx(100.0) and "case:lc" in lc.signature
    tok = tokenized_bleu_lc(["Ein Mann fährt Rad."], ["ein mann fährt rad."], "de")
    assert tok.score == pytest.approx(100.0) and "|lc|" in tok.signature


def _corpus(n=60, seed=3):
    import random

    rng = random.Random(seed)
    words = [f"w{i}" for i in range(40)]
    refs = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 12))) for _ in range(n)]
    hyps = [r if i % 3 else " ".join(r.split()[::-1]) for i, r in enumerate(refs)]
    return hyps, refs


def test_sentence_stats_sum_to_sacrebleus_corpus_score():
    from transformer.bleu import bleu_of_stats, sentence_stats

    hyps, refs = _corpus()
    hyps[5] = ""  # an empty line: no n-grams, its reference still counts
    stats = sentence_stats(hyps, refs)
    assert len(stats) == len(refs) and all(len(row) == 10 for row in stats)
    total = [sum(col) for col in zip(*stats, strict=True)]
    assert bleu_of_stats(total) == pytest.approx(corpus_bleu(hyps, refs).score, abs=1e-9)
    assert stats[0][:2] == [len(hyps[0].split()), len(refs[0].split())]
    with pytest.raises(UserError, match="hypotheses but"):
        sentence_stats(hyps[:-1], refs)


def test_paired_bootstrap_resamples_every_system_alike():
    from transformer.bleu import bleu_of_stats, paired_bootstrap, sentence_stats

    hyps, refs = _corpus()
    a = sentence_stats(hyps, refs)
    b = sentence_stats(refs, refs)  # perfect: 100 on every resample
    boot_a, boot_b = paired_bootstrap([a, b], resamples=50, seed=7)
    assert len(boot_a) == len(boot_b) == 50
    assert boot_b == pytest.approx([100.0] * 50)
    assert len(set(boot_a)) > 10  # the resamples differ
    full = bleu_of_stats([sum(col) for col in zip(*a, strict=True)])
    assert min(boot_a) < full < max(boot_a)
    # the same seed draws the same resamples; a system against itself differs by 0 on each
    again, same = paired_bootstrap([a, a], resamples=50, seed=7)
    assert again == boot_a and same == boot_a
    with pytest.raises(ValueError, match="same sentences"):
        paired_bootstrap([a, a[:-1]])
