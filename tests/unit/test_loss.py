"""§5.4 label-smoothed cross-entropy: hand-computed values, padding, chunked == reference."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from transformer import gradhelper, kernels
from transformer import loss as loss_module
from transformer.loss import (
    chunked_label_smoothed_loss,
    label_smoothed_cross_entropy,
    smoothed_target_loss,
)
from transformer.tokenizer import PAD_ID


def test_hand_computed_value():
    # probs (0.25, 0.5, 0.25), target 1, eps 0.1, V = 3: q = (0.05, 0.9, 0.05), so
    # loss = 0.9 ln 2 + 0.05 ln 4 + 0.05 ln 4 = 0.9 ln 2 + 0.1 ln 4 (worked out by hand).
    logits = torch.log(torch.tensor([[0.25, 0.5, 0.25]]))
    loss, nll = label_smoothed_cross_entropy(logits, torch.tensor([1]), eps=0.1, ignore_index=-1)
    assert loss.item() == pytest.approx(0.9 * math.log(2) + 0.1 * math.log(4), rel=1e-6)
    assert nll.item() == pytest.approx(math.log(2), rel=1e-6)


def test_uniform_logits_give_log_v_whatever_eps():
    # q sums to one, p is uniform: -sum q log(1/V) = log V for every eps.
    logits = torch.zeros(2, 5)
    for eps in (0.0, 0.1, 0.5):
        loss, _ = label_smoothed_cross_entropy(logits, torch.tensor([1, 4]), eps)
        assert loss.item() == pytest.approx(2 * math.log(5), rel=1e-6)


def test_padding_is_excluded():
    logits = torch.randn(2, 4, 7)
    target = torch.tensor([[4, 5, PAD_ID, PAD_ID], [6, 4, 5, PAD_ID]])
    loss, nll = label_smoothed_cross_entropy(logits, target, 0.1)
    keep = target != PAD_ID
    ref_loss, ref_nll = label_smoothed_cross_entropy(logits[keep], target[keep], 0.1)
    assert torch.equal(loss, ref_loss) and torch.equal(nll, ref_nll)
    changed = logits.clone()
    changed[~keep] = 100.0  # garbage at padded positions changes nothing
    assert torch.equal(label_smoothed_cross_entropy(changed, target, 0.1)[0], loss)


def test_eps_zero_is_cross_entropy():
    logits, target = torch.randn(6, 9), torch.randint(1, 9, (6,))
    loss, nll = label_smoothed_cross_entropy(logits, target, 0.0)
    ref = F.cross_entropy(logits, target, reduction="sum")
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(nll, ref)


def test_v_minus_1_denominator_vs_pytorch_builtin():
    # PyTorch spreads eps over all V classes; ours (tensor2tensor, fairseq) over the V - 1
    # non-target classes. They coincide when eps_torch = eps * V / (V - 1).
    V, eps = 9, 0.1
    logits, target = torch.randn(6, V), torch.randint(1, V, (6,))
    ours, _ = label_smoothed_cross_entropy(logits, target, eps, ignore_index=-1)
    torch_ls = F.cross_entropy(logits, target, label_smoothing=eps * V / (V - 1), reduction="sum")
    torch.testing.assert_close(ours, torch_ls)
    plain_torch = F.cross_entropy(logits, target, label_smoothing=eps, reduction="sum")
    assert not torch.allclose(ours, plain_torch)


def test_smoothed_target_loss_is_minimal_at_q():
    # The loss -sum q log p is minimized by p = q (Gibbs' inequality).
    V, eps = 5, 0.2
    q = torch.full((V,), eps / (V - 1))
    q[2] = 1 - eps
    at_q = smoothed_target_loss(q.log()[None], torch.tensor([2]), eps)
    other = smoothed_target_loss(torch.log_softmax(torch.randn(1, V), -1), torch.tensor([2]), eps)
    assert at_q.item() < other.item()


def _reference(hidden, weight, target, eps):
    return label_smoothed_cross_entropy(hidden @ weight.t(), target, eps, ignore_index=-1)


@pytest.mark.parametrize("rows", [10, 3, 1])  # the last chunk padded with 2, 1 and 3 zero rows
@pytest.mark.parametrize("chunk_rows", [3, 4, 7, 1024])
def test_chunked_equals_reference_with_gradients(chunk_rows, rows):
    torch.manual_seed(0)
    hidden = torch.randn(rows, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(13, 8, dtype=torch.float64, requires_grad=True)
    target = torch.randint(1, 13, (rows,))
    loss, nll = chunked_label_smoothed_loss(hidden, weight, target, 0.1, chunk_rows)
    (2.0 * loss).backward()
    g_h, g_w = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    ref_loss, ref_nll = _reference(hidden, weight, target, 0.1)
    (2.0 * ref_loss).backward()
    torch.testing.assert_close(loss, ref_loss.float())
    torch.testing.assert_close(nll, ref_nll.float())
    # The chunked loss runs its log-softmax in fp32 whatever the input dtype.
    torch.testing.assert_close(g_h, hidden.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g_w, weight.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 3, 4, 10, 3826, 4097])
@pytest.mark.parametrize("chunk_rows", [3, 4, 7, 2048])
def test_chunks_tile_the_rows_in_multiples_of_four_but_the_last(rows, chunk_rows):
    # The n % 4 rows left over join the last chunk (padded there), not a chunk of their own.
    bounds = loss_module._chunks(rows, chunk_rows)
    assert bounds[0][0] == 0 and bounds[-1][1] == rows
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
    assert all((stop - start) % 4 == 0 for start, stop in bounds[:-1])
    assert bounds[-1][1] - bounds[-1][0] >= min(rows, 4)
    assert max(stop - start for start, stop in bounds) <= -(-chunk_rows // 4) * 4 + 3


class _LogitBlocks(TorchDispatchMode):
    """Keeps every (n > 1, V) tensor an op makes (so none is freed and its memory reused)."""

    def __init__(self, n_classes: int, weight: torch.Tensor) -> None:
        super().__init__()
        self.n_classes, self.weight, self.kept = n_classes, weight.untyped_storage(), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            shaped = isinstance(t, torch.Tensor) and t.dim() == 2 and t.size(0) > 1
            if shaped and t.size(1) == self.n_classes:
                if t.untyped_storage().data_ptr() != self.weight.data_ptr():  # not W^T
                    self.kept.append(t)
        return out

    def storages(self) -> int:
        return len({t.untyped_storage().data_ptr() for t in self.kept})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_logits_of_every_chunk_in_one_block(dtype):
    # One (n, V) block made once for all chunks (the last one shorter), not one per chunk: a
    # block freed and made again could land above the last (W3's peak, +1 block).
    kernels.unavailable()  # the library loaded (and its first-load checks run) before watching
    torch.manual_seed(0)
    hidden = torch.randn(40, 8).to(dtype).requires_grad_(True)
    weight = torch.randn(64, 8).to(dtype).requires_grad_(True)
    target = torch.randint(1, 64, (40,))
    blocks = _LogitBlocks(64, weight)
    with blocks:
        loss, _ = chunked_label_smoothed_loss(hidden, weight, target, 0.1, 16)  # 16 + 16 + 8
    assert {tuple(t.shape) for t in blocks.kept} >= {(16, 64), (8, 64)}
    assert blocks.storages() == 1
    ref, _ = _reference(hidden.detach().double(), weight.detach().double(), target, 0.1)
    torch.testing.assert_close(
        loss, ref.float(), rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=0.0
    )


def test_chunked_bf16_close_to_fp32():
    torch.manual_seed(0)
    hidden, weight = torch.randn(64, 32), torch.randn(50, 32) * 0.2
    target = torch.randint(1, 50, (64,))
    ref, _ = _reference(hidden, weight, target, 0.1)
    got, _ = chunked_label_smoothed_loss(hidden.bfloat16(), weight.bfloat16(), target, 0.1, 16)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=1e-2, atol=0.0)


def test_chunked_without_grad_and_nll_not_differentiable():
    hidden, weight = torch.randn(4, 6), torch.randn(7, 6, requires_grad=True)
    loss, nll = chunked_label_smoothed_loss(hidden, weight, torch.tensor([1, 2, 3, 4]), 0.1)
    assert loss.requires_grad and not nll.requires_grad
    with torch.no_grad():
        loss2, _ = chunked_label_smoothed_loss(hidden, weight, torch.tensor([1, 2, 3, 4]), 0.1)
    torch.testing.assert_close(loss2, loss.detach())


def test_chunked_target_probability_below_float_range():
    # The target's logit is 300 below the best one: its probability (e^-300) underflows fp32,
    # so the loss must come from log-sum-exp of the logits, not from the softmax.
    hidden = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    weight = torch.tensor([[300.0, 0.0], [0.0, 0.0], [0.0, 2.0]])
    target = torch.tensor([1, 2])
    loss, nll = chunked_label_smoothed_loss(hidden, weight, target, 0.1)
    ref_loss, ref_nll = _reference(hidden.double(), weight.double(), target, 0.1)
    assert 299.0 < float(nll) < 301.0  # row 0 alone: -log p = 300 + log(1 + 2e^-300) ≈ 300
    torch.testing.assert_close(loss, ref_loss.float())
    torch.testing.assert_close(nll, ref_nll.float())


@pytest.mark.parametrize("row_major", [False, True])
def test_chunked_bf16_gradients_close_to_fp64_reference(row_major, monkeypatch):
    # bf16 inputs: the softmax is kept in bf16 and the smoothed target q is applied to the
    # (N, D) and (V, D) products in fp32; gradients agree with fp64 to bf16 precision. On AMX
    # the (V, D) sum is taken as (D, V) = h^T probs from a row-major copy of h^T
    # (gradhelper.row_major_grads); forced both ways here, whatever this CPU is.
    monkeypatch.setattr(gradhelper, "ROW_MAJOR_GRADS", row_major)
    monkeypatch.setattr(gradhelper, "ROW_MAJOR_ROWS", 0)  # 40 rows
    torch.manual_seed(0)
    hidden = torch.randn(40, 16, dtype=torch.float64, requires_grad=True)
    weight = (torch.randn(30, 16, dtype=torch.float64) * 0.3).requires_grad_(True)
    target = torch.randint(1, 30, (40,))
    ref_loss, _ = _reference(hidden, weight, target, 0.1)
    ref_loss.backward()
    h16 = hidden.detach().bfloat16().requires_grad_(True)
    w16 = weight.detach().bfloat16().requires_grad_(True)
    loss, _ = chunked_label_smoothed_loss(h16, w16, target, 0.1, 16)  # 3 chunks summed
    loss.backward()
    for got, ref in ((h16.grad, hidden.grad), (w16.grad, weight.grad)):
        assert float((got.double() - ref).norm() / ref.norm()) < 2e-2


def test_chunked_bf16_row_major_sum_is_the_same_loss_and_hidden_gradient(monkeypatch):
    torch.manual_seed(0)
    hidden = torch.randn(50, 24).bfloat16()
    weight = (torch.randn(40, 24) * 0.3).bfloat16()
    target = torch.randint(1, 40, (50,))
    out = []
    monkeypatch.setattr(gradhelper, "ROW_MAJOR_ROWS", 0)  # 50 rows
    for row_major in (False, True):
        monkeypatch.setattr(gradhelper, "ROW_MAJOR_GRADS", row_major)
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        loss, _ = chunked_label_smoothed_loss(h, w, target, 0.1, 16)
        loss.backward()
        out.append((loss, h.grad, w.grad))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])
    torch.testing.assert_close(out[0][2].float(), out[1][2].float(), rtol=2e-2, atol=1e-2)


@pytest.mark.gpu
def test_chunked_on_cuda_equals_cpu():
    # The GPU path (benchmarks/bench_gpu.py) runs the same chunked loss with CUDA kernels.
    torch.manual_seed(0)
    hidden = torch.randn(50, 16, requires_grad=True)
    weight = (torch.randn(30, 16) * 0.3).requires_grad_(True)
    target = torch.randint(1, 30, (50,))
    loss, _ = chunked_label_smoothed_loss(hidden, weight, target, 0.1, 16)
    loss.backward()
    h, w = (t.detach().cuda().requires_grad_(True) for t in (hidden, weight))
    got, _ = chunked_label_smoothed_loss(h, w, target.cuda(), 0.1, 16)
    got.backward()
    torch.testing.assert_close(got.cpu(), loss)
    torch.testing.assert_close(h.grad.cpu(), hidden.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(w.grad.cpu(), weight.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("grad", [True, False])  # training, and validation's loss
def test_chunked_holds_one_vocabulary_block_at_a_time(grad):
    # Memory: a chunk's softmax is written over its logits, and freed before the next chunk's
    # logits are made (a new softmax and a name only rebound after the next chunk's logits
    # kept three (n, V) blocks alive at once: ~300 MiB of a base fp32 step's peak, W3). Every
    # (n, V) block made by an op is watched until it is freed.
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    n, vocab = 8, 101
    live: set[int] = set()
    peak = [0]

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.shape == (n, vocab):
                    ptr = t.untyped_storage().data_ptr()
                    if ptr not in live:
                        live.add(ptr)
                        weakref.finalize(t, live.discard, ptr)
                    peak[0] = max(peak[0], len(live))
            return out

    torch.manual_seed(0)
    hidden = torch.randn(4 * n, 16, requires_grad=grad)
    weight = torch.randn(vocab, 16, requires_grad=grad)
    target = torch.randint(1, vocab, (4 * n,))
    ref_loss, _ = _reference(hidden, weight, target, 0.1)
    with Watch(), torch.set_grad_enabled(grad):
        loss, _ = chunked_label_smoothed_loss(hidden, weight, target, 0.1, n)
    assert peak[0] == 1
    torch.testing.assert_close(loss, ref_loss)


@pytest.mark.parametrize(
    ("rows", "copies"), [(50, []), (60, [(40, 24), (60, 24), (24, 40)]), (70, None)]
)
def test_the_row_major_sum_only_from_row_major_rows(rows, copies, monkeypatch):
    # Fewer hidden rows than gradhelper.ROW_MAJOR_ROWS: the logits and the (V, D) sum in
    # torch's layout (the copies cost more than they save there); from it on, W^T once (the
    # logits' right operand), h^T once a chunk and the (D, V) sum once.
    monkeypatch.setattr(gradhelper, "ROW_MAJOR_GRADS", True)
    monkeypatch.setattr(gradhelper, "ROW_MAJOR_ROWS", 60)
    made, products = [], []
    real, mm = kernels.transposed, torch.mm
    monkeypatch.setattr(kernels, "transposed", lambda x: made.append(x) or real(x))
    monkeypatch.setattr(torch, "mm", lambda a, b, **kw: products.append(b) or mm(a, b, **kw))
    hidden = torch.randn(rows, 24).bfloat16().requires_grad_(True)
    weight = (torch.randn(40, 24) * 0.3).bfloat16().requires_grad_(True)
    target = torch.randint(1, 40, (rows,))
    loss, _ = chunked_label_smoothed_loss(hidden, weight, target, 0.1, 64)
    loss.backward()
    if copies is not None:
        assert [tuple(x.shape) for x in made] == copies
    if rows >= 60:  # the logits' right operand: the row-major copy of W^T, for every chunk
        assert len(products) == (rows + 63) // 64 and made[0] is not None
        assert all(b.is_contiguous() and b.shape == (24, 40) for b in products)
        assert torch.equal(products[0], weight.detach().t())
    else:
        assert [b.stride() for b in products] == [(1, 24)]  # weight.t(), a view
    ref_loss, _ = _reference(hidden.detach().double(), weight.detach().double(), target, 0.1)
    torch.testing.assert_close(loss, ref_loss.float(), rtol=2e-2, atol=0.0)


@pytest.mark.parametrize("v, n, d", [(40, 7, 16), (32000, 3826, 512)])
def test_minus_q_is_the_copy_and_subtract_q_bit_for_bit(v, n, d):
    # The bf16 loss's (V, D) weight gradient: partial.float(), then q's part subtracted
    # (index_add_ at the targets, many repeated, then -= eps * sum(h)), made in one pass.
    gen = torch.Generator().manual_seed(v)
    partial = torch.randn(v, d, generator=gen).to(torch.bfloat16)
    target = torch.randint(0, v, (n,), generator=gen)
    target[: n // 2] = target[0]  # one row summed over and over: its order decides its bits
    hidden = torch.randn(n, d, generator=gen).to(torch.bfloat16)
    e = torch.randn(d, generator=gen)
    ref = partial.float()
    loss_module._subtract_q(ref, target, hidden, 0.8, e)
    assert torch.equal(loss_module._minus_q(partial, target, hidden, 0.8, e), ref)
    if kernels.fused_supported():
        assert torch.equal(kernels.widen_minus(partial, e), partial.float() - e)
        with pytest.raises(ValueError, match="multiple of 16"):
            kernels.widen_minus(partial[:, :8].contiguous(), e[:8].contiguous())
