"""§6.2 Table 3's conclusions, checked against a sweep's results with their seed spread.

The paper reads Table 3 as six findings (§6.2): single-head attention is worse than the best
setting (A); quality also drops off with too many heads (A); reducing the attention key size d_k
hurts (B); bigger models are better (C); dropout is very helpful in avoiding over-fitting (D);
learned positional embeddings give nearly identical results to the sinusoids (E). Each finding
here is a list of comparisons between two rows (or a row and the best of a group), each judged
on dev perplexity and on dev BLEU:

- the difference counts only when it exceeds twice its standard error, sqrt(s_a²/n_a +
  s_b²/n_b), where s is a row's sample standard deviation over its seeds, or the base's when the
  row has one seed (the base's spread is the sweep's measure of seed noise);
- "holds": beyond the noise in the paper's direction; "reversed": beyond it the other way;
  "within noise": neither. For E (≈) "holds" means within the noise.

A finding's verdict is on dev perplexity (the sweep's stopping metric, less noisy than BLEU on
1,014 sentences); BLEU's verdicts are printed beside it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

METRICS = ("ppl", "bleu")  # dev PPL (lower is better) and dev BLEU (higher is better)
_LABEL = {"ppl": "PPL", "bleu": "BLEU"}


@dataclass(frozen=True)
class Stat:
    """A row's measurement over its seeds: mean, sample standard deviation (None for n = 1)."""

    mean: float
    std: float | None
    n: int

    def text(self, digits: int = 2) -> str:
        if self.std is None:
            return f"{self.mean:.{digits}f} (n={self.n})"
        return f"{self.mean:.{digits}f} ± {self.std:.{digits}f} (n={self.n})"


def stat(values: Sequence[float]) -> Stat:
    """Mean and sample standard deviation (ddof 1) of one row's per-seed values."""
    if not values:
        raise ValueError("stat: no values")
    std = statistics.stdev(values) if len(values) > 1 else None
    return Stat(statistics.fmean(values), std, len(values))


def needs_more_seeds(base: Sequence[float], row: float) -> bool:
    """The sweep's seed rule (issue 20): a row whose first seed differs from the base's mean by
    at most two standard deviations of the base's seeds gets as many seeds as the base.
    With fewer than two base seeds there is no spread to judge by: no extra seeds."""
    if len(base) < 2:
        return False
    s = stat(base)
    return abs(row - s.mean) <= 2 * (s.std or 0.0)


@dataclass(frozen=True)
class Comparison:
    """`row` against `other` on one metric, with the paper's expectation and the verdict."""

    metric: str
    row: str
    other: str  # a row name; `best_of` says when it was chosen as the best of a group
    row_stat: Stat
    other_stat: Stat
    expect: str  # "worse", "better" or "same": what the paper says of `row` against `other`
    verdict: str  # "holds", "reversed", "within noise" ("holds"/"does not hold" for "same")
    best_of: tuple[str, ...] = ()

    def text(self) -> str:
        other = f"best {self.other}" if self.best_of else self.other
        digits = 2 if self.metric == "ppl" else 1
        return (
            f"{_LABEL[self.metric]} {self.row} {self.row_stat.text(digits)} vs {other} "
            f"{self.other_stat.text(digits)}: {self.verdict}"
        )


def judge(a: Stat, b: Stat, metric: str, expect: str, noise: float | None) -> str:
    """Verdict of "a is `expect` than b" on `metric`; `noise` is the per-seed standard deviation
    used for a row with one seed (the base's), None if unknown (then any difference counts)."""
    sa = a.std if a.std is not None else noise
    sb = b.std if b.std is not None else noise
    se = math.sqrt((sa or 0.0) ** 2 / a.n + (sb or 0.0) ** 2 / b.n)
    # How much worse a is than b: higher perplexity, lower BLEU.
    worse = (a.mean - b.mean) if metric == "ppl" else (b.mean - a.mean)
    beyond = abs(worse) > 2 * se
    if expect == "same":
        return "does not hold" if beyond else "holds"
    if not beyond:
        return "within noise"
    in_direction = worse > 0 if expect == "worse" else worse < 0
    return "holds" if in_direction else "reversed"


@dataclass(frozen=True)
class Claim:
    """One of the paper's findings as comparisons: (row, expect, reference) where reference is a
    row name or a tuple of rows (the best of them on the metric)."""

    name: str
    comparisons: tuple[tuple[str, str, str | tuple[str, ...]], ...]


CLAIMS = (
    Claim("single head worse than the best setting (A1)",
          (("A1", "worse", ("base", "A2", "A3", "A4")),)),
    Claim("too many heads worse (A4, the most heads)",
          (("A4", "worse", ("base", "A1", "A2", "A3")),)),
    Claim("smaller d_k worse (B)", (("B1", "worse", "base"), ("B2", "worse", "base"))),
    Claim("bigger models better (C, big)",
          (("C1", "worse", "base"), ("C2", "worse", "base"), ("C3", "better", "base"),
           ("C4", "worse", "base"), ("C5", "better", "base"), ("C6", "worse", "base"),
           ("C7", "better", "base"), ("big", "better", "base"))),
    Claim("dropout helps (D1: no dropout worse)", (("D1", "worse", "base"),)),
    Claim("learned ≈ sinusoidal positions (E)", (("E", "same", "base"),)),
)  # fmt: skip


@dataclass(frozen=True)
class Finding:
    claim: str
    verdict: str  # on dev perplexity: see `combine`
    comparisons: tuple[Comparison, ...]


def combine(verdicts: Sequence[str]) -> str:
    """One verdict for a finding from its comparisons' verdicts on one metric."""
    if not verdicts:
        return "not measured"
    if len(set(verdicts)) == 1:
        return verdicts[0]
    counts = {v: verdicts.count(v) for v in dict.fromkeys(verdicts)}
    return "mixed: " + ", ".join(f"{n} {v}" for v, n in counts.items())


def findings(stats: Mapping[str, Mapping[str, Stat]]) -> list[Finding]:
    """Check every claim against `stats` (row -> metric -> Stat); rows not measured are skipped.

    The seed noise for rows with one seed is the base's standard deviation on that metric.
    """
    out = []
    for claim in CLAIMS:
        comparisons = []
        for row, expect, ref in claim.comparisons:
            group = tuple(r for r in (ref if isinstance(ref, tuple) else (ref,)) if r in stats)
            if row not in stats or not group:
                continue
            for metric in METRICS:
                base = stats.get("base", {}).get(metric)
                noise = base.std if base is not None else None
                sign = 1.0 if metric == "ppl" else -1.0  # the best: lowest PPL, highest BLEU
                other = min(group, key=lambda r, m=metric, s=sign: s * stats[r][m].mean)
                verdict = judge(stats[row][metric], stats[other][metric], metric, expect, noise)
                best_of = group if isinstance(ref, tuple) else ()
                pair = (stats[row][metric], stats[other][metric])
                comparisons.append(Comparison(metric, row, other, *pair, expect, verdict, best_of))
        verdict = combine([c.verdict for c in comparisons if c.metric == "ppl"])
        out.append(Finding(claim.name, verdict, tuple(comparisons)))
    return out


def render(found: Sequence[Finding]) -> list[str]:
    """Markdown lines: one bullet per finding, its comparisons on PPL and BLEU beside it."""
    lines = []
    for f in found:
        parts = "; ".join(c.text() for c in f.comparisons) or "rows not in this sweep"
        lines.append(f"- **{f.claim}: {f.verdict}** (on dev PPL). {parts}.")
    return lines
