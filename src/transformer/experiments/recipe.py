"""`transformer recipe multi30k-full`: Multi30k English→German trained to convergence on a CPU.

prepare (joint subwords) → train the `multi30k-full` preset with early stopping on val perplexity
inside a wall-clock budget → choose on val, beam 4, the checkpoints to average and the
length penalty α (`valchoice.py`, §6.1) → test_2016_flickr scored once with them: cased
detokenized sacreBLEU with its signature, and lowercased (sacreBLEU -lc, and Moses-tokenized
multi-bleu as the multimodal-translation literature reports it). With `lowercase`, the text is
lowercased before anything else, as the literature's is, and only the lowercased forms exist.
The val curve and every figure go to recipe.json.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from transformer.errors import UserError
from transformer.experiments.quickstart import _stage, find_multi30k

logger = logging.getLogger(__name__)

RECIPES = ("multi30k-full",)
BUDGET_MINUTES = 120.0  # the whole job, on 2 cores
# Kept back from the budget for the choices on val (up to 12 averages and beam-4 passes of val
# at α 1.0, then the other α in one search; one per α in int8 until per-row int8 inputs) and
# the val and test passes: ~1.2 minutes for the preset's 2.35M-parameter model on 2 cores (runs
# 6 and 7: 71 s, int8, one search per α), ~4 for a 26M-parameter one; the rest is a margin.
# (8 minutes until run 7.)
SCORING_MINUTES = 5.0
# How α is chosen on val (`valchoice.ALPHA_RULES`): the smallest α within one standard error of
# the best since run 10 ("best", the highest val BLEU, until then: docs/multi30k_converged.md).
ALPHA_RULE = "one-se"


def run_recipe(
    name: str,
    out_dir: Path,
    minutes: float = BUDGET_MINUTES,
    data_from: Path | None = None,
    resume: bool = False,
    overrides: list[str] | None = None,
    lowercase: bool = False,
    procs: int | None = None,
    alpha_rule: str = ALPHA_RULE,
) -> dict:
    """Run recipe `name` end to end; returns (and writes to OUT/recipe.json) its report.

    Args:
        name: "multi30k-full".
        out_dir: data/, run/, model.safetensors, the translations and recipe.json go here.
        minutes: the whole job's wall-clock budget; training gets it less SCORING_MINUTES.
        data_from: Multi30k's files (default: found on disk as the quickstart finds them).
        resume: continue an interrupted run in OUT/run from its last checkpoint.
        overrides: extra `section.key=value` settings (documented deviations only).
        lowercase: prepare lowercased text (`prepare --lowercase`: the lowercasing step of the
            literature's Multi30k files, `*.lc.norm.tok`): the model writes lowercased text, val
            and test are scored against the lowercased references, and no cased score exists.
        procs: train with this many one-thread processes (`train.procs`; default: the
            preset's, or on resume the run's own).
        alpha_rule: how α is chosen on val ("best" or "one-se", `valchoice.ALPHA_RULES`).
    """
    from transformer import rundir
    from transformer.config import build_config, to_dict
    from transformer.experiments.valchoice import check_alpha_rule
    from transformer.prepare import prepare_corpus
    from transformer.train import train

    if name not in RECIPES:
        raise UserError(f"unknown recipe {name!r}; choose one of: {', '.join(RECIPES)}")
    check_alpha_rule(alpha_rule)  # before hours of training
    if minutes <= SCORING_MINUTES:
        raise UserError(f"--minutes: the budget must exceed {SCORING_MINUTES} minutes of scoring")
    out_dir = Path(out_dir)
    seconds: dict[str, float] = {}
    data_dir, run_dir = out_dir / "data", out_dir / "run"
    start = time.monotonic()
    from_dir = data_from if data_from is not None else find_multi30k()
    prepared_lc = _prepared_lowercase(data_dir)  # the data of an earlier run stays as it was
    if prepared_lc is not None and prepared_lc != lowercase:
        flag = "with" if prepared_lc else "without"
        then = "resume it the same way" if resume else "choose another --out"
        raise UserError(f"{out_dir} was prepared {flag} --lowercase: {then}")
    with _stage("prepare", seconds):
        manifest = prepare_corpus(
            "multi30k", "en", "de", data_dir, from_dir=from_dir, lowercase=lowercase
        )
    spent = (time.monotonic() - start) / 60
    train_minutes = minutes - SCORING_MINUTES - spent
    # An interrupted run's minutes count against the budget (and in the report), once.
    earlier = _trained_minutes(run_dir) if resume else 0.0
    train_minutes -= earlier
    budget = [f"train.max_minutes={max(train_minutes, 0.01):.2f}"]
    if procs is not None:  # like the budget, it applies on resume too
        budget.append(f"train.procs={procs}")
    config = build_config(
        name, overrides=[*budget, *(overrides or [])], vocab_size=manifest.vocab_size
    )
    with _stage("train", seconds):
        if resume:  # the run's own config, with the budget that is left
            train(data_dir, run_dir, resume=True, overrides=budget)
        elif (run_dir / rundir.CONFIG).exists():
            raise UserError(f"{run_dir} holds an earlier run: pass --resume, or another --out")
        else:
            train(data_dir, run_dir, config)
    config = rundir.read_config(run_dir)  # what trained (on resume: the run's own)
    metric = config.train.patience_metric
    choice, scores = choose_and_score(data_dir, run_dir, out_dir, metric, seconds, alpha_rule)
    model_path, alpha = Path(choice["model"]), choice["alpha"]
    report = {
        "recipe": name,
        "lowercase": lowercase,
        "config": to_dict(config),
        "averaged_checkpoints": choice["averaged"],
        "alpha": alpha,
        "chosen_on_val": choice,
        "minutes": (time.monotonic() - start) / 60 + earlier,
        "stage_seconds": seconds,
        "train": {**_summary(run_dir), "minutes": _trained_minutes(run_dir)},
        "valid_curve": [row for _, row in rundir.read_metrics(run_dir, "valid")],
        "scores": scores,
        "model": str(model_path),
    }
    (out_dir / "recipe.json").write_text(json.dumps(report, indent=2))
    return report


def choose_and_score(
    data_dir: Path,
    run_dir: Path,
    out_dir: Path,
    metric: str,
    seconds: dict[str, float] | None = None,
    alpha_rule: str = ALPHA_RULE,
) -> tuple[dict, dict[str, dict]]:
    """The recipe's stages after training: choose on val the checkpoints to average and α
    (`valchoice.choose_on_val`, the best validation by `metric`, the run's patience metric;
    the average goes to OUT/model.safetensors; α by `alpha_rule`), then score val and
    test_2016_flickr once with them, beam 4, their translations to
    OUT/{val,test_2016_flickr}.de.hyp.

    Returns (the choice, {"val": report, "test_2016_flickr": report}); each stage's seconds
    go to `seconds` when given.
    """
    from transformer.experiments.valchoice import beam4_scorer, choose_on_val

    seconds = {} if seconds is None else seconds
    score = beam4_scorer(data_dir)
    with _stage("choose on val", seconds):
        choice = choose_on_val(run_dir, out_dir, score, metric=metric, alpha_rule=alpha_rule)
    model_path, alpha = Path(choice["model"]), choice["alpha"]
    scores = {}
    for split, file in (("valid", "val"), ("test", "test_2016_flickr")):
        with _stage(f"score {file}", seconds):  # test: once, with what val chose
            scores[file] = score(model_path, [alpha], split, out_dir / f"{file}.de.hyp")[0]
    return choice, scores


def _summary(run_dir: Path) -> dict:
    """Steps, epochs, target tokens and training minutes, from the run's metrics."""
    from transformer.rundir import read_metrics

    last: dict = {}
    times = []
    for _, row in read_metrics(run_dir):
        times.append(row["time"])
        if row.get("kind", "train") == "train":
            last = row
    return {
        "steps": last.get("step"),
        "epochs": last.get("epochs"),
        "target_tokens": last.get("tokens"),
        "minutes": (times[-1] - times[0]) / 60 if len(times) > 1 else 0.0,
    }


def _trained_minutes(run_dir: Path) -> float:
    """The training minutes up to the checkpoint a resume continues from: its counters keep
    them (`TrainState.seconds`), over every earlier resume, without the time between a crash
    and its resume; the checkpoint resume itself loads (`checkpoint.load_latest`: the newest
    readable one). Checkpoints written before they kept them: the span of the metrics rows,
    which misses the time before the first row and counts any downtime in between."""
    from transformer import checkpoint

    found = checkpoint.load_latest(run_dir)
    seconds = found[1]["counters"].get("seconds", 0.0) if found else 0.0
    if seconds > 0:
        return seconds / 60
    try:
        return _summary(run_dir)["minutes"]
    except UserError:  # no metrics yet
        return 0.0


def _prepared_lowercase(data_dir: Path) -> bool | None:
    """Whether `data_dir` holds lowercased data, as `PreparedData` reads it (None: nothing
    readable there yet; `prepare_corpus` then builds it, or says what is wrong with it)."""
    from transformer.data import load_prepared

    try:
        return load_prepared(data_dir).lowercase
    except (UserError, KeyError):
        return None
