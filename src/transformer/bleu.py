"""BLEU two ways: sacreBLEU on detokenized text (today's standard, with its signature) and the
paper's tokenized BLEU (tensor2tensor's get_ende_bleu.sh), plus `score_files` for any system.

The paper's recipe (SPEC §6.1): Moses `tokenizer.perl -l de` on hypotheses and references,
then `perl -ple 's{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g'`, then Moses `multi-bleu.perl`
(tokenized BLEU, closest reference length brevity penalty, no smoothing); for En-Fr the same
without the compound split. `multi_bleu` below is a line-for-line reimplementation of
multi-bleu.perl; the Moses tokenizer comes from `sacremoses` (a port of tokenizer.perl, checked
against the perl scripts on real files by the tests), an optional extra
(`pip install transformer[paper-bleu]`) imported only here. See docs/decoding.md.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from transformer.errors import UserError

# tensor2tensor get_ende_bleu.sh: perl -ple 's{(\S)-(\S)}{$1 ##AT##-##AT## $2}g'
_COMPOUND = re.compile(r"(\S)-(\S)")
MAX_ORDER = 4


@dataclass
class BleuResult:
    """A corpus BLEU score (0-100) with the details needed to reproduce and compare it."""

    score: float
    signature: str
    precisions: list[float] = field(default_factory=list)  # n-gram precisions, percent
    brevity_penalty: float = 1.0
    hyp_len: int = 0
    ref_len: int = 0

    def __str__(self) -> str:
        p = "/".join(f"{x:.1f}" for x in self.precisions)
        ratio = self.hyp_len / self.ref_len if self.ref_len else 0.0
        return (
            f"BLEU = {self.score:.2f} {p} (BP = {self.brevity_penalty:.3f} ratio = {ratio:.3f} "
            f"hyp_len = {self.hyp_len} ref_len = {self.ref_len}) {self.signature}"
        )


@dataclass
class ChrfResult:
    """A corpus chrF score (0-100) with its sacreBLEU signature."""

    score: float
    signature: str

    def __str__(self) -> str:
        return f"chrF2 = {self.score:.2f} {self.signature}"


def _check(hyps: Sequence[str], refs: Sequence[str]) -> None:
    if len(hyps) != len(refs):
        raise UserError(f"BLEU: {len(hyps)} hypotheses but {len(refs)} references")


def corpus_bleu(
    hyps: Sequence[str], refs: Sequence[str], tokenize: str = "13a", lowercase: bool = False
) -> BleuResult:
    """sacreBLEU on detokenized text (one reference per line), with its signature.

    Args:
        hyps: detokenized system outputs, one per line.
        refs: the references, aligned with `hyps`.
        tokenize: sacreBLEU's tokenizer ("13a" is its default, "intl", "none", ...).
        lowercase: sacreBLEU's `-lc` (case-insensitive; the signature says `case:lc`).
    """
    from sacrebleu.metrics import BLEU

    _check(hyps, refs)
    metric = BLEU(tokenize=tokenize, lowercase=lowercase)
    res = metric.corpus_score(list(hyps), [list(refs)])
    return BleuResult(
        score=res.score,
        signature=str(metric.get_signature()),
        precisions=list(res.precisions),
        brevity_penalty=res.bp,
        hyp_len=res.sys_len,
        ref_len=res.ref_len,
    )


def sentence_stats(
    hyps: Sequence[str], refs: Sequence[str], tokenize: str = "13a"
) -> list[list[int]]:
    """sacreBLEU's sufficient statistics of each sentence pair (cased, `tokenize`): [hypothesis
    length, reference length, matches of 1..4-grams, totals of 1..4-grams]. Summed over any
    subset of the sentences, `bleu_of_stats` gives that subset's corpus BLEU, as
    `corpus_bleu` scores it: the ground of `paired_bootstrap`."""
    from sacrebleu.metrics import BLEU

    _check(hyps, refs)
    # sacreBLEU's own significance tests read these (`_extract_corpus_statistics`); the tests
    # check that their sum reproduces `corpus_bleu`, so a change of their layout is caught.
    stats = BLEU(tokenize=tokenize)._extract_corpus_statistics(list(hyps), [list(refs)])
    return [[int(x) for x in row] for row in stats]


def bleu_of_stats(stats: Sequence[int]) -> float:
    """Corpus BLEU (sacreBLEU's default exponential smoothing) of summed `sentence_stats`."""
    from sacrebleu.metrics import BLEU

    sys_len, ref_len = int(stats[0]), int(stats[1])
    correct = [int(x) for x in stats[2 : 2 + MAX_ORDER]]
    total = [int(x) for x in stats[2 + MAX_ORDER : 2 + 2 * MAX_ORDER]]
    return BLEU.compute_bleu(correct, total, sys_len, ref_len, smooth_method="exp").score


def paired_bootstrap(
    systems: Sequence[Sequence[Sequence[int]]], resamples: int = 1000, seed: int = 12345
) -> list[list[float]]:
    """Corpus BLEU of each system on the same `resamples` resamples of the sentences (drawn
    with replacement, the same draw for every system: paired, Koehn 2004), from each system's
    `sentence_stats` of one test set. Returns one list of `resamples` scores per system; the
    spread of two systems' differences is the noise of comparing them on this set."""
    import numpy as np

    arrays = [np.asarray(s, dtype=np.int64) for s in systems]
    if not arrays:
        return []
    n = len(arrays[0])
    if n == 0 or any(a.shape != arrays[0].shape for a in arrays):
        raise ValueError("paired_bootstrap: every system needs stats for the same sentences")
    rng = np.random.default_rng(seed)
    # how often each sentence is drawn in each resample: (resamples, n) @ (n, 10) sums them
    counts = rng.multinomial(n, np.full(n, 1.0 / n), size=resamples)
    return [[bleu_of_stats(row) for row in counts @ a] for a in arrays]


def tokenized_bleu_lc(hyps: Sequence[str], refs: Sequence[str], lang: str) -> BleuResult:
    """The multimodal-translation literature's Multi30k metric: lowercase, Moses-tokenize both
    sides (no compound splitting), multi-bleu.perl (e.g. Wu et al. 2021's text-only baselines)."""
    _check(hyps, refs)
    res = multi_bleu(moses_tokenize(hyps, lang), moses_tokenize(refs, lang), lowercase=True)
    import sacremoses

    res.signature = f"tok:moses-{lang}(sacremoses {sacremoses.__version__})|lc|multi-bleu.perl"
    return res


def corpus_chrf(hyps: Sequence[str], refs: Sequence[str]) -> ChrfResult:
    """sacreBLEU's chrF (character n-gram F-score, β = 2) with its signature."""
    from sacrebleu.metrics import CHRF

    _check(hyps, refs)
    metric = CHRF()
    res = metric.corpus_score(list(hyps), [list(refs)])
    return ChrfResult(score=res.score, signature=str(metric.get_signature()))


def _ngrams(words: list[str], n: int) -> Counter:
    return Counter(tuple(words[i : i + n]) for i in range(len(words) - n + 1))


def multi_bleu(hyps: Sequence[str], refs: Sequence[str], lowercase: bool = False) -> BleuResult:
    """Moses multi-bleu.perl on already tokenized text: words split on whitespace, n-gram
    counts clipped by the reference, brevity penalty exp(1 - r/c) when c < r, no smoothing
    (any zero n-gram precision makes BLEU 0), one reference per line.
    """
    _check(hyps, refs)
    correct, total = [0] * MAX_ORDER, [0] * MAX_ORDER
    hyp_len = ref_len = 0
    for hyp, ref in zip(hyps, refs, strict=True):
        if lowercase:
            hyp, ref = hyp.lower(), ref.lower()
        h, r = hyp.split(), ref.split()
        hyp_len, ref_len = hyp_len + len(h), ref_len + len(r)
        for n in range(1, MAX_ORDER + 1):
            h_counts, r_counts = _ngrams(h, n), _ngrams(r, n)
            total[n - 1] += sum(h_counts.values())
            correct[n - 1] += sum(min(c, r_counts[g]) for g, c in h_counts.items())
    precisions = [c / t if t else 0.0 for c, t in zip(correct, total, strict=True)]
    if hyp_len == 0 or ref_len == 0:
        bp, score = 0.0, 0.0
    else:
        bp = 1.0 if hyp_len >= ref_len else math.exp(1.0 - ref_len / hyp_len)
        if min(precisions) == 0.0:
            score = 0.0  # multi-bleu.perl: log(0) is taken as -9999999999
        else:
            score = 100.0 * bp * math.exp(sum(math.log(p) for p in precisions) / MAX_ORDER)
    return BleuResult(
        score=score,
        signature="multi-bleu.perl" + ("|lc" if lowercase else ""),
        precisions=[100.0 * p for p in precisions],
        brevity_penalty=bp,
        hyp_len=hyp_len,
        ref_len=ref_len,
    )


def split_compounds(text: str) -> str:
    """tensor2tensor's compound splitting of tokenized German: a-b -> a ##AT##-##AT## b.

    Matches do not overlap, exactly as perl's s///g: "a-b-c" -> "a ##AT##-##AT## b-c".
    """
    return _COMPOUND.sub(r"\1 ##AT##-##AT## \2", text)


def moses_tokenize(lines: Sequence[str], lang: str) -> list[str]:
    """Moses tokenizer.perl -l LANG (default escaping, as tensor2tensor ran it) via sacremoses."""
    try:
        from sacremoses import MosesTokenizer
    except ImportError as e:
        raise UserError(
            "the paper's tokenized BLEU needs sacremoses: pip install 'transformer[paper-bleu]'"
        ) from e
    tok = MosesTokenizer(lang=lang)
    prefixes = tok.handles_nonbreaking_prefixes
    # tokenizer.perl (mosesdecoder 34452895f, the reference in tests) splits the period off the
    # last word of a line whatever the word ("am 27. und 28." -> "28 ."); sacremoses (0.2.0) keeps
    # it when the word is a non-breaking prefix. Same stage of the pipeline, same rule.
    tok.handles_nonbreaking_prefixes = lambda text: _split_last_period(prefixes(text))
    return [tok.tokenize(line, return_str=True, escape=True) for line in lines]


def _split_last_period(text: str) -> str:
    words = text.split()
    if words and (m := re.match(r"^(\S+)\.$", words[-1])):
        words[-1] = m.group(1) + " ."
    return " ".join(words)


def tokenized_bleu_compound_split(
    hyps: Sequence[str], refs: Sequence[str], lang: str = "de"
) -> BleuResult:
    """The paper's En-De metric: Moses-tokenize, split compounds, multi-bleu.perl
    (get_ende_bleu.sh).

    Args:
        hyps: detokenized system outputs; refs: detokenized references (both get tokenized).
        lang: the Moses tokenizer's language (the recipe is for German, "de").
    """
    return _paper_bleu(hyps, refs, lang, split=True)


def paper_bleu(hyps: Sequence[str], refs: Sequence[str], lang: str) -> BleuResult:
    """§6.1 the paper's metric for a target language: Moses `tokenizer.perl -l LANG` on both
    sides, then multi-bleu.perl; German compounds are split first (get_ende_bleu.sh), French
    and every other language are not.

    Args:
        hyps: detokenized system outputs; refs: detokenized references (both get tokenized).
        lang: the target language ("de" splits compounds).
    """
    return _paper_bleu(hyps, refs, lang, split=lang == "de")


def _paper_bleu(hyps: Sequence[str], refs: Sequence[str], lang: str, split: bool) -> BleuResult:
    _check(hyps, refs)
    tok_hyps, tok_refs = moses_tokenize(hyps, lang), moses_tokenize(refs, lang)
    if split:
        tok_hyps = [split_compounds(x) for x in tok_hyps]
        tok_refs = [split_compounds(x) for x in tok_refs]
    res = multi_bleu(tok_hyps, tok_refs)
    import sacremoses

    res.signature = (
        f"tok:moses-{lang}(sacremoses {sacremoses.__version__})"
        + ("|split:##AT##" if split else "")
        + "|multi-bleu.perl"
    )
    return res


# Marks that detokenized text never holds but Moses-tokenized corpora do: the Stanford release's
# hyphen split, Moses' aggressive hyphen split and its XML escapes of quotes.
_TOKENIZED_MARKS = ("##AT##-##AT##", " @-@ ", "&quot;", "&apos;")
_FINAL_PUNCT = re.compile(r"\S(\s?)[.!?]['\"»“”]?\s*$")


def tokenized_reason(lines: Sequence[str], punctuation: bool = True) -> str | None:
    """Why `lines` look Moses-tokenized, or None when they look like detokenized text.

    Tokenized: a mark above on at least 1% of the lines, or (with `punctuation`) a space before
    the final full stop (question or exclamation mark) on at least half of the lines that end in
    one. On the raw newstest2014 German reference 2 of ~2,700 such lines have the space; on the
    tokenized newstest2013 (Stanford release) 2,622 of 3,000 have it.
    """
    marked = sum(any(m in line for m in _TOKENIZED_MARKS) for line in lines)
    if lines and marked >= max(1, len(lines) // 100):
        mark = next(m for m in _TOKENIZED_MARKS if any(m in line for line in lines))
        return f"{marked} of {len(lines)} lines hold Moses tokenizer marks such as {mark.strip()!r}"
    if not punctuation:
        return None
    spaced = ended = 0
    for line in lines:
        m = _FINAL_PUNCT.search(line)
        if m is not None:
            ended += 1
            spaced += m.group(1) != ""
    if ended and spaced * 2 >= ended:
        return f"{spaced} of {ended} sentence-final punctuation marks are split off by a space"
    return None


def check_detokenized(
    hyps: Sequence[str],
    refs: Sequence[str],
    hyp_name: str,
    ref_name: str,
    hyp_punctuation: bool = True,
) -> bool:
    """Refuse to score tokenized text against raw text (or the reverse): sacreBLEU and the
    paper's metric would then tokenize twice, and `##AT##-##AT##` alone becomes many tokens.

    hyp_punctuation: False judges the hypotheses by the Moses marks only (`tokenized_reason`),
        for a model's own output: an under-trained model can put a space before a final period
        without having been trained on tokenized text.

    Returns:
        True when both sides look tokenized (the caller must detokenize or refuse), else False.

    Raises:
        UserError: one side looks tokenized and the other does not, naming both files.
    """
    hyp_why, ref_why = tokenized_reason(hyps, hyp_punctuation), tokenized_reason(refs)
    if (hyp_why is None) != (ref_why is None):
        tok, raw, why = (
            (hyp_name, ref_name, hyp_why) if hyp_why is not None else (ref_name, hyp_name, ref_why)
        )
        raise UserError(
            f"{tok} looks tokenized ({why}) but {raw} does not: score detokenized output "
            "against raw references (Moses detokenizer first, or raw references)"
        )
    return hyp_why is not None


def moses_detokenize(lines: Sequence[str], lang: str) -> list[str]:
    """Undo Moses tokenization (the Stanford WMT14 release's text): `##AT##-##AT##` back to a
    hyphen, then Moses `detokenizer.perl -l LANG` (which also unescapes `&quot;` etc.)."""
    from sacremoses import MosesDetokenizer

    detok = MosesDetokenizer(lang=lang)
    return [
        detok.detokenize(line.replace(" ##AT##-##AT## ", "-").split(), return_str=True)
        for line in lines
    ]


@dataclass
class ScoreReport:
    """`transformer score`: every metric of one hypothesis file against its references."""

    hyp_path: str
    ref_path: str
    lang: str
    lines: int
    sacrebleu: BleuResult
    chrf: ChrfResult
    paper: BleuResult

    def as_dict(self) -> dict:
        def bleu(r: BleuResult) -> dict:
            return {
                "score": r.score,
                "signature": r.signature,
                "precisions": r.precisions,
                "brevity_penalty": r.brevity_penalty,
                "hyp_len": r.hyp_len,
                "ref_len": r.ref_len,
            }

        return {
            "hyp": self.hyp_path,
            "ref": self.ref_path,
            "lang": self.lang,
            "lines": self.lines,
            "sacrebleu": bleu(self.sacrebleu),
            "chrf": {"score": self.chrf.score, "signature": self.chrf.signature},
            "paper": bleu(self.paper),
        }


def _read_text(path: str | Path) -> list[str]:
    from transformer.data import DataError, read_lines

    lines = list(read_lines(path))
    if not lines or not any(line.strip() for line in lines):
        raise DataError(path, "empty file: nothing to score")
    return lines


def score_files(hyp_path: str | Path, ref_path: str | Path, lang: str) -> ScoreReport:
    """Score a detokenized hypothesis file against its raw references: sacreBLEU (13a) and chrF
    with their signatures, and the paper's metric for target language `lang` (`paper_bleu`).

    Raises:
        UserError: a file is missing, empty or not UTF-8 (file and line), the line counts differ
            (both files and counts), or either side looks tokenized (`check_detokenized`).
    """
    for path in (hyp_path, ref_path):
        if not Path(path).is_file():
            raise UserError(f"{path}: no such file")
    hyps, refs = _read_text(hyp_path), _read_text(ref_path)
    if len(hyps) != len(refs):
        raise UserError(
            f"{hyp_path} has {len(hyps)} lines but {ref_path} has {len(refs)}: "
            "line i of the hypotheses must translate line i of the references"
        )
    if check_detokenized(hyps, refs, str(hyp_path), str(ref_path)):
        raise UserError(
            f"{hyp_path} and {ref_path} both look tokenized: `score` takes detokenized output "
            "and raw references (the paper's metric tokenizes them itself)"
        )
    return ScoreReport(
        hyp_path=str(hyp_path),
        ref_path=str(ref_path),
        lang=lang,
        lines=len(hyps),
        sacrebleu=corpus_bleu(hyps, refs),
        chrf=corpus_chrf(hyps, refs),
        paper=paper_bleu(hyps, refs, lang),
    )
