"""gradhelper's master gradients: the tied weight's gradients go to its fp32 master in fp32."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from transformer import gradhelper, kernels, optim
from transformer.config import ModelConfig
from transformer.gradhelper import WeightGradHelper
from transformer.loss import chunked_label_smoothed_loss
from transformer.model import Transformer
from transformer.optim import MixedPrecisionAdam


def test_without_a_master_gradients_go_to_grad_as_autograds():
    weight = nn.Parameter(torch.randn(6, 3))
    ids = torch.tensor([1, 4, 1, 0])
    gradhelper.embedding(ids, weight).square().sum().backward()
    ref = nn.Parameter(weight.detach().clone())
    nn.functional.embedding(ids, ref).square().sum().backward()
    torch.testing.assert_close(weight.grad, ref.grad, rtol=0, atol=0)
    gradhelper.add_to_master(weight, torch.ones(2, 3), rows=torch.tensor([5, 5]))
    assert torch.equal(weight.grad[5], ref.grad[5] + 2)


def test_a_master_takes_the_rows_in_fp32_and_goes_with_its_owner():
    weight = nn.Parameter(torch.zeros(5, 2, dtype=torch.bfloat16))
    master = weight.detach().float().requires_grad_()
    gradhelper.set_master(weight, master)
    ids = torch.tensor([3, 1, 3])
    out = gradhelper.embedding(ids, weight)
    # rows 1 and 2^-8 at id 3: their sum 1 + 2^-8 is between two bf16 numbers (a bf16 sum
    # rounds it to 1), and exact in fp32
    out.backward(torch.tensor([[1.0, 1.0], [0.5, 0.5], [2**-8, 2**-8]]).bfloat16())
    assert weight.grad is None
    assert master.grad.dtype == torch.float32
    assert torch.equal(master.grad[3], torch.full((2,), 1 + 2**-8))
    assert torch.equal(master.grad[1], torch.full((2,), 0.5))
    assert torch.tensor(1 + 2**-8).bfloat16() == 1  # what a bf16 gradient would have held
    assert master.grad[[0, 2, 4]].abs().sum() == 0
    gradhelper.add_to_master(weight, torch.full((5, 2), 0.5))  # whole, fp32: added
    assert master.grad[0, 0] == 0.5
    del master
    gc.collect()  # the optimizer (the master's owner) is gone: back to weight.grad
    assert gradhelper.master_of(weight) is None
    gradhelper.embedding(ids, weight).sum().backward()
    assert weight.grad is not None and weight.grad[3, 0] == 2  # two rows of ones, in bf16


@pytest.mark.parametrize("grad_scale", [1.0, 0.25])
def test_the_losss_weight_gradient_reaches_the_master_unrounded(grad_scale):
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(50, 16).bfloat16())
    hidden = torch.randn(37, 16).bfloat16()
    target = torch.randint(0, 50, (37,))
    grads = []
    for with_master in (False, True):
        weight.grad = None
        master = weight.detach().float().requires_grad_()
        if with_master:
            gradhelper.set_master(weight, master)
        h = hidden.clone().requires_grad_()
        loss, _ = chunked_label_smoothed_loss(h, weight, target, 0.1, chunk_rows=8)
        (loss * grad_scale).backward()
        grads.append((h.grad, weight.grad, master.grad))
    (h_a, w_a, _), (h_b, w_b, m_b) = grads
    assert torch.equal(h_b, h_a)  # the path to the layers below is unchanged
    assert w_b is None and m_b.dtype == torch.float32
    assert torch.equal(m_b.bfloat16(), w_a)  # the same gradient, before its bf16 rounding
    assert not torch.equal(m_b, w_a.float())


def _model_and_batch(batch: int = 6, p_drop: float = 0.0):
    cfg = ModelConfig(vocab_size=40, n_layers=2, d_model=16, d_ff=32, n_heads=2, d_k=8, d_v=8,
                      p_drop=p_drop, max_len=32)  # fmt: skip
    torch.manual_seed(0)
    model = Transformer(cfg).train()
    for p in model.parameters():
        p.data = p.data.bfloat16()
    src = torch.randint(4, 40, (batch, 9))
    src[0, 6:] = 0
    tgt_in = torch.randint(4, 40, (batch, 7))
    keep = torch.ones(batch, 7, dtype=torch.bool)
    keep[0, 5:] = False
    return model, (src, src != 0, tgt_in, keep)


def _step_grads(model, batch, opt: MixedPrecisionAdam | None):
    src, src_mask, tgt_in, keep = batch
    model.zero_grad(set_to_none=True)
    hidden = model(src, src_mask, tgt_in, keep)
    loss, _ = chunked_label_smoothed_loss(hidden, model.output_weight(), tgt_in[keep], 0.1)
    loss.backward()
    gradhelper.finish()
    if opt is None:
        return {n: p.grad.float() for n, p in model.named_parameters()}
    opt.collect_grads()
    masters = dict(zip([id(p) for p in opt.params], opt.master_grads(), strict=True))
    return {n: masters[id(p)].clone() for n, p in model.named_parameters()}


def test_a_training_step_sends_the_tied_weight_to_its_master_and_nothing_else_changes():
    model, batch = _model_and_batch()
    plain = _step_grads(model, batch, None)
    opt = MixedPrecisionAdam(model.parameters(), (0.9, 0.98), 1e-9)
    tied = model.output_weight()
    assert tied is model.src_embed.weight and gradhelper.master_of(tied) is not None
    ours = _step_grads(model, batch, opt)
    assert tied.grad is None  # the loss's and both lookups' went to the master
    for name, g in plain.items():
        if name in ("src_embed.weight", "tgt_embed.weight"):
            # three parts summed in fp32, each unrounded: bf16's rounding apart
            torch.testing.assert_close(ours[name], g, rtol=1e-2, atol=1e-2 * g.abs().max().item())
            assert not torch.equal(ours[name], g)
        else:
            assert torch.equal(ours[name], g), name
    # two accumulated backward passes: twice one's (the master keeps adding)
    opt.zero_grad()
    src, src_mask, tgt_in, keep = batch
    for _ in range(2):
        hidden = model(src, src_mask, tgt_in, keep)
        loss, _ = chunked_label_smoothed_loss(hidden, tied, tgt_in[keep], 0.1)
        loss.backward()
        opt.collect_grads()
    twice = dict(zip([id(p) for p in opt.params], opt.master_grads(), strict=True))[id(tied)]
    torch.testing.assert_close(twice, 2 * ours["src_embed.weight"], rtol=1e-6, atol=1e-7)


def test_beside_a_busy_process_the_helpers_projection_gradient_goes_to_the_master_too(
    monkeypatch,
):
    # The helper keeps W^Q and W^KV apart (it adds each layer's gradients to its own weight);
    # so does the inline step here, so that the two differ by the helper's sums alone.
    monkeypatch.setattr(gradhelper, "stacked_linear", lambda x, layers: None)
    made = WeightGradHelper.for_this_process()
    assert made is not None, "this test machine has 2 or more CPUs: the helper must exist"
    model, batch = _model_and_batch()
    opt = MixedPrecisionAdam(model.parameters(), (0.9, 0.98), 1e-9)
    inline = _step_grads(model, batch, opt)
    opt.zero_grad()
    made.active = True
    try:
        deferred = _step_grads(model, batch, opt)
    finally:
        made.active = False
        made.discard()
    assert model.output_weight().grad is None
    for name, g in inline.items():
        torch.testing.assert_close(deferred[name], g, rtol=1e-2, atol=1e-2 * g.abs().max().item())


def test_a_second_backward_through_the_loss_says_where_the_gradient_went():
    weight = nn.Parameter(torch.randn(20, 8).bfloat16())
    master = weight.detach().float().requires_grad_()
    gradhelper.set_master(weight, master)
    hidden = torch.randn(5, 8).bfloat16().requires_grad_()
    loss, _ = chunked_label_smoothed_loss(hidden, weight, torch.randint(0, 20, (5,)), 0.1)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="went to its master: one backward"):
        loss.backward()


def _train(one_pass: bool, monkeypatch, dtype: str, clip_norm: float = 0.0):
    """Three optimizer steps of the tiny model (the second over two accumulated batches, one
    with a parameter that gets no gradient), one-pass or with torch's passes; the model's
    parameters, the masters, Adam's state and the norms after."""
    monkeypatch.setattr(optim, "one_pass_adam", lambda: one_pass and optim._one_pass_agrees())
    model, batch = _model_and_batch()
    if dtype == "fp32":
        for p in model.parameters():
            p.data = p.data.float()
    opt = MixedPrecisionAdam(model.parameters(), (0.9, 0.98), 1e-9)
    src, src_mask, tgt_in, keep = batch
    norms = []
    for step, batches in enumerate((1, 2, 1)):
        for b in range(batches):
            hidden = model(src[b:], src_mask[b:], tgt_in[b:], keep[b:])
            loss, _ = chunked_label_smoothed_loss(
                hidden, model.output_weight(), tgt_in[b:][keep[b:]], 0.1
            )
            loss.backward()
            gradhelper.finish()
            if step == 1 and b == 1:
                model.encoder_layers[0].ffn.w_1.bias.grad = None  # no gradient this step
            opt.collect_grads()
        norms.append(opt.step(1e-3 * (step + 1), 1 / 37, clip_norm))
    state = [t for s in opt.adam.state for t in (s["exp_avg"], s["exp_avg_sq"], s["step"])]
    return [p.detach().clone() for p in model.parameters()], opt.masters, state, norms


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_one_pass_steps_are_torchs_passes_bit_for_bit(monkeypatch, dtype):
    # optim.one_pass_adam: the held bf16 gradients read as they are, the fp32 master gradient
    # of the tied weight beside them, accumulation over two batches settled in fp32 first, a
    # parameter without a gradient: the same parameters, masters and moments as torch's five
    # passes; the norms the same to fp32's rounding (summed in fp64).
    if not optim.one_pass_adam():
        assert not kernels.fused_supported()  # only a CPU without AVX-512 steps torch's way
        return
    ours = _train(True, monkeypatch, dtype)
    theirs = _train(False, monkeypatch, dtype)
    for a, b in zip(
        (*ours[0], *ours[1], *ours[2]), (*theirs[0], *theirs[1], *theirs[2]), strict=True
    ):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert ours[3] == pytest.approx(theirs[3], rel=1e-6)
    # clipping: the factor comes from the fp64 norm, so the bits may differ, not the values
    clipped = _train(True, monkeypatch, dtype, clip_norm=1e-3)
    reference = _train(False, monkeypatch, dtype, clip_norm=1e-3)
    assert clipped[3] == pytest.approx(reference[3], rel=1e-6) and clipped[3][0] > 1e-3
    for a, b in zip(clipped[1], reference[1], strict=True):
        # a master a last bit apart can round its bf16 parameter the other way, and the next
        # steps' gradients with it: apart by far less than a step (lr 1e-3 to 3e-3)
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)


def test_the_one_pass_check_refuses_a_kernel_that_differs(monkeypatch):
    if not kernels.fused_supported():
        assert not optim.one_pass_adam()
        return
    real = kernels.adam_update
    monkeypatch.setattr(
        kernels, "adam_update", lambda *a, **k: real(*a[:6], a[6] * 1.0001, *a[7:], **k)
    )
    assert not optim._one_pass_agrees.__wrapped__()  # uncached: the check itself
    monkeypatch.setattr(kernels, "adam_update", real)
    assert optim._one_pass_agrees.__wrapped__()
    monkeypatch.setattr(kernels, "FUSED", False)  # TRANSFORMER_FUSED_KERNELS=0
    assert not optim.one_pass_adam()


@pytest.mark.parametrize("one_pass", [True, False])
def test_a_column_major_gradient_updates_its_parameter_as_torch_adam(monkeypatch, one_pass):
    # torch 2.13's CPU `_fused_adam_` reads a gradient's storage in order whatever its strides:
    # a column-major gradient updated its parameter transposed. Both of our ways make it
    # contiguous first: the result of torch.optim.Adam's plain for-loop. (Without AVX-512, as
    # on a Zen 3, the one pass does not run: both ways are torch's.)
    real = optim.one_pass_adam
    monkeypatch.setattr(optim, "one_pass_adam", lambda: one_pass and real())
    torch.manual_seed(0)
    start, g = torch.randn(4, 6), torch.randn(4, 6)
    w = nn.Parameter(start.clone())
    opt = MixedPrecisionAdam([w], (0.9, 0.98), 1e-9)
    w.grad = g.t().contiguous().t()
    opt.collect_grads()
    opt.step(1e-3, 0.5)
    ref = nn.Parameter(start.clone())
    plain = torch.optim.Adam([ref], lr=1e-3, betas=(0.9, 0.98), eps=1e-9, foreach=False)
    ref.grad = g * 0.5
    plain.step()
    torch.testing.assert_close(w.detach(), ref.detach(), rtol=0, atol=1e-7)


@pytest.mark.parametrize("p_drop", [0.0, 0.1])
def test_the_packed_embedding_in_one_pass_has_the_ops_bits_both_ways(p_drop, monkeypatch):
    # model._embed_packed through gradhelper.MasterEmbeddingSum (kernels.embed) against its
    # torch ops (the lookup, * sqrt(d), + positions, dropout's _KeepScale): the same hidden
    # states, the same gradients in every master, the same draws from torch's generator.
    from transformer import model as model_module

    model, batch = _model_and_batch(p_drop=p_drop)
    opt = MixedPrecisionAdam(model.parameters(), (0.9, 0.98), 1e-9)
    fused = model_module._fused_embedding
    taken, runs = [], []
    for fn in (lambda w, pos: taken.append(fused(w, pos)) or taken[-1], lambda w, pos: False):
        monkeypatch.setattr(model_module, "_fused_embedding", fn)
        torch.manual_seed(3)
        grads = _step_grads(model, batch, opt)
        runs.append((grads, torch.rand(4)))
        opt.zero_grad()
    assert taken == [kernels.fused_supported()] * 2  # the source's and the target's
    (ours, after_ours), (ops, after_ops) = runs
    assert torch.equal(after_ours, after_ops)  # the same draws
    for name, g in ops.items():
        assert torch.equal(ours[name], g), name


def test_the_packed_embeddings_gradient_without_its_master_goes_to_the_weight(monkeypatch):
    # The optimizer (and with it the master) gone between forward and backward: the lookup's
    # gradient goes to the weight's .grad as the ops' own backward sends it.
    from transformer import model as model_module

    out = []
    for fused in (True, False):
        model, (src, src_mask, tgt_in, keep) = _model_and_batch(p_drop=0.1)
        opt = MixedPrecisionAdam(model.parameters(), (0.9, 0.98), 1e-9)
        taken = fused and kernels.fused_supported()
        monkeypatch.setattr(model_module, "_fused_embedding", lambda w, pos, f=taken: f)
        torch.manual_seed(3)
        hidden = model(src, src_mask, tgt_in, keep)
        del opt
        gc.collect()
        assert gradhelper.master_of(model.src_embed.weight) is None
        hidden.float().sum().backward()
        out.append(model.src_embed.weight.grad)
    assert out[0] is not None and torch.equal(out[0], out[1])
