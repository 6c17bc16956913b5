"""valchoice.py: the checkpoints to average and α, chosen on val after training."""

from __future__ import annotations

import json

import pytest
import torch

from transformer import checkpoint, rundir
from transformer.config import ModelConfig, RunConfig, to_dict
from transformer.errors import UserError
from transformer.experiments.valchoice import (
    beam4_scorer,
    best_valid_step,
    candidate_windows,
    choose_on_val,
    one_se_alpha,
)
from transformer.model import Transformer
from transformer.modelfile import load_model

TINY = RunConfig(model=ModelConfig(vocab_size=20, n_layers=1, d_model=8, d_ff=16, n_heads=2,
                                   d_k=4, d_v=4))  # fmt: skip


def test_best_valid_step_lowest_ppl_or_highest_bleu_first_of_equals():
    rows = [
        {"step": 500, "ppl": 6.0, "bleu": 30.0},
        {"step": 1000, "ppl": 5.0, "bleu": 31.0},
        {"step": 1500, "ppl": 5.0, "bleu": 29.0},
        {"step": 2000, "ppl": 5.5, "bleu": 31.0},
    ]
    assert best_valid_step(rows, "ppl") == 1000
    assert best_valid_step(rows, "bleu") == 1000
    assert best_valid_step([{"step": 5, "ppl": 3.0}], "bleu") is None  # validated without BLEU
    assert best_valid_step([], "ppl") is None


def test_candidate_windows_end_at_the_last_checkpoint_and_at_the_best_validation():
    steps = list(range(250, 5001, 250))  # 20 checkpoints
    assert candidate_windows(steps, 4000, (5, 10)) == [
        (4000, 4250, 4500, 4750, 5000),
        (3000, 3250, 3500, 3750, 4000),
        tuple(range(2750, 5001, 250)),
        tuple(range(1750, 4001, 250)),
    ]
    # best = last: the two bounds coincide; a short run shrinks the window to what is there
    assert candidate_windows(steps[-3:], 5000, (5, 10)) == [(4500, 4750, 5000)]
    # a best validation before the first kept checkpoint cannot bound anything
    assert candidate_windows(steps[-3:], 1000, (2,)) == [(4750, 5000)]
    with pytest.raises(UserError, match="no checkpoints"):
        candidate_windows([], None)


def _run(tmp_path, steps, valid):
    run = tmp_path / "run"
    for step in steps:
        torch.manual_seed(step)
        spm = torch.tensor([1], dtype=torch.uint8)
        data = {"spm_proto": spm, "src": "en", "tgt": "de"}
        state = {"step": step, "model": Transformer(TINY.model).state_dict(),
                 "config": to_dict(TINY), "data": data}  # fmt: skip
        checkpoint.save_checkpoint(run, step, state, keep_last=20)
    with open(run / rundir.METRICS, "w") as f:
        for row in valid:
            f.write(json.dumps({"kind": "valid", **row}) + "\n")
    return run


def test_choose_on_val_picks_the_window_then_alpha_and_never_scores_test(tmp_path):
    run = _run(tmp_path, range(1, 9), [{"step": 4, "ppl": 5.0}, {"step": 8, "ppl": 6.0}])
    calls = []

    def score(model, alphas):
        calls.append((model.name, tuple(alphas)))
        # the window up to the best validation wins at α 1; α 1.4 wins on it; 1.8 ties 1.4
        table = {"avg_1-4.safetensors": 30.0, "avg_7-8.safetensors": 29.0}
        bonus = {0.6: 0.0, 1.0: 0.5, 1.4: 0.9, 1.8: 0.9}
        return [{"bleu": table.get(model.name, 20.0) + bonus[a]} for a in alphas]

    out = tmp_path / "out"
    choice = choose_on_val(
        run, out, score, metric="ppl", windows=(2, 4), alphas=(0.6, 1.0, 1.4, 1.8)
    )
    assert [w["steps"] for w in choice["windows"]] == [[7, 8], [3, 4], [5, 6, 7, 8], [1, 2, 3, 4]]
    assert choice["averaged"] == [1, 2, 3, 4] and choice["best_valid_step"] == 4
    assert choice["alpha"] == 1.4  # the first of the equal best
    assert choice["alphas"] == {"0.6": 30.0, "1.0": 30.5, "1.4": 30.9, "1.8": 30.9}
    # the windows at α 1.0; then the other α on the chosen one, in one call (one search)
    assert calls[:4] == [
        (f"avg_{a}-{b}.safetensors", (1.0,)) for a, b in ((7, 8), (3, 4), (5, 8), (1, 4))
    ]
    assert calls[4:] == [("avg_1-4.safetensors", (0.6, 1.4, 1.8))]
    # the chosen file is the average of checkpoints 1-4; the other candidates are gone
    model = load_model(choice["model"]).model.state_dict()
    states = [checkpoint.load_checkpoint(p)["model"] for p in checkpoint.list_checkpoints(run)[:4]]
    key = "encoder_layers.0.ffn.w_1.weight"
    torch.testing.assert_close(model[key], sum(s[key] for s in states) / 4)
    assert sorted(p.name for p in out.iterdir()) == [rundir.MODEL]


def test_choose_on_val_offers_the_windows_ending_at_an_off_cadence_end(tmp_path):
    run = _run(tmp_path, range(1, 6), [])
    torch.manual_seed(99)
    state = {
        "step": 7,
        "model": Transformer(TINY.model).state_dict(),
        "config": to_dict(TINY),
        "data": {"spm_proto": torch.tensor([1], dtype=torch.uint8), "src": "en", "tgt": "de"},
    }
    checkpoint.save_checkpoint(run, 7, state, keep_last=20, on_cadence=False)  # ckpt_7_end.pt

    def score(model, alphas):  # the window with the end wins
        assert list(alphas) == [1.0]  # α 1.0 alone: no second call
        return [{"bleu": 31.0 if model.name == "avg_4-7.safetensors" else 30.0}]

    choice = choose_on_val(run, tmp_path / "out", score, windows=(2, 3), alphas=(1.0,))
    assert [w["steps"] for w in choice["windows"]] == [[4, 5], [3, 4, 5], [5, 7], [4, 5, 7]]
    assert choice["averaged"] == [4, 5, 7]
    model = load_model(choice["model"]).model.state_dict()
    paths = checkpoint.list_checkpoints(run)
    assert [p.name for p in paths[-3:]] == ["ckpt_4.pt", "ckpt_5.pt", "ckpt_7_end.pt"]
    states = [checkpoint.load_checkpoint(p)["model"] for p in paths[-3:]]
    key = "encoder_layers.0.ffn.w_1.weight"
    torch.testing.assert_close(model[key], sum(s[key] for s in states) / 3)
    # `transformer average` (§6.1) still averages the cadence checkpoints only
    assert checkpoint.list_checkpoints(run, cadence_only=True)[-1].name == "ckpt_5.pt"


def test_beam4_scorer_decodes_the_split_with_beam_4_and_the_given_alphas(monkeypatch, tmp_path):
    from transformer import evaluate

    seen = []
    monkeypatch.setattr(evaluate, "evaluate", lambda *a, **k: seen.append((a, k)) or {"bleu": 1})
    many = [{"bleu": 2}, {"bleu": 3}]
    monkeypatch.setattr(evaluate, "evaluate_alphas", lambda *a, **k: seen.append((a, k)) or many)
    score = beam4_scorer(tmp_path / "data", limit=7)
    assert score(tmp_path / "m.safetensors", [1.2]) == [{"bleu": 1}]
    score(tmp_path / "m.safetensors", [0.6], "test", tmp_path / "hyp")
    assert score(tmp_path / "m.safetensors", [0.6, 1.0]) == [{"bleu": 2}, {"bleu": 3}]
    (a1, k1), (a2, k2), (a3, k3) = seen
    assert a1 == (tmp_path / "m.safetensors", tmp_path / "data", "valid") and a2[2] == "test"
    assert k1["beam_size"] == 4 and k1["length_penalty"] == 1.2 and k1["limit"] == 7
    assert k1["output"] is None and k2["output"] == tmp_path / "hyp"
    # the choices get each sentence's BLEU statistics (the one-se rule); the test pass does not
    assert k1["sentence_stats"] and not k2["sentence_stats"] and k3["sentence_stats"]
    assert k1["dtype"] == "auto" and k2["length_penalty"] == 0.6
    # several α: one search (evaluate_alphas), beam 4, the same dtype and limit
    assert a3 == (tmp_path / "m.safetensors", tmp_path / "data", "valid", [0.6, 1.0])
    assert k3["beam_size"] == 4 and k3["dtype"] == "auto" and k3["limit"] == 7
    with pytest.raises(ValueError, match="one α"):  # translations are written for one α
        score(tmp_path / "m.safetensors", [0.6, 1.0], "test", tmp_path / "hyp")


def _reports(n=300):
    """Val reports for α 0.6, 1.0 and 1.4 of 300 sentences, half of them right for each α:
    1.4 is the best; 1.0 trades 30 of its right sentences for 28 others (a difference within
    the noise); 0.6 loses 60 of 1.4's (outside it)."""
    from transformer.bleu import bleu_of_stats, sentence_stats

    refs = [f"r{i} a{i % 7} b{i % 11} c{i % 13} d{i}" for i in range(n)]
    wrong = [f"x{i} y z" for i in range(n)]
    right = {1.4: set(range(150))}
    right[1.0] = (right[1.4] - set(range(30))) | set(range(150, 178))
    right[0.6] = right[1.4] - set(range(60))
    reports = {}
    for alpha, good in right.items():
        stats = sentence_stats([refs[i] if i in good else wrong[i] for i in range(n)], refs)
        bleu = bleu_of_stats([sum(col) for col in zip(*stats, strict=True)])
        reports[alpha] = {"bleu": bleu, "sentence_stats": stats}
    return reports


def test_one_se_alpha_takes_the_smallest_alpha_within_one_standard_error_of_the_best():
    reports = _reports()
    assert reports[0.6]["bleu"] < reports[1.0]["bleu"] < reports[1.4]["bleu"]
    alpha, ses = one_se_alpha(reports, 1.4)
    assert alpha == 1.0 and ses[1.4] == 0.0
    assert reports[1.4]["bleu"] - reports[1.0]["bleu"] <= ses[1.0]  # within: chosen
    assert reports[1.4]["bleu"] - reports[0.6]["bleu"] > ses[0.6]  # outside: passed over
    # no α below the best within its error: the best stays
    del reports[1.0]
    assert one_se_alpha(reports, 1.4)[0] == 1.4
    with pytest.raises(ValueError, match="sentence_stats"):
        one_se_alpha({1.4: {"bleu": 1.0}}, 1.4)


def test_choose_on_val_with_the_one_se_rule_records_the_best_and_the_errors(tmp_path):
    run = _run(tmp_path, range(1, 4), [])
    reports = _reports()

    def score(model, alphas):
        return [reports[a] for a in alphas]

    kwargs = {"windows": (3,), "alphas": (0.6, 1.0, 1.4), "window_alpha": 1.0}
    choice = choose_on_val(run, tmp_path / "se", score, alpha_rule="one-se", **kwargs)
    assert choice["alpha"] == 1.0 and choice["alpha_best"] == 1.4
    assert choice["alpha_rule"] == "one-se" and set(choice["alpha_se"]) == {"0.6", "1.0", "1.4"}
    json.dumps(choice)  # recipe.json: no statistics, nothing unserializable
    assert "sentence_stats" not in json.dumps(choice)
    best = choose_on_val(run, tmp_path / "best", score, **kwargs)
    assert best["alpha"] == best["alpha_best"] == 1.4 and "alpha_se" not in best
    with pytest.raises(UserError, match="unknown α rule"):
        choose_on_val(run, tmp_path / "x", score, alpha_rule="median", **kwargs)
