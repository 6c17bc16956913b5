"""`transformer recipe multi30k-full`: the converged recipe's pipeline, on a tiny model for
seconds (the real run takes 2 hours: docs/multi30k_converged.md)."""

from __future__ import annotations

import json

import pytest

from transformer import evaluate
from transformer.cli import main
from transformer.errors import UserError
from transformer.experiments import recipe, valchoice

pytestmark = pytest.mark.integration

TINY = [
    "model.n_layers=1", "model.d_model=32", "model.d_ff=64", "model.n_heads=2", "model.d_k=16",
    "model.d_v=16", "train.valid_every_steps=15", "train.save_every_steps=5",
    "train.max_steps=30", "train.patience=1", "train.patience_metric=ppl",
    # Seconds, not a minute: the preset's steps of 3 x 2,731 tokens would spend them on the
    # loss, and the untrained model's outputs run to the length cap in every search.
    "train.max_tokens=2048", "train.accum_steps=1", "decode.max_len_b=8",
]  # fmt: skip


def test_recipe_trains_averages_and_scores_val_then_test_in_both_forms(
    shared_data, tmp_path, monkeypatch, one_thread, capsys
):
    monkeypatch.setattr(recipe, "SCORING_MINUTES", 0.0)
    monkeypatch.setattr(valchoice, "ALPHAS", (0.6, 1.0, 1.4))
    # Beam search with an untrained model runs to the length cap: 50 sentences of each split.
    full, grid = evaluate.evaluate, evaluate.evaluate_alphas
    monkeypatch.setattr(evaluate, "evaluate", lambda *a, **k: full(*a, **{**k, "limit": 50}))
    monkeypatch.setattr(evaluate, "evaluate_alphas", lambda *a, **k: grid(*a, **{**k, "limit": 50}))
    out = tmp_path / "r"
    args = ["recipe", "multi30k-full", *TINY, "--out", str(out), "--minutes", "5"]
    args += ["--data-from", str(shared_data / "multi30k")]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "case:mixed" in printed and "case:lc" in printed and "|lc|multi-bleu.perl" in printed
    report = json.loads((out / "recipe.json").read_text())
    assert set(report["scores"]) == {"val", "test_2016_flickr"}
    test = report["scores"]["test_2016_flickr"]
    assert test["sentences"] == 50 and test["search"]["beam_size"] == 4
    for key in ("bleu", "bleu_lc", "tok_bleu_lc"):
        assert 0.0 <= test[key] <= 100.0
    assert test["bleu_lc"] >= test["bleu"]  # case-insensitive matching only adds matches
    curve = report["valid_curve"]
    assert curve and all(row["epochs"] > 0 and "bleu" in row for row in curve)
    assert 0 < report["train"]["steps"] <= 30 and report["train"]["epochs"] > 0
    assert report["config"]["model"]["d_model"] == 32
    # Chosen on val: the window among the candidates, α on it; test decoded with both.
    chosen = report["chosen_on_val"]
    assert report["averaged_checkpoints"] in [w["steps"] for w in chosen["windows"]]
    # α by the one-se rule: the smallest within one standard error of the best on val
    assert chosen["alpha_rule"] == "one-se"
    assert chosen["alphas"][str(chosen["alpha_best"])] == max(chosen["alphas"].values())
    gap = chosen["alphas"][str(chosen["alpha_best"])] - chosen["alphas"][str(report["alpha"])]
    assert 0.0 <= gap <= chosen["alpha_se"][str(report["alpha"])]
    assert report["alpha"] <= chosen["alpha_best"] and "sentence_stats" not in json.dumps(report)
    assert (
        test["search"]["length_penalty"]
        == report["alpha"]
        == report["scores"]["val"]["search"]["length_penalty"]
    )
    assert "chosen on val: checkpoints" in printed
    assert not (out / "candidates").exists()
    hyps = (out / "test_2016_flickr.de.hyp").read_text(encoding="utf-8").splitlines()
    assert len(hyps) == 50

    # An earlier run is never overwritten; --resume continues it instead.
    assert main(args) == 2
    assert "--resume" in capsys.readouterr().err
    assert main([*args, "--resume"]) == 0
    capsys.readouterr()
    assert main([*args, "--resume", "--lowercase"]) == 2  # its data stays cased
    assert "prepared without --lowercase: resume it the same way" in capsys.readouterr().err


def test_recipe_rejects_an_unknown_name_and_a_budget_below_scoring(tmp_path, capsys):
    assert main(["recipe", "wmt-in-a-minute"]) == 2
    assert "multi30k-full" in capsys.readouterr().err
    assert main(["recipe", "multi30k-full", "--minutes", "1"]) == 2
    assert "budget" in capsys.readouterr().err
    with pytest.raises(UserError, match="unknown α rule 'median'"):  # before any training
        recipe.run_recipe("multi30k-full", tmp_path / "r", alpha_rule="median")
    assert not (tmp_path / "r").exists()
    with pytest.raises(SystemExit):  # argparse: the choices are named
        main(["recipe", "multi30k-full", "--alpha-rule", "median"])
    assert "one-se" in capsys.readouterr().err


def test_recipe_resume_without_an_earlier_run_is_a_one_line_error(shared_data, tmp_path, capsys):
    args = ["recipe", "multi30k-full", "--out", str(tmp_path / "r"), "--resume"]
    assert main([*args, "--data-from", str(shared_data / "multi30k")]) == 2
    assert "run/config.yaml: not found" in capsys.readouterr().err


def test_recipe_lowercase_trains_and_scores_lowercased_text(
    shared_data, tmp_path, monkeypatch, one_thread, capsys
):
    monkeypatch.setattr(recipe, "SCORING_MINUTES", 0.0)
    monkeypatch.setattr(valchoice, "ALPHAS", (1.0,))
    full = evaluate.evaluate
    monkeypatch.setattr(evaluate, "evaluate", lambda *a, **k: full(*a, **{**k, "limit": 20}))
    out = tmp_path / "r"
    args = ["recipe", "multi30k-full", *TINY, "train.max_steps=10", "--out", str(out)]
    args += ["--minutes", "5", "--data-from", str(shared_data / "multi30k"), "--lowercase"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "no cased BLEU" in printed and "case:mixed" not in printed and "case:lc" in printed
    report = json.loads((out / "recipe.json").read_text())
    assert report["lowercase"] is True and report["config"]["model"]["lowercase"] is True
    test = report["scores"]["test_2016_flickr"]
    assert test["lowercase"] is True and test["bleu"] == test["bleu_lc"]  # references lowercased
    hyps = (out / "test_2016_flickr.de.hyp").read_text(encoding="utf-8")
    assert hyps.strip() and hyps == hyps.lower()
    assert main([*args[:-1], "--resume"]) == 2  # without --lowercase: refused, data unchanged
    assert "prepared with --lowercase: resume it the same way" in capsys.readouterr().err
    assert main(args[:-1]) == 2  # a new cased run in the same --out
    assert "prepared with --lowercase: choose another --out" in capsys.readouterr().err
