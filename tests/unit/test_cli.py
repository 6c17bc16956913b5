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


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from fixtures import make_model_file

    return make_model_file(tmp_path_factory.mktemp("cli_model"))


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--alpha", "nan"], "decode.length_penalty: must be in [0, 10.0], got nan"),
        (["--alpha", "inf"], "decode.length_penalty"),
        (["--alpha", "-1"], "decode.length_penalty"),
        (["--beam", "10000"], "decode.beam_size: must be in [1, 64], got 10000"),
    ],
)
@pytest.mark.parametrize("command", ["translate", "evaluate"])
def test_translate_and_evaluate_bound_the_search_like_the_server(
    command, flags, needle, tiny_model, tmp_path, capsys
) -> None:
    args = [command, str(tiny_model), *flags]
    if command == "evaluate":  # the options are checked before the data is read
        args += ["--data", str(tmp_path / "no-data")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"transformer {command}: error: {needle}"), err
