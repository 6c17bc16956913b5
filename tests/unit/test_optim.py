"""§5.3 eq. (3) schedule and Adam over fp32 master weights."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from transformer.optim import FusedAdam, MixedPrecisionAdam, cooldown_factor, learning_rate


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


def _collect_once(device: str, batched: bool | None = None) -> tuple[list, list]:
    """A bf16 model's first gradients of a step and the masters' after collect_grads (batched:
    the multi-tensor copy or per tensor; None: the device's way); one parameter without a
    gradient, one weight's gradient not contiguous."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 4)).to(device, torch.bfloat16)
    model[1].bias.requires_grad_(False)  # not among the optimizer's parameters
    unused = nn.Parameter(torch.ones(3, device=device, dtype=torch.bfloat16))
    opt = MixedPrecisionAdam([*model.parameters(), unused], (0.9, 0.98), 1e-9)
    assert opt.batched_copies == (device == "cuda")  # CPU: one at a time (peak memory)
    if batched is not None:
        opt.batched_copies = batched
    model(torch.randn(7, 6, device=device, dtype=torch.bfloat16)).float().square().sum().backward()
    model[0].weight.grad = model[0].weight.grad.t().contiguous().t()  # column-major
    grads = [None if p.grad is None else p.grad.clone() for p in opt.params]
    opt.collect_grads()
    return grads, [m.grad for m in opt.masters], opt


@pytest.mark.parametrize("batched", [None, True, False])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_bf16_first_gradients_become_exact_fp32_masters(device, batched):
    # collect_grads copies a step's first gradients per tensor or as one multi-tensor copy
    # (CUDA's way): either way each master's gradient is its parameter's, exactly (bf16 ->
    # fp32), in a tensor of its own; a parameter without a gradient leaves its master's None;
    # the model's gradients are dropped.
    grads, masters, opt = _collect_once(device, batched)
    if any(h is not None for h in opt.held):
        # CPU with one-pass steps (optim.one_pass_adam): the bf16 gradients are held as they
        # are until the step reads them; master_grads() makes the fp32 copies when asked.
        assert device == "cpu" and all(m is None for m in masters)
        assert opt.held[-1] is None
        assert all(
            h is g0 or torch.equal(h, g0) for h, g0 in zip(opt.held[:-1], grads[:-1], strict=True)
        )
        masters = opt.master_grads()
        assert torch.equal(masters[-1], torch.zeros(3)) and all(h is None for h in opt.held)
        masters[-1] = None
    assert grads[-1] is None and masters[-1] is None
    for g, m in zip(grads[:-1], masters[:-1], strict=True):
        assert m.dtype == torch.float32 and m.shape == g.shape
        assert torch.equal(m, g.float())
    assert len({m.data_ptr() for m in masters[:-1]}) == len(masters) - 1
    assert all(p.grad is None for p in opt.params)


def test_grad_scale_and_clipping():
    w = nn.Parameter(torch.zeros(2))
    opt = MixedPrecisionAdam([w], (0.9, 0.98), 1e-9)
    w.grad = torch.tensor([30.0, 40.0])
    norm = opt.step(0.0, grad_scale=0.1, clip_norm=1.0)
    assert norm == pytest.approx(5.0)  # 0.1 * |(30, 40)| = 5, reported before clipping
    exp_avg = opt.adam.state[0]["exp_avg"]
    # Clipped to norm 1: (0.6, 0.8); m = (1 - 0.9) * g.
    torch.testing.assert_close(exp_avg, 0.1 * torch.tensor([0.6, 0.8]), rtol=1e-5, atol=0)


def test_nonfinite_gradient_skips_step():
    w = nn.Parameter(torch.ones(2))
    opt = MixedPrecisionAdam([w], (0.9, 0.98), 1e-9)
    w.grad = torch.tensor([1.0, math.inf])
    assert not math.isfinite(opt.step(0.1))
    assert torch.equal(w.detach(), torch.ones(2)) and w.grad is None
    assert not any(opt.adam.state)  # Adam never ran


def test_master_state_roundtrip():
    model = _linear(torch.bfloat16)
    opt = MixedPrecisionAdam(model.parameters(), (0.9, 0.98), 1e-9)
    state = opt.master_state(model)
    assert all(t.dtype == torch.float32 for t in state.values())
    state = {k: v + 1e-4 for k, v in state.items()}  # below bf16 resolution near 1
    opt.load_master_state(model, state)
    torch.testing.assert_close(opt.master_state(model), state, rtol=0, atol=0)
    assert next(model.parameters()).dtype == torch.bfloat16


def _adam_pair(seed: int = 0):
    """Two copies of the same three tensors, and a generator for their gradients."""
    g = torch.Generator().manual_seed(seed)
    ours = [torch.randn(s, generator=g) for s in ((7, 5), (5,), (3, 3, 2))]
    return ours, [t.clone() for t in ours], g


def _same_grads(ours, theirs, g, skip=None):
    for i, (o, t) in enumerate(zip(ours, theirs, strict=True)):
        o.grad = None if i == skip else torch.randn(o.shape, generator=g)
        t.grad = None if o.grad is None else o.grad.clone()


def _torch_step(opt: torch.optim.Adam, lr: float) -> None:
    for group in opt.param_groups:
        group["lr"] = lr
    opt.step()


def test_fused_adam_is_torch_adam_fused_bit_for_bit_and_shares_its_state_dict():
    ours, theirs, g = _adam_pair()
    mine = FusedAdam(ours, (0.9, 0.98), 1e-9)
    ref = torch.optim.Adam(theirs, lr=0.0, betas=(0.9, 0.98), eps=1e-9, fused=True)
    for step, lr in enumerate((1e-3, 5e-3, 0.0, 2e-2, 7e-4)):
        # a parameter without gradients in the first steps: no state, no update, as in torch
        _same_grads(ours, theirs, g, skip=1 if step < 2 else None)
        mine.step(lr)
        _torch_step(ref, lr)
        assert all(torch.equal(o, t) for o, t in zip(ours, theirs, strict=True)), step
    a, b = mine.state_dict(), ref.state_dict()
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        for key in ("step", "exp_avg", "exp_avg_sq"):
            x, y = a["state"][i][key], b["state"][i][key]
            assert x.dtype == y.dtype and torch.equal(x, y), (i, key)


def test_fused_adam_resumes_from_torch_adams_state_and_torch_adam_from_its_own():
    ours, theirs, g = _adam_pair(1)
    ref = torch.optim.Adam(theirs, lr=0.0, betas=(0.9, 0.98), eps=1e-9, fused=True)
    for _ in range(3):
        _same_grads(ours, theirs, g)
        _torch_step(ref, 1e-2)
    for o, t in zip(ours, theirs, strict=True):
        o.copy_(t)
    mine = FusedAdam(ours, (0.5, 0.5), 1.0)  # hyperparameters come from the state, as in torch
    mine.load_state_dict(copy.deepcopy(ref.state_dict()))  # (a checkpoint's own tensors)
    assert mine.betas == (0.9, 0.98) and mine.eps == 1e-9
    for _ in range(2):
        _same_grads(ours, theirs, g)
        mine.step(3e-3)
        _torch_step(ref, 3e-3)
    assert all(torch.equal(o, t) for o, t in zip(ours, theirs, strict=True))
    copies = [o.clone() for o in ours]
    again = torch.optim.Adam(copies, lr=0.0, fused=True)
    again.load_state_dict(copy.deepcopy(mine.state_dict()))  # and the other way
    _same_grads(ours, copies, g)
    mine.step(1e-3)
    _torch_step(again, 1e-3)
    assert all(torch.equal(o, c) for o, c in zip(ours, copies, strict=True))


def test_fused_adam_refuses_a_state_of_other_parameters():
    ours, _, g = _adam_pair()
    other = FusedAdam([torch.zeros(2)], (0.9, 0.98), 1e-9)
    other.params[0].grad = torch.ones(2)
    other.step(1e-3)
    mine = FusedAdam(ours, (0.9, 0.98), 1e-9)
    with pytest.raises(ValueError, match="1 parameters, the model has 3"):
        mine.load_state_dict(other.state_dict())
    state = FusedAdam(ours, (0.9, 0.98), 1e-9)
    _same_grads(ours, [t.clone() for t in ours], g)
    state.step(1e-3)
    saved = state.state_dict()
    saved["state"][1]["exp_avg"] = torch.zeros(6)
    with pytest.raises(ValueError, match=r"parameter 1's exp_avg has shape \(6,\), the param"):
        mine.load_state_dict(saved)


def test_fused_adam_reserved_moments_are_taken_at_each_first_gradient_bit_for_bit():
    ours, theirs, g = _adam_pair(2)
    mine = FusedAdam(ours, (0.9, 0.98), 1e-9)
    mine.reserve()
    made = [pair[0].data_ptr() for pair in mine.reserved]
    ref = torch.optim.Adam(theirs, lr=0.0, betas=(0.9, 0.98), eps=1e-9, fused=True)
    assert mine.state_dict()["state"] == {}  # nothing in the state before a gradient
    for step, lr in enumerate((1e-3, 5e-3, 2e-2)):
        _same_grads(ours, theirs, g, skip=1 if step < 2 else None)
        mine.step(lr)
        _torch_step(ref, lr)
        assert all(torch.equal(o, t) for o, t in zip(ours, theirs, strict=True)), step
        # the state appears at each parameter's first gradient, as torch's does
        assert mine.state_dict()["state"].keys() == ref.state_dict()["state"].keys(), step
        assert (mine.reserved[1] is None) == (step == 2), step
    # each parameter's moments are the memory made by `reserve`, not a second allocation
    assert [s["exp_avg"].data_ptr() for s in mine.state] == made
    a, b = mine.state_dict(), ref.state_dict()
    for i in a["state"]:
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(a["state"][i][key], b["state"][i][key]), (i, key)


def test_fused_adam_drops_its_reserve_on_load_and_keeps_made_state():
    ours, theirs, g = _adam_pair(3)
    ref = torch.optim.Adam(theirs, lr=0.0, betas=(0.9, 0.98), eps=1e-9, fused=True)
    _same_grads(ours, theirs, g, skip=2)
    _torch_step(ref, 1e-2)
    mine = FusedAdam(ours, (0.9, 0.98), 1e-9)
    mine.reserve()
    mine.load_state_dict(copy.deepcopy(ref.state_dict()))
    assert mine.reserved == [None, None, None]  # a resume holds no second set of moments
    mine.reserve()  # after a resume: only the parameter without saved state gets moments
    assert [r is None for r in mine.reserved] == [True, True, False]
    saved = mine.state[0]["exp_avg"]
    mine.reserve()  # made state is not touched
    assert mine.state[0]["exp_avg"] is saved


def test_mixed_precision_adam_reserve_state_gives_the_same_bits():
    models = [_linear(torch.bfloat16) for _ in range(2)]  # the same seed: the same weights
    opts = [MixedPrecisionAdam(m.parameters(), (0.9, 0.98), 1e-9) for m in models]
    opts[1].reserve_state()
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1)).bfloat16()
    for step in range(3):
        for m, o in zip(models, opts, strict=True):
            m(x).float().square().sum().backward()
            o.collect_grads()
            o.step(1e-2 * (step + 1), grad_scale=0.25)
    assert all(r is None for r in opts[1].adam.reserved)  # each pair taken by the first step
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(opts[0].adam.state, opts[1].adam.state, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in ("step", "exp_avg", "exp_avg_sq"))


def test_training_does_not_import_torch_dynamo():
    """torch.optim's wrappers and torch.use_deterministic_algorithms import torch._dynamo (~2 s
    of every training process's start on a 2-core CPU): `FusedAdam`, `train.set_deterministic`."""
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from transformer.optim import MixedPrecisionAdam\n"
        "from transformer.train import set_deterministic\n"
        "set_deterministic(True)\n"
        "w = torch.nn.Parameter(torch.ones(3)); opt = MixedPrecisionAdam([w], (0.9, 0.98), 1e-9)\n"
        "w.grad = torch.ones(3); opt.step(1e-3); opt.load_state_dict(opt.state_dict())\n"
        "assert torch.are_deterministic_algorithms_enabled()\n"
        "set_deterministic(False)\n"
        "print('torch._dynamo' in sys.modules, 'torch._inductor' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False False", out.stderr
