"""What a recipe chooses on val once training has ended: the checkpoints to average and α.

§6.1: the beam size and length penalty "were chosen after experimentation on the development
set", and the averaged checkpoints are the last ones written. A run that has trained past its
best validation (early stopping waits `train.patience` validations) has its best checkpoints
behind the last ones, so the candidates are windows of the newest checkpoints ending at the last
checkpoint and at the best validation's step (fairseq's `--checkpoint-upper-bound`). The search
is coordinate-wise: the windows are compared at one α, then α on the chosen average. Every
candidate is scored with the same beam search on val, never on test; ties keep the earlier
candidate (the last-N window, the smaller α: the paper's 0.6 first).

α has two rules (`ALPHA_RULES`). "best": the α of the highest val BLEU. "one-se": the smallest α
whose val BLEU is within one standard error of the best, the error being that of the paired
difference over bootstrap resamples of val (`bleu.paired_bootstrap`): the one-standard-error
rule of model selection (Breiman et al. 1984; Hastie et al., ESL §7.10), which takes the
simplest candidate the data cannot tell from the best. Larger α favours longer translations
(§6.1, GNMT's lp); the recipe's val differences between α (0.1-0.3 BLEU between neighbours)
are within the noise that separates whole windows of near-identical checkpoints (0.55), so "best"
follows the noise of val's 1,014 sentences and their lengths. (docs/multi30k_converged.md, run 10.)
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

from transformer.errors import UserError

logger = logging.getLogger(__name__)

# How many checkpoints are averaged (§6.1 averages 5 for base, 20 for big). 20 and 30 were
# added on val (docs/multi30k_converged.md, "Longer averages"): on the recipe's runs 5-7 the
# best window of 20 or more scored 0.17-0.36 above the best of 5 and 10 at α 1.0 in all three.
WINDOWS = (5, 10, 20, 30)
ALPHAS = (0.6, 0.8, 1.0, 1.2, 1.4, 1.6, 1.8)  # §6.1 chose 0.6 on its dev set
WINDOW_ALPHA = 1.0  # α at which the windows are compared (the middle of ALPHAS)
ALPHA_RULES = ("best", "one-se")
BOOTSTRAP_RESAMPLES = 1000
BOOTSTRAP_SEED = 12345  # the same resamples for every α: the comparison is paired


def check_alpha_rule(rule: str) -> None:
    """UserError unless `rule` is one of `ALPHA_RULES` (a recipe checks before training)."""
    if rule not in ALPHA_RULES:
        raise UserError(f"unknown α rule {rule!r}; choose one of: {', '.join(ALPHA_RULES)}")


# score(model file, alphas) -> an `evaluate` report of val (at least "bleu") for each α, in
# order: `beam4_scorer` decodes them in one call (one search for every α, in every precision).
Scorer = Callable[[Path, Sequence[float]], list[dict]]


def beam4_scorer(data_dir: Path, limit: int | None = None) -> Callable[..., list[dict]]:
    """score(model, alphas, split="valid", output=None): `evaluate` of a prepared split with
    beam 4 (§6.1) for each α (several α in one call: `evaluate_alphas`), the CPU's own dtype
    (`--dtype auto`) and tuned threads, without the checksum (the recipes have just written the
    model file). The one decode setting a recipe's val choices and its test pass share.
    `output` (the translations) takes one α. Without `output` (the choices on val), each
    report has the "sentence_stats" of its BLEU (`bleu.sentence_stats`) for the "one-se" rule."""

    def score(
        model: Path, alphas: Sequence[float], split: str = "valid", output: Path | None = None
    ) -> list[dict]:
        from transformer.evaluate import evaluate, evaluate_alphas

        if output is None and len(alphas) > 1:
            return evaluate_alphas(
                model, data_dir, split, alphas, beam_size=4, dtype="auto", limit=limit,
                threads="auto", verify=False, sentence_stats=True,
            )  # fmt: skip
        if len(alphas) != 1:
            raise ValueError(f"one α to write the translations, got {list(alphas)}")
        report = evaluate(
            model, data_dir, split, beam_size=4, length_penalty=alphas[0], dtype="auto",
            output=output, limit=limit, threads="auto", verify=False,
            sentence_stats=output is None,
        )  # fmt: skip
        return [report]

    return score


def best_valid_step(valid_rows: Sequence[dict], metric: str = "ppl") -> int | None:
    """The step of the best validation record (lowest "ppl", or highest "bleu"); first on ties."""
    rows = [r for r in valid_rows if r.get(metric) is not None]
    if not rows:
        return None
    sign = -1.0 if metric == "ppl" else 1.0
    return max(rows, key=lambda r: (sign * r[metric], -r["step"]))["step"]


def candidate_windows(
    steps: Sequence[int], best_step: int | None, windows: Sequence[int] = WINDOWS
) -> list[tuple[int, ...]]:
    """Distinct sets of checkpoint steps to average: for each window size N, the last N
    checkpoints, and the last N up to `best_step`; a window larger than what is there shrinks
    to what is there (a short run still has one candidate)."""
    steps = sorted(steps)
    if not steps:
        raise UserError("no checkpoints on the save cadence to average")
    bounds = [steps]
    if best_step is not None:
        upto = [s for s in steps if s <= best_step]
        if upto and upto != steps:
            bounds.append(upto)
    found: list[tuple[int, ...]] = []
    for n in windows:
        for have in bounds:
            chosen = tuple(have[-n:])
            if chosen not in found:
                found.append(chosen)
    return found


def choose_on_val(
    run_dir: Path,
    out_dir: Path,
    score: Scorer,
    metric: str = "ppl",
    windows: Sequence[int] | None = None,
    alphas: Sequence[float] | None = None,
    window_alpha: float | None = None,
    alpha_rule: str = "best",
    calibrate: Callable[[Path], object] | None = None,
) -> dict:
    """Average each candidate window, score it on val, then α on the best one. The windows:
    `candidate_windows` of the cadence checkpoints, and, when the run ended off the cadence,
    the last N ending with its end checkpoint.

    Args:
        run_dir: the trained run (its checkpoints on the save cadence and its valid records).
        out_dir: the chosen average is written to OUT/model.safetensors.
        score: val scorer (`Scorer`, e.g. `beam4_scorer`): the windows are scored at
            `window_alpha`, then the other α on the chosen one in one call.
        metric: what "best validation" means ("ppl" or "bleu", the run's patience metric).
        windows, alphas, window_alpha: default WINDOWS, ALPHAS, WINDOW_ALPHA.
        alpha_rule: "best" or "one-se" (`ALPHA_RULES`, the module's docstring); "one-se"
            needs the scorer's "sentence_stats".
        calibrate: called with each average's path before it is scored (the quickstart:
            `gptq.quantize_model_file`, so that val chooses with the int8 weights it keeps).

    Returns:
        {"model", "alpha", "averaged" (checkpoint steps), "best_valid_step", "windows" (each
        candidate's steps and val BLEU), "alphas" (α → val BLEU), "alpha_rule", "alpha_best"
        (the α of the highest val BLEU); with "one-se", "alpha_se" (α → the standard error
        of its difference from the best's)}.
    """
    from transformer import checkpoint, rundir

    run_dir, out_dir = Path(run_dir), Path(out_dir)
    windows = WINDOWS if windows is None else windows
    alphas = ALPHAS if alphas is None else alphas
    window_alpha = WINDOW_ALPHA if window_alpha is None else window_alpha
    check_alpha_rule(alpha_rule)
    checkpoint.remove_stale(run_dir)  # e.g. the .tmp file of a killed average
    cadence = checkpoint.list_checkpoints(run_dir, cadence_only=True)
    files = {checkpoint.step_of(p): p for p in cadence}
    steps = sorted(files)
    best = best_valid_step([row for _, row in rundir.read_metrics(run_dir, "valid")], metric)
    candidates = candidate_windows(steps, best, windows)
    # A budget that ends between two cadence points leaves a newer off-cadence checkpoint
    # (checkpoint.save_checkpoint's `_end`), up to one interval of training that the cadence
    # windows leave out: the last N ending with it are candidates too, and val decides.
    ends = [p for p in checkpoint.list_checkpoints(run_dir) if p not in cadence]
    if ends and steps and checkpoint.step_of(ends[-1]) > steps[-1]:
        files[checkpoint.step_of(ends[-1])] = ends[-1]
        with_end = candidate_windows(sorted(files), None, windows)
        candidates += [chosen for chosen in with_end if chosen not in candidates]
    staging = out_dir / "candidates"
    staging.mkdir(parents=True, exist_ok=True)
    tried = []
    for chosen in candidates:
        path = staging / f"avg_{chosen[0]}-{chosen[-1]}.safetensors"
        rundir.average_files([files[s] for s in chosen], path)
        if calibrate is not None:
            calibrate(path)
        report = score(path, [window_alpha])[0]
        bleu = report["bleu"]
        logger.info("val: checkpoints %s … %s (%d), α %s: BLEU %.2f",
                    chosen[0], chosen[-1], len(chosen), window_alpha, bleu)  # fmt: skip
        tried.append({"steps": list(chosen), "path": path, "bleu": bleu, "report": report})
    pick = max(tried, key=lambda t: t["bleu"])  # max keeps the first of equals
    others = [alpha for alpha in alphas if alpha != window_alpha]
    found = dict(zip(others, score(pick["path"], others), strict=True)) if others else {}
    found[window_alpha] = pick["report"]
    by_alpha = {alpha: found[alpha]["bleu"] for alpha in alphas}
    for alpha in alphas:
        logger.info("val: α %s: BLEU %.2f", alpha, by_alpha[alpha])
    best_alpha = max(by_alpha, key=by_alpha.__getitem__)
    extra: dict = {}
    alpha = best_alpha
    if alpha_rule == "one-se":
        alpha, ses = one_se_alpha({a: found[a] for a in alphas}, best_alpha)
        extra["alpha_se"] = {str(a): se for a, se in ses.items()}
        logger.info("val: α %s, the smallest within one standard error of the best (α %s)",
                    alpha, best_alpha)  # fmt: skip
    model = out_dir / rundir.MODEL
    shutil.move(pick["path"], model)
    shutil.rmtree(staging)
    return {
        "model": str(model),
        "alpha": alpha,
        "averaged": pick["steps"],
        "best_valid_step": best,
        "windows": [{"steps": t["steps"], "bleu": t["bleu"]} for t in tried],
        "alphas": {str(a): b for a, b in by_alpha.items()},
        "alpha_rule": alpha_rule,
        "alpha_best": best_alpha,
        **extra,
    }


def one_se_alpha(reports: dict[float, dict], best: float) -> tuple[float, dict[float, float]]:
    """The one-standard-error rule on α: the smallest α whose val BLEU is no more than one
    standard error below the best's, the error that of the paired difference (best − α) over
    `BOOTSTRAP_RESAMPLES` resamples of val's sentences. `reports`: α → a report with "bleu" and
    "sentence_stats" (`bleu.sentence_stats`). Returns (that α, α → standard error)."""
    import numpy as np

    from transformer.bleu import paired_bootstrap

    order = sorted(reports)
    missing = [a for a in order if "sentence_stats" not in reports[a]]
    if missing:
        raise ValueError(f"the one-se rule needs sentence_stats; α {missing} have none")
    boot = paired_bootstrap(
        [reports[a]["sentence_stats"] for a in order], BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED
    )
    at = dict(zip(order, (np.asarray(b) for b in boot), strict=True))
    ses = {a: float(np.std(at[best] - at[a], ddof=1)) for a in order}
    top = reports[best]["bleu"]
    chosen = next(a for a in order if top - reports[a]["bleu"] <= ses[a])  # best: 0 <= 0
    return chosen, ses
