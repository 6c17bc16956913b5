"""End to end: prepare Multi30k en→de, then `transformer translate` and `transformer evaluate`
as subprocesses on a tiny random model with the prepared subword model."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fixtures import SHARED_DATA, built_once, run_cli
from transformer.config import DecodeConfig, ModelConfig, RunConfig
from transformer.model import Transformer
from transformer.modelfile import save_model
from transformer.translate import Translator

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> tuple[Path, Path]:
    shared = SHARED_DATA / "multi30k"
    if not shared.is_dir():
        pytest.skip(f"Multi30k not found at {shared}")

    def build(folder: Path) -> None:  # once for both xdist workers (fixtures.built_once)
        res = run_cli("prepare", "multi30k", "--src", "en", "--tgt", "de", "--from", str(shared),
                      "--out", str(folder / "en-de"))  # fmt: skip
        assert res.returncode == 0, res.stderr.decode()

    out = built_once(tmp_path_factory, "multi30k-en-de", build) / "en-de"  # read, not changed
    manifest = json.loads((out / "manifest.json").read_text())
    proto = (out / manifest["spm_model"]).read_bytes()
    from transformer.data import load_prepared

    vocab = load_prepared(out).tokenizer.vocab_size
    cfg = RunConfig(
        model=ModelConfig(vocab_size=vocab, n_layers=2, d_model=32, d_ff=64, n_heads=4, d_k=8,
                          d_v=8, p_drop=0.0, max_len=128),
        decode=DecodeConfig(max_len_b=10),
    )  # fmt: skip
    torch.manual_seed(0)
    model_path = save_model(tmp_path_factory.mktemp("model") / "model.safetensors",
                            Transformer(cfg.model).eval(), cfg, proto, "en", "de")  # fmt: skip
    return out, model_path


def test_translate_stdin_keeps_lines_and_order(prepared):
    data, model = prepared
    lines = (data / "test.en.txt").read_text(encoding="utf-8").split("\n")[:5]
    text = "\n".join(lines[:2] + [""] + lines[2:]) + "\n"
    res = run_cli("translate", str(model), "--beam", "4", "--alpha", "0.6", stdin=text.encode())
    assert res.returncode == 0, res.stderr.decode()
    out = res.stdout.decode("utf-8").split("\n")
    assert len(out) == 7 and out[2] == "" and out[-1] == ""
    alone = run_cli("translate", str(model), stdin=(lines[3] + "\n").encode())
    assert alone.stdout.decode("utf-8") == out[4] + "\n"  # same output when batched


def test_translate_invalid_utf8_names_the_line(prepared):
    _, model = prepared
    res = run_cli("translate", str(model), stdin=b"A dog.\n\xff\xfe\n")
    assert res.returncode == 2
    assert "<stdin>:2: invalid UTF-8" in res.stderr.decode()


def test_translate_answers_each_line_of_a_pipe_as_it_comes(prepared):
    # A user typing, or a program that sends a line and waits: before, nothing came out until
    # the input ended. The answers are those of the whole input at once.
    data, model = prepared
    lines = (data / "test.en.txt").read_text(encoding="utf-8").split("\n")[:3]
    whole = Translator.from_path(model, dtype="auto").translate_lines(lines)  # the CLI's dtype
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "transformer", "translate", str(model)]
    with subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, env=env) as proc:  # fmt: skip
        answers = []
        for line in lines:
            proc.stdin.write(line.encode() + b"\n")
            proc.stdin.flush()
            ready, _, _ = select.select([proc.stdout], [], [], 120)
            assert ready, "no answer before the input ended"
            answers.append(proc.stdout.readline())
        proc.stdin.close()
        assert proc.stdout.read() == b"" and proc.wait(60) == 0
    assert b"".join(answers).decode() == "".join(t + "\n" for t in whole)


def test_evaluate_prints_sacrebleu_chrf_and_the_paper_metric(prepared, tmp_path):
    pytest.importorskip("sacremoses")
    data, model = prepared
    hyps = tmp_path / "hyps.de"
    res = run_cli("evaluate", str(model), "--data", str(data), "--split", "test", "--limit", "20",
               "--beam", "2", "--output", str(hyps))  # fmt: skip
    assert res.returncode == 0, res.stderr.decode()
    out = res.stdout.decode()
    assert "sacreBLEU" in out and "nrefs:1|case:mixed|eff:no|tok:13a" in out
    assert "chrF" in out and "tokenized BLEU, compounds split" in out
    assert "sacreBLEU, lowercased" in out and "case:lc" in out
    assert "tokenized BLEU, lowercased" in out and "|lc|multi-bleu.perl" in out
    assert "search: beam_size 2, length_penalty 0.6, max_len_a 1.0, max_len_b 10, stop t2t" in out
    assert len(hyps.read_text(encoding="utf-8").split("\n")) == 21
    res = run_cli("evaluate", str(model), "--data", str(data), "--split", "nope")
    assert res.returncode == 2 and "no split 'nope'" in res.stderr.decode()


def test_evaluate_without_sacremoses_still_scores_and_says_how_to_get_the_paper_metric(
    prepared, monkeypatch
):
    import importlib.util

    from transformer import evaluate as evaluate_module

    real = importlib.util.find_spec
    monkeypatch.setattr(
        evaluate_module.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "sacremoses" else real(name, *a),
    )
    data, model = prepared
    report = evaluate_module.evaluate(model, data, "test", beam_size=1, limit=5)
    assert "paper_bleu" not in report and "bleu" in report and "chrf" in report
    assert "transformer[paper-bleu]" in report["paper_bleu_missing"]


def _with_test_refs(data: Path, tmp_path: Path, refs: list[str]) -> Path:
    """A copy of the prepared directory whose test references are `refs`."""
    import shutil

    copy = tmp_path / "data"
    shutil.copytree(data, copy)
    (copy / "test.de.txt").write_text("\n".join(refs), encoding="utf-8")
    return copy


def _outputs(monkeypatch, texts: list[str]) -> None:
    from transformer.translate import Translation, Translator

    def translate_alphas(self, lines, alphas, **_):  # what `evaluate` decodes with
        out = [[Translation(text=t, tokens=[5], score=0.0)] for t in texts[: len(lines)]]
        return [out for _ in alphas]

    monkeypatch.setattr(Translator, "translate_alphas", translate_alphas)


def test_evaluate_refuses_tokenized_output_against_raw_references_and_the_reverse(
    prepared, tmp_path, monkeypatch
):
    pytest.importorskip("sacremoses")
    import gzip

    from transformer import evaluate as evaluate_module
    from transformer.errors import UserError

    data, model = prepared
    raw = (data / "test.de.txt").read_text(encoding="utf-8").split("\n")[:20]
    # Tokenized German as a model trained on the Stanford release writes it (##AT##, &quot;).
    with gzip.open(SHARED_DATA / "wmt14_en_de" / "newstest2013.de.gz", "rt") as f:
        tokenized = f.read().split("\n")[:20]
    _outputs(monkeypatch, tokenized)  # a model trained on tokenized text, raw references
    with pytest.raises(UserError, match="its test output looks tokenized .* references does not"):
        evaluate_module.evaluate(model, data, "test", limit=20)
    _outputs(monkeypatch, raw)  # raw output, tokenized references
    tok_data = _with_test_refs(data, tmp_path, tokenized + raw[20:])
    with pytest.raises(UserError, match="test references looks tokenized .* output does not"):
        evaluate_module.evaluate(model, tok_data, "test", limit=20)
    # Raw references, output with a space before each final period but no Moses marks (an
    # under-trained model can do that): scored, not refused.
    _outputs(monkeypatch, [line.rstrip(".") + " ." for line in raw])
    assert evaluate_module.evaluate(model, data, "test", limit=20)["sentences"] == 20
    # Both tokenized (the Stanford release): scored after Moses detokenization, and said so.
    _outputs(monkeypatch, tokenized)
    report = evaluate_module.evaluate(model, tok_data, "test", limit=20)
    assert report["bleu"] == pytest.approx(100.0) and "detokenized" in report
    assert report["search"]["stop"] == "t2t" and report["search"]["beam_size"] == 4
    assert report["dtype"] == "fp32"  # the library's default
    info = tmp_path / "cpuinfo"  # a CPU with AMX: auto picks bf16, and the report says so
    info.write_text("flags\t\t: fpu avx512f amx_bf16 amx_tile\n", encoding="utf-8")
    monkeypatch.setattr("transformer.cpuinfo.CPUINFO", str(info))
    assert (
        evaluate_module.evaluate(model, tok_data, "test", limit=20, dtype="auto")["dtype"] == "bf16"
    )
    report = evaluate_module.evaluate(model, tok_data, "test", 2, 1.0, limit=20, stop="fairseq")
    assert report["search"] == {"beam_size": 2, "length_penalty": 1.0, "max_len_a": 1.0,
                                "max_len_b": 10, "stop": "fairseq"}  # fmt: skip
    assert report["paper_bleu"] == pytest.approx(100.0)
