"""`sweep table3 --converge`: the settings file and its refusals, the sweep's stopping config,
the seed rule as the sweep applies it, and the report (training replaced by synthetic results;
tests/integration/test_table3_sweep.py trains for real)."""

from __future__ import annotations

import csv
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

import transformer.experiments.table3_converge as tc
from transformer.errors import UserError
from transformer.experiments.table3_converge import (
    ConvergeSettings,
    SeedResult,
    prepare_sweep,
    run_converged,
    sweep_base,
)


def _settings(**kw) -> ConvergeSettings:
    return ConvergeSettings(**{"data": "/d", "scale": "tiny", "valid_every": 10, **kw})


def test_a_new_sweep_writes_its_settings_and_refuses_to_start_twice(tmp_path) -> None:
    out = tmp_path / "sweep"
    prepare_sweep(out, _settings(), resume=False)
    saved = json.loads((out / "sweep.json").read_text())
    assert saved["patience"] == 3 and saved["overrides"] == [] and saved["max_epochs"] == 10.0
    with pytest.raises(UserError, match="already holds a sweep .*pass --resume"):
        prepare_sweep(out, _settings(), resume=False)
    prepare_sweep(out, _settings(), resume=True)  # the same settings: fine


def test_resume_with_other_settings_is_refused(tmp_path) -> None:
    out = tmp_path / "sweep"
    prepare_sweep(out, _settings(overrides=("train.max_tokens=600",)), resume=False)
    with pytest.raises(UserError) as e:
        prepare_sweep(out, _settings(patience=5, overrides=("train.max_tokens=600",)), True)
    assert str(e.value) == (
        f"{out / 'sweep.json'}: the sweep was made with patience=3; this command has "
        "patience=5. Resume with the sweep's settings, or start a new --out"
    )
    with pytest.raises(UserError, match="overrides=.*max_tokens=600.*overrides=\\[\\]"):
        prepare_sweep(out, _settings(), True)


def test_resume_needs_a_sweep_and_a_new_sweep_an_empty_directory(tmp_path) -> None:
    with pytest.raises(UserError, match="no sweep to resume \\(sweep.json not found\\)"):
        prepare_sweep(tmp_path / "none", _settings(), resume=True)
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "base").mkdir()  # e.g. a fixed-budget sweep
    with pytest.raises(UserError, match="not empty and not a convergence sweep"):
        prepare_sweep(tmp_path / "old", _settings(), resume=False)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "sweep.json").write_text("[1, 2")
    with pytest.raises(UserError, match="sweep.json: cannot read the sweep's settings"):
        prepare_sweep(tmp_path / "bad", _settings(), resume=True)


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"patience": 0}, "--patience must be at least 1"),
        ({"valid_every": 0}, "--valid-every must be at least 1"),
        ({"max_epochs": 0.0}, "--max-epochs must be positive"),
        ({"seeds": 0}, "--seeds must be at least 1"),
        ({"overrides": ("train.patience=9",)}, "--set train.patience is the sweep's own"),
        ({"overrides": ("train.seed=2",)}, "--set train.seed is the sweep's own"),
    ],
)
def test_bad_settings_are_user_errors(tmp_path, kw, needle) -> None:
    with pytest.raises(UserError, match=needle):
        prepare_sweep(tmp_path / "s", _settings(**kw), resume=False)
    assert not (tmp_path / "s").exists()


def test_sweep_base_stops_on_dev_perplexity_and_keeps_the_best_checkpoint() -> None:
    t = sweep_base(_settings(patience=4, max_epochs=6.5, valid_every=None), 300).train
    assert (t.patience, t.patience_metric, t.max_epochs) == (4, "ppl", 6.5)
    assert t.valid_every_steps == t.save_every_steps == 150  # half an epoch by default
    assert t.keep_last == 5  # the best is at most `patience` validations back
    assert t.max_minutes is None and t.save_every_minutes >= 1e9
    assert sweep_base(_settings(valid_every=7), 300).train.valid_every_steps == 7
    mini = sweep_base(_settings(scale="mini")).model
    assert (mini.n_layers, mini.d_model, mini.d_ff, mini.n_heads, mini.d_k) == (3, 128, 512, 4, 32)


def _fake_result(row: str, seed: int, ppl: float) -> SeedResult:
    return SeedResult(
        row=row, n_layers=3, d_model=128, d_ff=512, n_heads=4, d_k=32, d_v=32, p_drop=0.1,
        eps_ls=0.1, positions="sinusoid", seed=seed, params=2412544, steps=900, epochs=5.0,
        best_step=720, stopped="patience", dev_ppl=ppl, dev_bleu=40 - 2 * ppl,
        last_valid_ppl=ppl + 0.3, train_minutes=3.0, wall_minutes=3.5,
    )  # fmt: skip


# Synthetic first-seed dev PPL per row: base's seeds 10, 11, 12 (mean 11, std 1).
_PPL = {("base", 1): 10.0, ("base", 2): 11.0, ("base", 3): 12.0, ("A1", 1): 12.5,
        ("B1", 1): 14.0, ("E", 1): 9.5, ("A1", 2): 12.0, ("A1", 3): 13.0, ("E", 2): 9.0,
        ("E", 3): 10.0}  # fmt: skip


def _fake_sweep(monkeypatch, calls: list) -> None:
    def fake(row, seed, config, data_dir, run_dir, settings, threads):
        assert config.train.seed == seed and config.train.patience == settings.patience
        calls.append((row, seed))
        run_dir.mkdir(parents=True, exist_ok=True)
        return _fake_result(row, seed, _PPL[row, seed])

    monkeypatch.setattr(tc, "_train_seed", fake)
    monkeypatch.setattr(tc, "_batches_per_epoch", lambda data_dir, settings: 100)


def test_seed_rule_base_first_then_every_first_seed_then_the_extra_seeds(
    tmp_path, monkeypatch
) -> None:
    calls: list = []
    _fake_sweep(monkeypatch, calls)
    out = tmp_path / "sweep"
    results = run_converged(tmp_path, out, _settings(), rows=["E", "A1", "B1"])
    # base always first (its spread decides); B1 (14.0 > 11 + 2) keeps one seed.
    assert calls == [("base", 1), ("base", 2), ("base", 3), ("E", 1), ("A1", 1), ("B1", 1),
                     ("E", 2), ("E", 3), ("A1", 2), ("A1", 3)]  # fmt: skip
    assert [(r.row, r.seed) for r in results][:4] == [("base", 1), ("base", 2), ("base", 3),
                                                      ("A1", 1)]  # fmt: skip
    assert json.loads((out / "E" / "seed2" / "result.json").read_text())["dev_ppl"] == 9.0
    md = (out / "table3.md").read_text()
    assert (
        "| base | 3 | 128 | 512 | 4 | 32 | 32 | 0.1 | 0.1 | sinusoid | 2.41 | 11.00 ± 1.00 "
        "(n=3) | 18.00 ± 2.00 (n=3) | 900 | 5.0 | 720 | patience ×3 | 3.0 | 4.92 | 25.8 |" in md
    )
    assert "| B1 |" in md and "14.00 (n=1)" in md
    assert "## Findings" in md and "- **smaller d_k worse (B): holds** (on dev PPL)" in md
    rows = list(csv.DictReader((out / "table3.csv").open()))
    assert len(rows) == 10 and rows[0]["seed"] == "1" and rows[0]["stopped"] == "patience"
    # Resumed: every seed is read back, nothing is trained again.
    calls.clear()
    again = run_converged(tmp_path, out, _settings(), rows=["E", "A1", "B1"], resume=True)
    assert calls == [] and again == results
    # One seed's result lost: only that one is run again.
    (out / "A1" / "seed3" / "result.json").unlink()
    run_converged(tmp_path, out, _settings(), rows=["E", "A1", "B1"], resume=True)
    assert calls == [("A1", 3)]


def test_one_seed_means_no_extra_seeds(tmp_path, monkeypatch) -> None:
    calls: list = []
    _fake_sweep(monkeypatch, calls)
    run_converged(tmp_path, tmp_path / "s", _settings(seeds=1), rows=["base", "E"])
    assert calls == [("base", 1), ("E", 1)]


def test_unknown_row_is_refused_before_anything_runs(tmp_path) -> None:
    with pytest.raises(UserError, match="unknown Table 3 row 'F'"):
        run_converged(tmp_path, tmp_path / "s", _settings(), rows=["base", "F"])
    assert not (tmp_path / "s").exists()


def test_the_report_covers_rows_run_by_earlier_calls(tmp_path, monkeypatch) -> None:
    calls: list = []
    _fake_sweep(monkeypatch, calls)
    out = tmp_path / "s"
    run_converged(tmp_path, out, _settings(seeds=1), rows=["B1"])
    done = run_converged(tmp_path, out, _settings(seeds=1), rows=["E"], resume=True)
    assert calls == [("base", 1), ("B1", 1), ("E", 1)]
    assert [r.row for r in done] == ["base", "B1", "E"]  # Table 3's order
    assert "| B1 |" in (out / "table3.md").read_text()
    (out / "E" / "seed1" / "result.json").write_text('{"row": "E"')  # damaged
    with pytest.raises(UserError, match="E/seed1/result.json: not a sweep result"):
        run_converged(tmp_path, out, _settings(seeds=1), rows=["E"], resume=True)


def test_a_bad_data_directory_fails_before_the_sweep_is_created(tmp_path) -> None:
    with pytest.raises(UserError, match="no-data"):
        run_converged(tmp_path / "no-data", tmp_path / "s", _settings(), rows=["base"])
    assert not (tmp_path / "s" / "sweep.json").exists()


def _threaded(monkeypatch) -> None:
    """`jobs > 1` with threads for processes: the fake training is visible to the workers."""
    monkeypatch.setattr(tc, "_executor", lambda jobs: ThreadPoolExecutor(jobs))


def test_jobs_run_the_first_seeds_together_then_the_extra_seeds(tmp_path, monkeypatch) -> None:
    calls: list = []
    _fake_sweep(monkeypatch, calls)
    _threaded(monkeypatch)
    out = tmp_path / "sweep"
    results = run_converged(tmp_path, out, _settings(), rows=["E", "A1", "B1"], jobs=4)
    # the same trainings as jobs=1 (test above); the first seeds need not wait for the base
    assert set(calls[:6]) == {("base", 1), ("base", 2), ("base", 3), ("E", 1), ("A1", 1),
                              ("B1", 1)}  # fmt: skip
    assert set(calls[6:]) == {("E", 2), ("E", 3), ("A1", 2), ("A1", 3)} and len(calls) == 10
    sequential = run_converged(tmp_path, tmp_path / "seq", _settings(), rows=["E", "A1", "B1"])
    assert results == sequential  # same results, same order in the report


def test_jobs_hand_each_training_one_thread_unless_told(tmp_path, monkeypatch) -> None:
    seen: list = []

    def fake(row, seed, config, data_dir, run_dir, settings, threads):
        seen.append(threads)
        run_dir.mkdir(parents=True, exist_ok=True)
        return _fake_result(row, seed, _PPL[row, seed])

    monkeypatch.setattr(tc, "_train_seed", fake)
    monkeypatch.setattr(tc, "_batches_per_epoch", lambda data_dir, settings: 100)
    _threaded(monkeypatch)
    run_converged(tmp_path, tmp_path / "a", _settings(seeds=1), rows=["E"], jobs=2)
    run_converged(tmp_path, tmp_path / "b", _settings(seeds=1), rows=["E"], jobs=2, threads=3)
    run_converged(tmp_path, tmp_path / "c", _settings(seeds=1), rows=["E"], threads="auto")
    assert seen == [1, 1, 3, 3, "auto", "auto"]
    with pytest.raises(UserError, match="--jobs must be at least 1, got 0"):
        run_converged(tmp_path, tmp_path / "d", _settings(), rows=["E"], jobs=0)


def test_a_failed_job_stops_the_sweep_and_keeps_what_finished(tmp_path, monkeypatch) -> None:
    started, lock = [], threading.Lock()

    def fake(row, seed, config, data_dir, run_dir, settings, threads):
        with lock:
            started.append((row, seed))
        if (row, seed) == ("A1", 1):
            raise UserError(f"{run_dir}: diverged")
        run_dir.mkdir(parents=True, exist_ok=True)
        return _fake_result(row, seed, _PPL[row, seed])

    monkeypatch.setattr(tc, "_train_seed", fake)
    monkeypatch.setattr(tc, "_batches_per_epoch", lambda data_dir, settings: 100)
    _threaded(monkeypatch)
    out = tmp_path / "sweep"
    with pytest.raises(UserError, match="A1/seed1: diverged"):
        run_converged(tmp_path, out, _settings(), rows=["E", "A1", "B1"], jobs=1 + 1)
    assert ("E", 2) not in started  # no extra seed after a failure
    assert not (out / "A1" / "seed1" / "result.json").exists()
    assert (out / "base" / "seed1" / "result.json").is_file()  # what finished is kept
