"""Typed configuration: ModelConfig, TrainConfig, DecodeConfig, the presets, YAML + overrides.

A field name is also its YAML key and its override key (`train.warmup_steps=8000`). An unknown
key or a value of the wrong type is an error that names the file (or "override") and the key.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from transformer.errors import UserError

# When a sentence's beam search stops (docs/decoding.md):
#   "t2t":     §6.1 "terminating early when possible", tensor2tensor's rule (the paper's code):
#              only when no live hypothesis can still beat the best finished one;
#   "fairseq": as soon as K hypotheses have finished (fairseq's rule, faster, can miss a longer
#              hypothesis that the length penalty would have preferred when α > 0).
STOP_RULES = ("t2t", "fairseq")

# The precisions a model translates in (translate.py); "auto" picks one for the device it runs
# on (`translate.auto_dtype`): bf16 with CUDA or a CPU with AMX, int8 on a CPU with VNNI and no
# AMX, else fp32.
INFERENCE_DTYPES = ("auto", "fp32", "bf16", "int8")
# The precisions a model trains in (train.py); "auto" (`train.auto_train_dtype`): bf16 where the
# device multiplies it natively (CUDA with bf16, a CPU with avx512_bf16 or AMX), else fp32. A CPU
# without them runs bf16 products through slow fallbacks: 58 against 2,100 target tokens/s for
# the quickstart model on an AVX2 Zen 3 (docs/performance.md, "A CPU without bf16").
TRAIN_DTYPES = ("auto", "bf16", "fp32")


class ConfigError(UserError):
    """A configuration file or override is invalid; the message names the source and the key."""


@dataclass(frozen=True)
class ModelConfig:
    """§3 architecture. Defaults are the paper's base model (Table 3, first row)."""

    vocab_size: int = 37000  # joint vocabulary (§5.1), or the source vocabulary when not shared
    tgt_vocab_size: int | None = None  # None: one joint vocabulary for both sides
    n_layers: int = 6  # N, in the encoder and in the decoder
    d_model: int = 512
    d_ff: int = 2048
    n_heads: int = 8  # h
    d_k: int = 64
    d_v: int = 64
    p_drop: float = 0.1  # §5.4 residual and embedding dropout
    share_embeddings: bool = True  # §3.4: source embedding = target embedding (joint vocabulary)
    learned_pos: bool = False  # Table 3 row (E) instead of §3.5 sinusoids
    max_len: int = 1024  # positions available to the positional encoding
    norm_first: bool = False  # not in the paper: pre-norm with a final LayerNorm per stack
    p_attn_drop: float = 0.0  # not in the paper (tensor2tensor): dropout on attention weights
    attn_window: int | None = None  # §4 Table 1: restricted self-attention, r neighbours each side
    # Not in the paper: the model reads and writes lowercased text. Set from the prepared data
    # (`transformer prepare --lowercase`), never by hand; its tokenizer lowercases any input.
    lowercase: bool = False

    def __post_init__(self) -> None:
        checks = {
            "vocab_size": self.vocab_size > 0,
            "n_layers": self.n_layers > 0,
            "d_model": self.d_model > 0,
            "d_ff": self.d_ff > 0,
            "n_heads": self.n_heads > 0,
            "d_k": self.d_k > 0,
            "d_v": self.d_v > 0,
            "p_drop": 0.0 <= self.p_drop < 1.0,
            "p_attn_drop": 0.0 <= self.p_attn_drop < 1.0,
            "max_len": self.max_len > 0,
            "attn_window": self.attn_window is None or self.attn_window >= 0,
        }
        for name, ok in checks.items():
            if not ok:
                raise ConfigError(f"model.{name}: invalid value {getattr(self, name)!r}")
        separate = self.tgt_vocab_size is not None and self.tgt_vocab_size != self.vocab_size
        if self.share_embeddings and separate:
            raise ConfigError(
                "model.share_embeddings: sharing source and target embeddings needs one joint "
                f"vocabulary, but vocab_size={self.vocab_size} and "
                f"tgt_vocab_size={self.tgt_vocab_size}"
            )

    @property
    def target_vocab_size(self) -> int:
        return self.vocab_size if self.tgt_vocab_size is None else self.tgt_vocab_size


@dataclass(frozen=True)
class TrainConfig:
    """§5 training recipe. Defaults are the paper's (§5.3 Adam + eq. 3, §5.4 eps_ls)."""

    max_tokens: int = 25000  # §5.1: tokens per side per batch (padding counted), per accumulation
    accum_steps: int = 1  # gradient accumulation: batches per optimizer step
    warmup_steps: int = 4000  # §5.3
    lr_scale: float = 1.0  # constant multiplier on eq. (3) (tensor2tensor later used 2.0)
    beta1: float = 0.9  # §5.3
    beta2: float = 0.98  # §5.3
    adam_eps: float = 1e-9  # §5.3
    eps_ls: float = 0.1  # §5.4 label smoothing
    clip_norm: float = 0.0  # not in the paper: gradient-norm clipping, 0 = off
    # Not in the paper: over the last `cooldown` fraction of the budget (max_steps, or
    # max_minutes when set, whichever is nearer its end) eq. (3) is scaled down linearly to 0,
    # for runs that a budget ends rather than convergence. 0 = off (the paper's schedule).
    cooldown: float = 0.0
    max_steps: int = 100000  # §5.2: base 100K steps, big 300K
    max_minutes: float | None = None  # wall-clock budget
    max_epochs: float | None = None  # passes over the training data (fractional allowed)
    # Early stopping (not in the paper, which trains for a fixed 100K/300K steps): stop once
    # `patience` validations in a row have not improved the best `patience_metric` ("ppl", lower
    # is better, or "bleu", greedy, higher is better) by more than `min_delta`. 0 = off.
    patience: int = 0
    patience_metric: str = "ppl"
    min_delta: float = 0.0
    valid_bleu: bool = True  # greedy valid BLEU at each validation (off: perplexity only, faster)
    dtype: str = "auto"  # "bf16" (fp32 master weights), "fp32", or "auto" (TRAIN_DTYPES)
    compile: bool = False  # torch.compile the model
    seed: int = 1
    save_every_steps: int = 0  # 0 = only by time
    save_every_minutes: float = 10.0  # §6.1: checkpoints every 10 minutes
    keep_last: int = 5  # §6.1: average the last 5 (base) or 20 (big)
    valid_every_steps: int = 1000
    log_every_steps: int = 50
    deterministic: bool = False  # deterministic algorithms, for bit-exact resume tests
    # Not in the paper: data-parallel processes on this CPU (`train --procs N`), one thread each,
    # making the same steps as one process would (`per_process`). 1 = one process.
    # (Across GPUs or machines, torchrun; max_tokens is then per rank, and procs stays 1.)
    procs: int = 1

    def per_process(self) -> tuple[int, int]:
        """(tokens a batch, batches a step) of each of the `procs` processes: a step is
        `accum_steps` batches of `max_tokens` whatever `procs` is. Where procs divides
        accum_steps the processes share out the batches (accum_steps 3, procs 3: one batch
        each, the very batches one process accumulates, as batching.py gives rank r batches
        r, r + procs, ...), so procs changes only the speed; otherwise every batch is split
        (max_tokens / procs tokens, accum_steps of them on each process): a step of as many
        tokens, in more, smaller batches."""
        if self.accum_steps % self.procs == 0:
            return self.max_tokens, self.accum_steps // self.procs
        return -(-self.max_tokens // self.procs), self.accum_steps

    def __post_init__(self) -> None:
        if self.dtype not in TRAIN_DTYPES:
            raise ConfigError(
                f"train.dtype: expected one of {', '.join(TRAIN_DTYPES)}, got {self.dtype!r}"
            )
        names = ("max_tokens", "accum_steps", "warmup_steps", "max_steps", "keep_last", "procs")
        for name in names:
            if getattr(self, name) <= 0:
                raise ConfigError(f"train.{name}: must be positive, got {getattr(self, name)!r}")
        if not 0.0 <= self.eps_ls < 1.0:
            raise ConfigError(f"train.eps_ls: must be in [0, 1), got {self.eps_ls!r}")
        if not 0.0 <= self.cooldown <= 1.0:
            raise ConfigError(f"train.cooldown: must be in [0, 1], got {self.cooldown!r}")
        if self.patience < 0 or self.min_delta < 0:
            raise ConfigError("train.patience and train.min_delta: must be >= 0")
        if self.patience_metric not in ("ppl", "bleu"):
            raise ConfigError(
                f"train.patience_metric: expected 'ppl' or 'bleu', got {self.patience_metric!r}"
            )
        if self.patience_metric == "bleu" and not self.valid_bleu:
            raise ConfigError("train.patience_metric=bleu needs train.valid_bleu=true")
        if self.max_epochs is not None and self.max_epochs <= 0:
            raise ConfigError(f"train.max_epochs: must be positive, got {self.max_epochs!r}")


# Bounds of DecodeConfig, shared by the CLI and the server. The output length is capped at the
# model's max_len anyway; these keep the search's memory and the scores meaningful.
MAX_BEAM_SIZE = 64  # 3x the largest beam in the paper (21, §6.3)
MAX_LENGTH_PENALTY = 10.0  # α; §6.1 uses 0.6, §6.3 0.3
MAX_LEN_A = 10.0
MAX_LEN_B = 10_000
MAX_DECODE_TOKENS = 1_000_000
# `transformer translate --window`: input lines read, batched and translated together
# (`translate.translate_stream`). The default gives enough batches of the default budget to keep
# every decoding stream busy (Multi30k: ~40 batches of 4,000 source tokens) in ~25 MB of Python
# objects (~2.5 KB a line); the largest, ~25 GB.
WINDOW_LINES = 10_000
MAX_WINDOW_LINES = 10_000_000
# `transformer quantize`: the train pairs whose inputs GPTQ sees (8,000: KL within 2%; gptq.py)
CALIBRATION_SENTENCES = 2000


@dataclass(frozen=True)
class DecodeConfig:
    """§6.1 inference: beam 4, α 0.6, maximum output length = input length + 50."""

    beam_size: int = 4
    length_penalty: float = 0.6  # α in lp(Y) = ((5 + |Y|) / 6)^α
    max_len_a: float = 1.0  # maximum output length = a * source length + b
    max_len_b: int = 50
    n_best: int = 1
    max_tokens: int = 4000  # source tokens per translation batch
    # §6.1 "terminating early when possible": "t2t" stops a sentence when no live hypothesis
    # can beat the best finished one; "fairseq" (not the paper's) once K have finished.
    stop: str = "t2t"

    def __post_init__(self) -> None:
        # One validation for every caller (translate, evaluate, the server, a model file's
        # config): search memory grows with beam x batch (beam 10,000 took 2.9 GB for one
        # sentence), and a NaN or negative α would silently rank hypotheses nonsensically.
        def number(key: str, value: Any, low: float, high: float, integer: bool) -> None:
            kinds, kind = (int, "an integer") if integer else ((int, float), "a number")
            if isinstance(value, bool) or not isinstance(value, kinds):
                raise ConfigError(f"decode.{key}: must be {kind}, got {value!r}")
            if not (math.isfinite(value) and low <= value <= high):
                raise ConfigError(f"decode.{key}: must be in [{low}, {high}], got {value}")

        number("beam_size", self.beam_size, 1, MAX_BEAM_SIZE, integer=True)
        number("n_best", self.n_best, 1, self.beam_size, integer=True)
        number("length_penalty", self.length_penalty, 0, MAX_LENGTH_PENALTY, integer=False)
        number("max_len_a", self.max_len_a, 0, MAX_LEN_A, integer=False)
        number("max_len_b", self.max_len_b, 0, MAX_LEN_B, integer=True)
        number("max_tokens", self.max_tokens, 1, MAX_DECODE_TOKENS, integer=True)
        if self.stop not in STOP_RULES:
            rules = " or ".join(repr(r) for r in STOP_RULES)
            raise ConfigError(f"decode.stop: must be {rules}, got {self.stop!r}")


@dataclass(frozen=True)
class RunConfig:
    """Everything a training run needs besides the data directory."""

    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)


# ---------------------------------------------------------------------------------------------
# Presets. A preset is a set of overrides on the defaults (= the paper's base model). Table 3's
# rows are written once, as the paper states them: changes relative to the base model.
# ---------------------------------------------------------------------------------------------

# Table 3's rows, in the paper's order, as changes relative to a base model b. With b = the
# paper's base (N 6, d_model 512, d_ff 2048, h 8, d_k = d_v = 64) each gives the paper's values.
TABLE3_ROWS: dict[str, Callable[[ModelConfig], dict[str, Any]]] = {
    "base": lambda b: {},
    # (A) h x d_k stays constant, so the computation stays constant.
    "A1": lambda b: {"n_heads": 1, "d_k": b.n_heads * b.d_k, "d_v": b.n_heads * b.d_v},
    "A2": lambda b: _heads(b, 0.5),
    "A3": lambda b: _heads(b, 2),
    "A4": lambda b: _heads(b, 4),
    # (B) smaller attention key size, d_v unchanged: 64 -> 16 and 32.
    "B1": lambda b: {"d_k": max(1, b.d_k // 4)},
    "B2": lambda b: {"d_k": max(1, b.d_k // 2)},
    # (C) bigger and smaller models: N 6 -> 2, 4, 8; d_model x0.5, x2 (d_k, d_v with it, h kept);
    # d_ff x0.5, x2.
    "C1": lambda b: {"n_layers": _layers(b, 2)},
    "C2": lambda b: {"n_layers": _layers(b, 4)},
    "C3": lambda b: {"n_layers": _layers(b, 8)},
    "C4": lambda b: _width(b, 0.5),
    "C5": lambda b: _width(b, 2),
    "C6": lambda b: {"d_ff": b.d_ff // 2},
    "C7": lambda b: {"d_ff": b.d_ff * 2},
    # (D) dropout and label smoothing: the paper's absolute values.
    "D1": lambda b: {"p_drop": 0.0},
    "D2": lambda b: {"p_drop": 0.2},
    "D3": lambda b: {"train.eps_ls": 0.0},
    "D4": lambda b: {"train.eps_ls": 0.2},
    # (E) learned positional embeddings instead of sinusoids.
    "E": lambda b: {"learned_pos": True},
    # big: d_model, d_ff and h x2 (d_k kept), P_drop 0.3.
    "big": lambda b: {
        **_width(b, 2),
        "d_ff": b.d_ff * 2,
        "n_heads": b.n_heads * 2,
        "d_k": b.d_k,
        "d_v": b.d_v,
        "p_drop": 0.3,
    },  # fmt: skip
}


def _heads(b: ModelConfig, factor: float) -> dict[str, int]:
    h = max(1, round(b.n_heads * factor))
    total_k, total_v = b.n_heads * b.d_k, b.n_heads * b.d_v
    return {"n_heads": h, "d_k": max(1, total_k // h), "d_v": max(1, total_v // h)}


def _layers(b: ModelConfig, paper_n: int) -> int:
    return max(1, round(b.n_layers * paper_n / 6))


def _width(b: ModelConfig, factor: float) -> dict[str, int]:
    return {"d_model": round(b.d_model * factor), "d_k": max(1, round(b.d_k * factor)),
            "d_v": max(1, round(b.d_v * factor))}  # fmt: skip


def scale_row(row: str, base: ModelConfig) -> dict[str, Any]:
    """The row's changes relative to `base`, as overrides (model keys bare, `train.` prefixed).

    Args:
        row: a Table 3 row name (`TABLE3_ROWS`).
        base: the model the row is applied to.

    Returns:
        e.g. {"n_heads": 1, "d_k": 512, "d_v": 512} for A1 on the paper's base.
    """
    if row not in TABLE3_ROWS:
        raise ConfigError(f"unknown Table 3 row {row!r}; choose from {', '.join(TABLE3_ROWS)}")
    return TABLE3_ROWS[row](base)


# The model of the cpu-small and quickstart presets: N 3, d_model 256, h 4 (~7.6M parameters).
_CPU_SMALL = {"n_layers": 3, "d_model": 256, "d_ff": 1024, "n_heads": 4, "d_k": 64, "d_v": 64}

PRESETS: dict[str, dict[str, Any]] = {
    "base": {},
    # Table 3 "big": d_k stays 64 (16 heads x 64 = 1024); §5.2: 300K steps; §6.1: average 20.
    "big": {**scale_row("big", ModelConfig()), "train.max_steps": 300000, "train.keep_last": 20},
    **{row: scale_row(row, ModelConfig()) for row in TABLE3_ROWS if row not in ("base", "big")},
    # §6.3: 4 layers, d_model 1024, everything else as base; d_k = d_v = 1024 / 8 as in row C5.
    # §6.3 does not say whether the embeddings are shared. Sentences and linearized trees use
    # disjoint pieces of the joint vocabulary, and with one shared matrix every word row also
    # sits in the tree softmax, where it only ever gets pushed down: on the NLTK sample the word
    # embeddings all shrank to norm ~0.47 (~1.0 in the translation model) and barely differed
    # (docs/parsing.md). So the source embedding is separate; the target embedding stays tied
    # to the output projection (§3.4). (The encoder collapse seen there is a separate failure of
    # post-norm on that data: configs/ptb_parsing_cpu.yaml.)
    "parsing": {"n_layers": 4, "d_model": 1024, "d_k": 128, "d_v": 128, "share_embeddings": False},
    # CPU-sized presets for the small corpora here (not in the paper).
    "tiny": {"n_layers": 2, "d_model": 32, "d_ff": 64, "n_heads": 4, "d_k": 8, "d_v": 8},
    "cpu-small": {**_CPU_SMALL, "train.max_tokens": 4000, "train.warmup_steps": 800},
    # `transformer sweep table3 --converge --scale mini`: Table 3 trained to convergence on the
    # CPU (docs/table3.md: the budget). The base of the 400-step sweep (docs/table3.md), whose
    # 20 rows all trained stably with it: half cpu-small's width, 2.41M parameters (1.0M of them
    # the shared 8,000 x 128 embedding), 1,500-token batches, eq. (3) x0.25 with warm-up 200
    # (peak 1.56e-3). d_k = d_v = d_model / h as in the paper's base.
    "cpu-mini": {
        "n_layers": 3,
        "d_model": 128,
        "d_ff": 512,
        "n_heads": 4,
        "d_k": 32,
        "d_v": 32,
        "train.max_tokens": 1500,
        "train.warmup_steps": 200,
        "train.lr_scale": 0.25,
    },
    "cpu-medium": {
        "n_layers": 4,
        "d_model": 384,
        "d_ff": 1536,
        "n_heads": 6,
        "d_k": 64,
        "d_v": 64,
        "train.max_tokens": 6000,
        "train.warmup_steps": 1500,
    },
    # `transformer quickstart`: Multi30k on a 2-core CPU in 20 minutes (tuning: docs/quickstart.md).
    "quickstart": {
        **_CPU_SMALL,
        "p_drop": 0.1,
        # ~4,000 steps of ~920 target tokens fit in the budget on 2 cores (~8.6 epochs): small
        # batches, because at this epoch count the number of updates is what the model lacks
        # (val BLEU 33.0 with 4,000-token batches, 34.3 with 2,000, 35.7 with 1,500, 36.5 with
        # 1,000; docs/quickstart.md). Eq. (3) scaled to a peak of ~9.4e-4 (256^-0.5 x 400^-0.5
        # x 0.3).
        "train.max_tokens": 1000,
        "train.warmup_steps": 400,
        "train.lr_scale": 0.3,
        "train.save_every_minutes": 1.0,
        "train.keep_last": 5,
        "train.valid_every_steps": 1000000,
    },
    # `transformer recipe multi30k-full`: Multi30k trained to convergence in 2 hours on 2 cores
    # (docs/multi30k_converged.md). Chosen on val: the literature's Transformer-Tiny (Wu et al.
    # 2021: 4 x 128, d_ff 256, h 4, 2.35M parameters, dropout 0.3, 2,000 warm-up updates to a
    # peak of 5e-3, ~8k-token batches) beat the best of our wider models (3 x 512, 26M: val
    # 40.91 against 41.40 for this one, beam 4, averaged, α chosen on val): it trains 3.5x the
    # tokens/s, so 2 hours hold ~145 epochs instead of ~40. Heavy dropout (at 0.1 dev
    # perplexity rises after ~15 epochs).
    "multi30k-full": {
        "n_layers": 4,
        "d_model": 128,
        "d_ff": 256,
        "n_heads": 4,
        "d_k": 32,
        "d_v": 32,
        "p_drop": 0.3,
        # A step of 8,192 tokens per side in three batches of 8,192 / 3, accumulated: each batch
        # comes from its own place of the length order (batching.py), so a step sees three
        # lengths and new companions each epoch, as `--procs 3`'s steps did (run 13) and as
        # §5.1's steps over 8 GPUs did. Chosen on dev perplexity: 6.81 at step 2,000 against
        # 7.50 for one 8,192-token batch (3 and 4 seeds, GPU), 6.62 with four parts, which
        # cost ~15% of the steps per second on a Zen 3 where three cost ~5%
        # (docs/multi30k_converged.md, "A step in parts").
        "train.max_tokens": 2731,
        "train.accum_steps": 3,
        "train.warmup_steps": 2000,
        # Eq. (3) scaled to the literature's peak: 2.53 x 128^-0.5 x 2000^-0.5 = 5.0e-3.
        "train.lr_scale": 2.53,
        "train.valid_every_steps": 500,
        "train.patience": 5,
        # Perplexity, not greedy BLEU: runs 5-7 (val 41.46-41.64 with the windows of
        # valchoice.WINDOWS) against run 3's BLEU patience (41.40).
        "train.patience_metric": "ppl",
        "train.save_every_steps": 100,
        "train.save_every_minutes": 1.0e9,
        # The best validation and the 30 checkpoints up to it (valchoice.WINDOWS) are still on
        # disk when patience (5 x 500 steps = 25 checkpoints) has run past it: valchoice.py
        # picks the window on val. 56 x 33 MB on disk.
        "train.keep_last": 56,
        "train.log_every_steps": 100,
    },
    "parsing-cpu": {
        "n_layers": 4,
        "d_model": 256,
        "d_ff": 1024,
        "n_heads": 4,
        "d_k": 64,
        "d_v": 64,
        "p_drop": 0.3,
        "share_embeddings": False,  # as `parsing`
        "train.max_tokens": 4000,
        "train.warmup_steps": 1000,
    },
}


def preset_overrides(name: str) -> dict[str, str]:
    """The preset's values as `section.key` overrides (model keys get the `model.` prefix)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    return {(k if "." in k else f"model.{k}"): v for k, v in PRESETS[name].items()}


def build_config(
    preset: str | None = None,
    yaml_path: Path | None = None,
    overrides: list[str] | None = None,
    vocab_size: int | None = None,
) -> RunConfig:
    """Resolve a RunConfig: defaults < preset < YAML file < `key=value` overrides.

    Args:
        preset: a name from PRESETS, or None for the paper's base model.
        yaml_path: a YAML file with sections `model`, `train`, `decode` (optional `preset`).
        overrides: strings `section.key=value`, value parsed as YAML.
        vocab_size: the prepared data's vocabulary size (overrides any other source).
    """
    cfg = RunConfig()
    if yaml_path is not None:
        raw = _read_yaml(yaml_path)
        preset = raw.pop("preset", preset)
    if preset is not None:
        cfg = apply_overrides(cfg, preset_overrides(preset), source=f"preset {preset}")
    if yaml_path is not None:
        flat = {}
        for section, values in raw.items():
            if not isinstance(values, dict):
                raise ConfigError(f"{yaml_path}: section {section!r} must be a mapping")
            flat.update({f"{section}.{k}": v for k, v in values.items()})
        cfg = apply_overrides(cfg, flat, source=str(yaml_path))
    cfg = apply_overrides(cfg, parse_overrides(overrides or []), source="override")
    if vocab_size is not None:
        cfg = replace(cfg, model=replace(cfg.model, vocab_size=vocab_size))
    return cfg


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """`section.key=value` strings -> {"section.key": value}, each value read as YAML."""
    parsed = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r}: expected section.key=value")
        try:
            parsed[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError as e:
            problem = str(e).replace("\n", " ")  # one line
            raise ConfigError(
                f"override {item!r}: the value is not valid YAML: {problem}"
            ) from None
    return parsed


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        problem = e.strerror if isinstance(e, OSError) and e.strerror else e
        problem = str(problem).replace("\n", " ")
        raise ConfigError(f"{path}: cannot read config: {problem}") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    return raw


def apply_overrides(cfg: RunConfig, values: dict[str, Any], source: str) -> RunConfig:
    """Return a copy of cfg with `section.key` values set, each type-checked."""
    sections: dict[str, dict[str, Any]] = {}
    for key, value in values.items():
        section, _, name = key.partition(".")
        if section not in {f.name for f in fields(RunConfig)} or not name:
            raise ConfigError(f"{source}: unknown key {key!r} (sections: model, train, decode)")
        sections.setdefault(section, {})[name] = value
    for section, kv in sections.items():
        current = getattr(cfg, section)
        hints = typing.get_type_hints(type(current))
        known = {f.name for f in fields(current)}
        checked = {}
        for name, value in kv.items():
            if name not in known:
                raise ConfigError(f"{source}: unknown key {section}.{name!r}")
            checked[name] = _coerce(value, hints[name], f"{source}: {section}.{name}")
        try:
            cfg = replace(cfg, **{section: replace(current, **checked)})
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from e
    return cfg


# A number in exponent notation without a decimal point, which YAML 1.2 and Python read as a
# float and YAML 1.1 (PyYAML) as a string.
_EXPONENT_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """Check `value` against a field's type hint; ints are accepted for floats."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    for t in options:
        if t is type(None) and value is None:
            return None
        if t is bool and isinstance(value, bool):
            return value
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if t is float and isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if t is float and isinstance(value, str) and _EXPONENT_FLOAT.fullmatch(value.strip()):
            return float(value)  # 1e-4, 5E3: YAML 1.1 (PyYAML) reads them as strings
        if t is str and isinstance(value, str):
            return value
    names = " or ".join(getattr(t, "__name__", str(t)) for t in options)
    raise ConfigError(f"{where}: expected {names}, got {value!r}")


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    """A plain dict (YAML/JSON-ready) of the resolved config."""
    return dataclasses.asdict(cfg)


# Options of earlier versions that no model used, with the only value they were ever saved with:
# model files and checkpoints written then still load.
_RETIRED = {"model.tie_output": True, "model.p_relu_drop": 0.0}


def from_dict(raw: dict[str, Any], source: str = "checkpoint") -> RunConfig:
    """Inverse of to_dict, with the same checks as a YAML file."""
    flat = {f"{s}.{k}": v for s, section in raw.items() for k, v in section.items()}
    for key, value in _RETIRED.items():
        if key in flat and flat[key] == value:
            del flat[key]
    return apply_overrides(RunConfig(), flat, source=source)
