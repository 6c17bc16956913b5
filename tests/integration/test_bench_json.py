"""bench_decode.py --json on a tiny model and real sentences: what issue19_summary.py reads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures import prepare_slice

pytestmark = pytest.mark.integration
BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_bench_decode_writes_runs_changes_and_autos_choice(tmp_path, shared_data, tiny_model_file):
    data = prepare_slice(tmp_path, shared_data / "multi30k", n_train=200, n_valid=12)
    out = tmp_path / "bleu.json"
    done = subprocess.run(
        [sys.executable, str(BENCH / "bench_decode.py"), "--model", str(tiny_model_file),
         "--data", str(data), "--split", "valid", "--dtypes", "fp32,int8", "--beams", "2,1",
         "--alpha", "0.6", "--threads", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    record = json.loads(out.read_text(encoding="utf-8"))
    assert record["split"] == "valid" and record["sentences"] == 12 and record["alpha"] == 0.6
    assert record["auto"] in ("fp32", "bf16", "int8") and record["auto_why"]
    assert f"--dtype auto on this CPU: {record['auto']}" in done.stdout
    runs = {(r["dtype"], r["beam"]): r for r in record["runs"]}
    assert set(runs) == {("fp32", 2), ("fp32", 1), ("int8", 2), ("int8", 1)}
    for (dtype, beam), r in runs.items():  # the printed table's BLEU is the file's
        assert f"| {dtype} | {beam} |" in done.stdout and f"| {r['bleu']:.2f} |" in done.stdout
        assert r["seconds"] > 0 and r["tok_per_s"] > 0
    changes = {(c["dtype"], c["beam"]): c for c in record["changes"]}
    assert set(changes) == {("int8", 2), ("int8", 1)}
    for (dtype, beam), c in changes.items():
        assert c["base"] == "fp32" and 0 <= c["lines_changed"] <= 12
        assert c["bleu_change"] == pytest.approx(
            runs[dtype, beam]["bleu"] - runs["fp32", beam]["bleu"]
        )
        assert c["low"] <= c["high"]
