"""The recipe's choices on val, then val and test once, for a trained run: OUT/run, OUT/data.

For a `transformer recipe` run stopped after training and before its choices (a device call's
limit): what the recipe would have done next (`recipe.choose_and_score`), printed as one
line; the translations go to OUT as the recipe's do.

    python3 benchmarks/gpu/score_run.py OUT     # e.g. /tmp/r/s2 of recipe_seeds.sh
"""

import sys
from pathlib import Path

from transformer import rundir
from transformer.experiments.recipe import choose_and_score

out = Path(sys.argv[1])
metric = rundir.read_config(out / "run").train.patience_metric
choice, reports = choose_and_score(out / "data", out / "run", out, metric)
steps = choice["averaged"]
print(out.name, len(steps), steps[0], steps[-1], choice["alpha"], " ".join(
    f"{f} {r['bleu']:.2f}/{r['bleu_lc']:.2f}/{r['tok_bleu_lc']:.2f}" for f, r in reports.items()
))  # fmt: skip
