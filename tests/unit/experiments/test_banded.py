"""§4 restricted self-attention: the banded O(r·n·d) kernel equals the masked reference."""

from __future__ import annotations

import pytest
import torch

from transformer.experiments.banded import attention_banded
from transformer.model import attention, window_mask


def _qkv(n: int, b: int = 2, h: int = 3, d_k: int = 4, d_v: int = 5):
    return torch.randn(b, h, n, d_k), torch.randn(b, h, n, d_k), torch.randn(b, h, n, d_v)


@pytest.mark.parametrize(
    ("n", "window"), [(1, 0), (7, 0), (7, 1), (12, 3), (13, 3), (10, 4), (5, 9), (64, 8)]
)
def test_banded_equals_masked_reference(n: int, window: int) -> None:
    q, k, v = _qkv(n)
    expected = attention(q, k, v, window_mask(n, window, q.device), fused=False)
    torch.testing.assert_close(attention_banded(q, k, v, window), expected)


def test_banded_with_key_padding() -> None:
    n, window = 11, 2
    q, k, v = _qkv(n)
    lengths = torch.tensor([11, 6])
    key_mask = torch.arange(n)[None, :] < lengths[:, None]  # (B, N)
    mask = window_mask(n, window, q.device) & key_mask[:, None, None, :]
    expected = attention(q, k, v, mask, fused=False)
    got = attention_banded(q, k, v, window, key_mask)
    visible = mask.any(-1)  # queries with at least one visible key: (B, 1, N)
    torch.testing.assert_close(got[visible.expand(-1, 3, -1)], expected[visible.expand(-1, 3, -1)])
    # Padding queries 9 and 10 of row 1 are more than r from every real token: zeros, not NaN.
    assert torch.equal(got[1, :, 9:], torch.zeros_like(got[1, :, 9:]))


def test_banded_gradients_equal_reference() -> None:
    n, window = 9, 2
    q, k, v = (t.requires_grad_() for t in _qkv(n))
    attention_banded(q, k, v, window).square().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    out = attention(q, k, v, window_mask(n, window, q.device), fused=False)
    out.square().sum().backward()
    for got, t in zip(grads, (q, k, v), strict=True):
        torch.testing.assert_close(got, t.grad)


def test_banded_work_grows_linearly(monkeypatch: pytest.MonkeyPatch) -> None:
    # The score tensor holds n/b blocks x b x 3b = 3·r·n entries (for n a multiple of r),
    # not n²: count them through a hook on the masked softmax's input size.
    from transformer.experiments import banded

    sizes = []
    original = banded.masked_softmax

    def spy(scores, mask):
        sizes.append(scores.numel())
        return original(scores, mask)

    q, k, v = _qkv(256, b=1, h=1)
    monkeypatch.setattr(banded, "masked_softmax", spy)
    attention_banded(q, k, v, 8)
    assert sizes == [3 * 8 * 256]
