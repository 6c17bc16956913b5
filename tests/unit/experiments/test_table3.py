"""§6.2 Table 3 sweep: the row-scaling mapping, the report, and a tiny end-to-end sweep."""

from __future__ import annotations

import csv

import pytest

from transformer.config import RunConfig, build_config
from transformer.errors import UserError
from transformer.experiments.table3 import (
    PAPER_TABLE3,
    ROWS,
    SCALES,
    RowResult,
    row_config,
    run_table3,
    scale_row,
    write_report,
)

# Table 3 as printed (N, d_model, d_ff, h, d_k, d_v, P_drop, eps_ls; blank = base), the
# reference the relative rules of config.TABLE3_ROWS must reproduce on the paper's base.
PAPER_ROWS = {
    "base": (6, 512, 2048, 8, 64, 64, 0.1, 0.1),
    "A1": (6, 512, 2048, 1, 512, 512, 0.1, 0.1),
    "A2": (6, 512, 2048, 4, 128, 128, 0.1, 0.1),
    "A3": (6, 512, 2048, 16, 32, 32, 0.1, 0.1),
    "A4": (6, 512, 2048, 32, 16, 16, 0.1, 0.1),
    "B1": (6, 512, 2048, 8, 16, 64, 0.1, 0.1),
    "B2": (6, 512, 2048, 8, 32, 64, 0.1, 0.1),
    "C1": (2, 512, 2048, 8, 64, 64, 0.1, 0.1),
    "C2": (4, 512, 2048, 8, 64, 64, 0.1, 0.1),
    "C3": (8, 512, 2048, 8, 64, 64, 0.1, 0.1),
    "C4": (6, 256, 2048, 8, 32, 32, 0.1, 0.1),
    "C5": (6, 1024, 2048, 8, 128, 128, 0.1, 0.1),
    "C6": (6, 512, 1024, 8, 64, 64, 0.1, 0.1),
    "C7": (6, 512, 4096, 8, 64, 64, 0.1, 0.1),
    "D1": (6, 512, 2048, 8, 64, 64, 0.0, 0.1),
    "D2": (6, 512, 2048, 8, 64, 64, 0.2, 0.1),
    "D3": (6, 512, 2048, 8, 64, 64, 0.1, 0.0),
    "D4": (6, 512, 2048, 8, 64, 64, 0.1, 0.2),
    "E": (6, 512, 2048, 8, 64, 64, 0.1, 0.1),
    "big": (6, 1024, 4096, 16, 64, 64, 0.3, 0.1),
}


@pytest.mark.parametrize("row", ROWS)
def test_presets_and_rows_on_the_paper_base_are_the_paper_rows(row: str) -> None:
    for cfg in (build_config(row), row_config(row, RunConfig())):
        m = cfg.model
        got = (m.n_layers, m.d_model, m.d_ff, m.n_heads, m.d_k, m.d_v, m.p_drop, cfg.train.eps_ls)
        assert got == PAPER_ROWS[row], row
        assert m.learned_pos == (row == "E")
    assert set(PAPER_ROWS) == set(ROWS)


def test_rows_on_cpu_small_scale_relatively() -> None:
    small = build_config("cpu-small").model  # N 3, d_model 256, d_ff 1024, h 4, d_k = d_v = 64
    assert (small.n_layers, small.d_model, small.d_ff, small.n_heads, small.d_k) == (
        3, 256, 1024, 4, 64,
    )  # fmt: skip
    expected = {
        "A1": {"n_heads": 1, "d_k": 256, "d_v": 256},  # one head of d_model
        "A2": {"n_heads": 2, "d_k": 128, "d_v": 128},
        "A3": {"n_heads": 8, "d_k": 32, "d_v": 32},  # h x2, d_k / 2
        "A4": {"n_heads": 16, "d_k": 16, "d_v": 16},
        "B1": {"d_k": 16},  # d_k / 4
        "B2": {"d_k": 32},
        "C1": {"n_layers": 1},  # N x 2/6
        "C2": {"n_layers": 2},  # N x 4/6
        "C3": {"n_layers": 4},  # N x 8/6
        "C4": {"d_model": 128, "d_k": 32, "d_v": 32},
        "C5": {"d_model": 512, "d_k": 128, "d_v": 128},
        "C6": {"d_ff": 512},
        "C7": {"d_ff": 2048},
        "D1": {"p_drop": 0.0},
        "D2": {"p_drop": 0.2},
        "D3": {"train.eps_ls": 0.0},
        "D4": {"train.eps_ls": 0.2},
        "E": {"learned_pos": True},
        "big": {"d_model": 512, "d_ff": 2048, "n_heads": 8, "d_k": 64, "d_v": 64, "p_drop": 0.3},
    }
    for row, changes in expected.items():
        assert scale_row(row, small) == changes, row
    assert scale_row("base", small) == {}


def test_row_a_keeps_attention_width() -> None:
    for base in (RunConfig().model, build_config("cpu-small").model):
        for row in ("A1", "A2", "A3", "A4"):
            cfg = row_config(row, RunConfig(model=base)).model
            assert cfg.n_heads * cfg.d_k == base.n_heads * base.d_k, row


def test_unknown_row_is_a_user_error() -> None:
    with pytest.raises(UserError, match="unknown Table 3 row 'F1'"):
        scale_row("F1", RunConfig().model)


def test_sweep_needs_a_budget(tmp_path) -> None:
    with pytest.raises(UserError, match="--budget-steps or --budget-minutes"):
        run_table3(tmp_path, tmp_path / "out", rows=["base"])


def _result(row: str, ppl: float) -> RowResult:
    return RowResult(row, 3, 256, 1024, 4, 64, 64, 0.1, 0.1, "sinusoid", 100, 9_500_000, ppl,
                     12.5, 3000.0, 2.0, 2.5)  # fmt: skip


def test_write_report(tmp_path) -> None:
    results = [_result("base", 9.87), _result("A1", 10.5)]
    write_report(results, tmp_path / "t.md", tmp_path / "t.csv", {"scale": "small"})
    md = (tmp_path / "t.md").read_text()
    assert (
        "| base | 3 | 256 | 1024 | 4 | 64 | 64 | 0.1 | 0.1 | sinusoid | 100 | 9.50 | 9.87 |" in md
    )
    assert "| 4.92 | 25.8 |" in md  # the paper's base row beside ours
    rows = list(csv.DictReader((tmp_path / "t.csv").open()))
    assert [r["row"] for r in rows] == ["base", "A1"]
    assert float(rows[1]["dev_ppl"]) == 10.5
    assert float(rows[1]["paper_bleu"]) == PAPER_TABLE3["A1"][1]


def test_scale_mini_is_the_400_step_sweeps_base() -> None:
    # docs/table3.md: the 400-step sweep ran --scale small with these --set flags; the
    # convergence sweep's base (--scale mini, preset cpu-mini) is the same config.
    flags = ["model.n_layers=3", "model.d_model=128", "model.d_ff=512", "model.d_k=32",
             "model.d_v=32", "train.max_tokens=1500", "train.warmup_steps=200",
             "train.lr_scale=0.25"]  # fmt: skip
    assert build_config("cpu-small", overrides=flags) == build_config(SCALES["mini"])
