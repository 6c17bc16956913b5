"""The presets as a table: each preset's hyperparameters and its parameter count."""

from __future__ import annotations

import dataclasses
from typing import Any

from transformer.config import PRESETS, build_config


def count_parameters(model_cfg) -> int:
    """Parameters of the model a config describes, counted by building it on the meta device."""
    import torch

    from transformer.model import Transformer

    with torch.device("meta"):
        return Transformer(model_cfg).num_parameters()


def describe_presets(vocab_size: int) -> list[dict[str, Any]]:
    """One dict per preset: name, parameters at this vocabulary size, every model and train value
    that the preset sets."""
    rows = []
    for name in PRESETS:
        cfg = build_config(name, vocab_size=vocab_size)
        row: dict[str, Any] = {"name": name, "parameters": count_parameters(cfg.model)}
        row.update(dataclasses.asdict(cfg.model))
        row.update({k: getattr(cfg.train, k) for k in ("eps_ls", "max_steps", "warmup_steps")})
        rows.append(row)
    return rows
