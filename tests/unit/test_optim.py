"""§5.3 eq. (3) schedule and Adam over fp32 master weights."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from transformer.optim import MixedPrecisionAdam, cooldown_factor, learning_rate


def test_lr_at_warmup_end_for_base():
    # §5.3: 512^-0.5 * 4000^-0.5 = 6.9877e-4 ("about 6.99e-4", SPEC.md).
    assert learning_rate(4000, 512, 4000) == pytest.approx(6.9877e-4, rel=1e-4)


def test_lr_warmup_is_linear_then_inverse_sqrt():
    d, w = 512, 4000
    assert learning_rate(1, d, w) == pytest.approx(d**-0.5 * w**-1.5)
    assert learning_rate(2000, d, w) == pytest.approx(learning_rate(4000, d, w) / 2)
    assert learning_rate(16000, d, w) == pytest.approx(learning_rate(4000, d, w) / 2)
    assert learning_rate(0, d, w) == learning_rate(1, d, w)


def test_cooldown_falls_linearly_to_zero_over_the_last_fraction():
    assert [cooldown_factor(p, 0.2) for p in (0.0, 0.8, 0.9, 0.95, 1.0, 1.3)] == pytest.approx(
        [1.0, 1.0, 0.5, 0.25, 0.0, 0.0]
    )
    assert cooldown_factor(0.999, 0.0) == 1.0  # off: eq. (3) as it is
    assert cooldown_factor(0.25, 1.0) == pytest.approx(0.75)


def test_lr_scale_multiplies():
    assert learning_rate(100, 256, 800, scale=2.0) == pytest.approx(
        2 * learning_rate(100, 256, 800)
    )


def _linear(dtype):
    torch.manual_seed(0)
    return nn.Linear(4, 3).to(dtype)


def test_fp32_is_plain_adam():
    a, b = _linear(torch.float32), _linear(torch.float32)
    ours = MixedPrecisionAdam(a.parameters(), (0.9, 0.98), 1e-9)
    ref = torch.optim.Adam(b.parameters(), lr=1e-2, betas=(0.9, 0.98), eps=1e-9)
    assert not ours.mixed
    for _ in range(3):
        x = torch.randn(5, 4)
        a(x).square().sum().backward()
        ours.collect_grads()
        ours.step(1e-2)
        b(x).square().sum().backward()
        ref.step()
        ref.zero_grad()
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q)


def test_first_adam_step_is_lr_times_sign():
    # Adam's first update is lr * m / (sqrt(v) + eps) = lr * g / |g| (bias-corrected), by hand.
    w = nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    opt = MixedPrecisionAdam([w], (0.9, 0.98), 1e-9)
    w.grad = torch.tensor([0.5, -4.0, 0.0])
    opt.step(0.1)
    torch.testing.assert_close(w.detach(), torch.tensor([0.9, -1.9, 3.0]))


def test_bf16_keeps_fp32_masters_and_sums_accumulation_in_fp32():
    model = _linear(torch.bfloat16)
    opt = MixedPrecisionAdam(model.parameters(), (0.9, 0.98), 1e-9)
    assert opt.mixed and all(m.dtype == torch.float32 for m in opt.masters)
    x = torch.randn(5, 4, dtype=torch.bfloat16)
    grads = []
    for _ in range(2):
        model(x).float().square().sum().backward()
        grads.append([p.grad.float() for p in model.parameters()])
        opt.collect_grads()
        assert all(p.grad is None for p in model.parameters())
    for m, g1, g2 in zip(opt.masters, grads[0], grads[1], strict=True):
        torch.testing.assert_close(m.grad, g1 + g2)
    before = [m.detach().clone() for m in opt.masters]
    opt.step(1e-3)
    for p, m, b in zip(model.parameters(), opt.masters, before, strict=True):
        assert p.dtype == torch.bfloat16
        assert torch.equal(p.detach(), m.detach().bfloat16())  # model = rounded masters
        # A step far below bf16 resolution still moves the fp32 master.
        assert not torch.equal(m, b)
        assert (m - b).abs().max() < 2e-3


def test_grad_scale_and_clipping():
    w = nn.Parameter(torch.zeros(2))
    opt = MixedPrecisionAdam([w], (0.9, 0.98), 1e-9)
    w.grad = torch.tensor([30.0, 40.0])
    norm = opt.step(0.0, grad_scale=0.1, clip_norm=1.0)
    assert norm == pytest.approx(5.0)  # 0.1 * |(30, 40)| = 5, reported before clipping
    exp_avg = opt.adam.state[w]["exp_avg"]
    # Clipped to norm 1: (0.6, 0.8); m = (1 - 0.9) * g.
    torch.testing.assert_close(exp_avg, 0.1 * torch.tensor([0.6, 0.8]), rtol=1e-5, atol=0)


def test_nonfinite_gradient_skips_step():
    w = nn.Parameter(torch.ones(2))
    opt = MixedPrecisionAdam([w], (0.9, 0.98), 1e-9)
    w.grad = torch.tensor([1.0, math.inf])
    assert not math.isfinite(opt.step(0.1))
    assert torch.equal(w.detach(), torch.ones(2)) and w.grad is None
    assert not opt.adam.state  # Adam never ran


def test_master_state_roundtrip():
    model = _linear(torch.bfloat16)
    opt = MixedPrecisionAdam(model.parameters(), (0.9, 0.98), 1e-9)
    state = opt.master_state(model)
    assert all(t.dtype == torch.float32 for t in state.values())
    state = {k: v + 1e-4 for k, v in state.items()}  # below bf16 resolution near 1
    opt.load_master_state(model, state)
    torch.testing.assert_close(opt.master_state(model), state, rtol=0, atol=0)
    assert next(model.parameters()).dtype == torch.bfloat16
