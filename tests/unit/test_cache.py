"""The decoder's incremental-decoding state (cache.py): the preallocated self-attention buffer,
the fused step projections and the cross-attention padding bias. Cached decoding against full
decoding is tested in test_model.py and test_search.py."""

from __future__ import annotations

from dataclasses import replace

import torch

from transformer.cache import CACHE_CAPACITY, StepProjections, padding_bias
from transformer.config import build_config
from transformer.model import Transformer

V = 50


def tiny(**kw):
    return replace(build_config("tiny", vocab_size=V).model, **kw)


def batch(b: int = 3, s: int = 7):
    src = torch.randint(4, V, (b, s))
    src_mask = torch.ones(b, s, dtype=torch.bool)
    src_mask[0, s - 2 :] = False  # first sentence is padded
    return src, src_mask


def test_cache_writes_in_place_and_grows_past_its_capacity() -> None:
    # Issue 19: one preallocated self-attention buffer written at position t, not a torch.cat of
    # the prefix per step; past CACHE_CAPACITY positions it doubles, and decoding still equals
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
            buffers.add(cache.self_kv.data_ptr())
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-5)
    assert len(buffers) == 2  # allocated once, grown once
    assert cache.self_kv.shape == (2 * CACHE_CAPACITY, 2, 3, 4, 8 + 8)  # (cap, N, B, H, K + Vd)


def test_step_projections_are_exactly_the_separate_ones() -> None:
    layer = Transformer(tiny(d_k=16, d_v=12)).decoder_layers[0].eval()
    proj = StepProjections.of(layer)
    sa, H = layer.self_attn, 4
    y = torch.randn(5, 1, 32)
    qkv = torch.nn.functional.linear(y, *proj.qkv)  # (5, 1, H*16 + H*(16 + 12))
    q, kv = qkv[..., : H * 16], qkv[..., H * 16 :].view(5, 1, H, 28)
    k, v = sa.w_kv(y).split([H * 16, H * 12], dim=-1)
    torch.testing.assert_close(q, sa.w_q(y) / 4, rtol=0, atol=1e-6)
    torch.testing.assert_close(kv[..., :16], k.view(5, 1, H, 16), rtol=0, atol=1e-6)
    torch.testing.assert_close(kv[..., 16:], v.view(5, 1, H, 12), rtol=0, atol=1e-6)


def test_padding_bias_is_minus_inf_at_padding_and_never_all_minus_inf() -> None:
    mask = torch.tensor([[True, True, False], [False, False, False]])
    bias = padding_bias(mask, torch.float32)
    assert bias.shape == (2, 1, 1, 3)
    assert bias[0, 0, 0].tolist() == [0.0, 0.0, float("-inf")]
    assert bias[1, 0, 0].tolist() == [0.0, 0.0, 0.0]  # all padding: no NaN row
