"""`recipe --resume`: what the interrupted run already spent of the budget (recipe.py)."""

from __future__ import annotations

import json

from transformer import checkpoint
from transformer.experiments import recipe


def _run(tmp_path, counters: dict, times: list[float]):
    run = tmp_path / "run"
    rows = [{"kind": "train", "step": 100 * (i + 1), "time": t} for i, t in enumerate(times)]
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    checkpoint.save_checkpoint(run, 200, {"step": 200, "counters": counters}, keep_last=5)
    return run


def test_the_checkpoints_training_seconds_count_not_the_days_between(tmp_path):
    # Trained 10 minutes, crashed, resumed a day later for 2 more: 12 minutes spent, not 1 day.
    run = _run(tmp_path, {"step": 200, "seconds": 720.0}, [1000.0, 1000.0 + 86_400 + 60.0])
    assert recipe._trained_minutes(run) == 12.0


def test_a_checkpoint_from_before_the_seconds_were_kept_falls_back_to_the_metrics(tmp_path):
    run = _run(tmp_path, {"step": 200}, [1000.0, 1300.0])
    assert recipe._trained_minutes(run) == 5.0


def test_a_damaged_latest_checkpoint_counts_the_one_resume_falls_back_to(tmp_path):
    run = _run(tmp_path, {"step": 200, "seconds": 720.0}, [1000.0, 1300.0])
    later = checkpoint.save_checkpoint(
        run, 300, {"step": 300, "counters": {"step": 300, "seconds": 900.0}}, keep_last=5
    )
    later.write_bytes(later.read_bytes()[:100])  # truncated since it was written
    assert recipe._trained_minutes(run) == 12.0


def test_nothing_trained_yet_is_no_time(tmp_path):
    assert recipe._trained_minutes(tmp_path / "run") == 0.0
