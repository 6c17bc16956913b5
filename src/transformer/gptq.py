"""GPTQ: int8 weights rounded with the layer's inputs in view (Frantar et al., 2023).

`Int8Linear` (translate.py) keeps one scale per output row, max |w| / levels (127, or 63 on
CPUs without VNNI), and rounds every weight to the nearest level. GPTQ keeps that grid (so the
same kernels run it, at the same speed) but rounds column by column, each column's rounding
error pushed onto the columns still to round through the inverse of H = X^T X, X the layer's
inputs on real sentences: the product x q(W)^T then stays closer to x W^T for inputs like X.
On the Zen 3 quickstart model it removes ~60% of the 7-bit weights' damage (teacher-forced KL
from fp32 on val; docs/performance.md, "int8's damage measured smoothly").

`input_moments` collects H for every nn.Linear and for the tied projection (`PROJECTION`) by
teacher-forcing pairs through the fp32 model; `gptq_round` rounds one matrix; `calibrate_int8`
rounds them all, for each grid, in the form a model file stores (`transformer quantize`,
modelfile.py) and `translate.quantize_int8(model, rounded=...)` takes.

Shapes: W (out, in); H (in, in), float64.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from torch import nn

from transformer.config import CALIBRATION_SENTENCES
from transformer.data import ParallelSplit, collate
from transformer.errors import UserError
from transformer.gradhelper import is_linear
from transformer.modelfile import INT8_LEVELS, PROJECTION, int8_targets, save_model
from transformer.threads import ThreadTuner
from transformer.threads import resolve as resolve_threads
from transformer.tokenizer import PAD_ID

logger = logging.getLogger(__name__)


def gptq_round(
    w: torch.Tensor,
    scales: torch.Tensor,
    levels: float,
    hessian: torch.Tensor,
    damp: float = 0.01,
    block: int = 128,
) -> torch.Tensor:
    """The integers (out, in), in [-levels, levels], of w (out, in) on the grid of one scale
    per row (`scales`, (out,)), rounded by GPTQ for inputs whose second moments are `hessian`
    (in, in): columns in order, each column's rounding error, divided by the inverse
    Hessian's Cholesky diagonal, subtracted from the columns still to round; H damped by `damp`
    times its mean diagonal; lazy updates in blocks of `block` columns (Frantar et al., 2023,
    Algorithm 1). An input that is always 0 has a diagonal of 0: its weights are set to 0,
    which changes no product on such inputs. With H = I the result is rounding to nearest."""
    W = w.detach().double().clone()
    H = hessian.detach().double().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H += damp * torch.diag(H).mean() * torch.eye(H.size(0), dtype=H.dtype)
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    s = scales.detach().double()
    Q = torch.zeros_like(W)
    for i1 in range(0, W.size(1), block):
        i2 = min(i1 + block, W.size(1))
        Wb, Ub = W[:, i1:i2].clone(), U[i1:i2, i1:i2]
        E = torch.zeros_like(Wb)
        for i in range(i2 - i1):
            q = (Wb[:, i] / s).round().clamp(-levels, levels)
            Q[:, i1 + i] = q
            E[:, i] = (Wb[:, i] - q * s) / Ub[i, i]
            Wb[:, i:] -= E[:, i : i + 1] * Ub[i : i + 1, i:]
        W[:, i2:] -= E @ U[i1:i2, i2:]
    return Q


def row_scales(w: torch.Tensor, levels: float) -> torch.Tensor:
    """One scale per output row: max |w| / levels (float64, at least 1e-12), `Int8Linear`'s."""
    return (w.detach().float().abs().amax(dim=1) / levels).clamp(min=1e-12).double()


@torch.no_grad()
def input_moments(
    model: nn.Module,
    split: ParallelSplit,
    sentences: int = CALIBRATION_SENTENCES,
    rows: int = 64,
    tuner: ThreadTuner | None = None,
) -> dict[str, torch.Tensor]:
    """X^T X (float64) of the inputs of every nn.Linear of `model` (by module name) and of the
    tied projection (`PROJECTION`), teacher-forcing the first `sentences` pairs of `split`
    through it in batches of `rows` pairs of similar length, dropout off; `tuner` chooses the
    CPU thread count batch by batch (threads.py)."""
    was_training = model.training
    model.eval()
    sums: dict[str, torch.Tensor] = {}

    def add(name: str, x: torch.Tensor) -> None:
        # one batch's product in fp32 (rows of a few thousand: ~1e-7 relative), summed in fp64;
        # half the time of fp64 products on the CPU
        x = x.detach().reshape(-1, x.size(-1)).float()
        part = (x.T @ x).double()
        sums[name] = sums[name].add_(part) if name in sums else part

    hooks = [
        m.register_forward_hook(lambda _m, inp, _out, name=name: add(name, inp[0]))
        for name, m in model.named_modules()
        if is_linear(m)
    ]
    n = min(sentences, len(split))
    order = sorted(range(n), key=lambda i: len(split.src_tokens(i)))
    try:
        for start in range(0, n, rows):
            b = collate(split, order[start : start + rows])
            if tuner is not None:
                tuner.start()
            add(PROJECTION, model(b.src, b.src_mask, b.tgt_in, b.tgt_out != PAD_ID))
            if tuner is not None:
                tuner.stop(b.n_tgt_tokens)
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    return sums


def calibrate_int8(
    model: nn.Module, moments: dict[str, torch.Tensor], levels: tuple[int, ...] = INT8_LEVELS
) -> dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """Every nn.Linear's and the projection's weights rounded by GPTQ with `moments`
    (`input_moments` of `model`), for each grid: {levels: {name: (int8 integers, fp32 row
    scales)}}, `LoadedModel.int8`'s form."""
    weights = int8_targets(model)
    missing = [n for n in weights if n not in moments]
    if missing:
        raise ValueError(f"calibrate_int8: no input moments for {', '.join(missing[:3])}")
    out: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    for lv in levels:
        out[lv] = {}
        for name, w in weights.items():
            scales = row_scales(w, float(lv))
            ints = gptq_round(w, scales, float(lv), moments[name]).to(torch.int8)
            out[lv][name] = (ints, scales.float())
    return out


def quantize_model_file(
    model_path: str | Path,
    data_dir: str | Path,
    out: str | Path | None = None,
    split: str = "train",
    sentences: int = CALIBRATION_SENTENCES,
    threads: int | str | None = None,
) -> Path:
    """`transformer quantize`: a model file with GPTQ's int8 weights for both grids (63 and
    127 levels), calibrated on the first `sentences` pairs of `split` of the prepared data
    `data_dir` (the model's language pair and tokenizer), written to `out` (default: the
    model file itself, replaced atomically). Returns `out`.

    threads: CPU threads: a count, "auto" (OMP_NUM_THREADS if set, else chosen on the
    calibration batches by their measured speed, and kept for GPTQ's rounding, threads.py) or
    None (torch's setting). Torch's count is put back afterwards."""
    from transformer.data import load_prepared
    from transformer.rundir import resolve_model
    from transformer.tokenizer import strip_build_paths

    if sentences < 1:  # before the model and the data are read
        raise UserError(f"--sentences must be at least 1, got {sentences}")
    loaded = resolve_model(model_path)
    if out is None:
        if loaded.path.suffix != ".safetensors":
            raise UserError(f"{model_path}: resolves to a checkpoint ({loaded.path}); give --out")
        out = loaded.path
    data = load_prepared(data_dir)
    if (data.src_lang, data.tgt_lang) != (loaded.src_lang, loaded.tgt_lang):
        raise UserError(
            f"{data_dir}: {data.src_lang}->{data.tgt_lang} data, the model translates "
            f"{loaded.src_lang}->{loaded.tgt_lang}"
        )
    spm = strip_build_paths((data.path / data.manifest["spm_model"]).read_bytes())
    if spm != loaded.spm_proto:
        raise UserError(
            f"{data_dir}: its subword model is not the one {loaded.path} was trained with"
        )
    if split not in data.split_names:
        raise UserError(f"{data_dir}: no split {split!r}; have {', '.join(data.split_names)}")
    model = loaded.model.float().eval()
    start = time.perf_counter()
    before = torch.get_num_threads()
    try:
        # Beside a busy process torch's every-core default waits at each op for a thread that
        # is not running (8 s alone, 25 s beside one on 2 Zen 5 cores; one thread: 13 s).
        tuner = resolve_threads(threads, warmup_units=1)
        moments = input_moments(model, data.split(split), sentences, tuner=tuner)
        if tuner is not None:
            torch.set_num_threads(tuner.best)
        int8 = calibrate_int8(model, moments)
    finally:
        torch.set_num_threads(before)
    n = min(sentences, len(data.split(split)))
    info = {"method": "gptq", "split": split, "sentences": n, "data": str(data_dir)}
    save_model(out, model, loaded.config, loaded.spm_proto, loaded.src_lang, loaded.tgt_lang,
               int8=int8, int8_info=info)  # fmt: skip
    logger.info(
        "GPTQ int8 weights from %d %s pairs in %.0f s", n, split, time.perf_counter() - start
    )
    return Path(out)
