"""§6.2 Table 3 at convergence: `transformer sweep table3 --converge`.

Each row trains until dev perplexity has not improved for `patience` validations in a row (the
trainer's early stopping, `train.patience`) or until an epoch cap, then is measured as §6.2 does:
dev perplexity per subword (no label smoothing) and dev BLEU with beam 4, α 0.6, no checkpoint
averaging. The parameters measured are those of the validation with the best dev perplexity
(checkpointed at every validation, and the last `patience + 1` kept, so the best is always on
disk), not those at the stop: the stop comes `patience` validations past the best, and how much
a row loses over those depends on how fast it over-fits (D1, without dropout, the most), which
would mix the patience setting into the comparison. The best checkpoint alone is used: §6.2's
"no checkpoint averaging". The dev perplexity of the last validation is recorded too.

Seeds (issue 20): the base gets `seeds` seeds; every other row gets one, and then as many as
the base if its first seed's dev perplexity is within two standard deviations of the base's
(`table3_findings.needs_more_seeds`). First every row's first seed (a whole table early), then
the extra seeds. The report shows mean ± std (n) per row and the paper's findings checked
against them (`table3_findings`).

Layout: DIR/sweep.json (the settings), DIR/<row>/seed<k>/ (a run directory with result.json,
model.safetensors = the measured parameters, and the last checkpoint), DIR/table3.md and .csv.
`resume=True` continues a sweep across sessions: finished seeds are read, a seed interrupted
in training resumes from its last checkpoint; a sweep made with other settings is refused.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import time
from collections.abc import Sequence
from concurrent.futures import Executor, ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

from transformer import checkpoint
from transformer.config import RunConfig, apply_overrides, build_config, parse_overrides
from transformer.errors import UserError
from transformer.experiments import table3_findings as tf
from transformer.experiments.table3 import (
    PAPER_TABLE3,
    ROWS,
    SCALES,
    RowModel,
    row_config,
    row_model,
    write_csv,
)

log = logging.getLogger(__name__)

SETTINGS = "sweep.json"
RESULT = "result.json"

# The sweep's own stopping and checkpointing keys: set by its flags, not by --set.
_CONTROLLED = ("train.patience", "train.patience_metric", "train.max_epochs",
               "train.max_steps", "train.max_minutes", "train.valid_every_steps",
               "train.save_every_steps", "train.save_every_minutes", "train.keep_last",
               "train.seed", "train.valid_bleu")  # fmt: skip


@dataclass(frozen=True)
class ConvergeSettings:
    """Everything that decides a convergence sweep's numbers; saved as DIR/sweep.json."""

    data: str
    scale: str
    overrides: tuple[str, ...] = ()
    patience: int = 3  # validations without a better dev perplexity
    valid_every: int | None = None  # steps between validations; None = half an epoch
    max_epochs: float = 10.0  # the cap: see docs/table3.md for the CPU-hour budget
    seeds: int = 3
    beam_size: int = 4
    length_penalty: float = 0.6
    valid_limit: int | None = None

    def check(self) -> None:
        if self.patience < 1:
            raise UserError(f"sweep --converge: --patience must be at least 1, got {self.patience}")
        if self.valid_every is not None and self.valid_every < 1:
            raise UserError(f"sweep --converge: --valid-every must be at least 1, got "
                            f"{self.valid_every}")  # fmt: skip
        if not self.max_epochs > 0:
            raise UserError(f"sweep --converge: --max-epochs must be positive, got "
                            f"{self.max_epochs}")  # fmt: skip
        if self.seeds < 1:
            raise UserError(f"sweep --converge: --seeds must be at least 1, got {self.seeds}")
        for key in parse_overrides(list(self.overrides)):
            if key in _CONTROLLED:
                raise UserError(f"sweep --converge: --set {key} is the sweep's own setting; use "
                                "--patience, --valid-every, --max-epochs or --seeds")  # fmt: skip


@dataclass
class SeedResult(RowModel):
    """One (row, seed): the model, how its training ended, and the §6.2 measurements."""

    seed: int
    params: int
    steps: int  # optimizer steps when training stopped
    epochs: float  # passes over the training data when it stopped
    best_step: int  # the validation with the best dev perplexity: the parameters measured
    stopped: str  # "patience", "epoch cap" (or "step cap", "time")
    dev_ppl: float  # §6.2, of the best-step parameters, all dev sentences
    dev_bleu: float  # §6.2, beam search, no averaging, of the best-step parameters
    last_valid_ppl: float  # the trainer's last validation (the parameters at the stop)
    train_minutes: float  # training time (validation and checkpoints excluded)
    wall_minutes: float  # the last attempt's wall time, measurement included


def check_sweep(out_dir: Path, settings: ConvergeSettings, resume: bool) -> None:
    """Refuse what cannot run: bad settings; on --resume a directory without DIR/sweep.json or
    with other settings; otherwise a directory that already holds a sweep or anything else."""
    settings.check()
    path = Path(out_dir) / SETTINGS
    if not resume:
        if path.is_file():
            raise UserError(f"{out_dir}: already holds a sweep ({SETTINGS}); pass --resume to "
                            "continue it, or choose another --out")  # fmt: skip
        if Path(out_dir).is_dir() and any(Path(out_dir).iterdir()):
            raise UserError(f"{out_dir}: not empty and not a convergence sweep; choose another "
                            "--out")  # fmt: skip
        return
    if not path.is_file():
        raise UserError(f"{out_dir}: no sweep to resume ({SETTINGS} not found)")
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: cannot read the sweep's settings: {e}") from e
    if not isinstance(saved, dict):
        raise UserError(f"{path}: not a settings object")
    wanted = _as_json(settings)
    diff = [k for k in sorted(set(saved) | set(wanted)) if saved.get(k) != wanted.get(k)]
    if diff:
        was = ", ".join(f"{k}={saved.get(k)!r}" for k in diff)
        now = ", ".join(f"{k}={wanted.get(k)!r}" for k in diff)
        raise UserError(f"{path}: the sweep was made with {was}; this command has {now}. "
                        "Resume with the sweep's settings, or start a new --out")  # fmt: skip


def _as_json(settings: ConvergeSettings) -> dict:
    return json.loads(json.dumps(asdict(settings)))  # tuples as lists, as read back


def prepare_sweep(out_dir: Path, settings: ConvergeSettings, resume: bool) -> None:
    """`check_sweep`, then write DIR/sweep.json for a new sweep."""
    check_sweep(out_dir, settings, resume)
    if not resume:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        text = json.dumps(_as_json(settings), indent=1) + "\n"
        (Path(out_dir) / SETTINGS).write_text(text, encoding="utf-8")


def _read_result(path: Path) -> SeedResult:
    try:
        return SeedResult(**json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError) as e:  # JSONDecodeError is a ValueError
        raise UserError(f"{path}: not a sweep result: {e}") from e


def collect(out_dir: Path) -> list[SeedResult]:
    """Every finished (row, seed) of a sweep directory, in Table 3's order, then by seed."""
    found = []
    for row in ROWS:
        found += [_read_result(p) for p in (Path(out_dir) / row).glob(f"seed*/{RESULT}")]
    return sorted(found, key=lambda r: (ROWS.index(r.row), r.seed))


def sweep_base(settings: ConvergeSettings, batches_per_epoch: int | None = None) -> RunConfig:
    """The base run config with the sweep's stopping rule: patience on dev perplexity, the epoch
    cap, a checkpoint at every validation with the last `patience + 1` kept (the best among
    them). `batches_per_epoch` gives the default cadence (half an epoch)."""
    base = build_config(SCALES.get(settings.scale, settings.scale),
                        overrides=list(settings.overrides))  # fmt: skip
    every = settings.valid_every or max(1, round((batches_per_epoch or 2) / 2))
    stop = {"train.patience": settings.patience, "train.patience_metric": "ppl",
            "train.max_epochs": settings.max_epochs, "train.max_steps": 10**9,
            "train.max_minutes": None, "train.valid_every_steps": every,
            "train.save_every_steps": every, "train.save_every_minutes": 1e9,
            "train.keep_last": settings.patience + 1,
            # only perplexity decides; the §6.2 BLEU is measured once, with beam 4, at the end
            "train.valid_bleu": False}  # fmt: skip
    return apply_overrides(base, stop, source="sweep --converge")


def _batches_per_epoch(data_dir: Path, settings: ConvergeSettings) -> int:
    from transformer.batching import TokenBatchSampler
    from transformer.data import load_prepared

    split = load_prepared(data_dir).split("train")
    max_tokens = sweep_base(settings).train.max_tokens
    return len(TokenBatchSampler(split.src_lens, split.tgt_lens, max_tokens, seed=1))


def _stop_reason(state, cfg, epochs: float) -> str:
    if cfg.patience > 0 and state.bad_validations >= cfg.patience:
        return "patience"
    if cfg.max_epochs is not None and epochs >= cfg.max_epochs:
        return "epoch cap"
    return "step cap" if state.step >= cfg.max_steps else "time"


def _train_seed(row: str, seed: int, config: RunConfig, data_dir: Path, run_dir: Path,
                settings: ConvergeSettings, threads) -> SeedResult:  # fmt: skip
    """Train (or resume) one seed of one row to its stop, then measure its best checkpoint."""
    from transformer import rundir
    from transformer.data import load_prepared
    from transformer.evaluate import evaluate
    from transformer.train import train
    from transformer.trainer import evaluate_loss

    start = time.perf_counter()
    if checkpoint.latest_checkpoint(run_dir) is not None:  # interrupted: continue from it
        state = train(None, run_dir, resume=True, progress=False, threads=threads)
    else:
        (run_dir / rundir.METRICS).unlink(missing_ok=True)  # an attempt killed before saving
        state = train(data_dir, run_dir, config, progress=False, threads=threads)
    cfg = rundir.read_config(run_dir).train
    trains = [r for _, r in rundir.read_metrics(run_dir, "train")]
    valids = [r for _, r in rundir.read_metrics(run_dir, "valid")]
    epochs = float(trains[-1].get("epochs", 0.0)) if trains else 0.0
    cadence = {checkpoint.step_of(p) for p in checkpoint.list_checkpoints(run_dir, True)}
    if not valids or state.best_step not in cadence:
        raise UserError(f"{run_dir}: training stopped at step {state.step} without a "
                        "checkpointed best validation; lower --valid-every")  # fmt: skip
    # §6.2: no checkpoint averaging: the one checkpoint of the best validation, as a model file.
    rundir.average_run(run_dir, last=1, upper_bound=state.best_step)
    loaded = rundir.resolve_model(run_dir)  # that model.safetensors
    valid = load_prepared(data_dir).split("valid")
    ppl = evaluate_loss(loaded.model, valid, cfg.max_tokens)["ppl"]
    report = evaluate(run_dir, data_dir, "valid", settings.beam_size, settings.length_penalty,
                      limit=settings.valid_limit, threads=threads)  # fmt: skip
    return SeedResult(
        **row_model(row, loaded.config), seed=seed, params=loaded.model.num_parameters(),
        steps=state.step, epochs=epochs,
        best_step=state.best_step, stopped=_stop_reason(state, cfg, epochs), dev_ppl=ppl,
        dev_bleu=float(report["bleu"]), last_valid_ppl=float(valids[-1]["ppl"]),
        train_minutes=rundir.training_totals(run_dir)["elapsed_s"] / 60,
        wall_minutes=(time.perf_counter() - start) / 60,
    )  # fmt: skip


def _prune(run_dir: Path) -> None:
    """A measured run keeps its model file and its last checkpoint (to train it further)."""
    for old in checkpoint.list_checkpoints(run_dir)[:-1]:
        old.unlink()


def _run_seed(out_dir: Path, data_dir: Path, settings: ConvergeSettings, base: RunConfig,
              threads, row: str, seed: int) -> SeedResult:  # fmt: skip
    """One (row, seed) of the sweep: read back if finished, else train, measure and record it.
    Module-level (not a closure) so that `jobs > 1` can run it in a worker process."""
    run_dir = out_dir / row / f"seed{seed}"
    done = run_dir / RESULT
    if done.is_file():
        return _read_result(done)
    log.info("row %s seed %d: training to convergence", row, seed)
    config = apply_overrides(row_config(row, base), {"train.seed": seed}, "sweep seed")
    result = _train_seed(row, seed, config, data_dir, run_dir, settings, threads)
    text = json.dumps(asdict(result), indent=1) + "\n"
    checkpoint.write_atomic(done, lambda f: f.write(text.encode("utf-8")))
    _prune(run_dir)
    log.info("row %s seed %d: %s after %d steps (%.1f epochs); dev PPL %.2f, BLEU %.2f",
             row, seed, result.stopped, result.steps, result.epochs, result.dev_ppl,
             result.dev_bleu)  # fmt: skip
    return result


def _worker_logging(level: int) -> None:
    """A worker process (spawned: it inherits no logging set-up) logs as the sweep does, with
    its process id, since several trainings interleave their lines."""
    logging.basicConfig(level=level, format="%(asctime)s [%(process)d] %(message)s",
                        datefmt="%H:%M:%S")  # fmt: skip


def _executor(jobs: int) -> Executor:
    """Worker processes for `jobs > 1`, started with "spawn": each initialises its own CUDA
    context and thread pools (a forked CUDA context is unusable, forked OpenMP pools hang)."""
    return ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_worker_logging,
                               initargs=(logging.getLogger().getEffectiveLevel(),))  # fmt: skip


def _run_all(run, tasks: Sequence[tuple[str, int]], jobs: int) -> dict[tuple[str, int], SeedResult]:
    """Run (row, seed) tasks, `jobs` at a time; the first failure cancels what has not started
    and is raised once the running trainings have stopped (each keeps its checkpoints)."""
    if jobs <= 1:
        return {task: run(*task) for task in tasks}
    with _executor(jobs) as pool:
        futures = {pool.submit(run, *task): task for task in tasks}
        try:
            for future in as_completed(futures):
                future.result()
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    return {task: future.result() for future, task in futures.items()}


def run_converged(
    data_dir: Path,
    out_dir: Path,
    settings: ConvergeSettings,
    rows: Sequence[str] = ROWS,
    resume: bool = False,
    threads: int | str | None = None,
    jobs: int = 1,
) -> list[SeedResult]:
    """`transformer sweep table3 --converge`: train every row to convergence with the seed rule;
    write DIR/table3.md (with the findings) and DIR/table3.csv.

    Args:
        data_dir: a prepared-data directory with train and valid splits.
        out_dir: the sweep directory (see the module docstring).
        settings: the sweep's settings (`settings.data` is recorded; `data_dir` is read).
        rows: the rows to run this time; base is always run first (the seed rule needs it).
        resume: continue the sweep in `out_dir` (made with the same settings).
        threads: CPU threads for training and decoding (a number, "auto" or None); with
            `jobs > 1`, "auto" and None mean one thread per training.
        jobs: trainings run at once, each in its own process (a GPU, or a CPU with cores to
            spare). With more than one, the base's seeds and every row's first seed run
            together, then the extra seeds: the seed rule and the results are those of
            `jobs=1`, only the order in which trainings start differs.

    Returns:
        Every finished (row, seed) of the sweep directory (`collect`), this call's and earlier
        calls' (e.g. with other `rows`), in Table 3's order.
    """
    out_dir, data_dir = Path(out_dir), Path(data_dir)
    for row in rows:
        if row not in ROWS:
            raise UserError(f"unknown Table 3 row {row!r}; choose from {', '.join(ROWS)}")
    if jobs < 1:
        raise UserError(f"sweep: --jobs must be at least 1, got {jobs}")
    check_sweep(out_dir, settings, resume)
    per_epoch = _batches_per_epoch(data_dir, settings)  # reads the data: a bad --data fails here
    prepare_sweep(out_dir, settings, resume)
    base = sweep_base(settings, per_epoch)
    if jobs > 1 and threads in (None, "auto"):
        threads = 1  # the trainings share the cores: one thread each (issue 20)
    run = partial(_run_seed, out_dir, data_dir, settings, base, threads)

    base_seeds = [("base", k) for k in range(1, settings.seeds + 1)]
    others = [r for r in dict.fromkeys(rows) if r != "base"]
    if jobs > 1:  # the first seeds need not wait for the base: only the extra seeds do
        first = _run_all(run, base_seeds + [(row, 1) for row in others], jobs)
    else:
        first = _run_all(run, base_seeds, jobs)
        first.update(_run_all(run, [(row, 1) for row in others], jobs))
    base_ppl = [first[task].dev_ppl for task in base_seeds]
    # the seed rule, once every row has its first seed
    extra = [(row, k) for row in others if tf.needs_more_seeds(base_ppl, first[row, 1].dev_ppl)
             for k in range(2, settings.seeds + 1)]  # fmt: skip
    _run_all(run, extra, jobs)
    done = collect(out_dir)  # this run's rows and those of earlier runs with other --rows
    write_converged_report(done, out_dir / "table3.md", out_dir / "table3.csv", settings)
    return done


def row_stats(results: Sequence[SeedResult]) -> dict[str, dict[str, tf.Stat]]:
    """row -> {"ppl": Stat, "bleu": Stat} over the row's seeds."""
    by_row: dict[str, list[SeedResult]] = {}
    for r in results:
        by_row.setdefault(r.row, []).append(r)
    return {
        row: {"ppl": tf.stat([r.dev_ppl for r in rs]), "bleu": tf.stat([r.dev_bleu for r in rs])}
        for row, rs in by_row.items()
    }


_HEADER = ["row", "N", "d_model", "d_ff", "h", "d_k", "d_v", "P_drop", "ε_ls", "positions",
           "params (M)", "dev PPL", "dev BLEU", "steps", "epochs", "best step", "stopped",
           "train min", "paper PPL", "paper BLEU"]  # fmt: skip


def _row_cells(rs: Sequence[SeedResult], stats: dict[str, tf.Stat]) -> list[str]:
    r, n = rs[0], len(rs)
    stops = {s: sum(x.stopped == s for x in rs) for s in dict.fromkeys(x.stopped for x in rs)}
    paper = PAPER_TABLE3.get(r.row, (float("nan"), float("nan"), None))
    return [r.row, str(r.n_layers), str(r.d_model), str(r.d_ff), str(r.n_heads), str(r.d_k),
            str(r.d_v), f"{r.p_drop:g}", f"{r.eps_ls:g}", r.positions, f"{r.params / 1e6:.2f}",
            stats["ppl"].text(2), stats["bleu"].text(2),
            f"{sum(x.steps for x in rs) / n:.0f}", f"{sum(x.epochs for x in rs) / n:.1f}",
            f"{sum(x.best_step for x in rs) / n:.0f}",
            ", ".join(f"{s} ×{c}" if n > 1 else s for s, c in stops.items()),
            f"{sum(x.train_minutes for x in rs) / n:.1f}", f"{paper[0]:.2f}",
            f"{paper[1]:.1f}"]  # fmt: skip


def write_converged_report(results: Sequence[SeedResult], md_path: Path, csv_path: Path,
                           settings: ConvergeSettings) -> None:  # fmt: skip
    """Markdown: one line per row (mean ± std over seeds; steps, epochs, best step and train
    minutes are means), then the findings; CSV: one line per (row, seed)."""
    stats = row_stats(results)
    by_row: dict[str, list[SeedResult]] = {}
    for r in results:
        by_row.setdefault(r.row, []).append(r)
    minutes = sum(r.train_minutes for r in results)
    lines = ["# Table 3 sweep at convergence", "",
             "Settings: " + ", ".join(f"{k}={v}" for k, v in asdict(settings).items()), "",
             f"{len(results)} trainings, {minutes:.0f} training minutes in all. Dev PPL and BLEU "
             "are mean ± sample std over seeds (n seeds), of the parameters of each run's best "
             "validation, beam search, no averaging (§6.2).", "",
             "| " + " | ".join(_HEADER) + " |", "|" + "---|" * len(_HEADER)]  # fmt: skip
    lines += ["| " + " | ".join(_row_cells(rs, stats[row])) + " |" for row, rs in by_row.items()]
    lines += ["", "## Findings", "", "The paper's conclusions (§6.2) at this scale; a difference "
              "counts when it exceeds twice its standard error (table3_findings).", ""]  # fmt: skip
    lines += tf.render(tf.findings(stats))
    Path(md_path).write_text("\n".join(lines) + "\n", encoding="utf-8")
    write_csv(results, csv_path, list(SeedResult.__dataclass_fields__))
