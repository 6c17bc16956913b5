"""Table 3's findings checked against results with seed spread: the seed rule, the verdicts and
the report lines, on synthetic numbers."""

from __future__ import annotations

import math

import pytest

from transformer.experiments.table3_findings import (
    CLAIMS,
    Stat,
    combine,
    findings,
    judge,
    needs_more_seeds,
    render,
    stat,
)


def test_stat_is_mean_and_sample_std() -> None:
    s = stat([5.0, 6.0, 7.0])
    assert (s.mean, s.std, s.n) == (6.0, 1.0, 3)  # ddof 1: sqrt(((1 + 0 + 1) / 2))
    assert stat([4.5]) == Stat(4.5, None, 1)
    assert stat([5.0, 6.0, 7.0]).text() == "6.00 ± 1.00 (n=3)"
    assert stat([4.5]).text(1) == "4.5 (n=1)"
    with pytest.raises(ValueError):
        stat([])


def test_seed_rule_is_two_base_standard_deviations() -> None:
    base = [10.0, 11.0, 12.0]  # mean 11, std 1: rows in [9, 13] get more seeds
    assert needs_more_seeds(base, 11.0)
    assert needs_more_seeds(base, 12.99) and needs_more_seeds(base, 9.01)
    assert needs_more_seeds(base, 13.0)  # "within": the boundary counts
    assert not needs_more_seeds(base, 13.01) and not needs_more_seeds(base, 8.9)
    assert not needs_more_seeds([10.0], 10.0)  # one base seed: no spread, no extra seeds
    assert needs_more_seeds([10.0, 10.0], 10.0) and not needs_more_seeds([10.0, 10.0], 10.1)


def test_judge_directions_and_noise() -> None:
    a, b = Stat(6.0, 0.1, 3), Stat(5.5, 0.1, 3)  # se = sqrt(2 * 0.01 / 3) = 0.082
    assert judge(a, b, "ppl", "worse", None) == "holds"  # higher PPL is worse
    assert judge(b, a, "ppl", "worse", None) == "reversed"
    assert judge(b, a, "ppl", "better", None) == "holds"
    assert judge(a, b, "bleu", "worse", None) == "reversed"  # higher BLEU is better
    assert judge(a, b, "ppl", "same", None) == "does not hold"
    close = Stat(5.6, 0.1, 3)  # 0.1 apart < 2 se = 0.163
    assert judge(close, b, "ppl", "worse", None) == "within noise"
    assert judge(close, b, "ppl", "same", None) == "holds"
    # A one-seed row borrows the base's spread: 0.5 apart, se = sqrt(0.3² + 0.3²/3) = 0.35.
    assert judge(Stat(6.0, None, 1), Stat(5.5, 0.3, 3), "ppl", "worse", 0.3) == "within noise"
    assert judge(Stat(6.0, None, 1), Stat(5.5, 0.3, 3), "ppl", "worse", 0.1) == "holds"
    # No spread known at all: any difference counts.
    assert judge(Stat(5.51, None, 1), Stat(5.5, None, 1), "ppl", "worse", None) == "holds"


def test_combine() -> None:
    assert combine([]) == "not measured"
    assert combine(["holds", "holds"]) == "holds"
    assert combine(["holds", "reversed", "holds"]) == "mixed: 2 holds, 1 reversed"


def _stats(ppl: dict[str, tuple[float, float | None, int]]) -> dict[str, dict[str, Stat]]:
    """PPL as given; BLEU = 40 - 2 PPL with the same relative spread (so both agree)."""
    return {
        row: {
            "ppl": Stat(m, s, n),
            "bleu": Stat(40 - 2 * m, None if s is None else 2 * s, n),
        }
        for row, (m, s, n) in ppl.items()
    }


def test_findings_on_a_synthetic_table() -> None:
    stats = _stats({
        "base": (5.0, 0.05, 3), "A1": (5.9, 0.1, 3), "A2": (5.5, 0.1, 3),
        "A3": (5.02, 0.05, 3), "A4": (5.6, None, 1),
        "B1": (5.8, None, 1), "B2": (5.03, 0.05, 3),
        "C1": (6.5, None, 1), "C3": (4.7, None, 1), "C5": (5.4, None, 1),
        "D1": (4.6, None, 1), "E": (5.01, 0.04, 3),
    })  # fmt: skip
    found = {f.claim: f for f in findings(stats)}
    assert [c.name for c in CLAIMS] == list(found)
    single = found["single head worse than the best setting (A1)"]
    assert single.verdict == "holds"
    ppl = [c for c in single.comparisons if c.metric == "ppl"][0]
    assert (ppl.other, ppl.best_of) == ("base", ("base", "A2", "A3", "A4"))  # the lowest PPL
    assert ppl.text() == (
        "PPL A1 5.90 ± 0.10 (n=3) vs best base 5.00 ± 0.05 (n=3): holds"
    )  # fmt: skip
    assert found["too many heads worse (A4, the most heads)"].verdict == "holds"
    # B1 far worse; B2 within the base's noise.
    assert found["smaller d_k worse (B)"].verdict == "mixed: 1 holds, 1 within noise"
    # C1 smaller and worse, C3 bigger and better: hold; C5 bigger but worse: reversed.
    bigger = found["bigger models better (C, big)"]
    assert bigger.verdict == "mixed: 2 holds, 1 reversed"
    assert {c.row for c in bigger.comparisons} == {"C1", "C3", "C5"}  # rows not run: skipped
    assert found["dropout helps (D1: no dropout worse)"].verdict == "reversed"
    assert found["learned ≈ sinusoidal positions (E)"].verdict == "holds"
    lines = render(findings(stats))
    assert lines[0].startswith("- **single head worse than the best setting (A1): holds** (on ")
    assert "BLEU A1 28.2 ± 0.2 (n=3) vs best base 30.0 ± 0.1 (n=3): holds" in lines[0]


def test_findings_with_rows_missing() -> None:
    found = findings(_stats({"base": (5.0, 0.1, 3)}))
    assert all(f.verdict == "not measured" and not f.comparisons for f in found)
    assert render(found)[-1].endswith("rows not in this sweep.")


def test_e_far_from_base_does_not_hold() -> None:
    found = findings(_stats({"base": (5.0, 0.05, 3), "E": (4.5, 0.05, 3)}))
    e = [f for f in found if f.claim.startswith("learned")][0]
    assert e.verdict == "does not hold"
    assert all(math.isfinite(c.row_stat.mean) for c in e.comparisons)
