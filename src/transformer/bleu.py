"""BLEU two ways: sacreBLEU on detokenized text (today's standard, with its signature) and the
paper's tokenized BLEU with German compounds split (tensor2tensor's get_ende_bleu.sh).

The paper's recipe (SPEC §6.1): Moses `tokenizer.perl -l de` on hypotheses and references,
then `perl -ple 's{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g'`, then Moses `multi-bleu.perl`
(tokenized BLEU, closest reference length brevity penalty, no smoothing). `multi_bleu` below is
a line-for-line reimplementation of multi-bleu.perl; the Moses tokenizer comes from
`sacremoses` (a port of tokenizer.perl), an optional extra (`pip install transformer[paper-bleu]`)
imported only here. See docs/decoding.md.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

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


def corpus_bleu(hyps: Sequence[str], refs: Sequence[str], tokenize: str = "13a") -> BleuResult:
    """sacreBLEU on detokenized text (one reference per line), with its signature.

    Args:
        hyps: detokenized system outputs, one per line.
        refs: the references, aligned with `hyps`.
        tokenize: sacreBLEU's tokenizer ("13a" is its default, "intl", "none", ...).
    """
    from sacrebleu.metrics import BLEU

    _check(hyps, refs)
    metric = BLEU(tokenize=tokenize)
    res = metric.corpus_score(list(hyps), [list(refs)])
    return BleuResult(
        score=res.score,
        signature=str(metric.get_signature()),
        precisions=list(res.precisions),
        brevity_penalty=res.bp,
        hyp_len=res.sys_len,
        ref_len=res.ref_len,
    )


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
    return [tok.tokenize(line, return_str=True, escape=True) for line in lines]


def tokenized_bleu_compound_split(
    hyps: Sequence[str], refs: Sequence[str], lang: str = "de"
) -> BleuResult:
    """The paper's metric: Moses-tokenize, split compounds, multi-bleu.perl (get_ende_bleu.sh).

    Args:
        hyps: detokenized system outputs; refs: detokenized references (both get tokenized).
        lang: the Moses tokenizer's language (the recipe is for German, "de").
    """
    _check(hyps, refs)
    tok_hyps = [split_compounds(x) for x in moses_tokenize(hyps, lang)]
    tok_refs = [split_compounds(x) for x in moses_tokenize(refs, lang)]
    res = multi_bleu(tok_hyps, tok_refs)
    import sacremoses

    res.signature = (
        f"tok:moses-{lang}(sacremoses {sacremoses.__version__})|split:##AT##|multi-bleu.perl"
    )
    return res
