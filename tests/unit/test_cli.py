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


def test_the_commands_that_make_no_tensors_start_without_torch(tmp_path) -> None:
    """The parser (`--help`, a bad flag), `prepare` and `score` import no torch: its ~2 s of
    imports were most of `transformer --help`'s 2.4 s on a Zen 3 (docs/performance.md, "Round
    sixty-one"). In a process of its own: this one has torch already."""
    from fixtures import multi30k_lines

    en, de = multi30k_lines("train", "en", 300), multi30k_lines("train", "de", 300)
    for name, lines in (("train.en", en), ("train.de", de), ("hyp", de[:5]), ("ref", de[:5])):
        (tmp_path / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    t = str(tmp_path)
    code = f"""
import sys
from transformer.cli import main
assert main(["prepare", "custom", "--src", "en", "--tgt", "de", "--out", {t!r} + "/data",
             "--train", {t!r} + "/train.en", {t!r} + "/train.de", "--valid", {t!r} + "/train.en",
             {t!r} + "/train.de", "--vocab-size", "400",
             "--threads", "1"]) == 0
assert main(["score", {t!r} + "/hyp", {t!r} + "/ref", "--lang", "de"]) == 0
try:
    main(["--help"])
except SystemExit as e:
    assert e.code == 0
print(sorted(name for name in sys.modules if name.split(".")[0] == "torch"))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "data" / "manifest.json").is_file()
    assert done.stdout.splitlines()[-1] == "[]"


def test_the_program_sets_its_imports_aside_from_the_cycle_collector(monkeypatch, capsys):
    """`transformer ...` (argv from sys.argv) freezes what the imports made; a caller's
    main([...]) leaves its own process's collector alone."""
    import gc

    frozen = []
    monkeypatch.setattr(gc, "freeze", lambda: frozen.append(True))
    assert main(["presets", "--vocab-size", "8000"]) == 0
    assert frozen == []
    monkeypatch.setattr(sys, "argv", ["transformer", "presets", "--vocab-size", "8000"])
    assert main() == 0
    assert frozen == [True]
    assert "base" in capsys.readouterr().out


def test_ctrl_c_while_the_parser_loads_is_one_line(monkeypatch, capsys) -> None:
    """Building the parser imports torch (~0.5 s): a Ctrl-C then was a traceback."""
    import transformer.cli as cli

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert main(["presets"]) == 130
    assert capsys.readouterr().err == "transformer: interrupted\n"


def test_unknown_subcommand_is_an_argparse_error() -> None:
    with pytest.raises(SystemExit) as e:
        main(["frobnicate"])
    assert e.value.code == 2


# --- ordinary mistakes are one line and exit 2, never a traceback --------------------------


def _naming(command: str, missing: str) -> list[str]:
    """A command and its first arguments, naming the file `missing`."""
    return [command, "custom", "--src", missing] if command == "prepare" else [command, missing]


@pytest.mark.parametrize(
    "command", ["translate", "train", "evaluate", "serve", "parse", "quantize", "prepare"]
)
@pytest.mark.parametrize("count", ["0", "-2"])
def test_threads_below_one_is_refused_before_anything_loads(tmp_path, capsys, command, count):
    """--threads 0 was said only after the model (or corpus) had been read."""
    missing = str(tmp_path / "nothing")
    with pytest.raises(SystemExit) as e:
        main([*_naming(command, missing), "--threads", count])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"--threads: at least 1 (or auto), not {count}" in err and "nothing" not in err


@pytest.mark.parametrize(
    "command", ["translate", "train", "evaluate", "serve", "parse", "quantize", "prepare"]
)
def test_threads_past_the_ceiling_is_refused_before_anything_loads(tmp_path, capsys, command):
    """--threads 99999 started threads until the process's limit, then the tokenizer's own
    thread failed: a traceback after the model had loaded."""
    missing = str(tmp_path / "nothing")
    with pytest.raises(SystemExit) as e:
        main([*_naming(command, missing), "--threads", "99999"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--threads: at most 1024 (this machine has" in err and "not 99999" in err
    assert "nothing" not in err and "Traceback" not in err


def _run(shell: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-c", f"set -o pipefail; {shell}"], capture_output=True, text=True, timeout=120
    )


def test_stdout_full_or_closed_is_one_line_and_exit_2() -> None:
    cli = f"{sys.executable} -m transformer presets --json"
    for shell, problem in (
        (f"{cli} > /dev/full", "<stdout>: No space left on device"),
        (f"{cli} | head -c0", "<stdout>: Broken pipe"),
    ):
        done = _run(shell)
        assert done.returncode == 2, (shell, done.stderr)
        assert done.stderr == f"transformer presets: error: {problem}\n", shell


def test_a_program_started_without_stdin_stdout_or_stderr_is_one_line_or_runs(
    tiny_model_file, tmp_path
) -> None:
    """`>&-`, `<&-`, `2>&-`: the descriptor is held on /dev/null, so a file the command opens
    cannot take its number; reading the closed stdin or writing the closed stdout is the
    one-line error of a closed pipe; a closed stderr drops the messages. Python gives the
    program None for the stream: each of these once ended in an AttributeError's traceback."""
    cli = f"{sys.executable} -m transformer"
    text = tmp_path / "in.txt"
    text.write_text("A dog runs.\n", encoding="utf-8")
    translate = f"{cli} translate {tiny_model_file} --threads 1"
    score = f"{cli} score {text} {text} --lang de"  # a command that starts without torch
    for shell, problem in (
        (f"{score} >&-", "<stdout>: Bad file descriptor"),
        (f"{translate} <&-", "<stdin>: Bad file descriptor"),
        (f"{translate} < {text} >&-", "<stdout>: Bad file descriptor"),
    ):
        done = _run(shell)
        assert done.returncode == 2, (shell, done.stderr)
        assert done.stderr.splitlines()[-1] == f"transformer {shell.split()[3]}: error: {problem}"
        assert "Traceback" not in done.stderr, shell
    done = _run(f"{cli} translate {tiny_model_file} {text} > {tmp_path / 'out.txt'} 2>&- <&-")
    assert done.returncode == 0 and done.stderr == ""
    assert len((tmp_path / "out.txt").read_text(encoding="utf-8").splitlines()) == 1
    done = _run(f"{score} --json 2>&- <&-")
    assert done.returncode == 0 and json.loads(done.stdout)


def test_a_config_that_is_not_utf8_or_not_yaml_is_one_line(tmp_path, capsys) -> None:
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes(b"# Gr\xfc\xdfe\nmodel:\n  d_model: 16\n")
    argv = ["train", str(tmp_path), "--out", str(tmp_path / "run"), "--config"]
    assert main([*argv, str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"transformer train: error: {bad}: cannot read config: 'utf-8' codec")
    assert err.count("\n") == 1
    assert main([*argv, str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml: cannot read config: No such file" in capsys.readouterr().err


def test_an_os_error_without_a_user_error_is_still_one_line(monkeypatch, capsys) -> None:
    import errno

    import transformer.experiments.table3 as table3

    def denied(vocab_size):
        raise PermissionError(errno.EACCES, "Permission denied", "/root/secret")

    monkeypatch.setattr(table3, "describe_presets", denied)
    assert main(["presets"]) == 2
    assert (
        capsys.readouterr().err == "transformer presets: error: /root/secret: Permission denied\n"
    )


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
    command, flags, needle, tiny_model_file, tmp_path, capsys
) -> None:
    args = [command, str(tiny_model_file), *flags]
    if command == "evaluate":  # the options are checked before the data is read
        args += ["--data", str(tmp_path / "no-data")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"transformer {command}: error: {needle}"), err


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


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        ([], "sweep: give --budget-steps or --budget-minutes (or --converge)"),
        (["--budget-steps", "5", "--resume"], "sweep: --resume only with --converge"),
        (["--budget-steps", "5", "--seeds", "2", "--patience", "1"],
         "sweep: --seeds, --patience only with --converge"),
        (["--converge", "--budget-steps", "5"], "sweep: --converge trains to convergence"),
        (["--converge", "--patience", "0"], "sweep --converge: --patience must be at least 1"),
        (["--converge", "--resume"], "no sweep to resume (sweep.json not found)"),
        (["--converge", "--set", "train.keep_last=2"], "--set train.keep_last is the sweep's"),
    ],
)  # fmt: skip
def test_sweep_flags_are_checked_before_training(flags, needle, tmp_path, capsys) -> None:
    args = ["sweep", "table3", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "o")]
    assert main([*args, *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("transformer sweep: error: ") and needle in err, err
    assert err.count("\n") == 1 and not (tmp_path / "o").exists()


def test_train_runs_itself_again_in_2mb_pages_as_a_program_only(monkeypatch, capsys) -> None:
    """`transformer train` (argv from sys.argv) runs itself again with glibc's heap in 2 MB pages
    (allocator.huge_pages_exec) before anything loads; a caller's main([...]) and the other
    commands never do; where the exec fails it goes on as it is, with one line."""
    import os

    import transformer.cli as cli

    calls = []

    def execve(*args):
        calls.append(args)
        raise OSError("no such interpreter")

    again = ("/py", ["/py", "-m", "transformer", "train", "--help"], {"GLIBC_TUNABLES": "x=1"})
    monkeypatch.setattr(cli, "huge_pages_exec", lambda: again)
    monkeypatch.setattr(os, "execve", execve)
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    monkeypatch.setattr(sys, "argv", ["transformer", "presets", "--vocab-size", "8000"])
    assert main() == 0
    assert calls == []
    monkeypatch.setattr(sys, "argv", ["transformer", "-v", "train", "--help"])
    with pytest.raises(SystemExit):
        main()
    assert calls == [again]
    assert "transformer: 4 KiB pages (no such interpreter)" in capsys.readouterr().err


def test_train_runs_again_with_the_tunable_where_it_gains(tmp_path) -> None:
    """The real exec: the program's code runs a second time, with the tunable in its
    environment, where `huge_pages_exec` finds THP in madvise mode and glibc >= 2.35 (this
    machine); once, unchanged, elsewhere."""
    import os

    from transformer.allocator import huge_pages_exec

    code = (
        "import os, sys; print('run', os.environ.get('GLIBC_TUNABLES'), flush=True); "
        "from transformer.cli import main; sys.argv[0] = 'transformer'; main()"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "TRANSFORMER_MALLOC")}
    done = subprocess.run([sys.executable, "-c", code, "train", "--help"], env=env,
                          capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    runs = [line for line in done.stdout.splitlines() if line.startswith("run ")]
    if huge_pages_exec(env) is not None:
        assert runs == ["run None", "run glibc.malloc.hugetlb=1"]
    else:
        assert runs == ["run None"]
    assert "usage: transformer train" in done.stdout
