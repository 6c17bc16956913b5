"""§3 incremental decoding: the decoder's cache and its inference-time projections.

`Transformer.decode(tgt, memory, src_mask, cache)` takes only the new target positions and
extends a `DecoderCache` in place; beam search reorders it with `DecoderCache.reorder`. What is
cached, and why it is laid out as it is (docs/decoding.md, "Incremental decoding"):

* self-attention keys/values of every layer in preallocated buffers, written in place; under
  beam search on the CPU in fp32 (and in bf16 with the compiled step attention), never
  reordered, each hypothesis reaching its prefix through back-pointers (`BeamHistory`);
* encoder-decoder keys/values, computed once per sentence (on the CPU padded to whole
  `model.KEY_BLOCK`s, the keys kept as K^T: `model._transposed_keys`), and the source padding
  as an additive bias;
* each layer's `StepProjections`: W^Q, W^K, W^V as one matrix, built from the parameters when
  the cache is made (model files and training are unchanged); int8 layers' once per layer.

Shapes as in model.py: B rows, H heads, S source length, K d_k, Vd d_v, N layers.
This module imports only torch.
"""

from __future__ import annotations

import functools
import math
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from transformer.gradhelper import is_linear

# Self-attention keys/values of a new cache: room for this many positions, doubled when full.
CACHE_CAPACITY = 32
# Beam search keeps each hypothesis's keys/values where they were computed and follows
# back-pointers (`BeamHistory`) on the CPU in fp32 (int8 decoding included): there one step's
# K queries of a sentence against its K*(t+1) keys cost less than copying the prefix. In bf16
# too where a step's attention is `kernels.step_attention` (`model.bf16_beam_history`, which
# adds bf16 to a cache's `history_dtypes`). CUDA (not measured) keeps the reordered buffers.
HISTORY_DTYPES = (torch.float32,)
# A sentence that leaves the beam search stays in the `BeamHistory` buffers until this fraction
# of them has left; then one copy compacts them to the live sentences.
COMPACT_DEAD = 0.25


@dataclass
class StepProjections:
    """A decoder layer's projections for cached decoding, built from its parameters when a
    cache is made (model files and training are unchanged): self-attention's W^Q, W^K, W^V as
    one matrix (rows [W^Q | W^K | W^V]), and both attentions' W^Q times 1/sqrt(d_k) where that
    is exact (sqrt(d_k) a power of two: 64 -> 1/8), which is eq. (1)'s scaling done once
    instead of per step. Each is a function of the layer input y (B, T, D)."""

    qkv: Callable[[torch.Tensor], torch.Tensor]  # -> (B, T, H*K + H*K + H*Vd)
    cross_q: Callable[[torch.Tensor], torch.Tensor]  # -> (B, T, H*K)
    prescaled: bool

    @staticmethod
    def of(layer: nn.Module) -> StepProjections | None:
        """The projections of a `DecoderLayer` whose W^Q, W^KV and cross W^Q are all plain
        nn.Linear, or all of one class with a `stacked([(module, factor), ...])` constructor
        (`translate.Int8Linear`); None otherwise (the layer's own modules are then used)."""
        sa, ca = layer.self_attn, layer.cross_attn
        kind = type(sa.w_q)
        if any(type(m) is not kind for m in (sa.w_kv, ca.w_q)):
            return None
        root = math.sqrt(sa.d_k)
        prescaled = root == 2.0 ** round(math.log2(root))  # scaling by a power of 2 is exact
        scale = 1.0 / root if prescaled else 1.0
        if not is_linear(sa.w_q):
            stacked = getattr(kind, "stacked", None)
            if stacked is None:
                return None
            # Such modules are immutable (int8 weights, packed): stacked once per layer, not
            # per cache (~12 ms a layer of the base model, a greedy W2 step takes ~50 ms).
            modules = (sa.w_q, sa.w_kv, ca.w_q)
            with _STACKING:  # decoding streams (translate.py) start their first steps at once
                known = _STACKED.get(layer)
                if known is None or any(a is not b for a, b in zip(known[0], modules, strict=True)):
                    proj = StepProjections(stacked([(sa.w_q, scale), (sa.w_kv, 1.0)]),
                                           stacked([(ca.w_q, scale)]), prescaled)  # fmt: skip
                    known = _STACKED[layer] = (modules, proj)
            return known[1]
        with torch.no_grad():
            w = torch.cat([sa.w_q.weight * scale, sa.w_kv.weight])  # (H*K + H*K + H*Vd, D)
            b = torch.cat([sa.w_q.bias * scale, sa.w_kv.bias])
            cross_q = (ca.w_q.weight * scale, ca.w_q.bias * scale)
        return StepProjections(functools.partial(F.linear, weight=w, bias=b),
                               functools.partial(F.linear, weight=cross_q[0], bias=cross_q[1]),
                               prescaled)  # fmt: skip


# Per decoder layer with immutable projection modules: those modules and their StepProjections.
_STACKED: weakref.WeakKeyDictionary[nn.Module, tuple[tuple[nn.Module, ...], StepProjections]]
_STACKED = weakref.WeakKeyDictionary()
_STACKING = threading.Lock()


@dataclass
class LayerCache:
    """One decoder layer's share of the cache: views of its self-attention keys/values in
    `DecoderCache.self_k` / `self_v` (written in place), and its encoder-decoder keys/values
    (computed once per sentence)."""

    proj: StepProjections | None = None  # None: the layer's own modules
    cross_k: torch.Tensor | None = None  # (B, H, S, K); on the CPU a view of K^T (B, H, K, S)
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
    layout first). Full, the capacity doubles (greedy search: rows are dropped, never
    reordered, and the rows left keep the capacity). The encoder-decoder attention's padding
    mask is kept as an additive bias (one add per step instead of masking twice).

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
    beam: BeamHistory | None = None  # beam search on the CPU (`_may_track`): self_k / self_v unused
    history: bool = True  # may switch to `BeamHistory` when beams are expanded ...
    history_dtypes: tuple[torch.dtype, ...] = HISTORY_DTYPES  # ... with keys of these dtypes

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
        if self.beam is not None:
            self.beam.reserve(self.length, need)
        elif self.self_k is None:
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
        copied, once per source. When `index` expands each sentence to K beams (CPU, a dtype
        of `history_dtypes`), the cache switches to `BeamHistory`, whose reorders copy nothing.
        The cache reordered from must not be stepped again: under `BeamHistory` both share
        the buffers.
        """
        if self.beam is not None:
            out = self._reorder_beams(index)
            # Not beams of the same sentences: each row's history into a row of its own, then
            # the copy below.
            return out if out is not None else self.without_history()._reorder_copies(index, cross)
        return self._reorder_copies(index, cross)

    def _reorder_copies(self, index: torch.Tensor, cross: bool) -> DecoderCache:
        if not cross:
            rows, group = None, self.group
        elif self.cross_bias is None:  # before the first step: nothing to regroup yet
            rows, group = None, 1
        else:
            rows, group = _cross_rows(index, self.group, self.cross_bias.size(0))

        layers, cross_bias = self._cross_picked(rows)
        out = DecoderCache(layers, self.length, cross_bias=cross_bias, group=group,
                           history_dtypes=self.history_dtypes)  # fmt: skip
        if self.self_k is None:
            return out
        runs = group * out.cross_bias.size(0) == index.numel()  # every row in a run of `group`
        if self.group == 1 and group > 1 and runs and self._may_track():
            # Beam search expands each sentence to `group` beams: from here on, back-pointers.
            src = index[::group]  # each run's one parent row
            out.beam = BeamHistory.expand(self.self_k, self.self_v, src, group, self.length)
            return out
        t = self.length
        # Beams reorder at every step: room for the next step exactly, so that attention reads
        # a contiguous prefix (a bf16 product through oneDNN copies any other layout). Rows
        # that greedy search drops keep the buffers' room: one copy, not a second one of the
        # whole prefix when the next step's `reserve` finds the buffers full.
        room = t + 1 if group > 1 or self.group > 1 else max(t + 1, self.self_k.size(3))
        k, v = self._new_buffers(index.numel(), room)
        for old, new in ((self.self_k, k), (self.self_v, v)):
            prefix = old[:, :, :, :t]  # (N, B, H, t, .)
            if prefix.requires_grad:  # out= is not differentiable (decoding outside no_grad)
                new[:, :, :, :t] = prefix.index_select(1, index)
            else:
                torch.index_select(prefix, 1, index, out=new[:, :, :, :t])
        out._use(k, v)
        return out

    def _cross_picked(
        self, rows: torch.Tensor | None
    ) -> tuple[list[LayerCache], torch.Tensor | None]:
        """New layer caches (no self-attention views yet) and padding bias with the
        encoder-decoder rows `rows` (None: the same tensors, nothing copied)."""

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None or rows is None:
                return t
            if t.dim() == 4 and not t.is_contiguous() and t.transpose(-2, -1).is_contiguous():
                # keys kept as K^T (model._transposed_keys): picked in that layout
                return t.transpose(-2, -1).index_select(0, rows).transpose(-2, -1)
            return t.index_select(0, rows)

        layers = [LayerCache(c.proj, pick(c.cross_k), pick(c.cross_v)) for c in self.layers]
        return layers, pick(self.cross_bias)

    def _may_track(self) -> bool:
        k = self.self_k
        return self.history and k.device.type == "cpu" and k.dtype in self.history_dtypes

    def _reorder_beams(self, index: torch.Tensor) -> DecoderCache | None:
        """`reorder` under `BeamHistory`: None where `index` is not beams of the same sentences,
        K per sentence in order (then `without_history` and a copy)."""
        beam = self.beam.reorder(index)
        if beam is None:
            return None
        live = beam.live
        compact = live is not None and live.numel() <= (1 - COMPACT_DEAD) * beam.hist.size(0)
        layers, cross_bias = self._cross_picked(live if compact else None)
        if compact:
            beam = beam.compact(self.length)
        return DecoderCache(layers, self.length, cross_bias=cross_bias, group=self.group,
                            beam=beam)  # fmt: skip

    def begin_step(self, n_new: int, dtype: torch.dtype) -> None:
        """Before the layers of a step of `n_new` positions (room reserved): the back-pointers'
        mask of this step under `BeamHistory`, which takes one position at a time (with more,
        the rows' histories are gathered first)."""
        if self.beam is None:
            return
        if n_new == 1:
            self.beam.begin_step(self.length, dtype)
            return
        plain = self.without_history()
        self.layers, self.cross_bias, self.group = plain.layers, plain.cross_bias, plain.group
        self.beam, self.history = None, False
        self._use(plain.self_k, plain.self_v)
        self.reserve(n_new, (), 0, 0, self.self_k)

    def without_history(self) -> DecoderCache:
        """The same cache with one row of keys/values per hypothesis (self_k / self_v), each
        row's history gathered along its back-pointers; the cross rows one per live sentence."""
        beam = self.beam
        if beam is None:
            return self
        k, v = beam.gather(self.length)
        layers, cross_bias = self._cross_picked(beam.live)
        out = DecoderCache(layers, self.length, cross_bias=cross_bias, group=beam.beams,
                           history=False)  # fmt: skip
        out._use(k, v)
        return out


@dataclass
class BeamHistory:
    """Beam search's self-attention keys/values, never reordered (docs/decoding.md).

    Each sentence has K slots (K = `beams`): at position s slot j holds the keys/values that
    the hypothesis in row j computed at step s, and stays there. A hypothesis reaches its own
    prefix through back-pointers, `hist[c, i, s]`: the slot of row i's ancestor at position s.
    A reorder then rewrites `hist` (a few integers per row) where copying the prefix moves
    N x 2 x rows x H x t x d_k floats every step (O(T^2) over a translation; 37% of beam 4's
    time on the W2 batch). Attention takes a sentence's K queries together against all its
    K*(t+1) keys and values, those off a query's history masked by `bias` (-inf: weight exactly
    0): K times the products for the same bytes read and none written.

    Sentences leave the search as they finish; their slots stay (`live` maps the live
    sentences to theirs, their queries are zeros) until COMPACT_DEAD of them have left.

    All layers share one buffer for keys and one for values. Tried in three decoding streams
    (docs/performance.md, "Round forty-five"): a pair per layer (smaller blocks, which a
    stream's malloc arena keeps for the next batch), the quickstart model 4% faster but a
    base-size one 16% slower, peak memory +15% / +52%; blocks kept across a job's streams, 2-4%
    faster / no faster, +18% / +26%.
    """

    k: torch.Tensor  # (N, C, H, capacity, K, d_k)
    v: torch.Tensor  # (N, C, H, capacity, K, d_v)
    hist: torch.Tensor  # (C, K, capacity) long: positions [:length] filled
    live: torch.Tensor | None = None  # (C_live,) the buffer sentence of each live sentence
    bias: torch.Tensor | None = None  # (C, 1, K, (t + 1) * K) of the step (`begin_step`)

    @property
    def beams(self) -> int:
        return self.hist.size(1)

    @staticmethod
    def expand(k: torch.Tensor, v: torch.Tensor, src: torch.Tensor, beams: int, t: int):
        """From one row per sentence (k, v: (N, B, H, capacity, .), positions [:t]) to `beams`
        slots for each of the rows `src`: their prefixes in slot 0, every beam pointing at it.
        The other slots of [:t] are zeros: masked, a key must still be finite (0 x inf is
        NaN). Positions from t on are written, every slot of a live sentence, before they are
        read, so they are left uninitialized here and when the buffers grow (`reserve`):
        zeroing 2 x 200 MB at W2's shape cost ~3% of a search."""
        N, _, H, capacity, K = k.shape
        C = src.numel()
        nk = k.new_empty(N, C, H, capacity, beams, K)
        nv = v.new_empty(N, C, H, capacity, beams, v.size(-1))
        for new, old in ((nk, k), (nv, v)):
            new[:, :, :, :t].zero_()
            new[:, :, :, :t, 0] = old[:, :, :, :t].index_select(1, src)
        hist = torch.zeros(C, beams, capacity, dtype=torch.long, device=k.device)
        return BeamHistory(nk, nv, hist)

    def reserve(self, length: int, need: int) -> None:
        """Room for positions [:need] (doubling), positions [:length] kept."""
        capacity = self.hist.size(-1)
        if need <= capacity:
            return
        capacity, t = max(need, 2 * capacity), length
        k = self.k.new_empty(*self.k.shape[:3], capacity, *self.k.shape[4:])
        v = self.v.new_empty(*self.v.shape[:3], capacity, *self.v.shape[4:])
        hist = self.hist.new_zeros(*self.hist.shape[:2], capacity)
        k[:, :, :, :t], v[:, :, :, :t], hist[:, :, :t] = (
            self.k[:, :, :, :t], self.v[:, :, :, :t], self.hist[:, :, :t])  # fmt: skip
        self.k, self.v, self.hist = k, v, hist

    def reorder(self, index: torch.Tensor) -> BeamHistory | None:
        """Rows `index` of the old live rows (sentence by sentence, K each): the new history,
        sharing the buffers; None where `index` is not K beams of each of a subset of the
        live sentences, taken in order."""
        g, n = self.beams, index.numel()
        if n == 0 or n % g:
            return None
        parents = index.view(-1, g)  # (C', K) old rows
        old = torch.div(parents[:, :1], g, rounding_mode="floor")  # (C', 1) old live sentence
        local = parents - old * g  # (C', K) the parent's slot
        old = old.squeeze(1)
        n_live = self.hist.size(0) if self.live is None else self.live.numel()
        in_order = old[1:].gt(old[:-1]).all() & old[-1].lt(n_live)
        if not bool(local.ge(0).all() & local.lt(g).all() & in_order):
            return None
        live = self.live
        if old.numel() < n_live:  # sentences left: `old` is the in-order rest
            live = old if live is None else live[old]
        if live is None:
            hist = self.hist.gather(1, local[:, :, None].expand_as(self.hist))
        else:
            hist = self._regather(live, local)
        return BeamHistory(self.k, self.v, hist, live)

    def _regather(self, live: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        rows = self.hist.index_select(0, live)
        rows = rows.gather(1, local[:, :, None].expand_as(rows))
        return self.hist.index_copy(0, live, rows)

    def compact(self, length: int) -> BeamHistory:
        """The live sentences' slots only (one copy of their prefixes)."""
        live, t = self.live, length
        k = self.k.new_empty(*self.k.shape[:1], live.numel(), *self.k.shape[2:])
        v = self.v.new_empty(*self.v.shape[:1], live.numel(), *self.v.shape[2:])
        torch.index_select(self.k[:, :, :, :t], 1, live, out=k[:, :, :, :t])
        torch.index_select(self.v[:, :, :, :t], 1, live, out=v[:, :, :, :t])
        return BeamHistory(k, v, self.hist.index_select(0, live))

    def begin_step(self, t: int, dtype: torch.dtype) -> None:
        """Position t is each row's own slot; the step's mask over (t + 1) * K keys."""
        g = self.beams
        slots = torch.arange(g, device=self.hist.device)
        self.hist[:, :, t] = slots
        on = self.hist[:, :, : t + 1, None] == slots  # (C, K, t + 1, K)
        bias = torch.zeros(on.shape, dtype=dtype, device=on.device).masked_fill_(~on, float("-inf"))
        self.bias = bias.view(on.size(0), 1, g, (t + 1) * g)

    def write(self, i: int, t: int, k: torch.Tensor, v: torch.Tensor):
        """Layer i's keys (R, H, 1, d_k) and values of the live rows at position t; returns the
        layer's keys (C, H, (t + 1) * K, d_k) and values, slot-minor, as `bias` reads them."""
        g = self.beams
        out = []
        for buf, new in ((self.k[i], k), (self.v[i], v)):
            new = new.reshape(-1, g, new.size(1), new.size(-1)).transpose(1, 2)  # (C', H, K, .)
            slot = buf[:, :, t]  # (C, H, K, .)
            if self.live is None:
                slot.copy_(new)
            else:
                slot.index_copy_(0, self.live, new)
            C, H, _, _, d = buf.shape
            out.append(buf[:, :, : t + 1].reshape(C, H, (t + 1) * g, d))
        return out[0], out[1]

    def gather(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One row per live hypothesis: (N, R, H, capacity, .) with positions [:length] each
        row's own history (`DecoderCache.without_history`)."""
        t, g = length, self.beams
        hist = self.hist if self.live is None else self.hist.index_select(0, self.live)
        C = hist.size(0)
        c = torch.arange(C, device=hist.device)[:, None, None].expand(C, g, t)
        s = torch.arange(t, device=hist.device)[None, None, :].expand(C, g, t)
        j = hist[:, :, :t]
        out = []
        for buf in (self.k, self.v):
            if self.live is not None:
                buf = buf.index_select(1, self.live)
            rows = buf[:, c, :, s, j]  # (C, K, t, N, H, d)
            N, H, d = buf.size(0), buf.size(2), buf.size(-1)
            new = buf.new_empty(N, C * g, H, max(t + 1, CACHE_CAPACITY), d)
            new[:, :, :, :t] = rows.permute(3, 0, 1, 4, 2, 5).reshape(N, C * g, H, t, d)
            out.append(new)
        return out[0], out[1]


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
