"""§3 incremental decoding: the decoder's cache and its inference-time projections.

`Transformer.decode(tgt, memory, src_mask, cache)` takes only the new target positions and
extends a `DecoderCache` in place; beam search reorders it with `DecoderCache.reorder`. What is
cached, and why it is laid out as it is (docs/decoding.md, "Incremental decoding"):

* self-attention keys/values of every layer in preallocated buffers, written in place;
* encoder-decoder keys/values, computed once per sentence, and the source padding as an
  additive bias;
* each layer's `StepProjections`: W^Q, W^K, W^V as one matrix, built from the parameters when
  the cache is made (model files and training are unchanged).

Shapes as in model.py: B rows, H heads, S source length, K d_k, Vd d_v, N layers.
This module imports only torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

# Self-attention keys/values of a new cache: room for this many positions, doubled when full.
CACHE_CAPACITY = 32


@dataclass
class StepProjections:
    """A decoder layer's projections for cached decoding, built from its parameters when a
    cache is made (model files and training are unchanged): self-attention's W^Q, W^K, W^V as
    one matrix (rows [W^Q | W^K | W^V]), and both attentions' W^Q times 1/sqrt(d_k) where that
    is exact (sqrt(d_k) a power of two: 64 -> 1/8), which is eq. (1)'s scaling done once
    instead of per step."""

    qkv: tuple[torch.Tensor, torch.Tensor]  # weight (H*K + H*K + H*Vd, D), bias
    cross_q: tuple[torch.Tensor, torch.Tensor]  # weight (H*K, D), bias
    prescaled: bool

    @staticmethod
    def of(layer: nn.Module) -> StepProjections | None:
        """The projections of a `DecoderLayer`; None where they are not plain nn.Linear (int8
        quantized modules), whose own modules are then used."""
        sa, ca = layer.self_attn, layer.cross_attn
        if any(type(m) is not nn.Linear for m in (sa.w_q, sa.w_kv, ca.w_q)):
            return None
        root = math.sqrt(sa.d_k)
        prescaled = root == 2.0 ** round(math.log2(root))  # scaling by a power of 2 is exact
        scale = 1.0 / root if prescaled else 1.0
        with torch.no_grad():
            w = torch.cat([sa.w_q.weight * scale, sa.w_kv.weight])  # (H*K + H*K + H*Vd, D)
            b = torch.cat([sa.w_q.bias * scale, sa.w_kv.bias])
            cross_q = (ca.w_q.weight * scale, ca.w_q.bias * scale)
        return StepProjections((w, b), cross_q, prescaled)


@dataclass
class LayerCache:
    """One decoder layer's share of the cache: views of its self-attention keys/values in
    `DecoderCache.self_k` / `self_v` (written in place), and its encoder-decoder keys/values
    (computed once per sentence)."""

    proj: StepProjections | None = None  # None: the layer's own modules (int8)
    cross_k: torch.Tensor | None = None  # (B, H, S, K)
    cross_v: torch.Tensor | None = None  # (B, H, S, Vd)
    self_k: torch.Tensor | None = None  # (B, H, capacity, K): positions [:length] filled
    self_v: torch.Tensor | None = None  # (B, H, capacity, Vd)


@dataclass
class DecoderCache:
    """Incremental-decoding state for all decoder layers; `length` target positions so far.

    The self-attention keys and values of every layer live in two preallocated buffers,
    (N, B, H, capacity, K) and (N, B, H, capacity, Vd), written in place at the new positions
    (no `torch.cat` of the whole prefix per step). A reorder (beam search: every step) is one
    `index_select` of the filled prefix per buffer, for all layers at once, into a buffer with
    room for exactly one more position: the next step's keys and values then fill it, so
    attention reads them contiguous (a bf16 batched product through oneDNN copies any other
    layout first). Full, the capacity doubles (greedy search: rows are dropped, rarely
    reordered). The encoder-decoder attention's padding mask is kept as an additive bias (one
    add per step instead of masking twice).

    The encoder-decoder keys and values are kept once per source, not once per row: `group`
    consecutive rows share one source (the beams of a sentence), row r reading cross row
    r // group. Their queries are then attended together, `group` queries against one copy of
    the keys (the step reads 1/group of the bytes a per-row copy would), and expanding a
    sentence to K beams copies nothing.
    """

    layers: list[LayerCache] = field(default_factory=list)
    length: int = 0
    self_k: torch.Tensor | None = None  # (N, B, H, capacity, K)
    self_v: torch.Tensor | None = None  # (N, B, H, capacity, Vd)
    cross_bias: torch.Tensor | None = None  # (C, 1, 1, S): 0 at real source tokens, else -inf
    group: int = 1  # consecutive rows sharing one cross row (C = rows / group)

    def _use(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.self_k, self.self_v = k, v
        for i, layer in enumerate(self.layers):
            layer.self_k, layer.self_v = k[i], v[i]  # (B, H, capacity, K), (B, H, capacity, Vd)

    def _new_buffers(self, rows: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        N, _, H, _, K = self.self_k.shape
        return (self.self_k.new_empty(N, rows, H, capacity, K),
                self.self_v.new_empty(N, rows, H, capacity, self.self_v.size(-1)))  # fmt: skip

    def reserve(
        self, n_new: int, shape: tuple[int, int, int], d_k: int, d_v: int, like: torch.Tensor
    ) -> None:
        """Room for `n_new` more positions in buffers of `shape` (N, B, H) x (., K) and
        (., Vd), with `like`'s dtype and device."""
        need = self.length + n_new
        if self.self_k is None:
            capacity = max(need, CACHE_CAPACITY)
            self._use(like.new_empty(*shape, capacity, d_k), like.new_empty(*shape, capacity, d_v))
        elif self.self_k.size(3) < need:
            k, v = self._new_buffers(self.self_k.size(1), max(need, 2 * self.self_k.size(3)))
            t = self.length
            k[:, :, :, :t], v[:, :, :, :t] = self.self_k[:, :, :, :t], self.self_v[:, :, :, :t]
            self._use(k, v)

    def reorder(self, index: torch.Tensor, cross: bool = True) -> DecoderCache:
        """Select batch rows (beam search: the surviving hypotheses' parents).

        Only the filled prefix of the self-attention buffers is copied. With cross=False the
        encoder-decoder keys/values are kept as they are: valid when `index` maps every row
        to a row with the same source, as beams of one sentence do. With cross=True the new
        rows' sources are regrouped (`_cross_rows`): only the cross rows that change are
        copied, once per source.
        """
        if not cross:
            rows, group = None, self.group
        elif self.cross_bias is None:  # before the first step: nothing to regroup yet
            rows, group = None, 1
        else:
            rows, group = _cross_rows(index, self.group, self.cross_bias.size(0))

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return t if t is None or rows is None else t.index_select(0, rows)

        layers = [LayerCache(c.proj, pick(c.cross_k), pick(c.cross_v)) for c in self.layers]
        out = DecoderCache(layers, self.length, cross_bias=pick(self.cross_bias), group=group)
        if self.self_k is None:
            return out
        t = self.length
        k, v = self._new_buffers(index.numel(), t + 1)  # room for the next step exactly
        for old, new in ((self.self_k, k), (self.self_v, v)):
            prefix = old[:, :, :, :t]  # (N, B, H, t, .)
            if prefix.requires_grad:  # out= is not differentiable (decoding outside no_grad)
                new[:, :, :, :t] = prefix.index_select(1, index)
            else:
                torch.index_select(prefix, 1, index, out=new[:, :, :, :t])
        out._use(k, v)
        return out


def _cross_rows(index: torch.Tensor, group: int, n_cross: int) -> tuple[torch.Tensor | None, int]:
    """The cross rows to keep after selecting rows `index`, and the new group size.

    New row j reads old cross row index[j] // group. When those come in equal runs of one
    length g (K beams per sentence, sentence after sentence), the new cache keeps one cross row
    per run, group g; otherwise one per row, group 1. Returns None for the rows when they are
    all the old ones in order (no copy), e.g. when each sentence is expanded to its K beams.
    """
    src = index if group == 1 else torch.div(index, group, rounding_mode="floor")
    n = src.numel()
    if n == 0:
        return src, 1
    g = int((src == src[0]).cumprod(0).sum())  # the first run's length
    if g > 1 and n % g == 0:
        runs = src.view(-1, g)
        if bool((runs == runs[:, :1]).all()):
            src = runs[:, 0]
        else:
            g = 1
    else:
        g = 1
    if src.numel() == n_cross and bool((src == torch.arange(n_cross, device=src.device)).all()):
        return None, g
    return src, g


def padding_bias(src_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, S) bool True at real tokens -> (B, 1, 1, S) additive mask: 0 at real tokens, -inf
    at padding (-inf + a score is exactly -inf, as masked_fill gives). A row of padding only
    gets 0 throughout: uniform weights instead of NaN."""
    bias = torch.zeros(src_mask.shape, dtype=dtype, device=src_mask.device)
    bias.masked_fill_(~src_mask & src_mask.any(-1, keepdim=True), float("-inf"))
    return bias[:, None, None, :]  # (B, 1, 1, S)
