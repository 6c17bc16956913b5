"""§6.1 Table 2: training cost, estimated the paper's way and counted analytically.

The paper estimates training cost as training time x number of GPUs x sustained single-precision
TFLOPS per GPU (Table 2, footnote 5). The analytic count here is the model's matmul FLOPs per
token (2 FLOPs per multiply-add) times the tokens processed, x3 for training (the backward pass
costs about twice the forward). Dividing the counted FLOPs by the paper-style estimate of the
same run gives the model-FLOPs utilisation (MFU). docs/table2.md works through the numbers.

Counting conventions (all forward, per token):
- every projection: 2 * fan_in * fan_out (biases, LayerNorm, softmax and ReLU are ignored);
- attention: Q K^T and weights x V, 2 * H * (K + Vd) per (query, key) pair; decoder
  self-attention counts all T keys, as the dense training kernels compute the masked half too;
- encoder-decoder attention's keys and values are projected once per source token;
- the output projection, 2 * D * V, once per target token; embedding look-ups are free.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

from transformer.config import ModelConfig
from transformer.errors import UserError

log = logging.getLogger(__name__)

# Table 2 footnote 5: sustained single-precision TFLOPS the paper assumed per GPU.
DEVICE_TFLOPS = {"K80": 2.8, "K40": 3.7, "M40": 6.0, "P100": 9.5}

# §5.2: one machine with 8 P100s; base 100K steps in 12 hours, big 300K steps in 3.5 days.
# §5.1: each batch holds about 25,000 source and 25,000 target tokens.
PAPER_RUNS = {
    "base": {"hours": 12.0, "devices": 8, "device": "P100", "steps": 100_000},
    "big": {"hours": 3.5 * 24, "devices": 8, "device": "P100", "steps": 300_000},
}
PAPER_TOKENS_PER_STEP = 25_000  # §5.1, per side
# Table 2 as printed: 3.3 * 10^18 (base) and 2.3 * 10^19 (big).
PAPER_TABLE2_FLOPS = {"base": 3.3e18, "big": 2.3e19}
# Not in the paper: mean subword sentence length assumed for WMT14 En-De when a run does not
# tell us (about 27-30 BPE tokens per side); it only affects the small attention terms.
DEFAULT_MEAN_LEN = 28.0


def _attn_proj_flops(cfg: ModelConfig) -> tuple[int, int, int]:
    """Per-token forward FLOPs of W^Q, of W^K and W^V together, and of W^O."""
    d, h = cfg.d_model, cfg.n_heads
    return 2 * d * h * cfg.d_k, 2 * d * h * (cfg.d_k + cfg.d_v), 2 * h * cfg.d_v * d


def _attn_product_flops(cfg: ModelConfig, n_keys: float) -> float:
    """§3.2.1 eq. (1) per query: Q K^T over n_keys keys and weights x V."""
    return 2 * cfg.n_heads * (cfg.d_k + cfg.d_v) * n_keys


def forward_flops_per_src_token(cfg: ModelConfig, src_len: float) -> float:
    """Forward FLOPs charged to each source token: the encoder stack plus the decoder's
    encoder-decoder key/value projections (computed once per source token).

    Args:
        cfg: the model.
        src_len: source length S (the number of keys each encoder query attends over).
    """
    q, kv, o = _attn_proj_flops(cfg)
    ffn = 2 * 2 * cfg.d_model * cfg.d_ff  # §3.3 eq. (2): two projections
    encoder_layer = q + kv + o + _attn_product_flops(cfg, src_len) + ffn
    return cfg.n_layers * (encoder_layer + kv)


def forward_flops_per_tgt_token(cfg: ModelConfig, src_len: float, tgt_len: float) -> float:
    """Forward FLOPs charged to each target token: the decoder stack (without the cross-attention
    key/value projections) and the output projection.

    Args:
        cfg: the model.
        src_len: source length S (keys of encoder-decoder attention).
        tgt_len: target length T (keys of decoder self-attention, dense).
    """
    q, kv, o = _attn_proj_flops(cfg)
    ffn = 2 * 2 * cfg.d_model * cfg.d_ff
    self_attn = q + kv + o + _attn_product_flops(cfg, tgt_len)
    cross_attn = q + o + _attn_product_flops(cfg, src_len)
    output = 2 * cfg.d_model * cfg.target_vocab_size  # §3.4 pre-softmax linear
    return cfg.n_layers * (self_attn + cross_attn + ffn) + output


def training_flops(
    cfg: ModelConfig, src_tokens: float, tgt_tokens: float, src_len: float, tgt_len: float
) -> float:
    """Analytic training FLOPs: 3 x forward (the backward pass costs twice the forward).

    Args:
        cfg: the model.
        src_tokens, tgt_tokens: tokens processed on each side (real tokens, not padding).
        src_len, tgt_len: mean sentence lengths, for the attention products.
    """
    forward = src_tokens * forward_flops_per_src_token(cfg, src_len)
    forward += tgt_tokens * forward_flops_per_tgt_token(cfg, src_len, tgt_len)
    return 3.0 * forward


def paper_estimate(hours: float, devices: int, tflops: float) -> float:
    """Table 2's estimate: training time x number of GPUs x sustained TFLOPS per GPU."""
    return hours * 3600.0 * devices * tflops * 1e12


@dataclass(frozen=True)
class CostReport:
    """A run's training cost both ways, and the resulting utilisation."""

    name: str
    steps: int
    src_tokens: float
    tgt_tokens: float
    hours: float
    devices: int
    device_tflops: float
    flops_per_src_token: float  # training FLOPs (x3) per source token at the mean lengths
    flops_per_tgt_token: float  # training FLOPs (x3) per target token at the mean lengths
    analytic_flops: float
    estimated_flops: float

    @property
    def mfu(self) -> float:
        """Model-FLOPs utilisation: counted FLOPs / (time x devices x sustained peak)."""
        return self.analytic_flops / self.estimated_flops if self.estimated_flops else math.nan

    def lines(self) -> list[str]:
        """A human-readable summary, one fact per line, with the arithmetic spelled out."""
        return [
            f"run: {self.name}",
            f"steps: {self.steps:,}   tokens: {self.src_tokens:,.0f} source, "
            f"{self.tgt_tokens:,.0f} target",
            f"paper estimate: {self.hours:.4g} h x 3600 s x {self.devices} device(s) x "
            f"{self.device_tflops:g} TFLOPS = {self.estimated_flops:.3g} FLOPs",
            f"analytic count: 3 x forward = {self.flops_per_src_token:.4g} FLOPs/source token x "
            f"{self.src_tokens:.3g} + {self.flops_per_tgt_token:.4g} FLOPs/target token x "
            f"{self.tgt_tokens:.3g} = {self.analytic_flops:.3g} FLOPs",
            f"model-FLOPs utilisation: {100 * self.mfu:.1f}%",
        ]


def paper_report(preset: str) -> CostReport:
    """Table 2 for the paper's `base` or `big` run, from the paper's own inputs (§5.1, §5.2)."""
    from transformer.config import build_config

    if preset not in PAPER_RUNS:
        raise UserError(f"--paper: no paper run for preset {preset!r}; choose base or big")
    run = PAPER_RUNS[preset]
    cfg = build_config(preset).model  # vocab 37000, the shared En-De BPE vocabulary (§5.1)
    tokens = float(run["steps"] * PAPER_TOKENS_PER_STEP)
    return _report(
        f"paper {preset} (WMT14 En-De)", cfg, run["steps"], tokens, tokens, DEFAULT_MEAN_LEN,
        DEFAULT_MEAN_LEN, run["hours"], run["devices"], DEVICE_TFLOPS[run["device"]],
    )  # fmt: skip


def _report(name, cfg, steps, src_tok, tgt_tok, src_len, tgt_len, hours, devices, tflops):
    return CostReport(
        name=name,
        steps=steps,
        src_tokens=src_tok,
        tgt_tokens=tgt_tok,
        hours=hours,
        devices=devices,
        device_tflops=tflops,
        flops_per_src_token=training_flops(cfg, 1.0, 0.0, src_len, tgt_len),
        flops_per_tgt_token=training_flops(cfg, 0.0, 1.0, src_len, tgt_len),
        analytic_flops=training_flops(cfg, src_tok, tgt_tok, src_len, tgt_len),
        estimated_flops=paper_estimate(hours, devices, tflops),
    )


def _data_lengths(run_dir: Path) -> tuple[float, float] | None:
    """Mean source and target lengths (EOS included) of the run's training split, if found."""
    try:
        from transformer import rundir
        from transformer.data import load_prepared

        split = load_prepared(rundir.read_data_dir(run_dir)).split("train")
        return float(split.src_lens.mean()), float(split.tgt_lens.mean())
    except (OSError, KeyError, ValueError, UserError) as e:
        log.warning("%s: cannot read the run's data for mean lengths (%s)", run_dir, e)
        return None


def run_report(
    run_dir: Path,
    device_tflops: float | None = None,
    devices: int = 1,
    src_len: float | None = None,
    tgt_len: float | None = None,
) -> CostReport:
    """Table 2 for a training run directory.

    Source tokens are not logged by the trainer; they are the target tokens scaled by the
    mean source / target length ratio.

    Args:
        run_dir: a directory with the trainer's config.yaml and metrics.jsonl (and run.json).
        device_tflops: sustained TFLOPS of one device; None measures this machine's matmul rate
            in the run's dtype (the paper's "sustained", not the datasheet peak).
        devices: number of devices the run used.
        src_len, tgt_len: mean sentence lengths; None takes them from the run's training data,
            or DEFAULT_MEAN_LEN when that cannot be read.
    """
    from transformer import rundir  # torch's import: not for the analytic counts above

    cfg, totals = rundir.read_config(run_dir), rundir.training_totals(run_dir)
    if src_len is None or tgt_len is None:
        lengths = _data_lengths(run_dir) or (DEFAULT_MEAN_LEN, DEFAULT_MEAN_LEN)
        src_len, tgt_len = src_len or lengths[0], tgt_len or lengths[1]
    tgt_tok = totals["tgt_tokens"]
    src_tok = tgt_tok * src_len / tgt_len
    if device_tflops is None:
        device_tflops = measure_matmul_tflops(cfg.train.dtype)
    hours = totals["elapsed_s"] / 3600.0
    return _report(
        str(run_dir), cfg.model, totals["step"], src_tok, tgt_tok, src_len, tgt_len,
        hours, devices, device_tflops,
    )  # fmt: skip


def measure_matmul_tflops(dtype: str = "fp32", size: int = 1024, seconds: float = 1.0) -> float:
    """This machine's sustained square-matmul rate in TFLOPS (CUDA when available, else CPU);
    dtype "auto" is the one training would take there (`train.auto_train_dtype`)."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        from transformer.train import auto_train_dtype

        dtype = auto_train_dtype(device)[0]
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    a = torch.randn(size, size, device=device, dtype=torch_dtype)
    b = torch.randn(size, size, device=device, dtype=torch_dtype)
    a @ b  # warm-up
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        n += 1
    if device == "cuda":
        torch.cuda.synchronize()
    rate = 2.0 * size**3 * n / (time.perf_counter() - start) / 1e12
    log.info("measured %s matmul on %s: %.3f TFLOPS", dtype, device, rate)
    return rate
