"""The CLI front door: subcommands, JSON preset listing, clean user errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from transformer.cli import main
from transformer.config import PRESETS


def test_presets_json_lists_every_preset_with_its_parameter_count(capsys) -> None:
    assert main(["presets", "--vocab-size", "37000", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == list(PRESETS)
    by_name = {r["name"]: r for r in rows}
    assert by_name["base"]["parameters"] == 63_082_496  # the golden count
    assert by_name["big"]["parameters"] == 214_245_376
    assert by_name["A1"]["n_heads"] == 1 and by_name["D3"]["eps_ls"] == 0.0


def test_presets_table(capsys) -> None:
    assert main(["presets", "--vocab-size", "8000"]) == 0
    out = capsys.readouterr().out
    assert "parsing" in out and "cpu-small" in out


def test_user_errors_are_one_clean_line(capsys) -> None:
    assert main(["presets", "--vocab-size", "-1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("transformer presets: error: model.vocab_size")
    assert "Traceback" not in err


def test_python_dash_m_runs_the_same_cli() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "transformer", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "presets" in out


def test_unknown_subcommand_is_an_argparse_error() -> None:
    with pytest.raises(SystemExit) as e:
        main(["frobnicate"])
    assert e.value.code == 2


def test_score_json_holds_sacrebleu_and_paper_scores(tmp_path, capsys) -> None:
    pytest.importorskip("sacremoses")
    (tmp_path / "hyp.de").write_text("Der Mann spielt Computer-Spiele.\n", encoding="utf-8")
    (tmp_path / "ref.de").write_text("Ein Mann spielt Computer-Spiele.\n", encoding="utf-8")
    argv = ["score", str(tmp_path / "hyp.de"), str(tmp_path / "ref.de"), "--lang", "de"]
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["paper"]["score"] == pytest.approx(100 * (3 / 7) ** 0.25)  # test_bleu.py
    assert 0 < report["sacrebleu"]["score"] < 100 and "tok:13a" in report["sacrebleu"]["signature"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "sacreBLEU" in out and "compounds split (paper) 80.91" in out


def test_score_bad_input_is_one_line_naming_the_file(tmp_path, capsys) -> None:
    (tmp_path / "hyp").write_text("a.\nb.\n", encoding="utf-8")
    (tmp_path / "ref").write_text("a.\n", encoding="utf-8")
    assert main(["score", str(tmp_path / "hyp"), str(tmp_path / "ref"), "--lang", "fr"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("transformer score: error: ") and "hyp has 2 lines" in err
    assert "\n" not in err
