"""§6.2 Table 3 as a command: train the base model and the row A-E variants under one budget;
and the presets table (`transformer presets`: every preset with its parameter count).

`transformer sweep table3 --data PREPARED --out DIR --budget-minutes M --scale small` trains every
row for the same budget, then measures what Table 3 reports: parameters, dev perplexity (per
subword, no label smoothing) and dev BLEU with beam search and no checkpoint averaging (§6.2),
plus tokens/s and wall time. Each row's result is saved in DIR/<row>/result.json, so an
interrupted sweep continues where it stopped. The report goes to DIR/table3.md and .csv.

`--scale` picks the base the rows are applied to: `base` is the paper's base model (the rows are
then exactly the paper's, see `config.PRESETS`); `small` is the `cpu-small` preset, and each row's
change is applied relatively (`scale_row`), so the sweep fits a CPU; `mini` (`cpu-mini`) is the
convergence sweep's base.

`--converge` trains each row to convergence instead, with seeds: `table3_converge.py`.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from transformer.config import (
    PRESETS,
    TABLE3_ROWS,
    RunConfig,
    apply_overrides,
    build_config,
    scale_row,
)
from transformer.errors import UserError

log = logging.getLogger(__name__)

ROWS = tuple(TABLE3_ROWS)  # base, A1 ... E, big: the paper's order


# Table 3 as printed (newstest2013, 100K steps; big 300K): dev PPL, dev BLEU, params (M).
PAPER_TABLE3: dict[str, tuple[float, float, float | None]] = {
    "base": (4.92, 25.8, 65), "A1": (5.29, 24.9, None), "A2": (5.00, 25.5, None),
    "A3": (4.91, 25.8, None), "A4": (5.01, 25.4, None), "B1": (5.16, 25.1, 58),
    "B2": (5.01, 25.4, 60), "C1": (6.11, 23.7, 36), "C2": (5.19, 25.3, 50),
    "C3": (4.88, 25.5, 80), "C4": (5.75, 24.5, 28), "C5": (4.66, 26.0, 168),
    "C6": (5.12, 25.4, 53), "C7": (4.75, 26.2, 90), "D1": (5.77, 24.6, None),
    "D2": (4.95, 25.5, None), "D3": (4.67, 25.3, None), "D4": (5.47, 25.7, None),
    "E": (4.92, 25.7, None), "big": (4.33, 26.4, 213),
}  # fmt: skip

# --scale name -> the preset used as the base; "mini" is the convergence sweep's (--converge)
SCALES = {"base": "base", "small": "cpu-small", "mini": "cpu-mini"}


def row_config(row: str, base: RunConfig) -> RunConfig:
    """The base run config with the row's changes applied."""
    changes = scale_row(row, base.model)
    flat = {(k if "." in k else f"model.{k}"): v for k, v in changes.items()}
    return apply_overrides(base, flat, source=f"Table 3 row {row}")


@dataclass
class RowModel:
    """A row's Table 3 columns: the model and ε_ls (`row_model` fills them from a config)."""

    row: str
    n_layers: int
    d_model: int
    d_ff: int
    n_heads: int
    d_k: int
    d_v: int
    p_drop: float
    eps_ls: float
    positions: str


def row_model(row: str, config: RunConfig) -> dict[str, Any]:
    """The `RowModel` fields of a row trained with `config`."""
    m = config.model
    return {"row": row, "n_layers": m.n_layers, "d_model": m.d_model, "d_ff": m.d_ff,
            "n_heads": m.n_heads, "d_k": m.d_k, "d_v": m.d_v, "p_drop": m.p_drop,
            "eps_ls": config.train.eps_ls,
            "positions": "learned" if m.learned_pos else "sinusoid"}  # fmt: skip


@dataclass
class RowResult(RowModel):
    """One row of the report."""

    steps: int
    params: int
    dev_ppl: float
    dev_bleu: float
    tokens_per_s: float
    train_minutes: float
    wall_minutes: float


def _train_row(row: str, config: RunConfig, data_dir: Path, run_dir: Path, args: dict) -> RowResult:
    """Train one row, then measure it; `args` holds beam, alpha, valid_limit, eval_max_tokens."""
    from transformer import rundir
    from transformer.checkpoint import latest_checkpoint
    from transformer.data import load_prepared
    from transformer.evaluate import evaluate
    from transformer.train import train
    from transformer.trainer import evaluate_loss

    start = time.perf_counter()
    if latest_checkpoint(run_dir) is not None:  # trained, then stopped before being measured
        state = train(None, run_dir, resume=True, progress=False)
    else:
        (run_dir / rundir.METRICS).unlink(missing_ok=True)  # an interrupted attempt's lines
        state = train(data_dir, run_dir, config, progress=False)
    wall = time.perf_counter() - start
    totals = rundir.training_totals(run_dir)
    loaded = rundir.resolve_model(run_dir)  # the latest checkpoint: no averaging (§6.2)
    valid = load_prepared(data_dir).split("valid")
    ppl = evaluate_loss(loaded.model, valid, args["eval_max_tokens"])["ppl"]
    report = evaluate(run_dir, data_dir, "valid", args["beam"], args["alpha"],
                      limit=args["valid_limit"])  # fmt: skip
    return RowResult(
        **row_model(row, loaded.config), steps=state.step,
        params=loaded.model.num_parameters(), dev_ppl=ppl, dev_bleu=float(report["bleu"]),
        tokens_per_s=totals["tgt_tokens"] / max(totals["elapsed_s"], 1e-9),
        train_minutes=totals["elapsed_s"] / 60, wall_minutes=wall / 60,
    )  # fmt: skip


def run_table3(
    data_dir: Path,
    out_dir: Path,
    rows: Sequence[str] = ROWS,
    scale: str = "small",
    budget_steps: int | None = None,
    budget_minutes: float | None = None,
    overrides: Sequence[str] = (),
    beam_size: int = 4,
    length_penalty: float = 0.6,
    valid_limit: int | None = None,
) -> list[RowResult]:
    """`transformer sweep table3`: train and measure each row; write table3.md and table3.csv.

    Args:
        data_dir: a prepared-data directory with train and valid splits.
        out_dir: one run directory per row, the per-row result.json and the reports.
        rows: Table 3 rows to run (`ROWS`), in this order.
        scale: "base" (the paper's sizes), "small" (cpu-small) or any preset name as the base.
        budget_steps, budget_minutes: the same training budget for every row (at least one).
        overrides: `section.key=value` applied to the base before each row's change.
        beam_size, length_penalty: dev BLEU decoding (§6.1: 4 and 0.6).
        valid_limit: score only the first N dev sentences (perplexity uses all).

    Returns:
        One result per row.
    """
    if budget_steps is None and budget_minutes is None:
        raise UserError("sweep: give --budget-steps or --budget-minutes (the same for each row)")
    base = build_config(SCALES.get(scale, scale), overrides=list(overrides))
    budget = {"train.max_steps": budget_steps or 10**9, "train.max_minutes": budget_minutes,
              "train.valid_every_steps": 10**9, "train.save_every_minutes": 10**6,
              "train.keep_last": 1}  # fmt: skip
    base = apply_overrides(base, budget, source="sweep budget")
    out_dir = Path(out_dir)
    args = {"beam": beam_size, "alpha": length_penalty, "valid_limit": valid_limit,
            "eval_max_tokens": base.train.max_tokens}  # fmt: skip
    results = []
    for row in rows:
        config = row_config(row, base)
        run_dir = out_dir / row
        done = run_dir / "result.json"
        if done.is_file():
            log.info("row %s: already done, reading %s", row, done)
            results.append(RowResult(**json.loads(done.read_text(encoding="utf-8"))))
            continue
        log.info("row %s: %s", row, scale_row(row, base.model) or "the base model")
        result = _train_row(row, config, Path(data_dir), run_dir, args)
        done.write_text(json.dumps(asdict(result), indent=1), encoding="utf-8")
        log.info("row %s: dev PPL %.2f, dev BLEU %.2f", row, result.dev_ppl, result.dev_bleu)
        results.append(result)
    settings = {"data": str(data_dir), "scale": scale, "budget_steps": budget_steps,
                "budget_minutes": budget_minutes, "overrides": list(overrides), "beam": beam_size,
                "alpha": length_penalty, "valid_limit": valid_limit}  # fmt: skip
    write_report(results, out_dir / "table3.md", out_dir / "table3.csv", settings)
    return results


_COLUMNS = ["row", "n_layers", "d_model", "d_ff", "n_heads", "d_k", "d_v", "p_drop", "eps_ls",
            "positions", "steps", "params", "dev_ppl", "dev_bleu", "tokens_per_s",
            "train_minutes", "wall_minutes"]  # fmt: skip
_HEADER = ["row", "N", "d_model", "d_ff", "h", "d_k", "d_v", "P_drop", "ε_ls", "positions",
           "steps", "params (M)", "dev PPL", "dev BLEU", "tok/s", "train min", "wall min",
           "paper PPL", "paper BLEU"]  # fmt: skip


def _cells(r: RowResult) -> list[str]:
    paper = PAPER_TABLE3.get(r.row, (math.nan, math.nan, None))
    return [r.row, str(r.n_layers), str(r.d_model), str(r.d_ff), str(r.n_heads), str(r.d_k),
            str(r.d_v), f"{r.p_drop:g}", f"{r.eps_ls:g}", r.positions, str(r.steps),
            f"{r.params / 1e6:.2f}", f"{r.dev_ppl:.2f}", f"{r.dev_bleu:.2f}",
            f"{r.tokens_per_s:.0f}", f"{r.train_minutes:.1f}", f"{r.wall_minutes:.1f}",
            f"{paper[0]:.2f}", f"{paper[1]:.1f}"]  # fmt: skip


def write_report(results: Sequence[RowResult], md_path: Path, csv_path: Path, settings: dict):
    """Table 3 shaped report: markdown (with the paper's PPL and BLEU beside ours) and CSV."""
    lines = ["# Table 3 sweep", "", "Settings: " + ", ".join(f"{k}={v}" for k, v in
             settings.items()), "",  # fmt: skip
             "| " + " | ".join(_HEADER) + " |", "|" + "---|" * len(_HEADER)]  # fmt: skip
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in results]
    Path(md_path).write_text("\n".join(lines) + "\n", encoding="utf-8")
    write_csv(results, csv_path, _COLUMNS)


def write_csv(results: Sequence[RowModel], path: Path, columns: Sequence[str]) -> None:
    """One line per result: its `columns`, then the paper's dev PPL and BLEU for its row."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow([*columns, "paper_ppl", "paper_bleu"])
        for r in results:
            paper = PAPER_TABLE3.get(r.row, (None, None, None))
            writer.writerow([getattr(r, c) for c in columns] + [paper[0], paper[1]])


# ---------------------------------------------------------------- `transformer presets`


def count_parameters(model_cfg) -> int:
    """Parameters of the model a config describes, counted by building it on the meta device."""
    import torch

    from transformer.model import Transformer

    with torch.device("meta"):
        return Transformer(model_cfg).num_parameters()


def describe_presets(vocab_size: int) -> list[dict[str, Any]]:
    """One dict per preset: name, parameters at this vocabulary size, every model and train value
    that the preset sets."""
    rows = []
    for name in PRESETS:
        cfg = build_config(name, vocab_size=vocab_size)
        row: dict[str, Any] = {"name": name, "parameters": count_parameters(cfg.model)}
        row.update(asdict(cfg.model))
        row.update({k: getattr(cfg.train, k) for k in ("eps_ls", "max_steps", "warmup_steps")})
        rows.append(row)
    return rows
