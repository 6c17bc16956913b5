"""The recipe's choices on val, then val and test once, for a trained run: OUT/run, OUT/data.

For a `transformer recipe` run stopped after training and before its choices (a device call's
limit): what the recipe would have done next, printed as one line.

    python3 benchmarks/gpu/score_run.py OUT     # e.g. /tmp/r/s2 of recipe_seeds.sh
"""

import sys
from pathlib import Path

from transformer.experiments.valchoice import beam4_scorer, choose_on_val

out = Path(sys.argv[1])
score = beam4_scorer(out / "data")
choice = choose_on_val(out / "run", out, score, metric="ppl")
model, alpha = Path(choice["model"]), choice["alpha"]
reports = {f: score(model, [alpha], split)[0] for split, f in (("valid", "val"), ("test", "test"))}
steps = choice["averaged"]
print(out.name, len(steps), steps[0], steps[-1], alpha, " ".join(
    f"{f} {r['bleu']:.2f}/{r['bleu_lc']:.2f}/{r['tok_bleu_lc']:.2f}" for f, r in reports.items()
))  # fmt: skip
