"""§4 Table 1: restricted self-attention computed in O(r·n·d), not as a mask on O(n²·d).

Each query i attends only to keys j with |i - j| <= r. `model.window_mask` expresses this as a
mask on full attention, which still computes all n² scores. Here the sequence is cut into blocks
of b = max(r, 1) positions; the queries of block c can only see keys in blocks c-1, c and c+1, so
each block multiplies a (b, K) query tile with a (3b, K) key window: n/b blocks x b x 3b scores,
i.e. 3·r·n instead of n². The windows are strided views (`Tensor.unfold`), not copies of the keys.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from transformer.model import masked_softmax


def _band_mask(n: int, window: int, block: int, device: torch.device) -> torch.Tensor:
    """(n_blocks, block, 3 * block) bool: query i sees key j iff |i - j| <= r and 0 <= j < n."""
    n_blocks = math.ceil(n / block)
    q_pos = torch.arange(n_blocks * block, device=device).view(n_blocks, block, 1)
    offsets = torch.arange(-block, 2 * block, device=device)  # window start = block start - b
    k_pos = (torch.arange(n_blocks, device=device) * block).view(n_blocks, 1, 1) + offsets
    return ((q_pos - k_pos).abs() <= window) & (k_pos >= 0) & (k_pos < n)


def attention_banded(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """§3.2.1 eq. (1) restricted to a neighbourhood of r = `window` positions on each side (§4).

    Equal to `model.attention(q, k, v, window_mask(n, r) & key_mask)` wherever a query has at
    least one visible key; a query with none (e.g. padding far from any real token) gets zeros
    instead of NaN.

    Args:
        q, k: (B, H, N, K); v: (B, H, N, Vd) — self-attention, so one length N.
        window: r >= 0, the neighbours visible on each side.
        key_mask: (B, N) bool, True at real tokens, or None.

    Returns:
        The attended values (B, H, N, Vd).
    """
    B, H, N, K = q.shape
    block = max(window, 1)
    n_blocks = math.ceil(N / block)
    pad = n_blocks * block - N
    # One block of padding before and after, so every query block has three key blocks.
    q = F.pad(q, (0, 0, 0, pad)).view(B, H, n_blocks, block, K)  # (B, H, nb, b, K)
    k = F.pad(k, (0, 0, block, pad + block)).unfold(2, 3 * block, block)  # (B, H, nb, K, 3b)
    v = F.pad(v, (0, 0, block, pad + block)).unfold(2, 3 * block, block)  # (B, H, nb, Vd, 3b)
    scores = q @ k / math.sqrt(K)  # (B, H, nb, b, 3b)
    allowed = _band_mask(N, window, block, q.device)  # (nb, b, 3b)
    if key_mask is not None:
        keys = F.pad(key_mask, (block, pad + block)).unfold(1, 3 * block, block)  # (B, nb, 3b)
        allowed = allowed & keys[:, None, :, None, :]  # (B, 1, nb, b, 3b)
    weights = masked_softmax(scores, allowed)  # rows with no visible key -> zeros
    out = weights @ v.transpose(-1, -2)  # (B, H, nb, b, Vd)
    return out.reshape(B, H, n_blocks * block, -1)[:, :, :N]  # (B, H, N, Vd)
