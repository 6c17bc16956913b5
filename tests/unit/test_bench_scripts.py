"""benchmarks/bench_step_phases.py and benchmarks/issue19_table.sh: bad input is one clear line
(the script, the problem), exit status 2, before any timing starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _phases(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH / "bench_step_phases.py"), *args],
                          capture_output=True, text=True, timeout=120)  # fmt: skip


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--threads", "0"], "--threads, --batches and --rounds must be at least 1"),
        (["--threads", "1,two"], "--threads: comma-separated thread counts, got '1,two'"),
        (["--batches", "0"], "--threads, --batches and --rounds must be at least 1"),
        (["--warmup", "-1"], "--warmup at least 0"),
    ],
)
def test_step_phases_rejects_bad_counts(tmp_path, args, message):
    out = _phases("--data", str(tmp_path), *args)
    assert out.returncode == 2
    assert message in out.stderr and "Traceback" not in out.stderr


def test_step_phases_names_a_missing_corpus(tmp_path):
    out = _phases("--data", str(tmp_path / "none"))
    assert out.returncode == 2
    assert f"{tmp_path / 'none' / 'manifest.json'}: not found" in out.stderr
    assert "Traceback" not in out.stderr


def _table(qs: Path | None, out: Path | None) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin"} | ({"QS": str(qs)} if qs else {})
    return subprocess.run(["bash", str(BENCH / "issue19_table.sh"), *([str(out)] if out else [])],
                          capture_output=True, text=True, env=env, timeout=60)  # fmt: skip


def test_issue19_table_names_what_is_missing(tmp_path):
    usage = _table(tmp_path, None)
    assert usage.returncode != 0 and "usage: QS=QUICKSTART_OUT" in usage.stderr

    missing = _table(tmp_path, tmp_path / "out")
    assert missing.returncode == 2
    assert f"{tmp_path}/data/manifest.json not found" in missing.stderr

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "manifest.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "quickstart.json").write_text(json.dumps({"bleu": 1.0}))  # no α chosen on val
    no_alpha = _table(tmp_path, tmp_path / "out")
    assert no_alpha.returncode != 0
    assert "quickstart.json: no α chosen on val (KeyError" in no_alpha.stderr
    assert not (tmp_path / "out" / "w0.log").exists()  # stopped before any benchmark ran
