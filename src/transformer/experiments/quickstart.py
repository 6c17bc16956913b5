"""`transformer quickstart`: Multi30k English→German end to end on a CPU, as a new user wants it.

prepare (joint subwords) → train (a CPU-sized preset; bf16 where the CPU multiplies it natively,
else fp32) → average the last checkpoints (§6.1) → int8 weights rounded by GPTQ on 2,000 train
pairs into the model file (gptq.py: what `--dtype auto` decodes with on CPUs without AMX) →
choose the length penalty α on val (§6.1, `valchoice.py`) → translate test_2016_flickr with beam
4 and that α → sacreBLEU with signature and chrF.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from transformer.errors import UserError

logger = logging.getLogger(__name__)

LANGUAGES = ("en", "de", "fr", "cs")
QUICKSTART_PRESET = "quickstart"
# Training budget: the whole job (prepare + train + average + α on val + translate + score)
# fits in 20 minutes on the 2-core CPU this project is developed on; the other stages take
# ~100 s (val decoded once per averaging window at α 1.0, then for the other α in one search;
# ~8-17 s a pass; test once). (int8, `--dtype auto`'s choice on a CPU with VNNI and no AMX,
# searched once per α until its inputs were quantized per row: then ~30 s more.)
TRAIN_MINUTES = 17.5
# α candidates, chosen on val: on the 18.5-minute model, val BLEU 36.02 at 0.6, 36.46 at 1.0,
# 36.31 at 1.4, 35.06 at 1.6 (docs/quickstart.md).
ALPHAS = (0.6, 0.8, 1.0, 1.2, 1.4)
SMOKE_STEPS = 40
SMOKE_TEST_SENTENCES = 50


@dataclass
class QuickstartResult:
    out_dir: Path
    model: Path
    translations: Path
    report: dict
    stage_seconds: dict[str, float] = field(default_factory=dict)
    losses: list[float] = field(default_factory=list)

    @property
    def loss_fell(self) -> bool:
        return len(self.losses) >= 2 and self.losses[-1] < self.losses[0]


def find_multi30k() -> Path | None:
    """Multi30k on disk: $TRANSFORMER_DATA/multi30k, else ../shared/data/multi30k next to the
    current directory or next to this checkout."""
    candidates = []
    if os.environ.get("TRANSFORMER_DATA"):
        candidates.append(Path(os.environ["TRANSFORMER_DATA"]) / "multi30k")
    candidates.append(Path.cwd().parent / "shared" / "data" / "multi30k")
    repo = Path(__file__).resolve().parents[3]  # src/transformer/experiments/quickstart.py -> repo
    candidates.append(repo.parent / "shared" / "data" / "multi30k")
    for c in candidates:
        if (c / "train.en").is_file():
            return c
    return None


@contextmanager
def _stage(name: str, seconds: dict[str, float]) -> Iterator[None]:
    logger.info("== %s", name)
    start = time.perf_counter()
    yield
    seconds[name] = time.perf_counter() - start
    logger.info("== %s done in %.1f s", name, seconds[name])


def quickstart(
    out_dir: Path = Path("runs/quickstart"),
    src_lang: str = "en",
    tgt_lang: str = "de",
    smoke: bool = False,
    train_minutes: float | None = None,
    data_from: Path | None = None,
    overrides: Sequence[str] = (),
) -> QuickstartResult:
    """Run the whole pipeline; returns where everything is and the scores.

    Args:
        out_dir: everything goes here: data/, run/, model.safetensors, test translations.
        src_lang, tgt_lang: any two of en, de, fr, cs (the paper's direction is en→de).
        smoke: the same pipeline on a tiny model for a few steps (tests; minutes at most).
        train_minutes: training budget (default TRAIN_MINUTES; smoke runs use steps).
        data_from: Multi30k's files (default: found by `find_multi30k`, else downloaded).
        overrides: `section.key=value` changes to the preset (e.g. `train.seed=2`,
            `train.procs=2`), applied last; the run's config.yaml records them.
    """
    from transformer import rundir
    from transformer.config import build_config
    from transformer.experiments.valchoice import beam4_scorer, choose_on_val
    from transformer.gptq import quantize_model_file
    from transformer.prepare import prepare_corpus
    from transformer.train import train

    for lang in (src_lang, tgt_lang):
        if lang not in LANGUAGES:
            raise UserError(f"--src/--tgt: Multi30k has {', '.join(LANGUAGES)}, not {lang!r}")
    if src_lang == tgt_lang:
        raise UserError(f"--src and --tgt must differ, both are {src_lang!r}")
    preset = "tiny" if smoke else QUICKSTART_PRESET
    settings: list[str] = []  # train.dtype auto: bf16 where the CPU multiplies it natively
    if smoke:
        settings += [f"train.max_steps={SMOKE_STEPS}", "train.save_every_steps=10",
                      "train.warmup_steps=10", "train.valid_every_steps=1000000",
                      "train.max_tokens=2000", "train.keep_last=2",
                      "train.log_every_steps=5"]  # fmt: skip
    else:
        settings.append(f"train.max_minutes={train_minutes or TRAIN_MINUTES}")
    settings += overrides
    build_config(preset, overrides=settings)  # a bad override fails now, not after `prepare`
    out_dir = Path(out_dir)
    seconds: dict[str, float] = {}
    data_dir, run_dir = out_dir / "data", out_dir / "run"
    from_dir = data_from if data_from is not None else find_multi30k()

    with _stage("prepare", seconds):
        if from_dir is None:
            logger.info("Multi30k not found on disk: downloading it from its official source")
        manifest = prepare_corpus("multi30k", src_lang, tgt_lang, data_dir, from_dir=from_dir)
    config = build_config(preset, overrides=settings, vocab_size=manifest.vocab_size)

    with _stage("train", seconds):
        if (run_dir / rundir.CONFIG).exists():
            logger.info("%s holds an earlier run: starting it afresh", run_dir)
            _clear_run(run_dir)
        train(data_dir, run_dir, config)

    score = beam4_scorer(data_dir, limit=SMOKE_TEST_SENTENCES if smoke else None)

    def calibrate(model: Path) -> None:  # GPTQ's int8 weights into the model file (gptq.py)
        quantize_model_file(model, data_dir, threads="auto")

    with _stage("average, int8 by GPTQ, α on val", seconds):  # the last 5 (§6.1), then α
        alphas = ALPHAS[::2] if smoke else ALPHAS
        choice = choose_on_val(run_dir, out_dir, score, windows=(config.train.keep_last,),
                               alphas=alphas, calibrate=calibrate)  # fmt: skip
    model_path = Path(choice["model"])

    translations = out_dir / f"test_2016_flickr.{tgt_lang}.hyp"
    with _stage("translate", seconds):
        report = score(model_path, [choice["alpha"]], "test", translations)[0]
    report["chosen_on_val"] = choice
    report["train_steps"], losses = _train_losses(run_dir)
    result = QuickstartResult(out_dir, model_path, translations, report, seconds, losses)
    (out_dir / "quickstart.json").write_text(
        json.dumps({**report, "stage_seconds": seconds, "model": str(model_path)}, indent=2)
    )
    return result


def _clear_run(run_dir: Path) -> None:
    import shutil

    shutil.rmtree(run_dir)


def _train_losses(run_dir: Path) -> tuple[int, list[float]]:
    """The training losses logged in the run's metrics.jsonl, in order, and the last step."""
    from transformer.rundir import read_metrics

    losses, step = [], 0
    for _, row in read_metrics(run_dir, "train"):
        if "loss" in row:
            losses.append(float(row["loss"]))
            step = int(row.get("step", step))
    return step, losses
