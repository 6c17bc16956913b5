"""The decoder's incremental-decoding state (cache.py): the preallocated self-attention buffer,
the fused step projections and the cross-attention padding bias. Cached decoding against full
decoding is tested in test_model.py and test_search.py."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from transformer import cache as cache_module
from transformer.cache import (
    CACHE_CAPACITY,
    BeamHistory,
    DecoderCache,
    StepProjections,
    padding_bias,
)
from transformer.config import build_config
from transformer.model import Transformer
from transformer.search import beam_search

V = 50


def tiny(**kw):
    return replace(build_config("tiny", vocab_size=V).model, **kw)


def batch(b: int = 3, s: int = 7):
    src = torch.randint(4, V, (b, s))
    src_mask = torch.ones(b, s, dtype=torch.bool)
    src_mask[0, s - 2 :] = False  # first sentence is padded
    return src, src_mask


def test_cache_writes_in_place_and_grows_past_its_capacity() -> None:
    # Issue 19: preallocated self-attention buffers written at position t, not a torch.cat of the
    # prefix per step; past CACHE_CAPACITY positions they double, and decoding still equals
    # full decoding.
    model = Transformer(tiny(max_len=128)).eval()
    src, src_mask = batch()
    tgt = torch.randint(4, V, (3, CACHE_CAPACITY + 5))
    with torch.no_grad():
        memory = model.encode(src, src_mask)
        full = model.decode(tgt, memory, src_mask)
        cache = model.new_cache()
        steps, buffers = [], set()
        for i in range(tgt.size(1)):
            steps.append(model.decode(tgt[:, i : i + 1], memory, src_mask, cache))
            buffers.add(cache.self_k.data_ptr())
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-5)
    assert len(buffers) == 2  # allocated once, grown once
    assert cache.self_k.shape == (2, 3, 4, 2 * CACHE_CAPACITY, 8)  # (N, B, H, capacity, K)


def test_cpu_decoding_stores_the_encoder_decoder_keys_in_whole_blocks() -> None:
    """A CPU decoding step's cross-attention keys padded (masked) to a multiple of KEY_BLOCK,
    so that a sentence's few queries meet its keys in the same blocks alone or beside a longer
    batch mate (docs/decoding.md); decoding still equals full decoding."""
    from transformer.model import KEY_BLOCK

    model = Transformer(tiny()).eval()
    src, src_mask = batch(b=2, s=KEY_BLOCK + 3)
    tgt = torch.randint(4, V, (2, 4))
    with torch.no_grad():
        memory = model.encode(src, src_mask)
        full = model.decode(tgt, memory, src_mask)
        cache = model.new_cache()
        steps = [model.decode(tgt[:, i : i + 1], memory, src_mask, cache) for i in range(4)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-5)
    assert cache.layers[0].cross_k.shape[2] == cache.layers[1].cross_v.shape[2] == 2 * KEY_BLOCK
    assert cache.cross_bias.shape == (2, 1, 1, 2 * KEY_BLOCK)
    real = torch.cat([src_mask, torch.zeros(2, KEY_BLOCK - 3, dtype=torch.bool)], 1)
    assert torch.equal(cache.cross_bias[:, 0, 0] == 0, real)


@pytest.mark.parametrize(
    ("dtype", "kernel"),
    [(torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False), (torch.float64, True)],
)
def test_cpu_decoding_keeps_the_encoder_decoder_keys_transposed(dtype, kernel, monkeypatch) -> None:
    """On the CPU the cross-attention keys are a view of K^T (B, H, K, S) in fp32 (fp64's
    kept), in that layout still after greedy search drops rows; a bf16 model's stay bf16 rows
    where `kernels.step_attention` reads them (`bf16_key_rows`), else are widened to K^T;
    decoding equals full decoding throughout."""
    from transformer import model as model_module

    if not kernel:
        monkeypatch.setattr(model_module, "bf16_key_rows", lambda: False)
    rows = dtype == torch.bfloat16 and model_module.bf16_key_rows()
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    model = Transformer(tiny()).eval().to(dtype)
    src, src_mask = batch()
    tgt = torch.randint(4, V, (3, 4))
    with torch.no_grad():
        memory = model.encode(src, src_mask)
        full = model.decode(tgt, memory, src_mask).float()
        cache = model.new_cache()
        first = model.decode(tgt[:, :2], memory, src_mask, cache).float()
        k = cache.layers[0].cross_k
        if rows:
            assert k.dtype == torch.bfloat16 and k.is_contiguous()
        else:
            assert k.dtype == wide and k.transpose(-2, -1).is_contiguous()
        keep = torch.tensor([0, 2])  # a sentence ended: its row dropped
        cache = cache.reorder(keep)
        k = cache.layers[1].cross_k
        assert k.size(0) == 2
        assert k.is_contiguous() if rows else k.transpose(-2, -1).is_contiguous()
        rest = model.decode(tgt[keep, 2:], memory[keep], src_mask[keep], cache).float()
        with torch.enable_grad():  # a gradient wanted: the keys as the model computes them
            fp32_model = Transformer(tiny())
            grad_cache = fp32_model.new_cache()
            fp32_model.decode(tgt[:, :1], memory.float(), src_mask, grad_cache)
        assert grad_cache.layers[0].cross_k.is_contiguous()
    tol = {"rtol": 0.05, "atol": 0.05} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(first, full[:, :2], **tol)
    torch.testing.assert_close(rest, full[keep, 2:], **tol)


@torch.no_grad()
def _three_steps(tgt_len: int, history: bool = True):
    """A tiny model's cache after 3 cached steps of 3 random targets of `tgt_len` tokens."""
    model = Transformer(tiny()).eval()
    src, src_mask = batch()
    tgt = torch.randint(4, V, (3, tgt_len))
    memory = model.encode(src, src_mask)
    cache = model.new_cache()
    cache.history = history
    for i in range(3):
        model.decode(tgt[:, i : i + 1], memory, src_mask, cache)
    return model, memory, src_mask, tgt, cache


def test_beam_reorders_leave_room_for_exactly_one_step_so_attention_reads_contiguous() -> None:
    # Beam search reorders every step (bf16 and CUDA keep reordered buffers); the next step's
    # keys/values then fill the buffer, the layout a bf16 batched matrix product takes without
    # copying it first.
    # no back-pointers: reordered buffers, as in bf16
    model, memory, src_mask, tgt, cache = _three_steps(4, history=False)
    with torch.no_grad():
        index = torch.tensor([0, 0, 1, 1, 2, 2])  # each sentence expanded to 2 beams
        cache = cache.reorder(index)
        assert cache.group == 2 and cache.beam is None
        assert cache.self_k.shape == (2, 6, 4, 3 + 1, 8)  # (N, B', H, t + 1, K)
        out = model.decode(tgt[index, 3:4], memory, src_mask, cache)
        full = model.decode(tgt[index], memory[index], src_mask[index])[:, 3:]
    assert all(c.self_k[:, :, :4].is_contiguous() for c in cache.layers)
    torch.testing.assert_close(out, full, rtol=0, atol=1e-5)


def test_rows_dropped_by_greedy_search_keep_the_buffers_room() -> None:
    # Greedy search drops finished rows: one copy of the rest, into buffers as long as before,
    # so the next step writes in place instead of growing them (a second copy).
    model, memory, src_mask, tgt, cache = _three_steps(5)
    with torch.no_grad():
        keep = torch.tensor([0, 2])
        cache = cache.reorder(keep)
        assert cache.self_k.shape == (2, 2, 4, CACHE_CAPACITY, 8)
        before = cache.self_k.data_ptr()
        out = [model.decode(tgt[keep, i : i + 1], memory, src_mask, cache) for i in (3, 4)]
        assert cache.self_k.data_ptr() == before  # written in place
        full = model.decode(tgt[keep], memory[keep], src_mask[keep])[:, 3:]
    torch.testing.assert_close(torch.cat(out, dim=1), full, rtol=0, atol=1e-5)


def test_step_projections_are_exactly_the_separate_ones() -> None:
    layer = Transformer(tiny(d_k=16, d_v=12)).decoder_layers[0].eval()
    proj = StepProjections.of(layer)
    sa, H = layer.self_attn, 4
    y = torch.randn(5, 1, 32)
    qkv = proj.qkv(y)  # (5, 1, H*16 + H*16 + H*12)
    assert qkv.shape == (5, 1, H * (16 + 16 + 12))
    torch.testing.assert_close(qkv[..., : H * 16], sa.w_q(y) / 4, rtol=0, atol=1e-6)
    torch.testing.assert_close(qkv[..., H * 16 :], sa.w_kv(y), rtol=0, atol=1e-6)


def test_padding_bias_is_minus_inf_at_padding_and_never_all_minus_inf() -> None:
    mask = torch.tensor([[True, True, False], [False, False, False]])
    bias = padding_bias(mask, torch.float32)
    assert bias.shape == (2, 1, 1, 3)
    assert bias[0, 0, 0].tolist() == [0.0, 0.0, float("-inf")]
    assert bias[1, 0, 0].tolist() == [0.0, 0.0, 0.0]  # all padding: no NaN row


class _CountOps(TorchDispatchMode):
    """Counts the ATen ops dispatched while active, by name (as benchmarks/count_ops.py)."""

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _step_ops(n_layers: int) -> Counter[str]:
    """Ops of one cached decoder step (the third) of a tiny model with d_k = 16. The rows the
    attention's value sums read are built once a step and kept by shape (`model._row_bags`):
    emptied first, so that every count starts from the same state."""
    from transformer import model as model_module

    model_module._row_bags.cache_clear()
    model = Transformer(tiny(n_layers=n_layers, d_k=16)).eval()
    src, src_mask = batch()
    tokens = torch.ones(3, 1, dtype=torch.long)
    with torch.inference_mode():
        memory, cache = model.encode(src, src_mask), model.new_cache()
        for _ in range(2):
            model.decode(tokens, memory, src_mask, cache)
        with _CountOps() as counter:
            model.decode(tokens, memory, src_mask, cache)
    return counter.ops


def test_a_cached_step_costs_47_ops_per_layer_and_copies_no_prefix():
    # Issue 19: at sentence lengths a step's CPU time is largely per-op overhead. Golden counts
    # from this test's model on torch 2.13 (ops called from Python, inference mode): 43 ops per
    # decoder layer before issue 19 (a torch.cat of the keys and of the values, separate W^Q and
    # W^KV products, eq. (1)'s division, the padding mask applied with bitwise_not +
    # masked_fill twice), 37 after; 46 since each row's values no longer depend on its batch
    # (`model._attention_rowwise`): per attention the fp64 softmax's weights rounded to fp32
    # (+1), the value sums' three views (+3, `_weighted_rows`, now at every size), and
    # self-attention's query copied in Python instead of inside matmul (+1, once a layer);
    # 44 since a step's softmax runs in fp32 over keys laid out in whole blocks (-2); 47 since
    # the encoder-decoder scores are sums of the rows of K^T (+3: the transpose, and the row
    # sums' views in place of one matmul; 45 against 144 us at W2's greedy shapes).
    two, four = _step_ops(2), _step_ops(4)
    per_layer = (sum(four.values()) - sum(two.values())) / 2
    assert per_layer <= 47
    assert four["cat"] == 0 and four["index_select"] == 0  # written in place, nothing re-copied
    assert four["linear"] == 6 * 4 + 1  # per layer: W^QKV, W^O, cross W^Q, W^O, FFN 2; output


def test_cross_rows_keep_one_source_per_run_of_beams() -> None:
    from transformer.cache import _cross_rows

    expand = torch.arange(3).repeat_interleave(4)  # 3 sentences to 4 beams each
    assert _cross_rows(expand, 1, 3) == (None, 4)  # nothing copied: the sources as they were
    rows, g = _cross_rows(torch.tensor([0, 1, 2, 3, 8, 9, 10, 11]), 4, 3)  # sentence 1 done
    assert rows.tolist() == [0, 2] and g == 4
    rows, g = _cross_rows(torch.tensor([0, 0, 1]), 1, 2)  # runs of unequal length: per row
    assert rows.tolist() == [0, 0, 1] and g == 1
    rows, g = _cross_rows(torch.tensor([0, 0, 1, 2]), 1, 3)
    assert rows.tolist() == [0, 0, 1, 2] and g == 1
    assert _cross_rows(torch.tensor([2, 0, 1]), 1, 3)[0].tolist() == [2, 0, 1]
    assert _cross_rows(torch.tensor([0, 1, 2]), 1, 3) == (None, 1)  # the identity: no copy


def test_grouped_cross_attention_equals_one_copy_per_row() -> None:
    # Issue 19: beams of one sentence share one copy of its encoder keys/values and attend to
    # it together; the step's output is that of a cache with a copy per beam.
    model = Transformer(tiny()).eval()
    src, src_mask = batch()
    with torch.no_grad():
        memory = model.encode(src, src_mask)
        cache = model.new_cache()
        model.decode(torch.full((3, 1), 1), memory, src_mask, cache)
        index = torch.tensor([0, 0, 1, 1, 2, 2])  # two beams per sentence
        grouped = cache.reorder(index)
        per_row = cache.reorder(index)
        per_row.group = 1
        for layer in per_row.layers:
            layer.cross_k, layer.cross_v = (layer.cross_k[index], layer.cross_v[index])
        per_row.cross_bias = per_row.cross_bias[index]
        assert grouped.group == 2 and grouped.layers[0].cross_k.size(0) == 3
        tgt = torch.randint(4, V, (6, 1))
        got = model.decode(tgt, memory, src_mask, grouped)
        want = model.decode(tgt, memory, src_mask, per_row)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert not torch.equal(got[0], got[2])  # different sentences, different outputs


# ------------------------------------------------------------ beam search through back-pointers


def _sources(b: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 12, (b,), generator=g).tolist()
    src = torch.full((b, max(lengths)), 0, dtype=torch.long)
    for i, n in enumerate(lengths):
        src[i, : n - 1] = torch.randint(4, vocab, (n - 1,), generator=g)
        src[i, n - 1] = 2  # EOS
    return src, src != 0


class _Spy:
    """Counts BeamHistory's expansions and compactions, and reorders that fell back to copies."""

    def __init__(self, monkeypatch):
        self.expand = self.compact = self.fallback = 0
        expand, compact = BeamHistory.expand, BeamHistory.compact
        without = DecoderCache.without_history

        def spy_expand(*a):
            self.expand += 1
            return expand(*a)

        def spy_compact(beam, *a):
            self.compact += 1
            return compact(beam, *a)

        def spy_without(c):
            self.fallback += c.beam is not None
            return without(c)

        monkeypatch.setattr(BeamHistory, "expand", staticmethod(spy_expand))
        monkeypatch.setattr(BeamHistory, "compact", spy_compact)
        monkeypatch.setattr(DecoderCache, "without_history", spy_without)


@pytest.mark.parametrize(("beam", "vocab", "max_len_b"), [(2, 8, 5), (4, 20, 40), (5, 50, 12)])
def test_beam_search_through_back_pointers_equals_reordered_copies(monkeypatch, beam, vocab,
                                                                   max_len_b) -> None:  # fmt: skip
    # Issue 19: on the CPU in fp32 the beams' keys/values stay where they were computed and a
    # reorder rewrites only the back-pointers; sentences leaving the batch (lengths 2-12,
    # stopping apart) are compacted away; past CACHE_CAPACITY positions (max_len_b 40) the
    # buffers grow. Every hypothesis and score equals the search over reordered copies.
    model = Transformer(tiny(vocab_size=vocab, max_len=128)).eval()
    with torch.no_grad():
        model.src_embed.weight.mul_(3.0)  # spread the logits: beams trade places
    src, src_mask = _sources(9, vocab, seed=beam)
    kw = dict(beam_size=beam, max_len_a=1.0, max_len_b=max_len_b, n_best=2)
    spy = _Spy(monkeypatch)
    with torch.no_grad():
        tracked = beam_search(model, src, src_mask, **kw)
        monkeypatch.setattr(cache_module, "HISTORY_DTYPES", ())
        copied = beam_search(model, src, src_mask, **kw)
    assert spy.expand == 1 and spy.compact >= 1 and spy.fallback == 0
    for a, b in zip(tracked, copied, strict=True):
        assert [h.tokens for h in a] == [h.tokens for h in b]
        assert [h.score for h in a] == pytest.approx([h.score for h in b], abs=1e-5)
    if max_len_b == 40:
        assert max(len(h.tokens) for hyps in tracked for h in hyps) > CACHE_CAPACITY


def _expanded(model, src, src_mask, beams: int, steps: int):
    """A cache after `steps` decoding steps of `beams` rows per sentence, the rows reordered
    within their sentences after each step; the rows' full target prefixes beside it."""
    g = torch.Generator().manual_seed(1)
    B = src.size(0)
    memory = model.encode(src, src_mask)
    cache = model.new_cache()
    prefix = torch.ones(B, 1, dtype=torch.long)  # BOS
    model.decode(prefix, memory, src_mask, cache)
    index = torch.arange(B).repeat_interleave(beams)
    for _ in range(steps):
        cache = cache.reorder(index)
        prefix = torch.cat([prefix[index], torch.randint(4, V, (index.numel(), 1), generator=g)], 1)
        model.decode(prefix[:, -1:], memory, src_mask, cache)
        parents = torch.randint(0, beams, (B, beams), generator=g)
        index = (parents + torch.arange(B)[:, None] * beams).view(-1)
    return memory, cache, prefix, index


def test_back_pointers_fall_back_to_copies_for_any_other_reorder() -> None:
    # A reorder that is not beams of the same sentences (rows of two sentences in one run), or
    # a step of several positions, gathers each row's history into its own row first: the
    # output still equals decoding the whole prefix.
    model = Transformer(tiny()).eval()
    src, src_mask = batch()
    with torch.no_grad():
        memory, cache, prefix, _ = _expanded(model, src, src_mask, beams=2, steps=3)
        assert cache.beam is not None
        index = torch.tensor([0, 2, 5, 5, 3, 1])  # across sentences
        moved = cache.reorder(index)
        assert moved.beam is None and moved.self_k.size(1) == 6
        rows = index // 2
        tgt = torch.randint(4, V, (6, 1))
        got = model.decode(tgt, memory[rows], src_mask[rows], moved)
        full = model.decode(torch.cat([prefix[index], tgt], 1), memory[rows], src_mask[rows])
        torch.testing.assert_close(got, full[:, -1:], rtol=0, atol=1e-5)

        memory, cache, prefix, index = _expanded(model, src, src_mask, beams=2, steps=2)
        cache = cache.reorder(index)
        assert cache.beam is not None
        tgt = torch.randint(4, V, (6, 3))  # three positions in one step
        rows = torch.arange(3).repeat_interleave(2)
        got = model.decode(tgt, memory, src_mask, cache)
        assert cache.beam is None
        full = model.decode(torch.cat([prefix[index], tgt], 1), memory[rows], src_mask[rows])
        torch.testing.assert_close(got, full[:, -3:], rtol=0, atol=1e-5)


def test_a_beam_reorder_copies_no_prefix_and_keeps_its_buffers() -> None:
    # Issue 19: under back-pointers a step's reorder moves a few integers per row, not the
    # N x 2 x rows x H x t x d_k floats of the prefix (37% of beam 4's time on W2 before).
    model = Transformer(tiny()).eval()
    src, src_mask = batch()
    with torch.no_grad():
        memory, cache, prefix, index = _expanded(model, src, src_mask, beams=3, steps=4)
        buffers = cache.beam.k.data_ptr(), cache.beam.v.data_ptr()
        with _CountOps() as counter:
            moved = cache.reorder(index)
        assert (moved.beam.k.data_ptr(), moved.beam.v.data_ptr()) == buffers
        assert counter.ops["index_select"] == 0 and counter.ops["copy_"] == 0
        rows = torch.arange(3).repeat_interleave(3)
        tgt = torch.randint(4, V, (9, 1))
        got = model.decode(tgt, memory, src_mask, moved)
        full = model.decode(torch.cat([prefix[index], tgt], 1), memory[rows], src_mask[rows])
    torch.testing.assert_close(got, full[:, -1:], rtol=0, atol=1e-5)


def test_local_attention_keeps_reordered_copies() -> None:
    # A local attention window masks by position, which back-pointers do not: it keeps the
    # copying reorder.
    src, src_mask = batch()
    index = torch.arange(3).repeat_interleave(2)
    model = Transformer(tiny(attn_window=2)).eval()
    with torch.no_grad():
        memory = model.encode(src, src_mask)
        cache = model.new_cache()
        model.decode(torch.ones(3, 1, dtype=torch.long), memory, src_mask, cache)
        assert cache.reorder(index).beam is None


@pytest.mark.parametrize("history", [False, True])
def test_bf16_follows_back_pointers_where_the_step_kernel_runs(monkeypatch, history) -> None:
    # bf16 takes back-pointers where a step's attention is the compiled kernel, which skips the
    # masked keys (`model.bf16_beam_history`); through torch's ops the K x (t + 1) keys would be
    # widened every step, and the copying reorder is kept.
    from transformer import model as model_module

    monkeypatch.setattr(model_module, "bf16_beam_history", lambda: history)
    src, src_mask = batch()
    index = torch.arange(3).repeat_interleave(2)
    model = Transformer(tiny()).eval().to(torch.bfloat16)
    with torch.no_grad():
        memory = model.encode(src, src_mask)
        cache = model.new_cache()
        model.decode(torch.ones(3, 1, dtype=torch.long), memory, src_mask, cache)
        assert (cache.reorder(index).beam is not None) is history


def test_bf16_back_pointers_follow_the_step_kernel() -> None:
    from transformer import model as model_module

    assert model_module.bf16_beam_history() is model_module.step_attention_kernel()
    dtypes = Transformer(tiny()).to(torch.bfloat16).new_cache().history_dtypes
    assert (torch.bfloat16 in dtypes) is model_module.step_attention_kernel()
    assert torch.float32 in dtypes
    assert Transformer(tiny()).new_cache().history_dtypes == cache_module.HISTORY_DTYPES


@pytest.mark.parametrize("kernel", [True, False])
def test_bf16_beam_search_through_back_pointers_equals_reordered_copies(monkeypatch,
                                                                       kernel) -> None:  # fmt: skip
    # With the step kernel (as it runs) and through torch's ops (forced), bf16 beam search over
    # back-pointers gives the copying reorder's hypotheses, sentences leaving and the buffers
    # growing on the way.
    from transformer import model as model_module

    if not kernel:
        monkeypatch.setattr(model_module, "_step_kernel_takes", lambda *a: False)
    model = Transformer(tiny(vocab_size=20, max_len=128)).eval()
    with torch.no_grad():
        model.src_embed.weight.mul_(3.0)  # spread the logits: beams trade places
    model = model.to(torch.bfloat16)
    src, src_mask = _sources(9, 20, seed=4)
    kw = dict(beam_size=4, max_len_a=1.0, max_len_b=40, n_best=2)
    spy = _Spy(monkeypatch)
    with torch.no_grad():
        monkeypatch.setattr(model_module, "bf16_beam_history", lambda: True)
        tracked = beam_search(model, src, src_mask, **kw)
        monkeypatch.setattr(model_module, "bf16_beam_history", lambda: False)
        copied = beam_search(model, src, src_mask, **kw)
    assert spy.expand == 1 and spy.fallback == 0
    for a, b in zip(tracked, copied, strict=True):
        assert [h.tokens for h in a] == [h.tokens for h in b]
        assert [h.score for h in a] == pytest.approx([h.score for h in b], abs=1e-4)


def test_slots_never_written_are_never_read() -> None:
    # BeamHistory leaves positions from t on uninitialized (written before they are read) and
    # a finished sentence's slots as they are until compaction: NaN there must not reach the
    # live rows (a NaN key, even masked, would: 0 x NaN).
    model = Transformer(tiny()).eval()
    src, src_mask = batch(b=5)
    with torch.no_grad():
        memory, cache, prefix, index = _expanded(model, src, src_mask, beams=2, steps=3)
        beam = cache.beam
        t = cache.length
        beam.k[:, :, :, t:], beam.v[:, :, :, t:] = float("nan"), float("nan")
        index = index.view(5, 2)[[0, 2, 3, 4]].view(-1)  # sentence 1 is done
        moved = cache.reorder(index)
        assert moved.beam.live.tolist() == [0, 2, 3, 4]  # 4 of 5 live: not compacted yet
        moved.beam.k[:, 1], moved.beam.v[:, 1] = float("nan"), float("nan")
        rows = torch.tensor([0, 2, 3, 4]).repeat_interleave(2)
        tgt = torch.randint(4, V, (8, 1))
        got = model.decode(tgt, memory, src_mask, moved)
        full = model.decode(torch.cat([prefix[index], tgt], 1), memory[rows], src_mask[rows])
    torch.testing.assert_close(got, full[:, -1:], rtol=0, atol=1e-5)
