"""GPTQ: int8 weights rounded with the layer's inputs in view (Frantar et al., 2023).

`Int8Linear` (translate.py) keeps one scale per output row, max |w| / levels (127, or 63 on
CPUs without VNNI), and rounds every weight to the nearest level. GPTQ keeps that grid (so the
same kernels run it, at the same speed) but rounds column by column, each column's rounding
error pushed onto the columns still to round through the inverse of H = X^T X, X the layer's
inputs on real sentences: the product x q(W)^T then stays closer to x W^T for inputs like X.
On the Zen 3 quickstart model it removes ~60% of the 7-bit weights' damage (teacher-forced KL
from fp32 on val; docs/performance.md, "int8's damage measured smoothly").

`input_moments` collects H for every nn.Linear and for the tied projection by teacher-forcing
pairs through the fp32 model; `gptq_round` rounds one matrix; `translate.quantize_int8(model,
moments=...)` uses them.

Shapes: W (out, in); H (in, in), float64.
"""

from __future__ import annotations

import torch
from torch import nn

from transformer.data import ParallelSplit, collate
from transformer.tokenizer import PAD_ID

PROJECTION = "projection"  # the moments' key of the tied pre-softmax projection's inputs


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
    model: nn.Module, split: ParallelSplit, sentences: int = 2000, rows: int = 64
) -> dict[str, torch.Tensor]:
    """X^T X (float64) of the inputs of every nn.Linear of `model` (by module name) and of the
    tied projection (`PROJECTION`), teacher-forcing the first `sentences` pairs of `split`
    through it in batches of `rows` pairs of similar length, dropout off."""
    was_training = model.training
    model.eval()
    sums: dict[str, torch.Tensor] = {}

    def add(name: str, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.size(-1)).double()
        sums[name] = sums[name].addmm_(x.T, x) if name in sums else x.T @ x

    hooks = [
        m.register_forward_hook(lambda _m, inp, _out, name=name: add(name, inp[0]))
        for name, m in model.named_modules()
        if type(m) is nn.Linear
    ]
    n = min(sentences, len(split))
    order = sorted(range(n), key=lambda i: len(split.src_tokens(i)))
    try:
        for start in range(0, n, rows):
            b = collate(split, order[start : start + rows])
            add(PROJECTION, model(b.src, b.src_mask, b.tgt_in, b.tgt_out != PAD_ID))
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    return sums
