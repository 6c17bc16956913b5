"""§3 The Transformer: attention, feed-forward, positional encoding, layers, stacks.

Shapes: B batch, S source length, T target length, D d_model, H heads, K d_k, Vd d_v, V vocab.
Masks are boolean and True where a position takes part (a real token), as in
`F.scaled_dot_product_attention`. This module imports only torch, numpy (dropout's random bits
on the CPU), its own config, the decoder's incremental-decoding state (cache.py, torch only) and
`gradhelper.Linear` (nn.Linear whose weight gradients a training step beside a busy process
computes on a second thread) and `kernels` (compiled CPU kernels: the post-norm sub-layer's add,
dropout and LayerNorm in one pass when training in bf16).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import transformer.cache as cache_module
from transformer import gradhelper, kernels
from transformer.cache import DecoderCache, LayerCache, StepProjections, padding_bias
from transformer.config import ModelConfig
from transformer.gradhelper import Linear

logger = logging.getLogger(__name__)

# The floating dtypes of a model's parameters, by their config name (train.dtype).
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def accelerator_dtype(device: torch.device) -> tuple[str, str]:
    """The "auto" dtype, and why, on a device that is not the CPU: bf16 on CUDA that supports
    it, fp32 elsewhere (on the CPU the choice follows its flags and the work:
    `train.auto_train_dtype`, `translate.auto_dtype`)."""
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return "bf16", "CUDA with bf16"
        return "fp32", "CUDA without bf16"
    return "fp32", f"a {device.type.upper()} device"


# On CPU, eq. (1) written out beats PyTorch's fused kernels on sentence-length sequences (bf16
# forward+backward at B=300, H=4, T=18: 30 vs 201 ms; a beam step, Tq=1, Tk=50: 4.8 vs 24 ms);
# fused wins from about 512 keys on, and always on CUDA (docs/performance.md).
CPU_EXPLICIT_MAX_KEYS = 256
# The packed training path keeps its row count a multiple of this (`Packing`): few distinct
# matrix shapes, so that oneDNN's cache of compiled kernels holds them.
ROW_ALIGN = 16
# CPU inference pads a sentence's attention queries and keys (masked) to a multiple of this many
# positions (the encoder's inside attention, a decoding step's encoder-decoder keys once in the
# cache), so that they are laid out in the same blocks alone or beside a longer batch mate:
# MKL's products and PyTorch's fp32 softmax then give its rows the same bits
# (`_attention_rowwise`; AVX-512's 16 fp32 lanes).
KEY_BLOCK = 16


class Packing:
    """The real positions of a right-padded (B, T) batch, for the packed training path.

    Packed, a batch's real tokens are rows (N, ...) in row-major (b, t) order, as `x[mask]`
    gives them: the position-wise work (embeddings, the W^Q, W^K, W^V, W^O and FFN products,
    LayerNorm, dropout, residuals) then skips the padding, which the length-sorted batches of
    §5.1 still carry on the source side (13-20% of the source tokens of Multi30k at 4,000-8,192
    tokens a batch). Only eq. (1) needs the padded layout: `to_heads` puts projected rows into
    (B, H, T, K), and `from_heads` takes the attended values back. At the padding, `to_heads`
    leaves a copy of packed row 0: as a key it is masked out (weight exactly 0), as a query its
    output is never taken back, so neither its value nor its gradient (0) matters, and no
    zero-filled tensor is made. Each move is one row gather forward and one backward
    (`_Gather`), no scatter-add.
    """

    def __init__(self, mask: torch.Tensor, align: int = ROW_ALIGN):
        """mask: (B, T) bool, True at real tokens, each row's real tokens first.

        align: the packed rows are made a multiple of it. First the first few padding
        positions are taken in (as many as there are): computed like tokens, they are padding
        to attention (masked as keys: the source mask, or after every real query of their row
        under §3.2.3's causal mask). Rows still missing are copies of packed row 0 appended at
        the end ("spares"): computed row by row like the others, but never placed in the
        padded layout, so no other row attends to them and their gradient is 0. `real_rows`
        drops both at the end. Why: oneDNN builds (JIT-compiles) a kernel for each new matrix
        shape, ~0.6 ms each, and keeps 1,024 of them: with a row count that changed with every
        batch, training the quickstart preset spent ~7% of its time building them
        (docs/performance.md). CPU products over a row count that is not a multiple of 4 also
        ran 7-20% slower.
        """
        self.B, self.T = mask.shape
        flat = mask.reshape(-1)
        n_real = int(flat.sum())
        if n_real == 0:
            raise ValueError("a packed batch needs at least one real token")
        extra = -n_real % align
        taken = flat
        if extra:
            pad = (~flat).nonzero().squeeze(1)[:extra]
            if pad.numel():
                taken = flat.clone()
                taken[pad] = True
        placed = taken.nonzero().squeeze(1)  # flat indices of the rows in the padded layout
        self.placed = placed.numel()  # the spares come after these rows
        spares = -self.placed % align
        self.rows = torch.cat([placed, placed[:1].expand(spares)]) if spares else placed  # (N,)
        self.n = self.rows.numel()
        self.real: torch.Tensor | None = None  # (N_real,) packed rows of the real tokens
        if self.n != n_real:
            self.real = flat[placed].nonzero().squeeze(1)
            # For the gradient: each packed row's real row (row 0 for the others, whose
            # gradient is then zeroed: `_Gather`).
            is_real = torch.zeros(self.n, dtype=torch.bool, device=mask.device)
            is_real[self.real] = True
            self._real_back = torch.zeros(self.n, dtype=torch.long, device=mask.device)
            self._real_back[self.real] = torch.arange(n_real, device=mask.device)
            self._not_real = (~is_real).nonzero().squeeze(1)
        self.t = self.rows % self.T  # (N,) position of each packed row
        # (B * T,) packed row of each position; N (past the last) at the padding.
        self.slots = torch.full_like(flat, self.n, dtype=torch.long)
        self.slots[placed] = torch.arange(self.placed, device=mask.device)
        self._heads: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        self._row_map: torch.Tensor | None = None

    def _head_index(self, n_heads: int, parts: int = 1) -> tuple[torch.Tensor, ...]:
        """For packed rows (N, parts, H) and padded ones (parts, B, H, T), both flattened:
        where each packed row lies padded; which packed row each padded one holds (row 0 at
        the padding); the padded rows at the padding; the packed rows of the spares (None
        without spares). parts = 2: keys and values from one projection (W^K | W^V)."""
        key = (n_heads, parts)
        if key not in self._heads:
            B, T, n, dev = self.B, self.T, self.n, self.rows.device
            ph = parts * n_heads
            part_head = torch.arange(ph, device=dev)  # part * H + h
            part, h = part_head // n_heads, part_head % n_heads
            b = self.rows // T
            rows = ((part * B + b[:, None]) * n_heads + h) * T + self.t[:, None]  # (N, PH)
            slots = self.slots.view(1, B, 1, T) * ph + (part * n_heads + h).view(parts, 1, -1, 1)
            pad = (self.slots == n).view(1, B, 1, T).expand_as(slots)
            spares = None
            if self.placed < n:
                spares = torch.arange(self.placed * ph, n * ph, device=dev)
            self._heads[key] = (
                rows.reshape(-1),
                slots.masked_fill(pad, 0).reshape(-1),
                pad.reshape(-1).nonzero().squeeze(1),
                spares,
            )
        return self._heads[key]

    def row_map(self) -> torch.Tensor:
        """(B, T) int64: each position's packed row, -1 where it is not packed (the padding
        left out; `kernels.attention_train`)."""
        if self._row_map is None:
            slots = self.slots.masked_fill(self.slots == self.n, -1)
            self._row_map = slots.view(self.B, self.T)
        return self._row_map

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, ...) -> (N, ...): the rows of the packed positions."""
        return x.reshape(self.B * self.T, *x.shape[2:]).index_select(0, self.rows)

    def real_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Packed (N, ...) -> the real tokens' rows (N_real, ...), in `x[mask]`'s order."""
        if self.real is None:
            return x
        return _Gather.apply(x, self.real, self._real_back, self._not_real)

    def to_heads(self, y: torch.Tensor, n_heads: int, size: int, parts: int = 1) -> torch.Tensor:
        """Packed projections (N, parts*H*size) -> (B, H, T, size), or (parts, B, H, T, size)
        for parts > 1 (2: keys and values of one (N, 2*H*K) projection); the padding holds a
        copy of a real row. (Not (1, B, H, T, size) then [0]: the gradient of that select is
        a zero-filled (1, B, H, T, size) with the gradient copied in.)"""
        rows, slots, _, spares = self._head_index(n_heads, parts)
        # The spares' gradient: a zero row, not their copy's.
        out = _Gather.apply(y.reshape(-1, size), slots, rows, spares)
        if parts == 1:
            return out.view(self.B, n_heads, self.T, size)
        return out.view(parts, self.B, n_heads, self.T, size)  # (parts * B * H * T, size) inside

    def from_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, H, T, Vd) -> packed (N, H*Vd): the real queries' attended values."""
        B, H, T, size = x.shape
        rows, slots, pad, _ = self._head_index(H)
        return _Gather.apply(x.reshape(B * H * T, size), rows, slots, pad).view(self.n, H * size)


class _Gather(torch.autograd.Function):
    """out = x.index_select(0, index); the gradient is the gather of the incoming gradient
    with `back`, the inverse map on the real rows (a bijection), and zero at the rows
    `zero_rows` (None: none), whose `back` may be any row. Both directions are row copies,
    where autograd's own backward of an indexing is a scatter-add into a zeroed tensor
    (several times slower here). The zeros are written over the gathered rows, not read from
    a zero row appended to the gradient: that copied the whole gradient (~5 ms of a 2.1 s base
    training step, 19 copies)."""

    @staticmethod
    def forward(ctx, x, index, back, zero_rows):  # noqa: D102
        ctx.save_for_backward(back, zero_rows)
        return x.index_select(0, index)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        back, zero_rows = ctx.saved_tensors
        out = grad.contiguous().index_select(0, back)
        if zero_rows is not None and zero_rows.numel():
            out.index_fill_(0, zero_rows, 0)
        return out, None, None, None


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    p_drop: float = 0.0,
    weights: list[torch.Tensor] | None = None,
    fused: bool | None = None,
    prescaled: bool = False,
    aligned: bool = False,
) -> torch.Tensor:
    """§3.2.1 eq. (1): softmax(Q K^T / sqrt(d_k)) V.

    Args:
        q: (B, H, Tq, K); k: (B, H, Tk, K); v: (B, H, Tk, Vd).
        mask: bool, broadcastable to (B, H, Tq, Tk), True where attention is allowed; or
            float, added to the scores (0 allowed, -inf not; `DecoderCache.cross_bias`).
        causal: §3.2.3: query i (the last Tq of the Tk positions) sees only keys j <= i.
        p_drop: dropout on the attention weights (not in the paper; 0 by default).
        weights: a list to append the (B, H, Tq, Tk) attention weights to (Figures 3-5).
        fused: PyTorch's fused kernels (True) or eq. (1) written out (False); default the
            faster for this device and length. Asking for the weights writes it out.
        prescaled: q is already multiplied by 1 / sqrt(d_k) (`_StepWeights`).
        aligned: every row's queries and keys are as many whatever its batch, or padded in
            whole KEY_BLOCKs (a decoding step's; CPU inference, `_attention_rowwise`).

    Returns:
        The attended values (B, H, Tq, Vd).
    """
    t_q, t_k = q.size(-2), k.size(-2)
    # CPU inference computes each row's values the same whatever the rest of its batch is
    # (`_attention_rowwise`): not through the fused kernels, which split the keys into blocks.
    rowwise = _cpu_inference(q, k, v) and p_drop == 0.0
    if fused is None:
        fused = q.device.type != "cpu" or (t_k > CPU_EXPLICIT_MAX_KEYS and not rowwise)
    if causal and (mask is not None or t_q != t_k or not fused or weights is not None):
        # The fused kernels' is_causal aligns the first query with the first key; with a cache
        # (Tq < Tk) or another mask the causal mask is written out.
        allowed = causal_mask(t_q, t_k, q.device)
        mask, causal = (allowed if mask is None else mask & allowed), False
    if fused and weights is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=p_drop, is_causal=causal,
            scale=1.0 if prescaled else None,
        )  # fmt: skip
    if rowwise:
        return _attention_rowwise(q, k, v, mask, weights, prescaled, aligned)
    scores = q @ k.transpose(-2, -1)  # (B, H, Tq, Tk)
    if mask is not None and mask.dtype == torch.bool and _compiled_softmax(scores):
        c = 0.0 if prescaled else math.sqrt(q.size(-1))
        w = _ScaledMaskedSoftmax.apply(scores, mask, c)  # the division and the softmax at once
        if weights is not None:
            weights.append(w)
        return dropout(w, p_drop, True) @ v
    if not prescaled:
        scores = scores / math.sqrt(q.size(-1))
    if mask is None:
        w = scores.softmax(dim=-1)
    elif mask.dtype != torch.bool:
        w = (scores + mask).softmax(dim=-1)
    else:
        w = masked_softmax(scores, mask)
    if weights is not None:
        weights.append(w)
    return dropout(w, p_drop, True) @ v  # (B, H, Tq, Vd)


def _key_blocks(memory: torch.Tensor, src_mask: torch.Tensor):
    """memory (B, S, D) and src_mask (B, S) padded to a multiple of KEY_BLOCK positions (zero
    rows, masked), for the decoder cache's encoder-decoder keys and values."""
    extra = -memory.size(1) % KEY_BLOCK
    if extra == 0:
        return memory, src_mask
    return F.pad(memory, (0, 0, 0, extra)), F.pad(src_mask, (0, extra), value=False)


def _transposed_keys(k: torch.Tensor) -> torch.Tensor:
    """A decoding step's encoder-decoder keys k (B, H, S, K) as they are kept in the cache: on
    the CPU (no gradient wanted), a (B, H, S, K) view of K^T (B, H, K, S) in fp32 (an fp64
    model's in fp64), whose rows `_attention_rowwise` sums weighted by the few queries of a
    step (a bf16 model's keys widened once here, not at every step); elsewhere contiguous.

    A bf16 model's keys stay bf16 rows where `bf16_key_rows()`."""
    if not _cpu_inference(k):
        return k.contiguous()
    if k.dtype == torch.bfloat16 and bf16_key_rows():
        return k.contiguous()
    if k.dtype not in (torch.float32, torch.float64):
        k = k.float()
    return k.transpose(-2, -1).contiguous().transpose(-2, -1)


def bf16_key_rows() -> bool:
    """Whether a bf16 model's encoder-decoder keys are kept as they are, bf16 rows, on the CPU
    (`_transposed_keys`): where a step's attention is `kernels.step_attention`
    (`step_attention_kernel`), which widens them in registers as it reads them. A greedy step
    then reads half the bytes of the fp32 K^T: W2 bf16 greedy -7.1%, the quickstart model's test
    set -3.0% (8 of 8 and 7 of 8 alternated searches, AMD Zen 5; `bench_bf16_keys.py`); beam 4
    within 2%, as a sentence's K queries share one read of its keys (docs/performance.md,
    "Round forty-two")."""
    return step_attention_kernel()


def _cpu_inference(*tensors: torch.Tensor) -> bool:
    """Whether an attention runs on the CPU with no gradient wanted of its operands."""
    return tensors[0].device.type == "cpu" and not (
        torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    )


def _attention_rowwise(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    weights: list[torch.Tensor] | None,
    prescaled: bool,
    aligned: bool = False,
) -> torch.Tensor:
    """`attention` for CPU inference (eq. 1 written out, no dropout), every row's values the
    same bits however many rows its batch has and wherever it sits in it, so that a server's
    answer does not depend on who else is asking and a sentence translates the same in any
    file (docs/decoding.md, "A sentence's translation does not depend on its batch").

    aligned: the caller's queries and keys are as many for a row whatever its batch, or
    padded (masked) in whole KEY_BLOCKs: a decoding step's (its cache's positions, the same
    for every row; the encoder-decoder keys stored so, `_key_blocks`). Otherwise (the
    encoder; decoding without a cache) the queries and keys are padded so here
    (`_in_key_blocks`): a sentence's own length against a longer batch mate's changed MKL's
    products (4 of 76 random cases with only the keys padded, 18 with neither; none with
    both) and PyTorch's fp32 softmax (564 of 11,592 random rows); in whole blocks, neither.

    Each of eq. (1)'s reductions is then one whose result for a row does not depend on the
    others:
    - the scores in fp32 (a bf16 model's q and k widened: exact), by MKL, whose batched
      products agree row for row at any batch size; oneDNN's bf16 ones did not (1 of 6,400
      scores rounded differently alone, (4, 1, 64) x (4, 64, 8) against 200 such), and a
      bf16 score is rounded before the softmax besides;
    - the softmax in fp32 over rows of the same length or of whole blocks (`_softmax_rowwise`);
    - a decoding step's weights x values as the sums of value rows (`_weighted_rows`, for any
      batch: the sums and the batched product round differently, so neither may be chosen by
      the batch's size), else the batched product in fp32;
    - operands laid out the same for any batch size (`_heads_merged`).
    """
    narrow = v.dtype == torch.bfloat16
    t_q, t_k = q.size(-2), k.size(-2)
    if not aligned:
        q, k, v, mask = _in_key_blocks(q, k, v, mask)
    if narrow:
        q = q.float()
    if aligned and weights is None and _step_kernel_takes(q, k, v, mask):
        # A decoding step's whole eq. (1) per (batch, head) in one pass over its keys and
        # values, keys masked by the bias not read (`kernels.step_attention`): a W2 int8
        # search's steps' attention 208-225 -> 168-186 ms greedy, 595-645 -> 374-398 beam 4
        # (docs/performance.md, "Round thirty-eight"). Each row's values depend on that row
        # alone, as below. A bf16 model's cache keys are read as they are, not widened here.
        bias = None if mask is None else mask.float()
        return kernels.step_attention(q, k, v, bias, 0.0 if prescaled else math.sqrt(q.size(-1)))
    if narrow:
        k = k.float()
    kt = k.transpose(-2, -1) if aligned and k.stride(-2) == 1 else None  # (B, H, K, Tk)
    if kt is not None and kt.is_contiguous() and _weighted_rows_apply(q, kt):
        # A decoding step's few queries against keys stored transposed (the encoder-decoder
        # keys, `_transposed_keys`): each score row is the sum of the K rows of K^T weighted
        # by the query, read once (`_weighted_rows`): (64, 8, 1, 64) x (64, 8, 64, 48) took
        # 45 us this way, 144 as a batched product (Zen 5, 2 threads).
        scores = _weighted_rows(q, kt)
    else:
        scores = _heads_merged(q) @ _heads_merged(k).transpose(-2, -1)  # (B, H, Tq, Tk)
    if not prescaled:
        scores = scores / math.sqrt(q.size(-1))
    w = _softmax_rowwise(scores, mask)  # fp32 (fp64 for an fp64 model)
    rows = _weighted_rows_apply(w, v)
    # The weights in the model's dtype, rounded only where they are read so: the value sums
    # (bf16 rows with bf16 weights, summed in fp32) and the returned weights.
    w_model = w.bfloat16() if narrow and (rows or weights is not None) else w
    if weights is not None:
        weights.append(w_model[..., :t_q, :t_k])
    if rows:
        return _weighted_rows(w_model, v)
    if narrow:
        return (w @ _heads_merged(v.float())).bfloat16()[..., :t_q, :]
    return (w @ _heads_merged(v))[..., :t_q, :]  # (B, H, Tq, Vd)


def _step_kernel_takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> bool:
    """Whether `kernels.step_attention` takes this aligned step (`_attention_rowwise`): an
    additive mask or none, q, k and v as it reads them (`kernels.step_attention_problem`), and
    the kernel checked here (`step_attention_kernel`). Nothing here depends on the batch's
    size."""
    if mask is not None and (mask.dtype == torch.bool or mask.dim() != 4):
        return False
    return kernels.step_attention_problem(q, k, v) is None and step_attention_kernel()


@functools.cache
def step_attention_kernel() -> bool:
    """Whether decoding steps on the CPU take `kernels.step_attention` (AVX-512 or AVX2 with
    FMA, the library built, `TRANSFORMER_FUSED_KERNELS` not 0): only once it has agreed with
    eq. (1) in fp64, to 1e-5 of the largest value (bf16 keys and values: to bf16's rounding),
    on heads of every kind (key rows and K^T columns, masked keys, a query with none legal,
    bf16 keys and values, strided queries, widths off 16). Decoding streams may ask at once:
    each gets the same answer."""
    if not kernels.attention_supported():
        return False
    g = torch.Generator().manual_seed(0)
    for B, H, Tq, L, d, rows, narrow in ((2, 3, 1, 37, 64, True, False), (3, 2, 4, 20, 24, False,
                                         False), (2, 2, 3, 70, 16, True, True)):  # fmt: skip
        # narrow: bf16 keys (rows) and values
        q = torch.randn(B, Tq, H, d + 3, generator=g)[..., :d].transpose(1, 2)
        k = torch.randn(B, H, L, d, generator=g)
        if not rows:
            k = k.transpose(-2, -1).contiguous().transpose(-2, -1)
        v = torch.randn(B, H, L, d + 5, generator=g)
        bias = torch.zeros(B, 1, Tq, L).masked_fill_(torch.rand(B, 1, Tq, L, generator=g) < 0.3,
                                                     float("-inf"))  # fmt: skip
        bias[0, 0, 0] = float("-inf")  # a query with no legal key: zeros
        if narrow:
            k, v = k.bfloat16(), v.bfloat16()
        ref = (q.double() @ k.double().transpose(-2, -1)) / math.sqrt(d) + bias.double()
        ref = ref.softmax(-1).nan_to_num_(0.0) @ v.double()
        out = kernels.step_attention(q, k, v, bias, math.sqrt(d)).double()
        tol = (1e-2 if narrow else 1e-5) * float(ref.abs().max())
        if not bool(((out - ref).abs() <= tol).all()):
            logger.info("attention: torch's ops for a decoding step (the compiled kernel differs)")
            return False
    return True


def bf16_beam_history() -> bool:
    """Whether bf16 beam search on the CPU follows back-pointers (`cache.BeamHistory`) as fp32
    and int8 do: where a step's attention is `kernels.step_attention` (`step_attention_kernel`),
    which reads the bf16 keys in place and does not read the keys off a query's history, so a
    step reads about what reordered buffers hold, and the copy of the prefix at every step is
    gone: a W2 bf16 beam-4 search 5-8% faster on a Zen 5, the same translations
    (docs/performance.md, "Round forty"). Through torch's ops the K * (t + 1) keys were widened
    to fp32 every layer and step (0.95x, round twenty-three): there the copies stay."""
    return step_attention_kernel()


def _in_key_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None):
    """q (B, H, Tq, K) and k, v (B, H, Tk, .) padded with zero rows to whole KEY_BLOCKs, and
    mask (bool or additive; None: every key) to match: the added keys masked, the added
    queries (whose rows are dropped) allowed every key."""
    t_q, t_k = q.size(-2), k.size(-2)
    pad_q, pad_k = -t_q % KEY_BLOCK, -t_k % KEY_BLOCK
    if pad_q:
        q = F.pad(q, (0, 0, 0, pad_q))
    if pad_k:
        k, v = F.pad(k, (0, 0, 0, pad_k)), F.pad(v, (0, 0, 0, pad_k))
        if mask is None:
            mask = torch.arange(t_k + pad_k, device=q.device) < t_k
        elif mask.dtype == torch.bool:
            mask = F.pad(mask, (0, pad_k), value=False)
        else:
            mask = F.pad(mask, (0, pad_k), value=float("-inf"))
    if pad_q and mask is not None and mask.dim() > 1 and mask.size(-2) == t_q:
        mask = F.pad(mask, (0, 0, 0, pad_q), value=True if mask.dtype == torch.bool else 0.0)
    return q, k, v, mask


def _heads_merged(t: torch.Tensor) -> torch.Tensor:
    """t (B, H, T, .) laid out so that the batched products see B * H matrices the same way
    for every B. `matmul` merges B and H into one batch dimension, a view where t's strides
    allow it and a contiguous copy where not; with B = 1 they always allow it, so one sentence
    alone was multiplied from a strided layout (the encoder's heads, H * d_k apart) and the
    same sentence in a batch from a copy, by MKL kernels that round differently. A copy here
    wherever B > 1 would need one."""
    if t.size(1) > 1 and t.stride(0) != t.size(1) * t.stride(1):
        return t.contiguous()
    return t


def _softmax_rowwise(scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """softmax(scores where mask allows: bool, or float added; or everywhere) over the last
    dimension, for `_attention_rowwise`: rows as long as any batch mate's, or of whole
    KEY_BLOCKs, get the same bits whatever else is in the tensor. PyTorch's softmax takes a
    row in vectors of 16 (AVX-512; 8 with AVX2) lanes, a partial one where the row ends: -inf
    keys added in whole blocks add whole vectors of zeros to the sum, which changes nothing
    (none of 13,631 random rows of 1-69 keys padded to a block, then 1-4 blocks more; 148 where
    padded to any length instead).
    A row with no legal key (bool mask) gets zero weights, as `masked_softmax`'s.
    """
    if mask is None:
        return torch.softmax(scores, dim=-1)
    if mask.dtype != torch.bool:  # 0 or -inf: the sum is exact
        return torch.softmax(scores + mask, dim=-1)
    w = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return w.nan_to_num_(0.0)  # a row of -inf: 0/0


# A decoding step's weights-times-values product (a few queries per head) as weighted sums of
# the value rows (`_weighted_rows`): up to this many queries per head (beams of a sentence
# attend together; at 8 and more the batched product reads its keys once for all of them and
# is as fast or faster).
WEIGHTED_ROWS_MAX_QUERIES = 6


def _weighted_rows_apply(w: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether `_weighted_rows` takes w @ v in CPU inference (`_attention_rowwise`'s fp32
    weights): at most WEIGHTED_ROWS_MAX_QUERIES queries a head, v fp32 or bf16, each value row
    one run of memory and every (batch, head) block of rows starting on a row boundary.
    Nothing here depends on the batch's size or padding."""
    if w.dtype != torch.float32 or v.dtype not in (torch.float32, torch.bfloat16):
        return False
    if w.device.type != "cpu" or w.size(-2) > WEIGHTED_ROWS_MAX_QUERIES:
        return False
    B, H, L, size = v.shape
    s_b, s_h, s_t, s_d = v.stride()
    return (s_d == 1 and s_t == size and L > 1
            and (B == 1 or s_b % size == 0) and (H == 1 or s_h % size == 0))  # fmt: skip


def _weighted_rows(w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """w (B, H, Tq, L) @ v (B, H, L, Vd) for a decoding step (`_weighted_rows_apply`): each
    output row the sum of the L value rows times their weights, `embedding_bag` over v's rows
    with one bag per query; (B, H, Tq, Vd).

    A batched product of one (or a few) query rows per head is a matrix-vector product per
    (batch, head), whose fixed costs dominate: (64, 8, 1, 34) x (64, 8, 34, 64) in fp32 took
    105 us against 55 here, 40 positions of a 64-position cache 219 against 88, bf16 70-117
    against 30-49 (AMD Zen 5, 2 threads, out of the cache: `benchmarks/bench_weighted_rows.py`).
    Here every row is read once, as fast as memory gives it. Each query's sum runs over its
    rows in order in fp32 (bf16 rows widened) on one thread: a result does not depend on the
    rest of the batch.
    """
    B, H, Tq, L = w.shape
    size = v.size(-1)
    s_b = v.stride(0) // size if B > 1 else 0  # in rows
    s_h = v.stride(1) // size if H > 1 else 0
    index, offsets = _row_bags(B, H, Tq, L, s_b, s_h)
    # v's rows from its first, as one table (rows between v's blocks, such as a cache's
    # positions not yet written, are never named by the index)
    table = v.as_strided((s_b * (B - 1) + s_h * (H - 1) + L, size), (size, 1))
    # The op itself (mode 1: sum), not `F.embedding_bag`, whose argument checks cost as much
    # as the sums at one sentence's sizes (1 x 4 heads x 10 positions: 3.2 against 3.9 us).
    out = torch.embedding_bag(table, index, offsets, False, 0, False, w.reshape(-1))[0]
    return out.view(B, H, Tq, size)


@functools.lru_cache(maxsize=4)
def _row_bags(B: int, H: int, Tq: int, L: int, s_b: int, s_h: int):
    """The rows (B * H * Tq * L,) that the queries sum, row (b, h, j) at b * s_b + h * s_h + j
    of the table, and the bags' offsets. Kept for the last few shapes: every layer of a step
    asks for the same two (self-attention's, a new one each step, and the encoder-decoder
    attention's); an entry is as large as the step's attention weights, twice over (int64)."""
    base = torch.arange(B)[:, None] * s_b + torch.arange(H)[None, :] * s_h  # (B, H)
    index = base[:, :, None, None] + torch.arange(L)  # (B, H, 1, L)
    return index.expand(B, H, Tq, L).reshape(-1), torch.arange(0, B * H * Tq * L, L)


def _compiled_softmax(scores: torch.Tensor) -> bool:
    """Whether eq. (1)'s scaling and masked softmax go through `_ScaledMaskedSoftmax`: when
    training in bf16 on a CPU with the compiled kernels (`kernels.masked_softmax`), the
    (B, H, Tq, Tk) scores contiguous. Torch's ops take 2.9-3.3 ms forward on (128, 8, 34, 34)
    (a division, an fp32 copy, masked_fill, max, exp, sum, divide, a bf16 copy), the kernel 1.1."""
    return scores.requires_grad and scores.dim() == 4 and _fused_training(scores)


def _fused_training(*tensors: torch.Tensor) -> bool:
    """Whether a fused kernel (`kernels.fused_supported`) may take these tensors: gradients on
    (training), each contiguous bf16 on the CPU, not inside torch.compile's trace."""
    return torch.is_grad_enabled() and kernels.fused_takes(*tensors)


class _ScaledMaskedSoftmax(torch.autograd.Function):
    """softmax(scores / c with -inf where mask is False) in one pass of `kernels.masked_softmax`
    (c = 0: no division; a row with no legal key gets zero weights, as `_MaskedSoftmax`), and
    its gradient in one more: `masked_softmax(scores / c, mask)`'s values to bf16 rounding (its
    exp is a polynomial, to ~1 ulp of fp32), each of the two backward roundings kept."""

    @staticmethod
    def forward(ctx, scores, mask, c):  # noqa: D102
        w = kernels.masked_softmax(scores, mask, c)
        ctx.save_for_backward(w)
        ctx.c = c
        return w

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        (w,) = ctx.saved_tensors
        return kernels.masked_softmax_backward(grad.contiguous(), w, ctx.c), None, None


# The longest padded key length `_PackedAttention` takes. Its (sentence, head) tasks keep their
# scores whole (T x T fp32): a base-width sub-layer's forward and backward (8 heads of 64, ~4,096
# positions a batch) ran 1.10-1.63x the batched path's speed at T = 34 to 512, 0.81x / 1.01x
# (keys masked / causal) at 768 and 0.75x / 0.85x at 1,024 (AMX Xeon, 2 threads;
# docs/performance.md, "Round forty-nine").
PACKED_ATTENTION_MAX_KEYS = 512


def _packed_attention_takes(q, kv, xs: Packing, kvs: Packing, mask, causal: bool, heads: int):
    """Whether `_PackedAttention` takes a packed sub-layer's eq. (1): training in bf16 on a CPU
    with the compiled kernels (`_fused_training`, `packed_attention_kernel`), no mask or a
    (B, 1, 1, Tk) bool key mask, §3.2.3's causal mask only within one packing (self-attention),
    projections the kernel reads as they are (`kernels.attention_train_problem`: head widths
    that are multiples of 16) and keys padded to at most `PACKED_ATTENTION_MAX_KEYS`."""
    # The tensors' kind and layout are attention_train_problem's to judge (rows contiguous).
    if not _fused_training() or xs.B != kvs.B or (causal and xs is not kvs):
        return False
    if kvs.T > PACKED_ATTENTION_MAX_KEYS:
        return False
    if mask is not None and (mask.dtype != torch.bool or mask.shape != (kvs.B, 1, 1, kvs.T)):
        return False
    return kernels.attention_train_problem(q, kv, heads) is None and packed_attention_kernel()


class _PackedAttention(torch.autograd.Function):
    """§3.2.2's heads of eq. (1) on a packed batch, forward and backward, by
    `kernels.attention_train`: each (batch row, head) reads its projected query, key and value
    rows where the packing keeps them and writes its attended values (forward) or their
    gradients (backward) there. It replaces `Packing.to_heads`' and `from_heads`' gathers (and
    their gradients' gathers and the keys' and values' stack), the two batched products each
    way and `_ScaledMaskedSoftmax`; the scores, softmax and products are fp32 inside, so its
    values differ from that path's (bf16 scores, a bf16 dP) by bf16's rounding
    (docs/performance.md, "Round forty-nine")."""

    @staticmethod
    def forward(ctx, q, kv, xs: Packing, kvs: Packing, kmask, causal: bool, heads: int, d_k=0):  # noqa: D102
        # kv None: q is self-attention's stacked (N, H*K + H*(K+Vd)) projection, whose first
        # d_k * heads columns are the queries (`gradhelper.stacked_linear`); its gradient is
        # then written as one tensor, the stacked product's.
        ctx.stacked = kv is None
        qkv = q
        if ctx.stacked:
            ctx.widths = [heads * d_k, qkv.size(1) - heads * d_k]  # queries | keys, values
            q, kv = qkv.split(ctx.widths, dim=1)
        inv_c = 1.0 / math.sqrt(q.size(1) // heads)  # §3.2.1: 1 / sqrt(d_k)
        qrow, krow = xs.row_map(), kvs.row_map()
        out, p = kernels.attention_train(
            q, kv, qrow, krow, kmask, causal, heads, inv_c, xs.placed
        )  # fmt: skip
        if ctx.stacked:
            ctx.save_for_backward(qkv, p)
        else:
            ctx.save_for_backward(q, kv, p)
        ctx.args = (qrow, krow, kmask, causal, heads, inv_c, xs.placed, kvs.placed)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        rest = (None,) * 6
        if ctx.stacked:
            qkv, p = ctx.saved_tensors
            q, kv = qkv.split(ctx.widths, dim=1)
            dqkv = torch.empty_like(qkv)
            out = dqkv.split(ctx.widths, dim=1)
            kernels.attention_train_backward(grad.contiguous(), q, kv, p, *ctx.args, out=out)
            return dqkv, None, *rest
        q, kv, p = ctx.saved_tensors
        dq, dkv = kernels.attention_train_backward(grad.contiguous(), q, kv, p, *ctx.args)
        return dq, dkv, *rest


def packed_attention_reference(q, kv, qrow, krow, kmask, causal: bool, heads: int, inv_c: float):
    """`kernels.attention_train`'s out in fp64 by torch's ops on the padded layout (the
    check of `packed_attention_kernel` and the tests'); differentiable in q and kv."""
    B, Tq = qrow.shape
    Tk = krow.size(1)
    d = q.size(1) // heads
    dv = kv.size(1) // heads - d
    qp = q.double()[qrow.clamp(min=0)].view(B, Tq, heads, d).transpose(1, 2)
    kvp = kv.double()[krow.clamp(min=0)]
    k = kvp[..., : heads * d].reshape(B, Tk, heads, d).transpose(1, 2)
    v = kvp[..., heads * d :].reshape(B, Tk, heads, dv).transpose(1, 2)
    legal = (krow >= 0)[:, None, None, :]
    if kmask is not None:
        legal = legal & kmask[:, None, None, :]
    if causal:
        legal = legal & (torch.arange(Tk)[None, :] <= torch.arange(Tq)[:, None])
    w = ((qp @ k.transpose(-2, -1)) * inv_c).masked_fill(~legal, -1e300).softmax(-1)
    w = w * legal.any(-1, keepdim=True)  # no legal key: zeros
    o = (w @ v).transpose(1, 2).reshape(B * Tq, heads * dv)
    at = qrow.reshape(-1) >= 0
    out = torch.zeros(q.size(0), heads * dv, dtype=torch.float64)
    return out.index_put((qrow.reshape(-1)[at],), o[at])


def packed_attention_case(B, Tq, Tk, H, d, dv, causal: bool, g: torch.Generator):
    """A random operand set for `kernels.attention_train` (the check of `packed_attention_kernel`
    and the tests'): the row maps of a right-padded batch (random lengths, the first row full,
    -1 at the padding left out), a key mask with the last batch row of no legal key (not
    causal), and random q, kv and out-gradient rows with 2 spare rows each that no position
    maps to. Returns q, kv, grad, qrow, krow, kmask and the query and key rows mapped."""

    def rows(T):
        lens = torch.randint(1, T + 1, (B,), generator=g)
        lens[0] = T
        r = torch.full((B, T), -1, dtype=torch.long)
        r[torch.arange(T) < lens[:, None]] = torch.arange(int(lens.sum()))
        return r

    qrow = rows(Tq)
    krow, kmask = qrow, None
    if not causal:
        krow = rows(Tk)
        kmask = torch.rand(B, Tk, generator=g) < 0.8
        kmask[-1] = False
    nq, nk = int(qrow.max()) + 1, int(krow.max()) + 1
    q = torch.randn(nq + 2, H * d, generator=g).bfloat16()
    kv = torch.randn(nk + 2, H * (d + dv), generator=g).bfloat16()
    grad = torch.randn(nq + 2, H * dv, generator=g).bfloat16()
    return q, kv, grad, qrow, krow, kmask, nq, nk


@functools.cache
def packed_attention_kernel() -> bool:
    """Whether training takes `_PackedAttention` (the compiled kernels built, AVX-512 F, BW and
    VL, `TRANSFORMER_FUSED_KERNELS` not 0): only once `kernels.attention_train` and its backward
    have agreed with `packed_attention_reference`, to 2% of the largest value, on batches of
    every kind (`packed_attention_case`: causal, a key mask, unpacked positions, spare rows, a
    batch row with no legal key; head widths 16 to 48, keys and values of different widths)."""
    if not kernels.fused_supported():
        return False
    g = torch.Generator().manual_seed(0)
    for B, Tq, Tk, H, d, dv, causal in ((3, 7, 7, 2, 16, 16, True), (3, 9, 21, 3, 32, 48, False)):
        q, kv, grad, qrow, krow, kmask, nq, nk = packed_attention_case(
            B, Tq, Tk, H, d, dv, causal, g
        )  # fmt: skip
        inv_c = 1.0 / math.sqrt(d)
        try:
            out, p = kernels.attention_train(q, kv, qrow, krow, kmask, causal, H, inv_c, nq)
            dq, dkv = kernels.attention_train_backward(
                grad, q, kv, p, qrow, krow, kmask, causal, H, inv_c, nq, nk
            )  # fmt: skip
        except (OSError, RuntimeError, ValueError) as e:
            logger.warning("training attention kept on torch's ops: %s", e)
            return False
        with torch.enable_grad():
            qd, kvd = q.double().requires_grad_(), kv.double().requires_grad_()
            ref = packed_attention_reference(qd, kvd, qrow, krow, kmask, causal, H, inv_c)
            (ref * grad.double()).sum().backward()
        for ours, theirs in ((out, ref.detach()), (dq, qd.grad), (dkv, kvd.grad)):
            if not bool(((ours.double() - theirs).abs() <= 0.02 * theirs.abs().max()).all()):
                logger.warning("training attention kept on torch's ops: the kernel differs")
                return False
    return True


def masked_softmax(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """softmax over the last dimension with -inf where mask (bool, broadcastable) is False;
    zero weights for a row with no legal key (`_MaskedSoftmax`)."""
    return _MaskedSoftmax.apply(scores, mask)


class _MaskedSoftmax(torch.autograd.Function):
    """softmax(scores with -inf where mask is False) over the last dimension, in fp32 (at least).

    §3.2.1: illegal connections are set to -inf before the softmax. A query with no legal key
    at all (a padded position whose whole window is padding) gets zero weights, as in the fused
    kernels, rather than NaN. PyTorch's softmax over a short last dimension (Multi30k: ~14
    keys) runs row by row with most of each row in the vector tail: (585, 4, 14, 14) bf16 took
    2.5 ms with its two masked_fills, against 1.15 here (max, exp, sum and divide each over the
    whole tensor; docs/performance.md). The backward is PyTorch's; the masked positions, whose
    weights are 0, get gradient 0 from it without a masked_fill.
    """

    @staticmethod
    def forward(ctx, scores, mask):  # noqa: D102
        # A copy even when scores is fp32 already: the in-place steps below must not write
        # into the caller's tensor.
        x = scores.to(torch.promote_types(scores.dtype, torch.float32), copy=True)
        x = x.masked_fill_(~mask, float("-inf"))
        # A row without a legal key has max -inf: clamped, it gives exp(-inf) = 0 everywhere.
        top = x.amax(dim=-1, keepdim=True).clamp_(min=torch.finfo(x.dtype).min)
        e = x.sub_(top).exp_()
        # Every other row holds exp(0) = 1, so its sum is >= 1 and the clamp changes nothing.
        w = e.div_(e.sum(dim=-1, keepdim=True).clamp_(min=1.0)).to(scores.dtype)
        ctx.save_for_backward(w)
        return w

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        (w,) = ctx.saved_tensors
        return torch._softmax_backward_data(grad.contiguous(), w, -1, w.dtype), None


class MultiHeadAttention(nn.Module):
    """§3.2.2: h heads of eq. (1) over projected queries, keys and values, then W^O.

    d_k and d_v are free (Table 3 rows A, B, C). W^K and W^V are stored as one (D, H*(K+Vd))
    projection so that keys and values come from a single matrix product.
    """

    def __init__(self, d_model: int, n_heads: int, d_k: int, d_v: int, p_attn_drop: float = 0.0):
        super().__init__()
        self.n_heads, self.d_k, self.d_v = n_heads, d_k, d_v
        self.p_attn_drop = p_attn_drop
        self.w_q = Linear(d_model, n_heads * d_k)
        self.w_kv = Linear(d_model, n_heads * (d_k + d_v))
        self.w_o = Linear(n_heads * d_v, d_model)

    def project_kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T, D) -> keys (B, H, T, K) and values (B, H, T, Vd)."""
        B, T, _ = x.shape
        k, v = self.w_kv(x).split([self.n_heads * self.d_k, self.n_heads * self.d_v], dim=-1)
        k = k.view(B, T, self.n_heads, self.d_k).transpose(1, 2)  # (B, H, T, K)
        v = v.view(B, T, self.n_heads, self.d_v).transpose(1, 2)  # (B, H, T, Vd)
        return k, v

    def forward(self, x, k, v, mask, causal: bool = False, weights=None) -> torch.Tensor:
        """Attend from queries x (B, Tq, D) over projected k, v (`project_kv`); (B, Tq, D).

        mask, causal, weights: as `attention`'s (the weights of every head are appended).
        """
        return self.attend(self.split_heads(self.w_q(x)), k, v, mask, causal, weights)

    def split_heads(self, x: torch.Tensor, size: int | None = None) -> torch.Tensor:
        """Projected queries (or keys, values: size d_v) (B, T, H*K) -> (B, H, T, K)."""
        B, T, _ = x.shape
        size = self.d_k if size is None else size
        if T == 1:  # a decoding step: the same memory layout, one op fewer
            return x.view(B, self.n_heads, 1, size)  # (B, H, 1, K)
        return x.view(B, T, self.n_heads, size).transpose(1, 2)  # (B, H, T, K)

    def attend(
        self, q, k, v, mask, causal=False, weights=None, prescaled=False, aligned=False
    ) -> torch.Tensor:
        """Eq. (1) per head from projected queries q (B, H, Tq, K), then W^O; (B, Tq, D)."""
        B, _, Tq, _ = q.shape
        p = self.p_attn_drop if self.training else 0.0
        out = attention(q, k, v, mask, causal, p, weights, prescaled=prescaled, aligned=aligned)
        if Tq > 1:  # with one query, (B, H, 1, Vd) is already laid out as (B, 1, H, Vd)
            out = out.transpose(1, 2)  # (B, Tq, H, Vd)
        return self.w_o(out.reshape(B, Tq, self.n_heads * self.d_v))  # (B, Tq, H*Vd) inside

    def attend_grouped(
        self, q, k, v, mask, group: int, prescaled=False, live: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`attend` for rows that share keys in runs of `group` (the beams of one sentence,
        `DecoderCache.group`): q (R, H, Tq, K) against k (R / group, H, S, K), v and mask likewise
        per run. The run's queries are attended together, one matrix product per head and
        source instead of `group` (each reads the keys and values once); (R, Tq, D).
        live: the runs of k that the R / group runs of q are (`BeamHistory.live`); the
        others are attended with zero queries, and their output dropped."""
        R, H, Tq, K = q.shape
        C = R // group
        q = q.reshape(C, group, H, Tq, K).transpose(1, 2).reshape(C, H, group * Tq, K)
        if live is not None:
            q = q.new_zeros(k.size(0), *q.shape[1:]).index_copy_(0, live, q)
        out = attention(q, k, v, mask, prescaled=prescaled, aligned=True)  # (C, H, group*Tq, Vd)
        if live is not None:
            out = out.index_select(0, live)
        out = out.view(C, H, group, Tq, self.d_v).permute(0, 2, 3, 1, 4)  # (C, group, Tq, H, Vd)
        return self.w_o(out.reshape(R, Tq, H * self.d_v))

    def attend_packed(
        self,
        x: torch.Tensor,
        xs: Packing,
        kv: torch.Tensor,
        kvs: Packing,
        mask,
        causal=False,
        kvp: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The packed path's sub-layer: queries from packed x (Nq, D) laid out by xs, keys and
        values from packed kv (Nk, D) laid out by kvs (kvp: their projection w_kv(kv), made
        already); mask and causal as `attention`'s; returns packed (Nq, D). Equal to `forward`
        on the padded tensors at the real rows."""
        H, K = self.n_heads, self.d_k
        p = self.p_attn_drop if self.training else 0.0
        qkv = None
        if kvp is not None:
            qp = self.w_q(x)  # (Nq, H*K); kvp (Nk, H*(K+Vd))
        elif x is kv and p == 0.0 and _fused_training(x):
            # Self-attention's W^Q and W^KV as one product (None: not taken).
            qkv = gradhelper.stacked_linear(x, [self.w_q, self.w_kv])
        if qkv is not None:
            qp, kvp = qkv.split([H * K, qkv.size(1) - H * K], dim=1)  # views of qkv
        elif kvp is None:
            qp, kvp = self.w_q(x), self.w_kv(kv)  # (Nq, H*K), (Nk, H*(K+Vd))
        if p == 0.0 and _packed_attention_takes(qp, kvp, xs, kvs, mask, causal, H):
            # Eq. (1) per head read from the packed rows, with no (B, H, T, K) copies.
            kmask = None if mask is None else mask.reshape(kvs.B, kvs.T).contiguous()
            if qkv is not None:
                out = _PackedAttention.apply(qkv, None, xs, kvs, kmask, causal, H, K)
            else:
                out = _PackedAttention.apply(qp, kvp, xs, kvs, kmask, causal, H)
            return self.w_o(out)
        q = xs.to_heads(qp, H, K)  # (B, H, Tq, K)
        if K == self.d_v:  # keys and values in one gather
            k, v = kvs.to_heads(kvp, H, K, parts=2)  # (B, H, Tk, K) each
        else:
            k, v = kvp.split([H * K, H * self.d_v], dim=-1)  # (Nk, H*K), (Nk, H*Vd)
            k, v = kvs.to_heads(k, H, K), kvs.to_heads(v, H, self.d_v)
        out = attention(q, k, v, mask, causal, p)  # (B, H, Tq, Vd)
        return self.w_o(xs.from_heads(out))  # (Nq, D)


class PositionwiseFeedForward(nn.Module):
    """§3.3 eq. (2): FFN(x) = max(0, x W1 + b1) W2 + b2."""

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.w_1 = Linear(d_model, d_ff)
        self.w_2 = Linear(d_ff, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = gradhelper.linear_relu(x, self.w_1)  # max(0, .) inside the product (None: not)
        if h is not None:
            return self.w_2(h)
        relu_forward = getattr(self.w_1, "relu_forward", None)  # decoding's translate.PackedLinear
        if relu_forward is not None:
            return self.w_2(relu_forward(x))  # max(0, .) inside oneDNN's product
        h = self.w_1(x)  # (B, T, d_ff)
        if h.requires_grad and _compiled_relu(h):
            return self.w_2(_ReLU.apply(h))
        return self.w_2(F.relu(h, inplace=True))


def _compiled_relu(h: torch.Tensor) -> bool:
    """Whether max(0, h) goes through `_ReLU` (`kernels.relu_`): training in bf16 on a CPU
    with the compiled kernels, h contiguous (torch's clamp_min_ and threshold_backward run at
    about a third of the kernels' rate there: 1.2 against 0.4 ms forward on (3840, 2048))."""
    return _fused_training(h)


class _ReLU(torch.autograd.Function):
    """§3.3 eq. (2)'s max(0, h) in place (`kernels.relu_`), the output saved for the gradient
    (`kernels.relu_grad`): F.relu(h, inplace=True)'s values, forward and backward."""

    @staticmethod
    def forward(ctx, h):  # noqa: D102
        kernels.relu_(h)
        ctx.mark_dirty(h)
        ctx.save_for_backward(h)
        return h

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        (h,) = ctx.saved_tensors
        return kernels.relu_grad(grad.contiguous(), h)


def sinusoid_table(max_len: int, d_model: int) -> torch.Tensor:
    """§3.5: PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...); (max_len, D)."""
    pos = torch.arange(max_len, dtype=torch.float64)[:, None]
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64)
    angle = pos / torch.pow(10000.0, two_i / d_model)  # (max_len, ceil(D/2))
    table = torch.zeros(max_len, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angle)
    table[:, 1::2] = torch.cos(angle[:, : d_model // 2])
    return table.float()


def building_skeleton() -> bool:
    """Whether modules are being built on the meta device (`with torch.device("meta")`): a
    skeleton that only gives names and shapes (the model file's header check, `transformer
    presets`).

    Not in the paper. Many meta kernels (`normal_`, `arange`, ...) are decompositions whose
    wrapper imports torch._dynamo on first use: ~1.8 s of every command that loads a model
    file (`translate` of one line took 5.3 s, 2.7 of them `import torch`). So a skeleton
    skips every fill and computation of values (`embedding`, `PositionalEncoding`,
    `Transformer.reset_parameters`); off the meta device nothing changes, nor the random
    numbers drawn.
    """
    return torch.get_default_device().type == "meta"


def embedding(num: int, dim: int) -> nn.Embedding:
    """`nn.Embedding(num, dim)`; in a skeleton (`building_skeleton`) without its N(0, 1) fill."""
    if building_skeleton():
        return nn.Embedding(num, dim, _weight=torch.empty(num, dim))
    return nn.Embedding(num, dim)


class PositionalEncoding(nn.Module):
    """§3.5 sinusoids, or learned position embeddings (Table 3 row E)."""

    def __init__(self, d_model: int, max_len: int, learned: bool):
        super().__init__()
        self.max_len = max_len
        if learned:
            self.learned = embedding(max_len, d_model)
            if not building_skeleton():
                nn.init.normal_(self.learned.weight, std=d_model**-0.5)
        else:
            self.learned = None
            table = (
                torch.empty(max_len, d_model)
                if building_skeleton()
                else sinusoid_table(max_len, d_model)
            )
            self.register_buffer("table", table, persistent=False)

    def forward(self, t: int, offset: int = 0) -> torch.Tensor:
        """Encodings of positions offset .. offset+t-1: (t, D)."""
        if offset + t > self.max_len:
            raise ValueError(f"sequence of {offset + t} positions exceeds max_len={self.max_len}")
        if self.learned is not None:
            return self.learned.weight[offset : offset + t]
        return self.table[offset : offset + t]


# `layer_norm` keeps its output for backward, not its input, while every |gain| is at least
# this fraction of the largest |bias| (the recovered x_hat then errs by under ~2^-13, far
# below the gradient's own rounding; see there) and at least GAIN_FLOOR.
GAIN_TO_BIAS = 2.0**-10
GAIN_FLOOR = 1e-6


def layer_norm(norm: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    """norm(x), with the same values; when training in fp32 on the CPU, keeping for backward
    the output instead of the input (`_LayerNormKeepOutput`).

    Every LayerNorm's output but the last is also the input of the product that follows
    (W^Q, W^KV, W_1), which keeps it anyway: saving the output instead of the input drops one
    (N, D) tensor per sub-layer, ~12% of a base step's saved activations (fp32 peak memory, W3,
    in docs/performance.md). Elsewhere `norm(x)`: in bf16 the output has 8 bits, too few to
    recover the input's normalized values from; on CUDA reading the gains on the host would
    stall the stream; a compiled model (torch.compile) traces `norm` itself.
    """
    if (
        torch.is_grad_enabled()
        and x.requires_grad
        and x.dtype == torch.float32
        and x.device.type == "cpu"
        and norm.weight is not None
        and norm.bias is not None
        and not torch.compiler.is_compiling()
    ):
        gain = float(norm.weight.detach().abs().min())
        if gain >= max(GAIN_FLOOR, GAIN_TO_BIAS * float(norm.bias.detach().abs().max())):
            return _LayerNormKeepOutput.apply(x, norm.weight, norm.bias, norm.eps)
    return norm(x)


class _LayerNormKeepOutput(torch.autograd.Function):
    """LayerNorm over the last dimension that saves y = gain * x_hat + bias, not x.

    Backward recovers x_hat = (y - bias) / gain and calls PyTorch's own LayerNorm backward
    with it as the input, mean 0 and 1 / std 1, which gives d gain = sum g x_hat and d bias =
    sum g exactly as from x, and d x divided by the row's true 1 / std, multiplied back here.
    In fp32 x_hat differs from the native one by the rounding of y: |error| <= 2^-24 (|x_hat| +
    |bias| / |gain|), under 2^-13 with the gains `layer_norm` allows and |x_hat| <= sqrt(D).
    (The memory-efficient LayerNorm of Apex and Megatron-LM, there an option; here chosen only
    where it is exact enough.)
    """

    @staticmethod
    def forward(ctx, x, weight, bias, eps):  # noqa: D102
        y, _, rstd = torch.native_layer_norm(x, weight.shape, weight, bias, eps)
        ctx.save_for_backward(y, weight, bias, rstd)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        y, weight, bias, rstd = ctx.saved_tensors
        x_hat = (y - bias).div_(weight)
        grad_x, grad_w, grad_b = torch.ops.aten.native_layer_norm_backward(
            grad.contiguous(), x_hat, weight.shape, torch.zeros_like(rstd),
            torch.ones_like(rstd), weight, bias,
            [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]],
        )  # fmt: skip
        if grad_x is not None:
            grad_x = grad_x.mul_(rstd)
        return grad_x, grad_w, grad_b, None


class _Residual(nn.Module):
    """One sub-layer connection: post-norm LayerNorm(x + Dropout(f(x))) (§3.1, §5.4), or
    pre-norm x + Dropout(f(LayerNorm(x))) when norm_first (not in the paper)."""

    def __init__(self, d_model: int, p_drop: float, norm_first: bool):
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.p_drop, self.norm_first = p_drop, norm_first

    def forward(self, x: torch.Tensor, sublayer) -> torch.Tensor:
        if self.norm_first:
            return x + dropout(sublayer(layer_norm(self.norm, x)), self.p_drop, self.training)
        # x's residual gradient may go into the sub-layer's first product of x (`ResidualPort`:
        # packed (N, D) rows in training, not inside torch.compile's trace)
        port = None
        if torch.is_grad_enabled() and x.requires_grad and x.dim() == 2:
            if not torch.compiler.is_compiling():
                port = gradhelper.ResidualPort(x)
        with gradhelper.offering(port) if port is not None else contextlib.nullcontext():
            f = sublayer(x)
        if _fused_residual_norm(x, f, self.norm):
            p = self.p_drop if self.training else 0.0
            keep = None if p == 0.0 else dropout_keep(f, p)
            scale = 1.0 if keep is None else 1.0 / (1.0 - p)
            norm = self.norm
            port = port if port is not None and port.claimed else None
            return _ResidualNorm.apply(x, f, keep, scale, norm.weight, norm.bias, norm.eps, port)
        return layer_norm(self.norm, x + dropout(f, self.p_drop, self.training))


def _fused_residual_norm(x: torch.Tensor, f: torch.Tensor, norm: nn.LayerNorm) -> bool:
    """Whether LayerNorm(x + Dropout(f)) goes through `_ResidualNorm`: when training in bf16
    on a CPU with the compiled kernels (`_fused_training`), x and f alike, the norm with a
    bf16 gain and bias over the last dimension."""
    w, b = norm.weight, norm.bias
    return (
        (x.requires_grad or f.requires_grad)
        and x.shape == f.shape
        and w is not None
        and b is not None
        and tuple(norm.normalized_shape) == (x.size(-1),)
        and _fused_training(x, f, w, b)
    )


class _ResidualNorm(torch.autograd.Function):
    """LayerNorm(x + (f * scale) * keep) (§3.1, §5.4: the post-norm sub-layer's add, dropout
    and norm) in one pass of `kernels.residual_norm`, and its gradient in one more: the values
    of `layer_norm(norm, x + dropout(f))` with the same mask, s = x + t to the same bits, y and
    dx within bf16 rounding, the gain's and bias's gradients summed in fp32 (torch's bf16
    LayerNorm backward sums them in bf16). Saves what that path saves: s, its mean and
    1 / std, and the bool mask."""

    @staticmethod
    def forward(ctx, x, f, keep, scale, weight, bias, eps, port=None):  # noqa: D102
        # port: a claimed `gradhelper.ResidualPort`, which takes dx (x's gradient is None then)
        ctx.port = port
        d = x.size(-1)
        y, s, mean, rstd = kernels.residual_norm(
            x.view(-1, d), f.view(-1, d), None if keep is None else keep.view(-1, d),
            scale, weight, bias, eps,
        )  # fmt: skip
        ctx.save_for_backward(s, mean, rstd, weight, keep)
        ctx.scale, ctx.shape = scale, x.shape
        return y.view(x.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        s, mean, rstd, weight, keep = ctx.saved_tensors
        d = s.size(-1)
        dx, df, dw, db = kernels.residual_norm_backward(
            grad.contiguous().view(-1, d), s, mean, rstd, weight,
            None if keep is None else keep.view(-1, d), ctx.scale,
        )  # fmt: skip
        dw, db = dw.to(weight.dtype), db.to(weight.dtype)
        dx = dx.view(ctx.shape)
        if ctx.port is not None:  # added into the sub-layer's product of x, in its backward
            ctx.port.grad, dx = dx, None
        return dx, df.view(ctx.shape), None, None, dw, db, None, None


class EncoderLayer(nn.Module):
    """§3.1: self-attention, then the feed-forward network, each in a residual sub-layer."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = MultiHeadAttention(
            cfg.d_model, cfg.n_heads, cfg.d_k, cfg.d_v, cfg.p_attn_drop
        )
        self.ffn = PositionwiseFeedForward(cfg.d_model, cfg.d_ff)
        self.res_attn = _Residual(cfg.d_model, cfg.p_drop, cfg.norm_first)
        self.res_ffn = _Residual(cfg.d_model, cfg.p_drop, cfg.norm_first)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None,
        weights: list | None = None,
        packing: Packing | None = None,
    ):
        """x: (B, S, D), or packed (N, D) laid out by `packing`; mask: broadcastable to
        (B, H, S, S)."""

        def attend(y: torch.Tensor) -> torch.Tensor:
            if packing is not None:
                return self.self_attn.attend_packed(y, packing, y, packing, mask)
            k, v = self.self_attn.project_kv(y)
            return self.self_attn(y, k, v, mask, weights=weights)

        return self.res_ffn(self.res_attn(x, attend), self.ffn)


class DecoderLayer(nn.Module):
    """§3.1: masked self-attention, encoder-decoder attention, feed-forward network."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.d_model
        self.self_attn = MultiHeadAttention(d, cfg.n_heads, cfg.d_k, cfg.d_v, cfg.p_attn_drop)
        self.cross_attn = MultiHeadAttention(d, cfg.n_heads, cfg.d_k, cfg.d_v, cfg.p_attn_drop)
        self.ffn = PositionwiseFeedForward(d, cfg.d_ff)
        self.res_self = _Residual(d, cfg.p_drop, cfg.norm_first)
        self.res_cross = _Residual(d, cfg.p_drop, cfg.norm_first)
        self.res_ffn = _Residual(d, cfg.p_drop, cfg.norm_first)
        self.window = cfg.attn_window

    def forward(
        self,
        x: torch.Tensor,
        memory: torch.Tensor,
        memory_mask: torch.Tensor | None,
        weights: dict[str, list] | None = None,
        packings: tuple[Packing, Packing] | None = None,
        memory_kv: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x: (B, T, D) target positions; memory: (B, S, D); memory_mask: (B, 1, 1, S).
        Packed: x (Nt, D) and memory (Ns, D), laid out by packings = (target, source);
        memory_kv: cross_attn.w_kv(memory) made already (`Transformer.forward`), or None."""
        T = x.size(1) if packings is None else packings[0].T

        def self_attend(y: torch.Tensor) -> torch.Tensor:
            # §3.2.3: no position attends to later positions.
            mask = None if self.window is None else causal_mask(T, T, y.device, self.window)
            causal = self.window is None and T > 1
            if packings is not None:
                # Right padding: a real position's earlier positions are all real.
                tp = packings[0]
                return self.self_attn.attend_packed(y, tp, y, tp, mask, causal)
            k, v = self.self_attn.project_kv(y)  # (B, H, T, K), (B, H, T, Vd)
            w = None if weights is None else weights["decoder"]
            return self.self_attn(y, k, v, mask, causal=causal, weights=w)

        def cross_attend(y: torch.Tensor) -> torch.Tensor:
            if packings is not None:
                tp, sp = packings
                return self.cross_attn.attend_packed(
                    y, tp, memory, sp, memory_mask, kvp=memory_kv
                )  # fmt: skip
            k, v = self.cross_attn.project_kv(memory)  # (B, H, S, K), (B, H, S, Vd)
            w = None if weights is None else weights["cross"]
            return self.cross_attn(y, k, v, memory_mask, weights=w)

        x = self.res_self(x, self_attend)
        x = self.res_cross(x, cross_attend)
        return self.res_ffn(x, self.ffn)

    def step(self, x: torch.Tensor, memory: torch.Tensor, cache: DecoderCache, i: int):
        """Cached decoding as layer i: x (B, T, D) holds target positions t .. t + T - 1
        (t = cache.length), whose keys/values are written into the cache (room reserved)."""
        lc, t, T = cache.layers[i], cache.length, x.size(1)
        sa, ca = self.self_attn, self.cross_attn
        prescaled = lc.proj is not None and lc.proj.prescaled

        beam = cache.beam

        def self_attend(y: torch.Tensor) -> torch.Tensor:
            q, k, v = self._project_qkv(y, lc.proj)  # (B, H, T, K), (B, H, T, K), (B, H, T, Vd)
            if beam is not None:  # one new position, reached through back-pointers
                k, v = beam.write(i, t, k, v)  # (C, H, (t + 1) * beams, .)
                return sa.attend_grouped(q, k, v, beam.bias, beam.beams, prescaled, beam.live)
            lc.self_k[:, :, t : t + T] = k  # in place
            lc.self_v[:, :, t : t + T] = v
            k, v = lc.self_k[:, :, : t + T], lc.self_v[:, :, : t + T]  # (B, H, t + T, .)
            # §3.2.3: no position attends to later positions. A single new query may see
            # every key in the cache, so it needs no mask.
            if self.window is None:
                return sa.attend(q, k, v, None, causal=T > 1, prescaled=prescaled, aligned=True)
            mask = causal_mask(T, t + T, y.device, self.window)
            return sa.attend(q, k, v, mask, prescaled=prescaled, aligned=True)

        def cross_attend(y: torch.Tensor) -> torch.Tensor:
            if lc.cross_k is None:
                k, v = ca.project_kv(memory)  # (B, H, S, K), (B, H, S, Vd)
                # Stored contiguous once, so that no decoding step has to copy them into the
                # batched matrix-product layout again (B * H, S, K); on the CPU the keys as
                # K^T (`_transposed_keys`).
                lc.cross_k, lc.cross_v = _transposed_keys(k), v.contiguous()
            q = ca.split_heads(lc.proj.cross_q(y) if lc.proj else ca.w_q(y))
            if cache.group == 1:
                return ca.attend(q, lc.cross_k, lc.cross_v, cache.cross_bias, prescaled=prescaled,
                                 aligned=True)  # fmt: skip
            live = None if beam is None else beam.live
            return ca.attend_grouped(q, lc.cross_k, lc.cross_v, cache.cross_bias, cache.group,
                                     prescaled, live)  # fmt: skip

        x = self.res_self(x, self_attend)
        x = self.res_cross(x, cross_attend)
        return self.res_ffn(x, self.ffn)

    def _project_qkv(self, y: torch.Tensor, proj: StepProjections | None):
        """Queries (B, H, T, K), keys (B, H, T, K) and values (B, H, T, Vd) of y (B, T, D)."""
        sa = self.self_attn
        HK = sa.n_heads * sa.d_k
        if proj is not None:
            qkv = proj.qkv(y)  # (B, T, H*K + H*K + H*Vd): one matrix product
            q, k, v = qkv[..., :HK], qkv[..., HK : 2 * HK], qkv[..., 2 * HK :]
        else:
            q, kv = sa.w_q(y), sa.w_kv(y)
            k, v = kv[..., :HK], kv[..., HK:]
        return sa.split_heads(q), sa.split_heads(k), sa.split_heads(v, sa.d_v)


class Transformer(nn.Module):
    """§3 encoder-decoder with shared embeddings (§3.4) and positional encodings (§3.5)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.d_model
        self.src_embed = embedding(cfg.vocab_size, d)
        if cfg.share_embeddings:
            self.tgt_embed = self.src_embed  # §3.4: one weight matrix
        else:
            self.tgt_embed = embedding(cfg.target_vocab_size, d)
        self.src_pos = PositionalEncoding(d, cfg.max_len, cfg.learned_pos)
        self.tgt_pos = (
            self.src_pos if not cfg.learned_pos else PositionalEncoding(d, cfg.max_len, True)
        )
        self.encoder_layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.n_layers))
        self.decoder_layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_layers))
        # Pre-norm needs a final LayerNorm on each stack's output; post-norm already ends in one.
        self.encoder_norm = nn.LayerNorm(d) if cfg.norm_first else None
        self.decoder_norm = nn.LayerNorm(d) if cfg.norm_first else None
        self.embed_scale = math.sqrt(d)  # §3.4: embeddings are multiplied by sqrt(d_model)
        # An inference-only stand-in for the tied projection (translate.quantize_int8's int8
        # copy of the embedding); None: F.linear with the embedding itself.
        self.projection: nn.Module | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Glorot-uniform projections and zero biases (tensor2tensor, fairseq); embeddings
        N(0, d^-1/2), so that after the sqrt(d) scale they have unit variance."""
        for name, p in self.named_parameters():
            if p.is_meta:  # a skeleton (`building_skeleton`): no values to draw
                continue
            if "embed" in name or "learned" in name:
                nn.init.normal_(p, std=self.cfg.d_model**-0.5)
            elif p.dim() > 1:
                nn.init.xavier_uniform_(p)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    @classmethod
    def from_tensors(
        cls, cfg: ModelConfig, tensors: dict[str, torch.Tensor]
    ) -> tuple[Transformer, list[str], list[str]]:
        """A model whose parameters are `tensors` (a state dict, a shared tensor stored once),
        built without drawing initial values to overwrite: (model, missing, unexpected), the
        names `load_state_dict(strict=False)` would report, less those filled through a
        shared module (the tied embeddings).

        Not in the paper. `Transformer(cfg)` then `load_state_dict` drew every initial value
        first: 0.36 s for the base model, 1.2 s for big (2 Zen 5 cores), in every command that
        loads one (translate, serve, evaluate, average). Here the skeleton (`building_skeleton`)
        takes the tensors themselves (`assign`), cast to its dtypes as `load_state_dict`'s copy
        casts, and only the sinusoid tables, which no file stores, are computed.
        """
        with torch.device("meta"):
            model = cls(cfg)
        state = model.state_dict(keep_vars=True)
        given = {k: v.to(state[k].dtype) if k in state else v for k, v in tensors.items()}
        _, unexpected = model.load_state_dict(given, strict=False, assign=True)
        missing = [k for k, v in model.state_dict(keep_vars=True).items() if v.is_meta]
        for m in model.modules():
            if isinstance(m, PositionalEncoding) and m.learned is None:
                m.table = sinusoid_table(m.max_len, m.table.size(1))
        return model, missing, list(unexpected)

    def _embed(self, tokens, embed: nn.Embedding, pos: PositionalEncoding, offset: int):
        x = embed(tokens) * self.embed_scale + pos(tokens.size(1), offset).to(embed.weight.dtype)
        return dropout(x, self.cfg.p_drop, self.training)  # §5.4: dropout on the sums

    def encode(
        self,
        src: torch.Tensor,
        src_mask: torch.Tensor,
        weights: list | None = None,
        packing: Packing | None = None,
    ):
        """Encoder stack: src (B, S) ids, src_mask (B, S) bool True at real tokens -> (B, S, D),
        or with `packing` (of src_mask) the packed rows (N, D) of the real tokens only."""
        if packing is None:
            x = self._embed(src, self.src_embed, self.src_pos, 0)
        else:
            x = self._embed_packed(src, self.src_embed, self.src_pos, packing)
        mask = src_mask[:, None, None, :]  # (B, 1, 1, S): keys that are real tokens
        if self.cfg.attn_window is not None:
            mask = mask & window_mask(src.size(1), self.cfg.attn_window, src.device)
        for layer in self.encoder_layers:
            x = layer(x, mask, weights, packing)
        return x if self.encoder_norm is None else layer_norm(self.encoder_norm, x)

    def decode_hidden(
        self,
        tgt: torch.Tensor,
        memory: torch.Tensor,
        src_mask: torch.Tensor,
        cache: DecoderCache | None = None,
        weights: dict[str, list] | None = None,
    ) -> torch.Tensor:
        """Decoder stack up to (not including) the output projection; (B, T, D).

        With a cache, tgt holds only the new positions, and the cache is extended in place.
        """
        offset = 0 if cache is None else cache.length
        x = self._embed(tgt, self.tgt_embed, self.tgt_pos, offset)
        if cache is None:
            memory_mask = src_mask[:, None, None, :]  # (B, 1, 1, S)
            for layer in self.decoder_layers:
                x = layer(x, memory, memory_mask, weights)
        else:
            cfg = self.cfg
            if not cache.layers:
                cache.layers = [LayerCache(StepProjections.of(l)) for l in self.decoder_layers]
                if memory.device.type == "cpu":
                    memory, src_mask = _key_blocks(memory, src_mask)
                cache.cross_bias = padding_bias(src_mask, x.dtype)
            shape = (cfg.n_layers, x.size(0), cfg.n_heads)
            cache.reserve(tgt.size(1), shape, cfg.d_k, cfg.d_v, x)
            cache.begin_step(tgt.size(1), x.dtype)
            for i, layer in enumerate(self.decoder_layers):
                x = layer.step(x, memory, cache, i)
            cache.length += tgt.size(1)
        return x if self.decoder_norm is None else layer_norm(self.decoder_norm, x)

    def output_weight(self) -> torch.Tensor:
        """The pre-softmax projection (V, D): the target embedding (§3.4)."""
        return self.tgt_embed.weight

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., D) -> logits (..., V)."""
        if self.projection is not None:
            return self.projection(hidden)
        return F.linear(hidden, self.output_weight())

    def decode(self, tgt, memory, src_mask, cache: DecoderCache | None = None) -> torch.Tensor:
        """Decoder logits. tgt: (B, T) ids starting with BOS (or, with a cache, only the new
        ids); memory: (B, S, D); src_mask: (B, S). Returns logits (B, T, V).

        The cache is an explicit object (see `new_cache`), extended in place; beam search
        reorders it with `DecoderCache.reorder`.
        """
        return self.project(self.decode_hidden(tgt, memory, src_mask, cache))

    def new_cache(self) -> DecoderCache:
        # A local attention window (cfg.attn_window) masks by position, which the
        # back-pointers of `BeamHistory` do not: its beams keep reordered buffers.
        # bf16 back-pointers only asked about for a bf16 model on the CPU: the question builds
        # and checks the compiled step attention, which no other model's search needs here.
        w = self.tgt_embed.weight
        cpu_bf16 = w.dtype == torch.bfloat16 and w.device.type == "cpu"
        bf16 = (torch.bfloat16,) if cpu_bf16 and bf16_beam_history() else ()
        dtypes = cache_module.HISTORY_DTYPES + bf16
        return DecoderCache(history=self.cfg.attn_window is None, history_dtypes=dtypes)

    def forward(
        self,
        src: torch.Tensor,
        src_mask: torch.Tensor,
        tgt: torch.Tensor,
        tgt_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Training: decoder hidden states for teacher-forced targets.

        Without tgt_mask: (B, T, D) at every position. With tgt_mask (B, T) bool (True at the
        real target positions, each row's first; right padding): the packed path, (N, D) in
        `hidden[tgt_mask]`'s order, computed on the real source and target tokens only (see
        `Packing`): the same values up to rounding, without the position-wise work on padding.
        The loss projects only those rows, which saves the vocabulary-sized work on padding too.
        """
        if tgt_mask is None:
            return self.decode_hidden(tgt, self.encode(src, src_mask), src_mask)
        sp, tp = Packing(src_mask), Packing(tgt_mask)
        memory = self.encode(src, src_mask, packing=sp)  # (Ns, D)
        x = self._embed_packed(tgt, self.tgt_embed, self.tgt_pos, tp)
        memory_mask = src_mask[:, None, None, :]
        # Every layer's encoder-decoder keys and values of the memory, with memory's gradient
        # summed inside the products (`gradhelper.chained_linears`; None: each layer's own).
        kvs = gradhelper.chained_linears(memory, [m.cross_attn.w_kv for m in self.decoder_layers])
        for i, layer in enumerate(self.decoder_layers):
            kv = None if kvs is None else kvs[i]
            x = layer(x, memory, memory_mask, packings=(tp, sp), memory_kv=kv)
        x = x if self.decoder_norm is None else layer_norm(self.decoder_norm, x)
        return tp.real_rows(x)  # (N, D): the real target positions

    def _embed_packed(self, tokens, embed: nn.Embedding, pos: PositionalEncoding, p: Packing):
        """`_embed` at the real positions only: (N, D)."""
        w, drop = embed.weight, self.cfg.p_drop if self.training else 0.0
        if drop < 1.0 and _fused_embedding(w, pos):  # the same bits in one pass each way
            ids, keep = p.pack(tokens), None
            if 0.0 < drop < 1.0:
                keep = dropout_keep(torch.empty((ids.numel(), w.size(1)), device="meta"), drop)
            table = pos(tokens.size(1)).to(w.dtype).contiguous()  # (T, D)
            return gradhelper.MasterEmbeddingSum.apply(
                w, ids, table, p.t, self.embed_scale, keep, 1.0 / (1.0 - drop)
            )  # fmt: skip
        table = pos(tokens.size(1)).index_select(0, p.t).to(embed.weight.dtype)  # (N, D)
        # The lookup's gradient goes to the weight's fp32 master where it has one (gradhelper).
        x = gradhelper.embedding(p.pack(tokens), embed.weight) * self.embed_scale + table
        return dropout(x, self.cfg.p_drop, self.training)  # §5.4: dropout on the sums

    @torch.no_grad()
    def attention_weights(
        self, src: torch.Tensor, src_mask: torch.Tensor, tgt: torch.Tensor
    ) -> dict[str, list[torch.Tensor]]:
        """Attention weights of every layer (Figures 3-5): {"encoder": [(B, H, S, S)] * N,
        "decoder": [(B, H, T, T)] * N, "cross": [(B, H, T, S)] * N}."""
        weights: dict[str, list] = {"encoder": [], "decoder": [], "cross": []}
        memory = self.encode(src, src_mask, weights["encoder"])
        self.decode_hidden(tgt, memory, src_mask, weights=weights)
        return weights

    def num_parameters(self) -> int:
        """Trainable parameters, each shared tensor counted once."""
        return sum(p.numel() for p in self.parameters())


# ---------------------------------------------------------------- masks and dropout


def causal_mask(
    t_q: int, t_k: int, device: torch.device, window: int | None = None
) -> torch.Tensor:
    """(Tq, Tk) bool: query i (the last Tq of Tk positions) sees key j iff j <= i, i - j <= r."""
    q_pos = torch.arange(t_k - t_q, t_k, device=device)[:, None]
    k_pos = torch.arange(t_k, device=device)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= q_pos - k_pos <= window
    return allowed


def window_mask(t: int, window: int, device: torch.device) -> torch.Tensor:
    """(T, T) bool for §4 restricted self-attention: |i - j| <= r."""
    pos = torch.arange(t, device=device)
    return (pos[:, None] - pos[None, :]).abs() <= window


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """§5.4 dropout: zero each element with probability p, scale the rest by 1 / (1 - p).

    On CPU, `F.dropout` draws one Mersenne-Twister number per element (`bernoulli_`), 13% of
    a profiled quickstart training step (2-3% of a timed one). Here each element gets a 16-bit
    uniform, so p is exact to 2^-16, four to a 64-bit draw of numpy's PCG64, seeded by one
    draw from torch's generator: seeding (`torch.manual_seed`) and resumption (torch's RNG
    state) are unchanged, and the bits come ~2x as fast as torch's Mersenne Twister gives them
    (`random_`: two 32-bit outputs a 64-bit number; 46 ms of a 2 s base training step) and
    are compared ~3x as fast (docs/performance.md, round seventeen). CUDA keeps the fused
    kernel.
    """
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu" or p >= 1.0:
        return F.dropout(x, p, True)
    return _KeepScale.apply(x, _keep_stream(p), 1.0 / (1.0 - p))


def _fused_embedding(weight: torch.Tensor, pos: PositionalEncoding) -> bool:
    """Whether `Transformer._embed_packed` takes `gradhelper.MasterEmbeddingSum`: a bf16 CPU
    weight whose gradient goes to its fp32 master (`gradhelper.master_of`), the compiled
    kernels, a width that is a multiple of 16, sinusoid positions (§3.5; learned ones need
    their own gradient)."""
    if not (torch.is_grad_enabled() and weight.requires_grad and pos.learned is None):
        return False
    if weight.dim() != 2 or weight.size(1) % 16 or gradhelper.master_of(weight) is None:
        return False
    return _fused_training(weight)


def dropout_keep(x: torch.Tensor, p: float) -> torch.Tensor:
    """`dropout`'s mask for a CPU tensor x: bool, x's shape, True where an element is kept.
    One draw from torch's generator seeds the PCG64 bits (0 < p < 1); `kernels.pcg64_keep`
    makes numpy's stream on the threads (0.57 against 1.2 ms for 2M values), the same mask."""
    return _keep_mask(_keep_stream(p), x.numel()).view(x.shape)


def _keep_stream(p: float) -> tuple[int, int, int]:
    """A mask's stream: PCG64's state and increment, seeded by one draw from torch's generator,
    and the threshold a 16-bit uniform must reach to keep its element (P(drop) = p to 2^-16)."""
    seed = int(torch.empty((), dtype=torch.int64).random_())  # [0, 2^63): torch's generator
    state = np.random.PCG64(seed).state["state"]
    return state["state"], state["inc"], round(p * 65536)


def _keep_mask(stream: tuple[int, int, int], n: int) -> torch.Tensor:
    """(n,) bool: the stream's mask (`_keep_stream`), the same every time it is made."""
    state, inc, threshold = stream
    keep = kernels.pcg64_keep(state, inc, threshold, n)  # numpy's bits
    if keep is None:  # no compiled kernels: numpy's stream itself, on one thread
        generator = np.random.PCG64()
        generator.state = {
            "bit_generator": "PCG64",
            "state": {"state": state, "inc": inc},
            "has_uint32": 0,
            "uinteger": 0,
        }
        bits = generator.random_raw((n + 3) // 4)  # uint64, four 16-bit uniforms each
        keep = torch.from_numpy(bits.view(np.uint16)[:n] >= threshold)
    return keep


class _KeepScale(torch.autograd.Function):
    """(x * scale) * keep, and its gradient (g * keep) * scale, the bool mask made again from
    its stream in the backward instead of saved.

    On CPU `masked_fill_` with a bool mask and a bool -> bf16 conversion each run ~13x slower
    than a product (1.4-1.5 and 0.55 ms against 0.1 on (8190, 128) bf16, 2 threads), while
    the same bytes read as uint8 convert as fast as a product; so the mask is multiplied in,
    its bytes taken as uint8. Multiplying by exactly 0 or 1 gives the values masked_fill did
    (up to the sign of a zero), forward and backward. Saved, the masks were a byte an element
    from the forward to the backward, where no fused kernel takes the residual's dropout (fp32,
    or a CPU without AVX-512): an fp32 base step at 15,356 target tokens peaked at 9,023-9,360
    MiB in three fresh processes made again, 9,297-9,808 in six saved, at the same speed (a
    Zen 3; docs/performance.md, "Round fifty-seven"). Making a mask again takes ~0.5 ms a
    million elements there.
    """

    @staticmethod
    def forward(ctx, x, stream, scale):  # noqa: D102
        ctx.stream, ctx.scale = stream, scale
        keep = _keep_mask(stream, x.numel()).view(x.shape)
        return (x * scale).mul_(keep.view(torch.uint8).to(x.dtype))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        keep = _keep_mask(ctx.stream, grad.numel()).view(grad.shape)
        return (grad * keep.view(torch.uint8).to(grad.dtype)).mul_(ctx.scale), None, None
