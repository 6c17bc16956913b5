"""Checkpoints: atomic save, keep the last K, a `latest` pointer, resume; §6.1 averaging of
state dicts (`rundir.average_run` writes the averaged model file).

A run directory holds `checkpoints/ckpt_<step>.pt` (written on the save cadence, the ones §6.1
averages), at most one `checkpoints/ckpt_<step>_end.pt` (the end of a run that stopped between
two cadence points: for resuming only, never averaged) and `checkpoints/latest` (the file name of
the newest complete checkpoint). A checkpoint is written to a temporary file, fsynced and renamed
into place; only then is `latest` replaced the same way, so a kill at any moment leaves `latest`
naming a complete file. Checkpoints hold only tensors and plain Python values and are read with
`torch.load(weights_only=True)`: loading never runs code from the file.
"""

from __future__ import annotations

import logging
import random
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

# Re-exported: the writers of runs, models and kernels call them as checkpoint.write_atomic etc.
from transformer.atomic import (  # noqa: F401
    TEMPORARY,
    remove_stale,
    replace_atomic,
    write_atomic,
)
from transformer.errors import UserError

logger = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
LATEST = "latest"
_NAME = re.compile(r"^ckpt_(\d+)(_end)?\.pt$")


class CheckpointError(UserError):
    """A checkpoint or run directory is missing or unreadable; the message names the file."""


def step_of(path: Path) -> int:
    """The step of a checkpoint file `ckpt_<step>.pt`."""
    return int(_NAME.match(Path(path).name).group(1))


def list_checkpoints(run_dir: Path, cadence_only: bool = False) -> list[Path]:
    """Complete checkpoints of a run, oldest first (by step).

    cadence_only: only those written on the save cadence (`ckpt_<step>.pt`), which §6.1
        averages; without it the end-of-run `ckpt_<step>_end.pt` is listed too.
    """
    directory = Path(run_dir) / CHECKPOINT_DIR
    if not directory.is_dir():
        return []
    found = [
        (int(m.group(1)), m.group(2) is not None, p)
        for p in directory.iterdir()
        if (m := _NAME.match(p.name)) and not (cadence_only and m.group(2))
    ]
    return [p for _, _, p in sorted(found)]


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint named by `latest`, or None if the run has none yet."""
    pointer = Path(run_dir) / CHECKPOINT_DIR / LATEST
    if not pointer.is_file():
        return None
    path = pointer.parent / pointer.read_text(encoding="utf-8").strip()
    if not path.is_file():
        raise CheckpointError(f"{pointer}: names {path.name}, which does not exist")
    return path


def save_checkpoint(
    run_dir: Path, step: int, state: dict[str, Any], keep_last: int, on_cadence: bool = True
) -> Path:
    """Write `checkpoints/ckpt_<step>.pt` atomically, point `latest` at it, keep the last K.

    Args:
        run_dir: the run directory.
        step: optimizer step, used in the file name.
        state: tensors and plain values only (see `training_state`).
        keep_last: how many cadence checkpoints to keep (§6.1: 5 for base, 20 for big).
        on_cadence: False for the end of a run between two cadence points: it is written as
            `ckpt_<step>_end.pt`, resumes like any other, and is never averaged nor counted
            in `keep_last` (so it pushes no cadence checkpoint out).

    Returns:
        The checkpoint's path.
    """
    directory = Path(run_dir) / CHECKPOINT_DIR
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / (f"ckpt_{step}.pt" if on_cadence else f"ckpt_{step}_end.pt")
    try:
        write_atomic(path, lambda f: torch.save(state, f))
        write_atomic(directory / LATEST, lambda f: f.write(path.name.encode("utf-8")))
    except OSError as e:  # disk full, permission denied; `latest` still names the previous one
        raise CheckpointError(f"{path}: cannot save the checkpoint: {e.strerror or e}") from e
    for old in list_checkpoints(run_dir, cadence_only=True)[:-keep_last]:
        old.unlink()
    for old in list_checkpoints(run_dir):  # an end checkpoint is kept only while it is latest
        if old.name.endswith("_end.pt") and old != path:
            old.unlink()
    logger.info("saved checkpoint %s", path)
    return path


def load_checkpoint(path: Path, mmap: bool = False) -> dict[str, Any]:
    """Read a checkpoint (tensors and plain values only). `mmap`: its tensors are views of a
    mapping of the file, read only where touched (`average_files` reads the model's and none
    of the optimizer's); they must not outlive a file that may be rewritten."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # torch raises several types for truncated or foreign files
        if mmap:  # a file it cannot map is "not saved with the zipfile format": read, it says why
            return load_checkpoint(path)
        if Path(path).is_file() and Path(path).stat().st_size == 0:
            raise CheckpointError(f"{path}: not a readable checkpoint: the file is empty") from e
        raise CheckpointError(f"{path}: not a readable checkpoint: {e}") from e


def load_latest(run_dir: Path, mmap: bool = False) -> tuple[Path, dict[str, Any]] | None:
    """The newest readable checkpoint of a run and its contents, or None if it has none.

    `latest` names a complete file when written; if that file was damaged since (truncated by a
    copy, a full disk, a bad sector), the newest older checkpoint that loads is used instead,
    with a warning naming both. `mmap`: as `load_checkpoint`'s.
    """
    try:
        named = latest_checkpoint(run_dir)
    except CheckpointError as e:
        logger.warning("%s", e)
        named = None
    candidates = list_checkpoints(run_dir)
    if named is not None:
        candidates = [p for p in candidates if p != named] + [named]
    if not candidates:
        return None
    first_error = None
    for path in reversed(candidates):
        try:
            state = load_checkpoint(path, mmap=mmap)
        except CheckpointError as e:
            first_error = first_error or e
            logger.warning("%s; trying the previous checkpoint", e)
            continue
        if path != candidates[-1]:
            logger.warning("using %s instead of the unreadable %s", path, candidates[-1])
        return path, state
    raise CheckpointError(f"{run_dir}: no readable checkpoint ({first_error})")


def rng_state() -> dict[str, Any]:
    """Every random generator's state as tensors and plain values (weights_only-safe)."""
    np_state = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": torch.from_numpy(np_state[1].astype(np.int64)),
        "numpy_pos": int(np_state[2]),
        "numpy_gauss": [int(np_state[3]), float(np_state[4])],
        "python": torch.tensor(py_state, dtype=torch.int64),
        "python_version": py_version,
        "python_gauss": py_gauss,
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` returned."""
    torch.set_rng_state(state["torch"])
    has_gauss, gauss = state["numpy_gauss"]
    np.random.set_state(
        ("MT19937", state["numpy"].numpy().astype(np.uint32), state["numpy_pos"], has_gauss, gauss)
    )
    py_state = tuple(int(x) for x in state["python"].tolist())
    random.setstate((state["python_version"], py_state, state["python_gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def average_checkpoints(states: Iterable[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """§6.1: the element-wise mean of several model state dicts (in fp64, returned as fp32).

    The states are taken one at a time (an iterator may load each as it is asked for): the
    memory is the fp64 sums and one state, not every state at once (a big model's 20
    checkpoints, the paper's, would be 20 x 0.86 GB of weights and twice that of Adam's moments).

    Args:
        states: model state dicts with the same keys and shapes.

    Returns:
        The averaged state dict; non-float entries are taken from the last state.
    """
    totals: dict[str, torch.Tensor] = {}
    others: dict[str, torch.Tensor] = {}  # the non-float entries of the latest state
    keys: list[str] | None = None
    n = 0
    for state in states:  # (not enumerate: its reused tuple would hold the previous state)
        if keys is None:
            keys = list(state)
        elif list(state) != keys:
            raise ValueError(f"average_checkpoints: state {n} has different keys")
        for k in keys:
            if not state[k].is_floating_point():
                others[k] = state[k].clone()
                continue
            if k not in totals:
                totals[k] = torch.zeros(state[k].shape, dtype=torch.float64)
            totals[k] += state[k].double()  # in the states' order, as when all were loaded
        n += 1
        del state  # not held while the next one loads
    if keys is None:
        raise ValueError("average_checkpoints: no checkpoints given")
    return {k: (totals[k] / n).float() if k in totals else others[k] for k in keys}
