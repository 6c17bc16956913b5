"""`transformer sweep table3` end to end on a slice of Multi30k: two rows trained, measured,
reported, and read back instead of retrained."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

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
