"""§3 incremental decoding: the decoder's cache and its inference-time projections.

`Transformer.decode(tgt, memory, src_mask, cache)` takes only the new target positions and
extends a `DecoderCache` in place; beam search reorders it with `DecoderCache.reorder`. What is
cached, and why it is laid out as it is (docs/decoding.md, "Incremental decoding"):

* self-attention keys/values of every layer in one preallocated buffer, written in place;
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
    one matrix, rows [Q heads | head 1 key, value | head 2 key, value | ...] (the cache's
    layout), and both attentions' W^Q times 1/sqrt(d_k) where that is exact (sqrt(d_k) a power
    of two: 64 -> 1/8), which is eq. (1)'s scaling done once instead of per step."""

    qkv: tuple[torch.Tensor, torch.Tensor]  # weight (H*K + H*(K+Vd), D), bias
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
        H, K, Vd, D = sa.n_heads, sa.d_k, sa.d_v, sa.w_q.in_features

        def kv_by_head(t: torch.Tensor) -> torch.Tensor:  # (H*K + H*Vd, ...) -> per head k|v
            k, v = t[: H * K].view(H, K, -1), t[H * K :].view(H, Vd, -1)
            return torch.cat([k, v], dim=1).view(H * (K + Vd), *t.shape[1:])

        with torch.no_grad():
            w = torch.cat([sa.w_q.weight * scale, kv_by_head(sa.w_kv.weight)])  # (., D)
            b = torch.cat([sa.w_q.bias * scale, kv_by_head(sa.w_kv.bias[:, None])[:, 0]])
            cross_q = (ca.w_q.weight * scale, ca.w_q.bias * scale)
        assert w.shape == (H * K + H * (K + Vd), D)
        return StepProjections((w, b), cross_q, prescaled)


@dataclass
class LayerCache:
    """One decoder layer's share of the cache: views of its self-attention keys/values in
    `DecoderCache.self_kv` (written in place), and its encoder-decoder keys/values (computed
    once per sentence)."""

    proj: StepProjections | None = None  # None: the layer's own modules (int8)
    cross_k: torch.Tensor | None = None  # (B, H, S, K)
    cross_v: torch.Tensor | None = None  # (B, H, S, Vd)
    self_kv: torch.Tensor | None = None  # (capacity, B, H, K + Vd): per head, key then value
    self_k: torch.Tensor | None = None  # (B, H, capacity, K): the same memory, permuted
    self_v: torch.Tensor | None = None  # (B, H, capacity, Vd)


@dataclass
class DecoderCache:
    """Incremental-decoding state for all decoder layers; `length` target positions so far.

    The self-attention keys and values of every layer share one preallocated buffer, written
    in place at the new positions (no `torch.cat` of the whole prefix per step). It is
    time-major, (capacity, N, B, H, K + Vd), so the filled prefix `[:length]` is contiguous:
    a reorder is one `index_select` of the prefix for all layers, and attention reads a
    layer's keys and values as strided views, without a copy. Full, its capacity doubles.
    The encoder-decoder attention's padding mask is kept as an additive bias (one add per
    step instead of masking twice).
    """

    layers: list[LayerCache] = field(default_factory=list)
    length: int = 0
    self_kv: torch.Tensor | None = None  # (capacity, N, B, H, K + Vd)
    d_k: int = 0
    cross_bias: torch.Tensor | None = None  # (B, 1, 1, S): 0 at real source tokens, else -inf

    def _use(self, kv: torch.Tensor) -> None:
        self.self_kv = kv
        for i, layer in enumerate(self.layers):
            layer.self_kv = kv[:, i]  # (capacity, B, H, K + Vd)
            kv_i = layer.self_kv.permute(1, 2, 0, 3)  # (B, H, capacity, K + Vd)
            layer.self_k, layer.self_v = kv_i[..., : self.d_k], kv_i[..., self.d_k :]

    def reserve(self, n_new: int, shape: tuple[int, ...], d_k: int, like: torch.Tensor) -> None:
        """Room for `n_new` more positions in a buffer of `shape` (N, B, H, K + Vd), with
        `like`'s dtype and device."""
        self.d_k, old, need = d_k, self.self_kv, self.length + n_new
        if old is not None and old.size(0) >= need:
            return
        capacity = max(need, CACHE_CAPACITY if old is None else 2 * old.size(0))
        kv = like.new_empty(capacity, *shape)  # (capacity, N, B, H, K + Vd)
        if old is not None:
            kv[: self.length] = old[: self.length]
        self._use(kv)

    def reorder(self, index: torch.Tensor, cross: bool = True) -> DecoderCache:
        """Select batch rows (beam search: the surviving hypotheses' parents).

        Only the filled prefix of the self-attention buffer is copied. With cross=False the
        encoder-decoder keys/values are kept as they are: valid when `index` maps every row
        to a row with the same source, as beams of one sentence do, and it saves copying
        (R, H, S, K) per layer and step.
        """

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return t.index_select(0, index) if t is not None and cross else t

        layers = [LayerCache(c.proj, pick(c.cross_k), pick(c.cross_v)) for c in self.layers]
        out = DecoderCache(layers, self.length, d_k=self.d_k, cross_bias=pick(self.cross_bias))
        if self.self_kv is not None:
            capacity, n, _, h, e = self.self_kv.shape
            kv = self.self_kv.new_empty(capacity, n, index.numel(), h, e)
            prefix = self.self_kv[: self.length]  # (t, N, B, H, K + Vd), contiguous
            if prefix.requires_grad:  # out= is not differentiable (decoding outside no_grad)
                kv[: self.length] = prefix.index_select(2, index)
            else:
                torch.index_select(prefix, 2, index, out=kv[: self.length])
            out._use(kv)
        return out


def padding_bias(src_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, S) bool True at real tokens -> (B, 1, 1, S) additive mask: 0 at real tokens, -inf
    at padding (-inf + a score is exactly -inf, as masked_fill gives). A row of padding only
    gets 0 throughout: uniform weights instead of NaN."""
    bias = torch.zeros(src_mask.shape, dtype=dtype, device=src_mask.device)
    bias.masked_fill_(~src_mask & src_mask.any(-1, keepdim=True), float("-inf"))
    return bias[:, None, None, :]  # (B, 1, 1, S)
