"""The run directory: one owner for its layout, its readers and for "any path -> a model".

    RUN/config.yaml          the resolved RunConfig, written at every (re)start, read on resume
    RUN/run.json             {"data_dir": ...}: the prepared data the run trains on
    RUN/train.log            the log of every start of the run
    RUN/metrics.jsonl        one JSON record a line: {"kind": "train" | "valid", "step", ...}
    RUN/tensorboard/         the same scalars for TensorBoard (when installed)
    RUN/checkpoints/         ckpt_<step>.pt and `latest` (checkpoint.py)
    RUN/model.safetensors    the averaged model (§6.1, `transformer average`)

A quickstart directory holds `data/`, `run/` (a run directory as above), `model.safetensors`
and the test translations. `resolve_model` turns any of these paths, or a model file, into a model.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import yaml

from transformer import checkpoint
from transformer.config import RunConfig, from_dict, to_dict
from transformer.errors import UserError
from transformer.model import Transformer
from transformer.modelfile import LoadedModel, load_model, model_of_tensors, save_model

logger = logging.getLogger(__name__)

CONFIG = "config.yaml"
RUN_INFO = "run.json"
LOG = "train.log"
METRICS = "metrics.jsonl"
TENSORBOARD = "tensorboard"
MODEL = "model.safetensors"
QUICKSTART_RUN = "run"  # a quickstart directory's run directory


def write_run_files(run_dir: Path, config: RunConfig, data_dir: Path) -> None:
    """config.yaml and run.json of a run that (re)starts, each written atomically (as
    checkpoints are): a kill at that moment must not leave a run that cannot resume."""
    run_dir = Path(run_dir)
    for name, text in (
        (CONFIG, yaml.safe_dump(to_dict(config))),
        (RUN_INFO, json.dumps({"data_dir": str(data_dir)})),
    ):
        try:
            checkpoint.write_atomic(run_dir / name, lambda f, t=text: f.write(t.encode("utf-8")))
        except OSError as e:
            raise UserError(f"{run_dir / name}: cannot write: {e.strerror or e}") from e


def read_config(run_dir: Path) -> RunConfig:
    """The run's resolved config (config.yaml)."""
    path = Path(run_dir) / CONFIG
    if not path.is_file():
        raise UserError(f"{path}: not found; is {run_dir} a run directory?")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        problem = str(e).replace("\n", " ")
        raise UserError(f"{path}: cannot parse YAML: {problem}") from e
    if not isinstance(raw, dict) or not all(isinstance(v, dict) for v in raw.values()):
        raise UserError(f"{path}: not a run config (a mapping of sections)")
    return from_dict(raw, source=str(path))


def read_data_dir(run_dir: Path) -> Path:
    """The prepared-data directory the run was started with (run.json)."""
    path = Path(run_dir) / RUN_INFO
    try:
        return Path(json.loads(path.read_text(encoding="utf-8"))["data_dir"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{path}: cannot read the run's data directory: {e}") from e


def append_metrics(run_dir: Path, record: dict[str, Any]) -> None:
    """One record a line in metrics.jsonl."""
    with open(Path(run_dir) / METRICS, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def read_metrics(run_dir: Path, kind: str | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, record) of metrics.jsonl, of one kind ("train", "valid") or all; a record
    without a kind is a training record. Blank lines are skipped, a bad line is an error."""
    path = Path(run_dir) / METRICS
    if not path.is_file():
        raise UserError(f"{path}: not found; is {run_dir} a training run directory?")
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{number}: not a JSON line: {e}") from e
            if kind is None or record.get("kind", "train") == kind:
                yield number, record


def training_totals(run_dir: Path) -> dict[str, float]:
    """The run's training totals from metrics.jsonl: {"step", "tgt_tokens", "elapsed_s"}.

    The trainer appends one `{"kind": "train", "step", "tokens" (target tokens so far),
    "tokens_per_s" (over the window since the previous record), ...}` line per log window.
    Training time is the sum over windows of window tokens / tokens_per_s, so validation and
    checkpointing time are not counted. A record with `elapsed_s` is taken as is.
    """
    path = Path(run_dir) / METRICS
    totals: dict[str, float] | None = None
    seconds, tokens_before = 0.0, 0
    for number, record in read_metrics(run_dir, "train"):
        if "tokens" not in record:
            continue
        if "elapsed_s" in record:
            seconds = float(record["elapsed_s"])
        elif record.get("tokens_per_s"):
            seconds += (record["tokens"] - tokens_before) / record["tokens_per_s"]
        else:
            raise UserError(f"{path}:{number}: no tokens_per_s or elapsed_s")
        tokens_before = record["tokens"]
        totals = {"step": int(record["step"]), "tgt_tokens": float(record["tokens"]),
                  "elapsed_s": seconds}  # fmt: skip
    if totals is None:
        raise UserError(f"{path}: no training record (step, tokens, tokens_per_s)")
    return totals


def model_from_checkpoint(
    state: dict[str, Any], source: Path, weights: dict[str, torch.Tensor] | None = None
) -> tuple[Transformer, RunConfig]:
    """The model (fp32 masters, or `weights` given with the same config) and config that a
    training checkpoint holds."""
    config = from_dict(state["config"], source=str(source))
    model = model_of_tensors(source, config.model, state["model"] if weights is None else weights)
    return model, config


def _spm_of(state: dict[str, Any]) -> tuple[bytes, str, str]:
    meta = state["data"]
    return bytes(meta["spm_proto"].numpy()), meta["src"], meta["tgt"]


def average_run(
    run_dir: Path, last: int, out: Path | None = None, upper_bound: int | None = None
) -> Path:
    """`transformer average`: average the run's last N checkpoints into one model file (§6.1).

    Args:
        run_dir: a training run directory.
        last: how many of the newest checkpoints to average (5 for base, 20 for big).
        out: the model file to write (default `RUN_DIR/model.safetensors`, the run's model).
        upper_bound: only checkpoints of at most this step (fairseq's
            `--checkpoint-upper-bound`): the last N up to, e.g., the best dev perplexity.

    Only checkpoints written on the save cadence are averaged (§6.1: "the last 5 checkpoints,
    written at 10-minute intervals"): a run's end between two cadence points is left out.

    Returns:
        The model file's path.
    """
    run_dir = Path(run_dir)
    checkpoint.remove_stale(run_dir)  # e.g. the .model.safetensors.tmp-PID of a killed average
    ckpt_dir = run_dir / checkpoint.CHECKPOINT_DIR
    paths = checkpoint.list_checkpoints(run_dir, cadence_only=True)
    if not paths:
        raise checkpoint.CheckpointError(f"{ckpt_dir}: no checkpoints on the save cadence")
    if upper_bound is not None:
        paths = [p for p in paths if checkpoint.step_of(p) <= upper_bound]
    if last < 1 or last > len(paths):
        bound = "" if upper_bound is None else f" up to step {upper_bound}"
        raise checkpoint.CheckpointError(
            f"{ckpt_dir}: --last {last} asked, {len(paths)} checkpoints present{bound}"
        )
    return average_files(paths[-last:], Path(out) if out is not None else run_dir / MODEL)


def average_files(paths: Sequence[Path], out: Path) -> Path:
    """Average these checkpoint files (§6.1) into the model file `out`; the newest (last) one
    gives the config and the tokenizer. Returns `out`."""
    newest: dict = {}

    def models() -> Iterator[dict[str, torch.Tensor]]:
        # One checkpoint at a time, mapped: its model's tensors are read as they are summed,
        # its optimizer's not at all (a checkpoint is ~3x its model: Adam's two moments).
        for path in paths:
            state = checkpoint.load_checkpoint(path, mmap=True)
            newest.clear()
            newest.update((k, v) for k, v in state.items() if k not in ("model", "optimizer"))
            model = state.pop("model")
            del state
            yield model
            del model  # not held while the next one loads

    averaged = checkpoint.average_checkpoints(models())
    model, config = model_from_checkpoint(newest, paths[-1], averaged)
    save_model(out, model, config, *_spm_of(newest))
    logger.info("averaged %s into %s", ", ".join(p.name for p in paths), out)
    return out


def resolve_model(
    path: str | Path, device: str | torch.device = "cpu", verify: bool = True
) -> LoadedModel:
    """Any path the product wrote -> its model (eval mode).

    A model file; a directory's `model.safetensors` (the averaged model that `transformer
    average` and the quickstart write), else its latest checkpoint (the newest readable one,
    `checkpoint.load_latest`); a quickstart directory's `run/` is looked into the same way.
    Directories written before the one name still resolve (`model_avg.safetensors`, the newest
    `average_last*.safetensors`). `verify`: check a model file's checksum
    (`modelfile.load_model`).
    """
    path = Path(path)
    if not path.is_dir():
        return load_model(path, device, verify)
    for name in (MODEL, "model_avg.safetensors"):
        if (path / name).is_file():
            return load_model(path / name, device, verify)
    averages = sorted(path.glob("average_last*.safetensors"), key=lambda p: p.stat().st_mtime)
    if averages:
        return load_model(averages[-1], device, verify)
    if (path / QUICKSTART_RUN / CONFIG).is_file():
        return resolve_model(path / QUICKSTART_RUN, device, verify)
    # Mapped, so that only the model's tensors are read (a checkpoint is ~3x its model: Adam's
    # moments), then copied: the model outlives the file, which training may rewrite. (A tied
    # weight's two names fill one module, whichever copy it keeps.)
    found = checkpoint.load_latest(path, mmap=True)
    if found is None:
        raise UserError(f"{path}: no model file ({MODEL}) and no checkpoints")
    ckpt, state = found
    state["model"] = {k: v.clone() for k, v in state["model"].items()}
    model, config = model_from_checkpoint(state, ckpt)
    logger.info("using the latest checkpoint %s (no averaged model in %s)", ckpt, path)
    return LoadedModel(model.to(device).eval(), config, *_spm_of(state), ckpt)
