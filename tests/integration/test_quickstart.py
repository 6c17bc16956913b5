"""`transformer quickstart --smoke`: the README's main job end to end on real Multi30k."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.integration
def test_quickstart_smoke_runs_the_whole_pipeline_and_the_loss_falls(shared_data, tmp_path) -> None:
    out = tmp_path / "qs"
    proc = subprocess.run(
        [sys.executable, "-m", "transformer", "quickstart", "--smoke", "--out", str(out),
         "train.seed=3", "--procs", "2"],
        capture_output=True, text=True, timeout=900,
        env={"TRANSFORMER_DATA": str(shared_data), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "sacreBLEU" in proc.stdout and "nrefs:1|case:mixed" in proc.stdout  # the signature
    assert "wall time" in proc.stdout
    report = json.loads((out / "quickstart.json").read_text())
    assert report["sentences"] == 50 and set(report["stage_seconds"]) == {
        "prepare", "train", "average, int8 by GPTQ, α on val", "translate",
    }  # fmt: skip
    # α chosen on val (50 sentences in a smoke run), test translated with it
    chosen = report["chosen_on_val"]
    assert set(chosen["alphas"]) == {"0.6", "1.0", "1.4"} and chosen["averaged"] == [30, 40]
    assert report["search"]["length_penalty"] == chosen["alpha"]
    assert chosen["alphas"][str(chosen["alpha"])] == max(chosen["alphas"].values())
    assert f"α {chosen['alpha']} (chosen on val)" in proc.stdout
    assert report["train_steps"] == 40
    hyps = (out / "test_2016_flickr.de.hyp").read_text(encoding="utf-8").splitlines()
    assert len(hyps) == 50
    assert Path(report["model"]).is_file()
    # the model file carries GPTQ's int8 weights for both grids; auto decoded with them here
    from transformer.modelfile import load_model
    from transformer.translate import auto_dtype

    assert set(load_model(Path(report["model"])).int8) == {63, 127}
    assert report["dtype"] == auto_dtype("cpu", [63, 127])[0]
    losses = [
        json.loads(line)["loss"]
        for line in (out / "run" / "metrics.jsonl").read_text().splitlines()
        if json.loads(line).get("kind") == "train"
    ]
    assert len(losses) >= 2 and losses[-1] < losses[0]
    # the override and --procs reached the training run (its config, its two processes)
    config = (out / "run" / "config.yaml").read_text()
    assert "seed: 3" in config and "procs: 2" in config
    assert "rank 1 of 2 (gloo)" in proc.stderr


def test_quickstart_rejects_a_bad_override_before_any_work(capsys, tmp_path) -> None:
    from transformer.cli import main

    assert main(["quickstart", "--out", str(tmp_path / "qs"), "train.sede=3"]) == 2
    assert "unknown key train.'sede'" in capsys.readouterr().err
    assert not (tmp_path / "qs").exists()


def test_quickstart_rejects_unknown_languages(capsys) -> None:
    from transformer.cli import main

    assert main(["quickstart", "--src", "en", "--tgt", "xx", "--out", "/nonexistent"]) == 2
    assert "Multi30k has en, de, fr, cs, not 'xx'" in capsys.readouterr().err
    assert main(["quickstart", "--src", "de", "--tgt", "de", "--out", "/nonexistent"]) == 2
