"""`transformer sweep table3` end to end on a slice of Multi30k: two rows trained, measured,
reported, and read back instead of retrained."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict

import pytest

from transformer.errors import UserError
from transformer.experiments.table3 import run_table3

pytestmark = pytest.mark.integration


def test_two_row_sweep_end_to_end(shared_data, tmp_path) -> None:
    from transformer.prepare import prepare_corpus

    m30k = shared_data / "multi30k"
    files = {}
    for split, src_name, n in (("train", "train", 400), ("val", "val", 20)):
        pair = []
        for lang in ("en", "de"):
            lines = (m30k / f"{src_name}.{lang}").read_text(encoding="utf-8").splitlines()[:n]
            path = tmp_path / f"{split}.{lang}"
            path.write_text("\n".join(lines) + "\n", encoding="utf-8")
            pair.append(path)
        files[split] = pair
    data = tmp_path / "prepared"
    prepare_corpus("custom", "en", "de", data, train_files=files["train"],
                   valid_files=files["val"], vocab_size=500, num_threads=1)  # fmt: skip
    out = tmp_path / "sweep"
    results = run_table3(data, out, rows=["base", "A1"], scale="tiny", budget_steps=3,
                         overrides=["train.max_tokens=600", "train.dtype=fp32"],
                         valid_limit=5)  # fmt: skip
    assert [r.row for r in results] == ["base", "A1"]
    assert results[1].n_heads == 1 and results[1].d_k == results[0].n_heads * results[0].d_k
    for r in results:
        assert r.steps == 3 and r.params > 0 and r.tokens_per_s > 0
        assert 1.0 < r.dev_ppl < 1000  # about the vocabulary size (500) after 3 steps
        assert 0.0 <= r.dev_bleu <= 100.0
        assert json.loads((out / r.row / "result.json").read_text()) == asdict(r)
    assert (out / "table3.md").is_file() and (out / "table3.csv").is_file()
    # A second call reads the finished rows instead of training them again.
    again = run_table3(data, out, rows=["base", "A1"], scale="tiny", budget_steps=3)
    assert again == results
    # A row trained but not measured (result.json lost) resumes from its checkpoint: no retraining.
    (out / "A1" / "result.json").unlink()
    resumed = run_table3(data, out, rows=["A1"], scale="tiny", budget_steps=3, valid_limit=5)[0]
    assert resumed.steps == 3 and resumed.dev_bleu == results[1].dev_bleu
    assert resumed.dev_ppl == pytest.approx(results[1].dev_ppl, rel=1e-5)  # same weights


def test_two_row_converge_sweep_resumes_after_an_interruption(shared_data, tmp_path,
                                                             monkeypatch) -> None:  # fmt: skip
    """`--converge` end to end: rows trained to their stop (patience or the epoch cap), measured
    on their best checkpoint, reported with the findings; then a seed killed mid-training
    resumes from its checkpoint to the same result as an uninterrupted run."""
    from fixtures import prepare_slice
    from transformer import checkpoint
    from transformer.experiments.table3_converge import ConvergeSettings, run_converged
    from transformer.trainer import Trainer

    data = prepare_slice(tmp_path, shared_data / "multi30k", n_train=200, n_valid=20,
                         vocab_size=400)  # fmt: skip
    settings = ConvergeSettings(
        data=str(data), scale="tiny", valid_every=2, patience=2, max_epochs=3.0, seeds=2,
        valid_limit=5, overrides=("train.max_tokens=600", "train.dtype=fp32",
                                  "train.warmup_steps=4", "train.deterministic=true"),
    )  # fmt: skip
    out = tmp_path / "sweep"
    # two trainings at a time, each in a spawned process (the interrupted run below: in-process)
    results = run_converged(data, out, settings, rows=["base", "E"], threads=1, jobs=2)
    assert [(r.row, r.seed) for r in results][:2] == [("base", 1), ("base", 2)]
    for r in results:
        assert r.stopped in ("patience", "epoch cap") and 0 < r.steps and r.epochs > 0
        assert 0 < r.best_step <= r.steps and r.best_step % 2 == 0
        assert r.stopped == "patience" or r.epochs >= 3.0
        assert 1.0 < r.dev_ppl < 1000 and 0.0 <= r.dev_bleu <= 100.0
        run_dir = out / r.row / f"seed{r.seed}"
        assert (run_dir / "model.safetensors").is_file()  # the measured (best) parameters
        assert len(checkpoint.list_checkpoints(run_dir)) == 1  # the last one kept
    assert results[0].dev_ppl != results[1].dev_ppl  # two seeds, two models
    for r in results:  # the measured parameters are those of the best validation
        valids = [json.loads(line) for line in (out / r.row / f"seed{r.seed}" /
                  "metrics.jsonl").read_text().splitlines() if '"valid"' in line]  # fmt: skip
        best = min(valids, key=lambda v: v["ppl"])
        assert (best["step"], best["ppl"]) == (r.best_step, pytest.approx(r.dev_ppl, rel=1e-6))
        assert r.last_valid_ppl == valids[-1]["ppl"]
    md = (out / "table3.md").read_text()
    assert "## Findings" in md and "learned ≈ sinusoidal positions (E)" in md

    # Interrupted: kill the base's first seed after its second checkpoint, then resume. (One
    # seed: the training of base seed 1 does not depend on how many seeds the sweep has.)
    fresh, one = tmp_path / "again", dataclasses.replace(settings, seeds=1)
    original = Trainer.save

    def killed(self, on_cadence=True):
        path = original(self, on_cadence)
        if self.state.step >= 4:
            raise KeyboardInterrupt
        return path

    monkeypatch.setattr(Trainer, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        run_converged(data, fresh, one, rows=["base"], threads=1)
    assert not (fresh / "base" / "seed1" / "result.json").exists() and results[0].steps > 4
    monkeypatch.setattr(Trainer, "save", original)
    with pytest.raises(UserError, match="already holds a sweep"):
        run_converged(data, fresh, one, rows=["base"], threads=1)
    with pytest.raises(
        UserError, match="the sweep was made with seeds=1; this command has seeds=2"
    ):
        run_converged(data, fresh, settings, rows=["base"], resume=True, threads=1)
    resumed = run_converged(data, fresh, one, rows=["base"], resume=True, threads=1)
    got = [(r.seed, r.steps, r.best_step) for r in resumed]
    assert got == [(1, results[0].steps, results[0].best_step)]
    assert resumed[0].dev_ppl == pytest.approx(results[0].dev_ppl, rel=1e-6)
