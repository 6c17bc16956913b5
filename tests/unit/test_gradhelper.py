"""gradhelper.py: weight gradients on the inter-op thread equal autograd's own."""

from __future__ import annotations

import ctypes
import os
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from transformer import gradhelper, kernels
from transformer import model as model_module
from transformer.config import ModelConfig
from transformer.gradhelper import Linear, WeightGradHelper, is_linear
from transformer.loss import chunked_label_smoothed_loss
from transformer.model import Transformer


@pytest.fixture
def helper():
    """The process's helper (one per process: the inter-op pool is the process's), active."""
    made = WeightGradHelper.for_this_process()
    assert made is not None, "this test machine has 2 or more CPUs: the helper must exist"
    made.active = True
    yield made
    made.active = False
    made.discard()


def _pair(dtype=torch.float32) -> tuple[Linear, nn.Linear]:
    torch.manual_seed(0)
    ours = Linear(12, 7).to(dtype)
    plain = nn.Linear(12, 7).to(dtype)
    plain.load_state_dict(ours.state_dict())
    return ours, plain


def test_inactive_linear_is_nn_linear():
    ours, plain = _pair()
    x = torch.randn(3, 5, 12)
    assert torch.equal(ours(x), plain(x))
    assert is_linear(ours) and is_linear(plain) and not is_linear(nn.Conv1d(1, 1, 1))
    gradhelper.finish()  # nothing queued: a no-op


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deferred_gradients_equal_autograds_over_two_accumulated_backwards(helper, dtype):
    ours, plain = _pair(dtype)
    for seed in (1, 2):  # the second backward accumulates into .grad, as autograd does
        torch.manual_seed(seed)
        x = torch.randn(4, 6, 12, dtype=dtype, requires_grad=True)
        x2 = x.detach().clone().requires_grad_()
        y = ours(x)
        (y.float() ** 2).sum().backward()
        assert ours.weight.grad is None or seed == 2  # not before `finish`
        helper.finish()
        (plain(x2).float() ** 2).sum().backward()
        assert torch.equal(y, plain(x2))
        assert torch.equal(x.grad, x2.grad)  # the input gradient: computed at once, the same
    # dW as one (out, N) x (N, in) product, where autograd's kernel may block it otherwise.
    tol = {"rtol": 1e-6, "atol": 1e-5} if dtype == torch.float32 else {}
    torch.testing.assert_close(ours.weight.grad, plain.weight.grad, **tol)
    torch.testing.assert_close(ours.bias.grad, plain.bias.grad, **tol)
    assert ours.weight.grad.dtype == dtype and ours.weight.grad.abs().max() > 1
    assert not ours.weight.grad.requires_grad and not ours.bias.grad.requires_grad


def test_without_autograd_nothing_is_deferred(helper):
    ours, plain = _pair()
    with torch.no_grad():
        assert torch.equal(ours(torch.ones(2, 12)), plain(torch.ones(2, 12)))
    assert helper._pending == []


def test_the_helper_thread_is_kept_off_the_training_threads_cpu(helper):
    ours, _ = _pair()
    ours(torch.randn(8, 12, requires_grad=True)).sum().backward()
    here = ctypes.CDLL(None).sched_getcpu()
    allowed = os.sched_getaffinity(helper._pool_thread)
    steered = helper._steer_to  # (`finish` may lend it this CPU while it waits: see below)
    helper.finish()
    assert steered is not None and steered not in allowed
    assert allowed and allowed <= os.sched_getaffinity(0)
    assert here >= 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, chunk_rows", [(37, 8), (300, 1024)])
def test_the_chunked_losss_projection_gradient_deferred_equals_inline(
    helper, dtype, rows, chunk_rows, monkeypatch
):
    # 5 chunks of 8 rows: more than the two products the loss keeps in flight; one chunk of
    # 300 rows: its (n, V) x D products split between the threads as well.
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(50, 16).to(dtype))
    hidden = torch.randn(rows, 16, dtype=dtype, requires_grad=True)
    target = torch.randint(0, 50, (rows,))
    launch, split = helper._launch_rows, []
    monkeypatch.setattr(helper, "_launch_rows", lambda *a: split.append(1) or launch(*a))
    monkeypatch.setattr(gradhelper, "MIN_SPLIT_MACS", 0)  # (300, 16) x (16, 50): tiny
    grads = []
    for active in (False, True):
        helper.active = active
        weight.grad = None
        h = hidden.detach().clone().requires_grad_()
        loss, nll = chunked_label_smoothed_loss(h, weight, target, 0.1, chunk_rows=chunk_rows)
        (loss * 0.5).backward()
        if active:
            assert weight.grad is None  # waits for `finish`
        helper.finish()
        assert not weight.grad.requires_grad
        grads.append((loss.detach(), h.grad, weight.grad.clone()))
    (loss_a, h_a, w_a), (loss_b, h_b, w_b) = grads
    assert len(split) == (2 if rows >= gradhelper.MIN_SPLIT_ROWS else 0)
    # the row blocks of a split product may round differently from one product's
    close = {} if split and dtype == torch.bfloat16 else {"rtol": 1e-6, "atol": 1e-6}
    torch.testing.assert_close(loss_b, loss_a, **close)
    torch.testing.assert_close(h_b, h_a, **close)
    if dtype == torch.float32:  # the same products, summed in the same order
        torch.testing.assert_close(w_b, w_a, rtol=1e-6, atol=1e-7)
    else:  # bf16 products summed in fp32, not in a bf16 running sum: closer, not equal
        torch.testing.assert_close(w_b, w_a, rtol=2e-2, atol=1e-2 * w_a.abs().max().item())
    assert w_a.abs().max() > 1e-3


@pytest.mark.parametrize("batch", [3, 40])  # 40 x 7 target rows: products split (forward)
def test_a_whole_models_gradients_with_the_helper_equal_autograds(helper, batch, monkeypatch):
    cfg = ModelConfig(vocab_size=40, n_layers=2, d_model=16, d_ff=32, n_heads=2, d_k=8, d_v=8,
                      p_drop=0.0, max_len=32)  # fmt: skip
    torch.manual_seed(0)
    model = Transformer(cfg).train()
    src = torch.randint(4, 40, (batch, 9))
    tgt_in = torch.randint(4, 40, (batch, 7))
    keep = torch.ones(batch, 7, dtype=torch.bool)
    keep[0, 5:] = False
    launch, split = helper._launch_rows, []
    monkeypatch.setattr(helper, "_launch_rows", lambda *a: split.append(1) or launch(*a))
    monkeypatch.setattr(gradhelper, "MIN_SPLIT_MACS", 0)  # this model's products are tiny
    grads = []
    for active in (False, True):
        helper.active = active
        model.zero_grad(set_to_none=True)
        hidden = model(src, src != 0, tgt_in, keep)
        target = tgt_in[keep]
        loss, _ = chunked_label_smoothed_loss(hidden, model.output_weight(), target, 0.1)
        loss.backward()
        gradhelper.finish()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    # each layer's products, and the loss's two, once the rows reach MIN_SPLIT_ROWS
    assert (len(split) > 20) == (batch * 7 >= gradhelper.MIN_SPLIT_ROWS)
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_split_linear_equals_f_linear(helper, dtype, bias, monkeypatch):
    # 4 x 75 = 300 rows: the last third (96 rows, whole blocks of 16) on the helper's thread.
    launch, split = helper._launch_rows, []
    monkeypatch.setattr(helper, "_launch_rows", lambda *a: split.append(1) or launch(*a))
    monkeypatch.setattr(gradhelper, "MIN_SPLIT_MACS", 300 * 24 * 40)
    torch.manual_seed(0)
    x = torch.randn(4, 75, 24, dtype=dtype)
    weight = torch.randn(40, 24, dtype=dtype)
    b = torch.randn(40, dtype=dtype) if bias else None
    got = helper.split_linear(x, weight, b)
    want = torch.nn.functional.linear(x, weight, b)
    assert got.shape == (4, 75, 40) and got.dtype == dtype and got.is_contiguous()
    torch.testing.assert_close(got, want, **({"rtol": 1e-6, "atol": 1e-5} if dtype ==
                                               torch.float32 else {}))  # fmt: skip
    assert split == [1]
    # too few rows, too little work, or rows that are not one block of memory: F.linear itself
    assert torch.equal(helper.split_linear(x[:1], weight, b), torch.nn.functional.linear(
        x[:1], weight, b))  # fmt: skip
    assert torch.equal(
        helper.split_linear(x, weight[:39], b if b is None else b[:39]),
        torch.nn.functional.linear(x, weight[:39], b if b is None else b[:39]),
    )
    strided = torch.randn(24, 300, dtype=dtype).t()  # (300, 24), a column-major view
    assert torch.equal(helper.split_linear(strided, weight, b),
                       torch.nn.functional.linear(strided, weight, b))  # fmt: skip
    assert split == [1]


def _spin(flag: torch.Tensor) -> torch.Tensor:
    while bool(flag[0] == 0):
        pass
    return flag


def _launch_spin(flag: torch.Tensor) -> torch.jit.Future[torch.Tensor]:
    return torch.jit.fork(_spin, flag)


def _hold_the_helper(flag: torch.Tensor):
    """Start a job on the helper's thread that runs until flag[0] is set (at the latest
    after 10 s: a test that fails does not hang)."""
    with warnings.catch_warnings():  # torch 2.13 calls torch.jit.script deprecated
        warnings.simplefilter("ignore", DeprecationWarning)
        launch = torch.jit.script(_launch_spin)
    timer = threading.Timer(10.0, flag.fill_, (1,))
    timer.start()
    return launch(flag), timer


def test_a_wait_for_a_job_not_done_lends_the_helper_this_threads_cpu(helper, monkeypatch):
    # The helper held by a spinning job: a product queued behind it is not done, so `wait`
    # moves the helper to the CPU this thread is on (and sleeps there) before it waits.
    cpus, lent = [], []
    getcpu = helper._getcpu
    monkeypatch.setattr(helper, "_getcpu", lambda: cpus.append(getcpu()) or cpus[-1])
    setaffinity = os.sched_setaffinity
    flag = torch.zeros(1, dtype=torch.uint8)

    def spy(tid, mask):
        lent.append((tid, set(mask)))
        setaffinity(tid, mask)
        if lent[0][0] == "armed":
            flag[0] = 1  # the held job ends once `wait` has moved the helper

    monkeypatch.setattr(os, "sched_setaffinity", spy)
    held, timer = _hold_the_helper(flag)
    a, b = torch.randn(30, 5), torch.randn(30, 7)
    job = helper.product(a, b)  # (steered off this CPU, if it moved since)
    lent[:] = [("armed", set())]
    assert not job.done()
    torch.testing.assert_close(helper.wait(job), a.t() @ b)
    held.wait()
    timer.cancel()
    assert lent[1:] == [(helper._pool_thread, {cpus[-1]})] and cpus[-1] >= 0
    assert os.sched_getaffinity(helper._pool_thread) == {cpus[-1]}
    assert helper._steer_to is None
    # A job done already: its value, the helper left where it is.
    lent.clear()
    done = helper.product(a, b)
    while not done.done():
        pass
    assert lent == [(helper._pool_thread, set(os.sched_getaffinity(0)) - {cpus[-1]})]  # steered
    torch.testing.assert_close(helper.wait(done), a.t() @ b)
    assert len(lent) == 1 and helper._steer_to == cpus[-1]


def test_a_refused_lend_leaves_the_helper_steered(helper, monkeypatch):
    flag = torch.zeros(1, dtype=torch.uint8)
    held, timer = _hold_the_helper(flag)
    job = helper.product(torch.ones(2, 3), torch.ones(2, 3))
    steered = helper._steer_to

    def refuse(tid, mask):
        flag[0] = 1  # the held job ends
        raise PermissionError("sched_setaffinity: not permitted")

    monkeypatch.setattr(os, "sched_setaffinity", refuse)
    assert not job.done()
    assert torch.equal(helper.wait(job), torch.full((3, 3), 2.0))
    held.wait()
    timer.cancel()
    assert helper._steer_to == steered and steered is not None


def _stack_and_inputs(dtype):
    torch.manual_seed(0)
    layers = [Linear(12, 12).to(dtype) for _ in range(4)]
    plain = [nn.Linear(12, 12).to(dtype) for _ in range(4)]
    for a, b in zip(layers, plain, strict=True):
        b.load_state_dict(a.state_dict())
    return layers, plain, torch.randn(5, 12, dtype=dtype)


def _run(layers, x):
    for layer in layers:
        x = torch.tanh(layer(x))
    (x.float() ** 2).sum().backward()


def _finish_with_the_helper_held(helper, layers, x, monkeypatch) -> int:
    """Backward through `layers` while the helper's thread is held by a job that spins until
    the training thread has computed every layer's weight gradients in `finish`; the number
    of jobs it computed."""
    flag = torch.zeros(1, dtype=torch.uint8)
    held, timer = _hold_the_helper(flag)
    computed = []
    weight_grads = gradhelper._weight_grads

    def on_main(g, x):
        computed.append(g.shape)
        if len(computed) == len(layers):
            flag[0] = 1  # release the helper: every job is claimed
        return weight_grads(g, x)

    with monkeypatch.context() as patch:
        patch.setattr(gradhelper, "_weight_grads", on_main)
        _run(layers, x)
        helper.finish()
    held.wait()
    timer.cancel()
    assert helper.taken == len(computed)
    return helper.taken


def _finish_after_the_helper(helper, layers, x) -> int:
    """Backward through `layers`, the helper done with every job before `finish`."""
    _run(layers, x)
    for future, _ in helper._pending:
        future.wait()
    helper.finish()
    return helper.taken


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_finish_takes_the_jobs_the_helper_has_not_started(helper, dtype, monkeypatch):
    # The training thread takes all four layers' jobs, from the queue's end; the helper's
    # copies, reached later, do nothing. Same gradients as autograd's.
    layers, plain, x = _stack_and_inputs(dtype)
    assert _finish_with_the_helper_held(helper, layers, x, monkeypatch) == len(layers)
    assert helper._jobs == []
    _run(plain, x)
    for a, b in zip(layers, plain, strict=True):
        torch.testing.assert_close(a.weight.grad, b.weight.grad)
        torch.testing.assert_close(a.bias.grad, b.bias.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_either_threads_gradients_are_the_same_bits(helper, dtype, monkeypatch):
    # One torch thread each, as in helper mode: whichever thread computes a job, the same bits.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        by_main, _, x = _stack_and_inputs(dtype)
        by_helper, _, _ = _stack_and_inputs(dtype)
        assert _finish_with_the_helper_held(helper, by_main, x, monkeypatch) == len(by_main)
        assert _finish_after_the_helper(helper, by_helper, x) == 0
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(by_main, by_helper, strict=True):
        assert torch.equal(a.weight.grad, b.weight.grad) and torch.equal(a.bias.grad, b.bias.grad)


def test_finish_takes_nothing_the_helper_has_done(helper):
    layers, plain, x = _stack_and_inputs(torch.float32)
    assert _finish_after_the_helper(helper, layers, x) == 0
    _run(plain, x)
    for a, b in zip(layers, plain, strict=True):
        torch.testing.assert_close(a.weight.grad, b.weight.grad, rtol=1e-6, atol=1e-6)


def test_a_failing_job_is_raised_by_finish(helper):
    ours, _ = _pair()
    x = torch.randn(2, 12, requires_grad=True)
    y = ours(x)
    # 2 rows of gradient against 4 rows of input: the product fails on the helper's thread.
    helper.defer_linear(torch.randn(2, 7), torch.randn(4, 12), ours.weight, ours.bias)
    y.sum().backward()
    with pytest.raises(RuntimeError):
        helper.finish()
    assert helper._pending == []  # dropped: the next step starts clean


def test_one_usable_cpu_makes_no_helper(monkeypatch):
    monkeypatch.setattr(gradhelper, "_MADE", False)
    monkeypatch.setattr(gradhelper, "_INSTANCE", None)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0})
    assert WeightGradHelper.for_this_process() is None
    assert gradhelper.active() is None


def test_the_helper_runs_on_another_thread(helper):
    seen = []
    ours, _ = _pair()
    ours(torch.randn(8, 12, requires_grad=True)).sum().backward()
    seen.append(threading.get_native_id())
    helper.finish()
    assert helper._pool_thread != seen[0]
    with open(f"/proc/self/task/{helper._pool_thread}/comm", encoding="utf-8") as f:
        assert f.read().strip() == "PTThreadPool"


def test_a_torch_without_torchscript_makes_no_helper(monkeypatch):
    # torch 2.13 calls torch.jit.script deprecated; where it is gone, training keeps the
    # tuner's thread counts (no helper candidate) instead of failing.
    def gone() -> None:
        raise RuntimeError("torch.jit.script was removed")

    monkeypatch.setattr(gradhelper, "_MADE", False)
    monkeypatch.setattr(gradhelper, "_INSTANCE", None)
    monkeypatch.setattr(gradhelper, "_script", gone)
    assert WeightGradHelper.for_this_process() is None


# Weight gradients from row-major copies (AMX: `row_major_grads`), forced on here whatever the CPU.


def _graph_nodes(fn) -> set[str]:
    """The names of the autograd nodes reachable from fn."""
    seen, todo = set(), [fn]
    while todo:
        f = todo.pop()
        if f is not None and type(f).__name__ not in seen:
            seen.add(type(f).__name__)
            todo.extend(n for n, _ in f.next_functions)
    return seen


@pytest.mark.parametrize("n_in,n_out", [(24, 40), (40, 24), (512, 2048), (2048, 512)])
def test_row_major_weight_grad_is_g_transposed_x(n_in, n_out):
    torch.manual_seed(0)
    g = torch.randn(300, n_out).bfloat16()
    x = torch.randn(300, n_in).bfloat16()
    got = gradhelper.row_major_weight_grad(g, x)
    ref = g.double().t() @ x.double()
    assert got.shape == (n_out, n_in) and got.dtype == torch.bfloat16 and got.is_contiguous()
    assert float((got.double() - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.parametrize("shape", [(37, 12), (3, 5, 12)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("n_out", [7, 12])  # 12: square, dW from the transposed view
def test_a_row_major_layer_is_nn_linear_up_to_dws_rounding(shape, bias, n_out, monkeypatch):
    monkeypatch.setattr(gradhelper, "ROW_MAJOR_GRADS", True)
    monkeypatch.setattr(gradhelper, "ROW_MAJOR_ROWS", 0)  # this layer is tiny
    torch.manual_seed(0)
    ours = Linear(12, n_out, bias=bias).bfloat16()
    plain = nn.Linear(12, n_out, bias=bias).bfloat16()
    plain.load_state_dict(ours.state_dict())
    x = torch.randn(*shape).bfloat16()
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ya, yb = ours(xa), plain(xb)
    assert torch.equal(ya, yb)
    assert "_RowMajorGradLinearBackward" in _graph_nodes(ya.grad_fn)
    ya, yb = F.relu(ya, inplace=True), F.relu(yb, inplace=True)  # as the FFN does
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    assert torch.equal(xa.grad, xb.grad)  # dx = g W, the same product
    if bias:  # fp32 column sums (kernels.column_sums on AVX-512), rounded once to bf16
        torch.testing.assert_close(
            ours.bias.grad.float(), plain.bias.grad.float(), rtol=2**-7, atol=2**-7
        )
    torch.testing.assert_close(
        ours.weight.grad.float(), plain.weight.grad.float(), rtol=1e-2, atol=1e-2
    )


@pytest.mark.parametrize("tiles", [True, False])
def test_a_square_layers_weight_gradient_comes_from_the_tiles_where_they_run(tiles, monkeypatch):
    """Round fifty-two: a square row-major layer's dW is `kernels.weight_grad`'s (AMX), bit for
    bit, or torch's g^T x where the tiles are off or not here; a wider layer's is
    `row_major_weight_grad`'s either way."""
    monkeypatch.setattr(gradhelper, "ROW_MAJOR_GRADS", True)
    monkeypatch.setattr(gradhelper, "ROW_MAJOR_ROWS", 0)
    old = kernels.weight_grad_amx()
    kernels.weight_grad_amx(tiles)
    try:
        torch.manual_seed(0)
        for n_out in (64, 96):
            layer = Linear(64, n_out).bfloat16()
            x = torch.randn(300, 64).bfloat16().requires_grad_(True)
            y = layer(x)
            g = torch.randn_like(y)
            y.backward(g)
            if n_out == 64:
                own = kernels.weight_grad(g, x.detach())
                expected = own if own is not None else g.t() @ x.detach()
                assert (own is not None) is (tiles and kernels.amx_tiles())
            else:
                expected = gradhelper.row_major_weight_grad(g, x.detach())
            assert torch.equal(layer.weight.grad, expected)
    finally:
        kernels.weight_grad_amx(old)


def _onednn_bf16_product_runs() -> bool:
    """Whether oneDNN multiplies bf16 on this CPU: it refuses where there is no AVX-512 (an AVX2
    Zen 3: "could not create a primitive descriptor")."""
    x = torch.ones(4, 8, dtype=torch.bfloat16)
    try:
        torch.ops.mkldnn._linear_pointwise(x, x[:2], None, "none", [], "")
    except RuntimeError:
        return False
    return True


def test_bias_in_product_is_kept_only_where_it_gives_f_linears_bits(monkeypatch):
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(gradhelper, "BIAS_IN_PRODUCT", None)
    expected = torch.backends.mkldnn.is_available() and _onednn_bf16_product_runs()
    assert gradhelper.bias_in_product() is expected
    assert gradhelper.BIAS_IN_PRODUCT is expected  # decided once

    def off_by_one_ulp(x, w, b, *rest):
        y = real(x, w, b, *rest)
        return (y.view(torch.int16) + 1).view(torch.bfloat16)

    def refused(*args):
        raise RuntimeError("no oneDNN kernel for this")

    for fake in (off_by_one_ulp, refused):
        monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", fake)
        monkeypatch.setattr(gradhelper, "BIAS_IN_PRODUCT", None)
        assert gradhelper.bias_in_product() is False


@pytest.mark.parametrize("in_product", [True, False])
def test_a_row_major_layers_forward_has_f_linears_bits_either_way(in_product, monkeypatch):
    """The bias added inside oneDNN's product (round forty-eight) or by F.linear: the same bits
    at rows the W1 step has, and the layer calls the one it was told to. Where oneDNN has no
    bf16 product (an AVX2 Zen 3), the check never tells it to: F.linear."""
    if in_product and not _onednn_bf16_product_runs():
        monkeypatch.setattr(gradhelper, "BIAS_IN_PRODUCT", None)
        in_product = gradhelper.bias_in_product()
        assert in_product is False
    monkeypatch.setattr(gradhelper, "ROW_MAJOR_GRADS", True)
    monkeypatch.setattr(gradhelper, "BIAS_IN_PRODUCT", in_product)
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise",
                        lambda *a: calls.append(1) or real(*a))  # fmt: skip
    torch.manual_seed(0)
    layer = Linear(64, 160).bfloat16()
    x = torch.randn(gradhelper.ROW_MAJOR_ROWS + 48, 64).bfloat16().requires_grad_(True)
    y = layer(x)
    assert torch.equal(y, F.linear(x, layer.weight, layer.bias))
    assert len(calls) == (1 if in_product else 0)
    assert "_RowMajorGradLinearBackward" in _graph_nodes(y.grad_fn)


def test_row_major_grads_only_for_bf16_non_square_trained_cpu_weights(monkeypatch):
    monkeypatch.setattr(gradhelper, "ROW_MAJOR_GRADS", True)
    rows = gradhelper.ROW_MAJOR_ROWS
    w = torch.zeros(7, 12, dtype=torch.bfloat16, requires_grad=True)
    assert gradhelper.row_major_grads(w, rows)
    assert not gradhelper.row_major_grads(w, rows - 1)  # too few rows: the copies cost more
    square = torch.zeros(12, 12, dtype=torch.bfloat16, requires_grad=True)
    assert not gradhelper.row_major_grads(square, rows)  # the copy would cost what it saves
    assert gradhelper.own_weight_grads(square, rows)  # the rest of _RowMajorGradLinear pays
    for other in (
        torch.zeros(7, 12, requires_grad=True),  # fp32
        torch.zeros(7, 12, dtype=torch.bfloat16),  # frozen
    ):
        assert not gradhelper.row_major_grads(other, rows)
        assert not gradhelper.own_weight_grads(other, rows)
    monkeypatch.setattr(gradhelper, "ROW_MAJOR_GRADS", False)
    assert not gradhelper.row_major_grads(w, rows)
    assert not gradhelper.own_weight_grads(square, rows)


@pytest.mark.parametrize("rows", [30, 2100])  # F.linear's autograd; _RowMajorGradLinear
@pytest.mark.parametrize("bias", [True, False])
def test_a_stacked_linear_is_its_layers_side_by_side(rows, bias, monkeypatch):
    # Self-attention's W^Q and W^KV as one product (model.MultiHeadAttention.attend_packed):
    # the layers' outputs side by side, and each layer's gradients its rows of the stacked
    # ones, near the separate layers' (one dx product where two were added, in bf16).
    monkeypatch.setattr(gradhelper, "ROW_MAJOR_GRADS", True)
    monkeypatch.setattr(gradhelper, "ROW_MAJOR_ROWS", 2048)
    torch.manual_seed(0)
    layers = [Linear(32, 32, bias=bias).bfloat16(), Linear(32, 64, bias=bias).bfloat16()]
    plain = [nn.Linear(32, n, bias=bias).bfloat16() for n in (32, 64)]
    for p, m in zip(plain, layers, strict=True):
        p.load_state_dict(m.state_dict())
    x = torch.randn(rows, 32).bfloat16()
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y = gradhelper.stacked_linear(xa, layers)
    ref = torch.cat([m(xb) for m in plain], 1)
    own = "_RowMajorGradLinearBackward" in _graph_nodes(y.grad_fn)
    assert own is (rows >= 2048)
    torch.testing.assert_close(y.float(), ref.float(), rtol=2**-7, atol=2**-7)
    g = torch.randn_like(y)
    y.backward(g)
    ref.backward(g)
    torch.testing.assert_close(xa.grad.float(), xb.grad.float(), rtol=2e-2, atol=2e-2)
    for m, p in zip(layers, plain, strict=True):
        for a, b in zip(m.parameters(), p.parameters(), strict=True):
            assert a.grad.shape == a.shape
            scale = float(b.grad.float().abs().max())
            torch.testing.assert_close(a.grad.float(), b.grad.float(), rtol=2e-2, atol=2e-2 * scale)


@pytest.mark.parametrize("in_product", [True, False])
def test_linear_relu_is_the_layer_then_relu_forward_and_backward(in_product, monkeypatch):
    # The FFN's max(0, x W1 + b1) inside oneDNN's product (or F.linear then kernels.relu_):
    # the bits of the layer then the compiled ReLU, its gradients too (the same relu_grad).
    if not kernels.fused_supported():
        assert gradhelper.linear_relu(torch.randn(8, 16).bfloat16(), Linear(16, 8)) is None
        return
    monkeypatch.setattr(gradhelper, "ROW_MAJOR_GRADS", True)
    monkeypatch.setattr(gradhelper, "ROW_MAJOR_ROWS", 0)
    monkeypatch.setattr(gradhelper, "BIAS_IN_PRODUCT", in_product)
    torch.manual_seed(0)
    layer = Linear(32, 96).bfloat16()
    x = torch.randn(300, 32).bfloat16()
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ya = gradhelper.linear_relu(xa, layer)
    yb = model_module._ReLU.apply(layer(xb))
    assert "_RowMajorGradLinearBackward" in _graph_nodes(ya.grad_fn)
    assert torch.equal(ya, yb) and bool((ya == 0).any()) and bool((ya > 0).any())
    g = torch.randn_like(ya)
    ya.backward(g)
    grads = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    yb.backward(g)
    assert torch.equal(xa.grad, xb.grad)
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, layer.parameters(), strict=True))


def test_linear_relu_is_not_taken_where_the_layer_runs_as_it_was(monkeypatch):
    monkeypatch.setattr(gradhelper, "ROW_MAJOR_GRADS", True)
    monkeypatch.setattr(gradhelper, "ROW_MAJOR_ROWS", 0)
    x = torch.randn(8, 16).bfloat16()
    assert gradhelper.linear_relu(x, Linear(16, 8, bias=False).bfloat16()) is None
    assert gradhelper.linear_relu(x.view(2, 4, 16), Linear(16, 8).bfloat16()) is None  # 3-D
    assert gradhelper.linear_relu(x.float(), Linear(16, 8)) is None  # fp32
    with torch.no_grad():
        assert gradhelper.linear_relu(x, Linear(16, 8).bfloat16()) is None
    monkeypatch.setattr(gradhelper, "active", lambda: object())  # the helper defers dW
    assert gradhelper.linear_relu(x, Linear(16, 8).bfloat16()) is None


def test_a_stacked_linear_is_not_taken_where_each_layer_keeps_its_own(monkeypatch):
    x = torch.randn(8, 16).bfloat16()
    a, b = Linear(16, 16).bfloat16(), Linear(16, 32).bfloat16()
    assert gradhelper.stacked_linear(x, [a, Linear(16, 32, bias=False).bfloat16()]) is None
    assert gradhelper.stacked_linear(x, [a, nn.Sequential(b)]) is None
    monkeypatch.setattr(gradhelper, "active", lambda: object())  # the helper adds per weight
    assert gradhelper.stacked_linear(x, [a, b]) is None


@pytest.mark.parametrize(
    "flags,expected",
    [
        ({"avx2"}, False),
        ({"avx512f", "avx512bw", "avx512vl"}, False),  # AVX-512 without bf16 products
        ({"avx512f", "avx512bw", "avx512vl", "avx512_bf16"}, True),  # a Zen 4 or Zen 5
        ({"amx_bf16", "avx512f", "avx512_bf16"}, True),
    ],
)
def test_row_major_grads_is_decided_by_native_bf16(flags, expected, monkeypatch):
    monkeypatch.setattr(gradhelper, "ROW_MAJOR_GRADS", None)
    monkeypatch.setattr(gradhelper.cpuinfo, "cpu_flags", lambda path=None: flags)
    w = torch.zeros(7, 12, dtype=torch.bfloat16, requires_grad=True)
    assert gradhelper.row_major_grads(w, gradhelper.ROW_MAJOR_ROWS) is expected
    assert gradhelper.ROW_MAJOR_GRADS is expected


def _tiny_batch(n_layers: int = 2):
    """A tiny bf16-able model's config and a packed-path batch (one row's targets padded)."""
    cfg = ModelConfig(vocab_size=40, n_layers=n_layers, d_model=16, d_ff=32, n_heads=2, d_k=8,
                      d_v=8, p_drop=0.0, max_len=32)  # fmt: skip
    src = torch.randint(4, 40, (20, 9))
    tgt_in = torch.randint(4, 40, (20, 7))
    keep = torch.ones(20, 7, dtype=torch.bool)
    keep[0, 5:] = False
    return cfg, src, tgt_in, keep


def _bf16_step(cfg, src, tgt_in, keep):
    """A seeded bf16 model's hidden states and gradients (fp32 copies) of one loss."""
    torch.manual_seed(0)
    model = Transformer(cfg).bfloat16().train()
    hidden = model(src, src != 0, tgt_in, keep)
    loss, _ = chunked_label_smoothed_loss(hidden, model.output_weight(), tgt_in[keep], 0.1)
    loss.backward()
    return hidden.detach(), {n: p.grad.float() for n, p in model.named_parameters()}


def test_a_whole_bf16_models_gradients_row_major_close_to_autograds(monkeypatch):
    batch = _tiny_batch()
    grads = []
    monkeypatch.setattr(gradhelper, "ROW_MAJOR_ROWS", 0)  # this model's layers are tiny
    for row_major in (False, True):
        monkeypatch.setattr(gradhelper, "ROW_MAJOR_GRADS", row_major)
        grads.append(_bf16_step(*batch)[1])
    for name, ref in grads[0].items():
        assert float((grads[1][name] - ref).norm()) <= 3e-2 * float(ref.norm()) + 1e-6, name


def test_a_layer_on_fewer_than_row_major_rows_keeps_torchs_layouts(monkeypatch):
    monkeypatch.setattr(gradhelper, "ROW_MAJOR_GRADS", True)
    layer = Linear(12, 7).bfloat16()
    x = torch.randn(3, 10, 12).bfloat16().requires_grad_(True)  # 30 rows
    monkeypatch.setattr(gradhelper, "ROW_MAJOR_ROWS", 31)
    assert type(layer(x).grad_fn).__name__ == "ViewBackward0"
    assert "_RowMajorGradLinearBackward" not in _graph_nodes(layer(x).grad_fn)
    monkeypatch.setattr(gradhelper, "ROW_MAJOR_ROWS", 30)
    assert "_RowMajorGradLinearBackward" in _graph_nodes(layer(x).grad_fn)


def test_a_quota_of_one_cpu_makes_no_helper(monkeypatch):
    # Two CPUs in the affinity but a control group's quota of one: the helper could only wait.
    from transformer import cpuinfo

    monkeypatch.setattr(gradhelper, "_MADE", False)
    monkeypatch.setattr(gradhelper, "_INSTANCE", None)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1})
    monkeypatch.setattr(cpuinfo, "cpu_quota", lambda *_: 1.0)
    assert WeightGradHelper.for_this_process() is None


def _chain_layers(bias: bool = True) -> list[Linear]:
    torch.manual_seed(0)
    return [Linear(32, n, bias=bias).bfloat16() for n in (48, 48, 64)]


@pytest.mark.parametrize("bias", [True, False])
def test_chained_linears_are_each_layers_own_with_one_sum_for_x(bias, monkeypatch):
    # The decoder's encoder-decoder keys and values (model.Transformer.forward): each output
    # the layer's own bits; each layer's dW and db its own path's; x's gradient the layers'
    # g_i W_i summed by accumulating products, the last layer's first (backward's order).
    monkeypatch.setattr(gradhelper, "ROW_MAJOR_GRADS", True)
    monkeypatch.setattr(gradhelper, "ROW_MAJOR_ROWS", 0)
    layers = _chain_layers(bias)
    x = torch.randn(300, 32).bfloat16()
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ys = gradhelper.chained_linears(xa, layers)
    refs = [m(xb) for m in layers]
    assert all(torch.equal(y, r) for y, r in zip(ys, refs, strict=True))
    gs = [torch.randn_like(y) for y in ys]
    torch.autograd.backward(ys, gs)
    own = [[p.grad.clone() for p in m.parameters()] for m in layers]
    for m in layers:
        m.zero_grad()
    torch.autograd.backward(refs, gs)
    for grads, m in zip(own, layers, strict=True):
        assert all(torch.equal(a, p.grad) for a, p in zip(grads, m.parameters(), strict=True))
    with torch.no_grad():
        chain = gs[2] @ layers[2].weight
        chain.addmm_(gs[1], layers[1].weight).addmm_(gs[0], layers[0].weight)
    assert torch.equal(xa.grad, chain)
    torch.testing.assert_close(xa.grad.float(), xb.grad.float(), rtol=2e-2, atol=2e-2)


def test_a_chained_layer_whose_output_is_unused_passes_the_sum_on(monkeypatch):
    monkeypatch.setattr(gradhelper, "ROW_MAJOR_GRADS", True)
    monkeypatch.setattr(gradhelper, "ROW_MAJOR_ROWS", 0)
    layers = _chain_layers()
    x = torch.randn(300, 32).bfloat16().requires_grad_(True)
    ys = gradhelper.chained_linears(x, layers)
    g0, g2 = torch.randn_like(ys[0]), torch.randn_like(ys[2])
    torch.autograd.backward([ys[0], ys[2]], [g0, g2])  # the middle layer's output unused
    with torch.no_grad():
        chain = (g2 @ layers[2].weight).addmm_(g0, layers[0].weight)
    assert torch.equal(x.grad, chain)
    assert layers[1].weight.grad is None and layers[0].weight.grad is not None


def test_chained_linears_are_not_taken_where_each_layer_keeps_its_own(monkeypatch):
    monkeypatch.setattr(gradhelper, "ROW_MAJOR_GRADS", True)
    monkeypatch.setattr(gradhelper, "ROW_MAJOR_ROWS", 100)
    layers = _chain_layers()
    x = torch.randn(300, 32).bfloat16()
    assert gradhelper.chained_linears(x, layers) is not None
    assert gradhelper.chained_linears(x[:99], layers) is None  # too few rows for row-major dW
    assert gradhelper.chained_linears(x.view(3, 100, 32), layers) is None  # 3-D
    assert gradhelper.chained_linears(x, []) is None
    assert gradhelper.chained_linears(x, [layers[0], nn.Sequential(layers[1])]) is None
    assert gradhelper.chained_linears(x.float(), [Linear(32, 8)]) is None  # fp32
    with torch.no_grad():
        assert gradhelper.chained_linears(x, layers) is None
    monkeypatch.setattr(gradhelper, "active", lambda: object())  # the helper adds per weight
    assert gradhelper.chained_linears(x, layers) is None


def test_a_models_cross_attention_keys_and_values_chained_keep_its_forward(monkeypatch):
    # The packed path's decoder takes every layer's keys and values of the memory from
    # chained_linears: the hidden states' bits as each layer's own w_kv gives them, the
    # gradients within bf16's rounding of them (the memory's sum has other roundings).
    batch = _tiny_batch(n_layers=3)
    monkeypatch.setattr(gradhelper, "ROW_MAJOR_GRADS", True)
    monkeypatch.setattr(gradhelper, "ROW_MAJOR_ROWS", 0)  # this model's layers are tiny
    chained = gradhelper.chained_linears
    calls = []

    def counted(x, layers):
        calls.append(len(layers))
        return chained(x, layers)

    out = []
    for fn in (counted, lambda x, layers: None):
        monkeypatch.setattr(gradhelper, "chained_linears", fn)
        out.append(_bf16_step(*batch))
    assert calls == [3]
    assert torch.equal(out[0][0], out[1][0])
    for name, ref in out[1][1].items():
        assert float((out[0][1][name] - ref).norm()) <= 3e-2 * float(ref.norm()) + 1e-6, name


def test_chained_layers_share_one_copy_of_x_transposed(monkeypatch):
    # Each layer's dW = (x^T g)^T from one row-major x^T (gradhelper._SharedTranspose), made
    # once for the chain and dropped after its last layer; the same bits as each its own.
    monkeypatch.setattr(gradhelper, "ROW_MAJOR_GRADS", True)
    monkeypatch.setattr(gradhelper, "ROW_MAJOR_ROWS", 0)
    layers = _chain_layers()
    x = torch.randn(300, 32).bfloat16()
    made = []
    real = kernels.transposed

    def counted(t):
        made.append(tuple(t.shape))
        return real(t)

    monkeypatch.setattr(kernels, "transposed", counted)
    ys = gradhelper.chained_linears(x.clone().requires_grad_(True), layers)
    gs = [torch.randn_like(y) for y in ys]
    torch.autograd.backward(ys, gs)
    assert made.count((300, 32)) == 1  # x^T once, for three layers
    for m, g in zip(layers, gs, strict=True):
        assert torch.equal(m.weight.grad, gradhelper.row_major_weight_grad(g, x))
