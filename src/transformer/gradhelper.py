"""Weight gradients on a second thread, for training beside a busy process on few cores.

Not in the paper. Beside one other busy process on a 2-core CPU, the thread tuner
(threads.py) trains with one thread: two threads meet at a barrier in every op, and one of
them is always waiting for the core the other process holds. One thread keeps one core, and a
step runs at its one-thread rate (~65% of two threads' alone rate, docs/performance.md).

The backward pass has work that nothing on its way waits for: the weight gradients. For
y = x W^T + b the input gradient dx = dy W is on the path to the layers below; dW = dy^T x and
db = sum(dy) only have to be ready for the optimizer. `WeightGradHelper` computes them, and the
(V, D) product of the chunked loss's projection gradient (loss.py), on torch's inter-op thread
while the training thread goes on, one torch thread each, and `finish()` adds them to the
parameters' `.grad` in the order they were made. The two threads meet once a step, not once an
op; beside a busy process the scheduler gives each of the three runnable threads about two
thirds of a core.

The forward pass has no such work, and there the helper would sit idle: instead each linear
layer's product (and the loss's two (n, V) x D products) gives the last third of its rows to
the helper and joins it at once (`split_linear`). Beside a busy process a step then uses ~1.2
cores where the backward's weight gradients alone used ~1.1 (docs/performance.md, "Round ten").

One detail decides whether it works: where the kernel wakes the helper. Woken (by a futex)
with no idle CPU, Linux queues it on the CPU of the thread that woke it, so the two threads
take turns on one core and the step runs no faster than one thread. Before each job the
helper's affinity is set to the usable CPUs other than the one the training thread is on
(`sched_setaffinity`, one system call); it then shares the busy process's core, where it gets
half of it. (Alone a helper finds the idle CPU itself, and the tuner keeps two threads then.)
The cost: each layer's output gradient and input stay alive until the helper has used them
(the backlog of one backward pass, in this mode only). At the end of the backward pass the
helper still has that backlog; `finish` does not wait idle for it: the training thread computes
the jobs the helper has not started, from the queue's end (a claim flag per job decides who
computes it), which took the wait from ~11% of a quickstart step to ~3%.

Kept off the training thread's CPU, the helper cannot use that CPU either when it is the one
free: where the training thread waits for a job (the helper's rows of a split product, one of
the loss's (V, D) products, a job `finish` did not take), it sleeps, and the helper may sit
queued behind the busy process on the other CPU for the rest of that process's time slice
while the training thread's CPU idles (beside a busy process on a 2-core Zen 3: a wait in 1 of
5 of the split products, ~2.7 ms each). `wait` first moves the helper to the training
thread's CPU, which it then has to itself until the job is done (one system call, only for
a job not done); the next job steers it off again. That halved the time waited there, and
`transformer train` ran 1.045x beside a busy process (docs/performance.md, "Round fifty-nine").

    helper = WeightGradHelper.for_this_process()   # None: fewer than 2 CPUs, or no pool thread
    helper.active = True                           # threads.ThreadTuner does this per step
    loss.backward()                                # nn.Linear layers built as `Linear` defer
    helper.finish()                                # dW, db (and the projection's) in .grad

The inter-op pool is started with one thread, so nothing else in the process may have used it
(nothing in this package does). TorchScript's `fork` is the way into that pool from Python: a
job runs in C++ without the GIL, which a Python helper thread would take between ops.
"""

from __future__ import annotations

import ctypes
import logging
import os
import warnings
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
import torch.utils.weak
from torch import nn

from transformer import cpuinfo, kernels

logger = logging.getLogger(__name__)

# Forward products (`split_linear`): the helper's share of the rows, and the least rows split.
# Beside a busy process the helper shares that process's core: a layer's four products at 1,024
# rows (`benchmarks/bench_split_rows.py`, 2-core Zen 5) ran 1.30x one thread's rate there with a
# third of the rows on the helper (d_model 512; 1.12x at the quickstart's 256), 1.23x with a
# quarter (1.06x), 0.96x with half (docs/performance.md, "Round ten").
SPLIT_SHARE = 1 / 3
# Smaller products are left whole: a split and its join cost ~50 us alone and ~125 us beside a
# busy process (bench_split_rows.py at d_model 64: 3x slower split than whole), more than a
# third of a product of fewer than ~2^25 multiply-adds saves (~0.1 ms on one Zen 5 core).
MIN_SPLIT_ROWS = 256
MIN_SPLIT_MACS = 1 << 25
_INSTANCE: WeightGradHelper | None = None  # the process's helper, once made
_MADE = False  # whether `for_this_process` has tried (it tries once)


class Linear(nn.Linear):
    """`nn.Linear` whose weight and bias gradients go to the process's `WeightGradHelper` while
    it is active; otherwise (and always without autograd) exactly `nn.Linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        if torch.is_grad_enabled():
            helper = _INSTANCE
            if helper is not None and helper.active:
                return helper.linear(x, self.weight, self.bias)
        return linear(x, self.weight, self.bias)


class ResidualPort:
    """A post-norm sub-layer's way to add its residual's gradient into a product (§3.1:
    LayerNorm(x + Sublayer(x)) sends x two gradients, the residual's and the sub-layer's).

    Autograd adds the two as a pass of their own over (N, D) after the sub-layer's first
    product of x has made its dx = g W: 30 such adds took ~22 ms of a 1.4 s W1 step. Instead
    `model._Residual` offers a port for x while the sub-layer runs (`offering`); the first
    `_RowMajorGradLinear` of that very x claims it (`_claim`); `model._ResidualNorm`'s backward
    puts its dx for x in the port instead of returning it, and the product's backward adds g W
    into it with oneDNN's accumulating product (`addmm_`, one rounding). The norm's backward
    always runs first: the product's own gradient comes through it. Unclaimed, nothing
    changes; claimed but with the norm not fused, the port stays empty and autograd adds."""

    def __init__(self, x: torch.Tensor):
        self.x: torch.Tensor | None = x  # cleared once the sub-layer has run
        self.claimed = False
        self.grad: torch.Tensor | None = None

    def take(self) -> torch.Tensor | None:
        """The residual's gradient for x, once (None: none was put)."""
        grad, self.grad = self.grad, None
        return grad


_OFFERED: ResidualPort | None = None  # the port of the sub-layer running now


class offering:  # noqa: N801 (a context manager, used as a function)
    """`with offering(port):` the sub-layer's forward, its first product of port.x may claim
    the port (port None: nothing offered)."""

    def __init__(self, port: ResidualPort | None):
        self.port = port

    def __enter__(self) -> None:
        global _OFFERED
        self.outer, _OFFERED = _OFFERED, self.port

    def __exit__(self, *exc) -> None:
        global _OFFERED
        _OFFERED = self.outer
        if self.port is not None:
            self.port.x = None


def _claim(x: torch.Tensor) -> ResidualPort | None:
    """The port offered for x, claimed once (None: none, or claimed already)."""
    port = _OFFERED
    if port is None or port.x is not x or port.claimed:  # (offered only where x needs grad)
        return None
    port.claimed = True
    return port


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias), through `_RowMajorGradLinear` where `own_weight_grads`
    (a training product of many rows on a CPU with native bf16 products), with F.linear's
    values either way. Not the helper's path (`Linear` goes there first)."""
    if torch.is_grad_enabled() and own_weight_grads(weight, x.shape[:-1].numel()):
        # 2-D inside the Function: a view made in there could not be changed in place
        if x.dim() == 2:
            return _RowMajorGradLinear.apply(x, weight, bias, False, _claim(x))
        y = _RowMajorGradLinear.apply(x.reshape(-1, x.size(-1)), weight, bias)
        return y.view(*x.shape[:-1], y.size(-1))
    return F.linear(x, weight, bias)


def linear_relu(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor | None:
    """max(0, layer(x)) (§3.3 eq. (2)'s first half) with the max inside the layer's oneDNN
    product, where the layer goes through `_RowMajorGradLinear` (`linear`) with a bias and the
    compiled kernels run (`kernels.relu_grad` gives its gradient); None elsewhere. The max was
    its own pass over the (N, d_ff) output: 8 ms of a 1.4 s W1 step (docs/performance.md,
    "Round fifty")."""
    if not torch.is_grad_enabled() or active() is not None or not is_linear(layer):
        return None
    weight, bias = layer.weight, layer.bias
    if bias is None or x.dim() != 2 or not own_weight_grads(weight, x.size(0)):
        return None
    if not kernels.fused_takes(x):
        return None
    return _RowMajorGradLinear.apply(x, weight, bias, True, _claim(x))


def stacked_linear(x: torch.Tensor, layers: list[nn.Linear]) -> torch.Tensor | None:
    """[x W_1^T + b_1, x W_2^T + b_2, ...] of layers that read the same x, as one product of
    their stacked weights (self-attention's W^Q and W^KV, §3.2.2): one (N, sum out) output
    whose columns are the layers' in order, one input gradient for x where the layers' would
    be added, and one weight-gradient product of the stacked width, which oneDNN runs at ~2x
    a 512 x 512 one's rate on AMX (docs/performance.md, "Round fifty"). Each layer's weight
    and bias gradients are their rows of the stacked ones (torch.cat's backward). None where
    the helper is active (it adds each layer's gradients to its own weight: `Linear`) or the
    layers are not plain linear layers alike in bias."""
    if active() is not None or not all(is_linear(m) for m in layers):
        return None
    if len({m.bias is None for m in layers}) != 1:
        return None
    weight = torch.cat([m.weight for m in layers])
    bias = None if layers[0].bias is None else torch.cat([m.bias for m in layers])
    return linear(x, weight, bias)


# Weight gradients from row-major copies (`_RowMajorGradLinear`): None decides on first use,
# on whether the CPU multiplies bf16 natively (AMX, or AVX-512 BF16 alone as on a Zen 4) and the
# compiled kernels build (kernels.py). Made for AMX (round twenty-six); on a Zen 4 the W1 step
# ran 1.033-1.038x with them, 1.025x with their fusions alone (the bias added in oneDNN's
# product, db's fp32 column sums, the ReLU in the product, the residual's gradient added by the
# product) and autograd's dW products (docs/performance.md, "Round sixty-four").
ROW_MAJOR_GRADS: bool | None = None
# ... for products over at least this many rows (a layer's input rows, the loss's hidden
# rows): the W1 step's 3,826 gained 4-9% a step; the quickstart's ~1,000 (d_model 256) lost
# 2.8% in the layers and 2.2% in the loss (docs/performance.md, "Round twenty-six").
ROW_MAJOR_ROWS = 2048


def own_weight_grads(weight: torch.Tensor, rows: int) -> bool:
    """Whether a product of this weight over `rows` rows goes through `_RowMajorGradLinear`: a
    bf16 CPU weight that needs a gradient, `ROW_MAJOR_ROWS` rows or more, on a CPU with native
    bf16 products (`cpuinfo.native_bf16`: AMX or AVX-512 BF16)."""
    global ROW_MAJOR_GRADS
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or not weight.requires_grad:
        return False
    if rows < ROW_MAJOR_ROWS:
        return False
    if ROW_MAJOR_GRADS is None:
        ROW_MAJOR_GRADS = bool(cpuinfo.native_bf16()) and kernels.unavailable() is None
    return ROW_MAJOR_GRADS and not torch.compiler.is_compiling()


def row_major_grads(weight: torch.Tensor, rows: int) -> bool:
    """Whether a product of this weight over `rows` rows takes its dW from a row-major copy:
    `own_weight_grads`, and a weight that is not square (a square layer's copy costs what its
    product saves)."""
    return own_weight_grads(weight, rows) and weight.size(0) != weight.size(1)


def row_major_weight_grad(
    g: torch.Tensor, x: torch.Tensor, x_t: Callable[[], torch.Tensor] | None = None
) -> torch.Tensor:
    """dW = g^T x (out, in) for g (N, out), x (N, in), with the product's left operand a
    row-major copy of the narrower side: g^T when the layer narrows, else (x^T g)^T. oneDNN's
    AMX kernels run a left operand that is a transposed view at half their rate (1,027-1,126
    against 1,988-2,262 GFLOP/s at the base model's shapes, docs/performance.md). x_t: gives
    x^T's copy where layers that read the same x share one (`chained_linears`)."""
    if g.size(1) < x.size(1):
        return kernels.transposed(g) @ x
    return kernels.transposed((kernels.transposed(x) if x_t is None else x_t()) @ g)


def _layer_weight_grad(
    g: torch.Tensor, x: torch.Tensor, x_t: Callable[[], torch.Tensor] | None = None
) -> torch.Tensor:
    """dW = g^T x (out, in) for `_RowMajorGradLinear`'s backward. A square layer's on AMX's tiles
    (`kernels.weight_grad`), where oneDNN ran its (512 x 3,888) x (3,888 x 512) from the
    transposed view at ~830 GFLOP/s in a W1 step (~1,150 warm, against 1,500-2,200 for the
    step's other shapes), and a row-major copy's product on one of its two threads; the tiles
    ran ~1,100 in the step, ~1,650 warm (docs/performance.md, "Round fifty-two"). The wider
    layers keep `row_major_weight_grad`, as fast as the tiles in the step."""
    square = g.size(1) == x.size(1)
    if square:
        own = kernels.weight_grad(g, x)
        if own is not None:
            return own
        return g.t() @ x
    return row_major_weight_grad(g, x, x_t)


# `_RowMajorGradLinear`'s forward with the bias added inside oneDNN's product (None: decided
# on first use by `bias_in_product`; False: F.linear's, for a before/after in one process).
BIAS_IN_PRODUCT: bool | None = None


def bias_in_product() -> bool:
    """Whether `mkldnn._linear_pointwise` gives F.linear's bits for bf16 rows with a bias,
    checked once per process on two small shapes (on the AMX Xeon of round forty-eight it did
    in all 144 cases of the base and big models' widths at 2,048-15,360 rows on one and two
    threads, as on these). F.linear (`addmm`) first copies the bias into every output row and
    then multiplies with beta = 1, which reads them back: on that Xeon 34 ms of a 1.6 s W1
    step (a (3,888 x 2,048) layer's forward 4.81 ms against 4.49, a (3,888 x 1,024) one 2.74
    against 1.79; docs/performance.md, "Round forty-eight"). `_linear_pointwise` adds the bias
    to the product's fp32 sums: the same bits there. Where they differ (another oneDNN),
    F.linear's."""
    global BIAS_IN_PRODUCT
    if BIAS_IN_PRODUCT is None:
        BIAS_IN_PRODUCT = False
        if torch.backends.mkldnn.is_available():
            g = torch.Generator().manual_seed(0)
            try:
                same = True
                for rows, k, n in ((320, 64, 96), (64, 96, 48)):
                    x = torch.randn(rows, k, generator=g).bfloat16()
                    w = (torch.randn(n, k, generator=g) * 0.1).bfloat16()
                    b = torch.randn(n, generator=g).bfloat16()
                    fused = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
                    same = same and torch.equal(fused, F.linear(x, w, b))
                BIAS_IN_PRODUCT = same
            except (AttributeError, RuntimeError):  # no such op, or it refused
                pass
    return BIAS_IN_PRODUCT


class _RowMajorGradLinear(torch.autograd.Function):
    """y = x W^T + b (x 2-D) whose dW comes from `_layer_weight_grad` (a square W's from AMX's
    tiles, the others' from `row_major_weight_grad`); dx as autograd's, db the fp32 column sums
    of `kernels.column_sums` where it runs (torch's bf16 sum(0) otherwise: 2.4x slower on
    (3,888 x 2,048), the same sums to bf16 rounding). y has F.linear's bits, the bias
    added inside oneDNN's product where that gives them (`bias_in_product`): F.linear first
    copied the bias into every output row (9 ms of a 1.45 s W1 step for the square layers)."""

    @staticmethod
    def forward(ctx, x, weight, bias, relu=False, port=None):  # noqa: D102
        # relu (`linear_relu`): y = max(0, x W^T + b), the max in oneDNN's product with the bias
        # (relu commutes with the rounding: `kernels.relu_`'s values, a -0 perhaps kept).
        # port: a `ResidualPort` whose gradient dx adds into (claimed for x).
        ctx.has_bias, ctx.relu, ctx.port = bias is not None, relu, port
        if bias is not None and x.is_contiguous() and bias_in_product():
            act = "relu" if relu else "none"
            y = torch.ops.mkldnn._linear_pointwise(x, weight, bias, act, [], "")
        else:
            y = F.linear(x, weight, bias)
            if relu:
                kernels.relu_(y)
        ctx.save_for_backward(x, weight, y if relu else None)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):  # noqa: D102
        return _row_major_backward(ctx, g)


def _row_major_backward(
    ctx,
    g: torch.Tensor,
    x_t: Callable[[], torch.Tensor] | None = None,
    into: torch.Tensor | None = None,
):
    """`_RowMajorGradLinear`'s gradients (x, weight, bias, then None twice) from its ctx (x_t:
    as `row_major_weight_grad`'s; into: a gradient for x that g W adds into, else the port's)."""
    x, weight, y = ctx.saved_tensors  # x (N, in), g (N, out)
    grad_b = None
    want_b = ctx.has_bias and ctx.needs_input_grad[2]
    if ctx.relu:  # through max(0, .): g where y > 0 (torch's threshold_backward)
        if want_b:  # and db's column sums from the same pass (`column_sums`' bits)
            g, grad_b = kernels.relu_grad_sums(g.contiguous(), y)
        else:
            g = kernels.relu_grad(g.contiguous(), y)
    grad_x = None
    if ctx.needs_input_grad[0]:
        residual = into if into is not None or ctx.port is None else ctx.port.take()
        grad_x = g @ weight if residual is None else residual.addmm_(g, weight)
    grad_w = None
    if ctx.needs_input_grad[1]:
        grad_w = _layer_weight_grad(g, x, x_t)
    if want_b and grad_b is None:
        fast = g.dtype == torch.bfloat16 and g.is_contiguous() and kernels.fused_supported()
        grad_b = kernels.column_sums(g) if fast else g.sum(0)  # fp32 sums either way
    return grad_x, grad_w, grad_b, None, None


def chained_linears(x: torch.Tensor, layers: list[nn.Linear]) -> list[torch.Tensor] | None:
    """[layer(x) for layer in layers] for the decoder's encoder-decoder attention, whose N
    layers each project the same encoder output x to keys and values (§3.2.3): the forward's
    values and bits as each layer's own `linear`, but x's gradient made as one sum, each product
    g_i W_i added into the later layers' sum by oneDNN's accumulating product (`addmm_`, one
    rounding each), where autograd made each g_i W_i and then added them in passes of their own
    over (N, D) (5 of ~1.45 ms in a W1 step). `_ChainedLinear` passes the sum from layer to
    layer: layer i reads x through layer i - 1's second output, an alias of x, whose gradient
    is the sum so far. None where a layer would not go through `_RowMajorGradLinear` (`linear`:
    not a training product of many rows with native bf16 products, or the helper active)."""
    if not torch.is_grad_enabled() or active() is not None or x.dim() != 2 or not layers:
        return None
    if not all(is_linear(m) and own_weight_grads(m.weight, x.size(0)) for m in layers):
        return None
    outs, through, shared = [], x, _SharedTranspose(x, len(layers))
    for i, m in enumerate(layers):
        last = i == len(layers) - 1
        y, through = _ChainedLinear.apply(through, m.weight, m.bias, not last, shared)
        outs.append(y)
    return outs


class _ChainedLinear(torch.autograd.Function):
    """`_RowMajorGradLinear` (no max, no port) with a second output when `chain`: x itself (an
    alias), which the next layer of `chained_linears` reads as its input. The gradient that
    comes back through it is the later layers' sum of g W, and this layer adds its own into it
    (`addmm_`) instead of returning g W for autograd to add."""

    @staticmethod
    def forward(ctx, x, weight, bias, chain, shared):  # noqa: D102
        ctx.set_materialize_grads(False)  # the last layer's alias: no gradient, not zeros
        ctx.shared = shared
        y = _RowMajorGradLinear.forward(ctx, x, weight, bias)
        return y, (x.view_as(x) if chain else None)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g, later):  # noqa: D102
        shared = ctx.shared
        if g is None:  # this layer's output unused: the later layers' sum goes on as it is
            shared.done()
            return later, None, None, None, None
        grad_x, grad_w, grad_b, _, _ = _row_major_backward(ctx, g, shared.get, into=later)
        shared.done()
        return grad_x, grad_w, grad_b, None, None


class _SharedTranspose:
    """x^T's row-major copy for the weight gradients of `chained_linears`' layers: made by the
    first that asks (`get`), dropped once each has been through its backward (`done`): one
    copy where each layer made its own (5 of ~0.45 ms in a W1 step)."""

    def __init__(self, x: torch.Tensor, users: int):
        self.x, self.users, self.copy = x, users, None

    def get(self) -> torch.Tensor:
        if self.copy is None:
            self.copy = kernels.transposed(self.x)
        return self.copy

    def done(self) -> None:
        self.users -= 1
        if self.users <= 0:
            self.copy = None


def is_linear(module: nn.Module) -> bool:
    """Whether `module` is a plain linear layer: `nn.Linear` or this module's `Linear`."""
    return type(module) in (nn.Linear, Linear)


def _weight_grads(g: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """dW = dy^T x (out, in) and db = sum dy (out,) of y = x W^T + b over all leading dims."""
    g2 = g.reshape(-1, g.shape[-1])  # (N, out)
    x2 = x.reshape(-1, x.shape[-1])  # (N, in)
    return g2.t() @ x2, g2.sum(0)


def _product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a^T b: the loss's (V, n) x (n, D) projection gradient."""
    return a.t() @ b


def _claimed_weight_grads(
    g: torch.Tensor, x: torch.Tensor, claim: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_weight_grads`, unless the training thread claimed the job first (`claim` nonzero):
    then two empty tensors. Neither side waits for the other: if both read 0 at once, both
    compute the same gradients and `finish` uses the training thread's."""
    if bool(claim[0] != 0):
        empty = torch.empty(0)
        return empty, empty
    claim[0] = 1
    return _weight_grads(g, x)


def _rows(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor
) -> torch.Tensor:
    """out = x W^T (+ b): some rows of a linear layer's output, written in place."""
    if bias is None:
        return torch.mm(x, weight.t(), out=out)
    return torch.addmm(bias, x, weight.t(), out=out)


def _launch_rows(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor
) -> torch.jit.Future[torch.Tensor]:
    return torch.jit.fork(_rows, x, weight, bias, out)


def _launch_weight_grads(
    g: torch.Tensor, x: torch.Tensor, claim: torch.Tensor
) -> torch.jit.Future[tuple[torch.Tensor, torch.Tensor]]:
    return torch.jit.fork(_claimed_weight_grads, g, x, claim)


def _launch_product(a: torch.Tensor, b: torch.Tensor) -> torch.jit.Future[torch.Tensor]:
    return torch.jit.fork(_product, a, b)


class _Job:
    """One layer's deferred dW, db: its inputs, whether a thread has claimed it, and the
    gradients if the training thread computed them (`WeightGradHelper.finish`)."""

    __slots__ = ("claim", "g", "x", "grads")

    def __init__(self, g: torch.Tensor, x: torch.Tensor) -> None:
        self.claim = torch.zeros(1, dtype=torch.uint8)  # 1: a thread has taken it
        self.g, self.x = g, x
        self.grads: tuple[torch.Tensor, torch.Tensor] | None = None


class _DeferredLinear(torch.autograd.Function):
    """y = x W^T + b; backward returns dx now and hands dW, db to the helper."""

    @staticmethod
    def forward(ctx, x, weight, bias, helper):  # noqa: D102
        ctx.save_for_backward(x)
        # The parameters themselves (leaves): their .grad is where `finish` adds.
        ctx.helper, ctx.weight, ctx.bias = helper, weight, bias
        return helper.split_linear(x, weight, bias)

    @staticmethod
    def backward(ctx, g):  # noqa: D102
        (x,) = ctx.saved_tensors
        grad_x = g @ ctx.weight if ctx.needs_input_grad[0] else None  # the path down: now
        ctx.helper.defer_linear(g, x, ctx.weight, ctx.bias)
        return grad_x, None, None, None


class WeightGradHelper:
    """Computes weight gradients on torch's inter-op thread while it is `active`.

    Made by `for_this_process` (one per process: the inter-op pool is the process's).
    """

    def __init__(self, pool_thread: int, cpus: set[int]) -> None:
        self.active = False
        self._pool_thread, self._cpus = pool_thread, cpus
        self._steer_to: int | None = None  # the CPU the helper was last kept off
        self._pending: list[tuple[object, Callable]] = []  # (future, what to do with its value)
        self._jobs: list[_Job] = []  # the weight-gradient jobs queued since `finish`
        self.taken = 0  # how many of them the training thread computed in the last `finish`
        self._getcpu = ctypes.CDLL(None, use_errno=True).sched_getcpu
        self._launch_weight_grads = _SCRIPTED["weight_grads"]
        self._launch_product = _SCRIPTED["product"]
        self._launch_rows = _SCRIPTED["rows"]

    @classmethod
    def for_this_process(cls) -> WeightGradHelper | None:
        """The process's helper, made on the first call; None where it cannot help: fewer than
        2 usable CPUs, no Linux affinity calls, or an inter-op pool already started (by
        other code) that is not one thread this module can find."""
        global _INSTANCE, _MADE
        if _MADE:
            return _INSTANCE
        _MADE = True
        if not hasattr(os, "sched_setaffinity"):
            return None
        cpus = set(os.sched_getaffinity(0))
        if len(cpus) < 2 or cpuinfo.usable_cores() < 2:  # under a quota of one CPU it only waits
            return None
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:  # the pool has started: its size is what it is
            pass
        if torch.get_num_interop_threads() != 1:
            return None
        try:
            _script()
        except Exception as e:  # noqa: BLE001 (TorchScript is deprecated: a torch without it)
            logger.debug("TorchScript unavailable (%s): no weight-gradient helper", e)
            return None
        before = _threads()
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # the pool thread takes the count current when it starts
        try:
            # Three calls each: TorchScript compiles on the first (~20 ms) and profiles on the
            # next, which would otherwise fall in the tuner's timed units.
            for _ in range(3):
                one = torch.zeros(1, 1)
                _SCRIPTED["product"](one, one).wait()
                _SCRIPTED["weight_grads"](one, one, torch.zeros(1, dtype=torch.uint8)).wait()
                _SCRIPTED["rows"](one, one, None, torch.empty(1, 1)).wait()
        finally:
            torch.set_num_threads(threads)
        new = [t for t, name in _threads().items() if t not in before and name == "PTThreadPool"]
        if len(new) != 1:
            logger.debug("no inter-op pool thread found (%s): no weight-gradient helper", new)
            return None
        _INSTANCE = cls(new[0], cpus)
        return _INSTANCE

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        """F.linear(x, weight, bias), its weight gradients deferred (when weight needs one)."""
        if not weight.requires_grad or (bias is not None and not bias.requires_grad):
            return F.linear(x, weight, bias)
        return _DeferredLinear.apply(x, weight, bias, self)

    def split_linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """F.linear(x, weight, bias) with the last SPLIT_SHARE of its rows on the helper, the
        rest here, at once (forward passes; nothing else is queued on the helper then); a
        product of fewer than MIN_SPLIT_ROWS rows or MIN_SPLIT_MACS multiply-adds stays whole."""
        x2 = x.reshape(-1, x.shape[-1])
        n = x2.shape[0]
        macs = n * x2.shape[1] * weight.shape[0]
        if n < MIN_SPLIT_ROWS or macs < MIN_SPLIT_MACS or not x2.is_contiguous():
            return F.linear(x, weight, bias)
        rows = int(n * SPLIT_SHARE) // 16 * 16  # whole blocks of rows for either side
        # Made in its final shape: an autograd Function may not return a view of its own.
        out = x.new_empty(*x.shape[:-1], weight.shape[0])
        out2 = out.view(n, weight.shape[0])
        w, b = weight.detach(), None if bias is None else bias.detach()
        self._steer()
        future = self._launch_rows(x2[n - rows :].detach(), w, b, out2[n - rows :])
        _rows(x2[: n - rows].detach(), w, b, out2[: n - rows])
        self.wait(future)
        return out

    def defer_linear(self, g, x, weight, bias) -> None:
        """Queue dW = g^T x (and db = sum g) of a linear layer, added to .grad by `finish`."""

        def add(grads):
            if job.grads is not None:  # the training thread computed them (`finish`)
                grads = job.grads
            accumulate_grad(weight, grads[0])
            if bias is not None:
                accumulate_grad(bias, grads[1])

        self._steer()
        # Detached: the job runs with grad mode on, and x is an activation that needs grad.
        job = _Job(g.detach(), x.detach())
        self._jobs.append(job)
        self._pending.append((self._launch_weight_grads(job.g, job.x, job.claim), add))

    def product(self, a: torch.Tensor, b: torch.Tensor):
        """a^T b, started now: a future (`.wait()` gives the product)."""
        self._steer()
        return self._launch_product(a.detach(), b.detach())

    def at_finish(self, use: Callable[[], None]) -> None:
        """Call use() in `finish`, after the gradients queued before it."""
        self._pending.append((None, lambda _: use()))

    def finish(self) -> None:
        """Wait for the queued gradients and add them to .grad, in the order they were queued
        (a job's error is raised here).

        Rather than wait idle while the helper works through its backlog (beside a busy
        process the helper has half a core; the wait was ~11% of a quickstart step), the
        training thread computes the weight-gradient jobs at the end of the helper's queue
        itself, each one the helper has not started, until it meets one the helper has (the
        helper takes them in order: every earlier one is then done or running there)."""
        pending, self._pending = self._pending, []
        jobs, self._jobs = self._jobs, []
        self.taken = 0
        with torch.no_grad():  # as autograd adds to .grad: nothing of it is recorded
            for job in reversed(jobs):
                if int(job.claim[0]) != 0:
                    break
                job.claim[0] = 1
                job.grads = _weight_grads(job.g, job.x)
                self.taken += 1
            for job in jobs:  # this side's hold on the activations (a running job keeps its own)
                job.g = job.x = None
            for future, use in pending:
                use(None if future is None else self.wait(future))

    def discard(self) -> None:
        """Drop queued work (a step that raised before `finish`)."""
        for future, _ in self._pending:
            if future is not None:
                future.wait()
        self._pending, self._jobs = [], []

    def wait(self, future: torch.jit.Future):
        """The value of a job started on the helper (`future.wait()`: its error raised here),
        the helper moved to this thread's CPU first where the job is not done yet: this thread
        sleeps until it is (module docstring)."""
        if not future.done():
            self._lend()
        return future.wait()

    def _lend(self) -> None:
        """Let the helper onto the training thread's CPU, about to be left idle by a wait for
        it; the next job's `_steer` keeps it off again."""
        cpu = self._getcpu()
        if cpu < 0:
            return
        try:
            os.sched_setaffinity(self._pool_thread, {cpu})
        except OSError:  # a CPU taken away (cpuset) since: leave the helper where it is
            return
        self._steer_to = None  # not kept off any CPU now

    def _steer(self) -> None:
        """Keep the helper off the training thread's CPU (module docstring)."""
        cpu = self._getcpu()
        if cpu == self._steer_to or cpu < 0:
            return
        try:
            os.sched_setaffinity(self._pool_thread, self._cpus - {cpu} or self._cpus)
        except OSError:  # a CPU taken away (cpuset) since: let the kernel place it
            os.sched_setaffinity(self._pool_thread, os.sched_getaffinity(0))
        self._steer_to = cpu


def accumulate_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """param.grad += grad, as autograd accumulates (set when there is none yet)."""
    if param.grad is None:
        param.grad = grad.to(param.dtype)
    else:
        param.grad += grad


# Master gradients (fp32) that a few gradients go to directly, past the parameter's own .grad.
# Not in the paper. With bf16 parameters (`optim.MixedPrecisionAdam`) the tied (V, D) weight
# of §3.4 gets three gradients a step: the §5.4 loss's, computed in fp32 (loss.py), and the two
# embedding lookups'. Through autograd each became a bf16 (V, D) tensor (the loss's rounded
# from fp32, each lookup's a zero-filled (V, D) tensor with its rows added), autograd summed
# them in bf16, and the optimizer made the sum fp32 again: eight passes over 16M elements, ~1%
# of a base training step, and three bf16 roundings of the one gradient that sums over every
# target token. Now the loss adds its fp32 gradient to the master's and each lookup adds its
# rows there (`add_to_master`, `MasterEmbedding`); the other parameters are as before.
_MASTERS = torch.utils.weak.WeakIdKeyDictionary()  # parameter -> weakref to its fp32 master


def set_master(param: torch.Tensor, master: torch.Tensor) -> None:
    """Send param's master-aware gradients (`add_to_master`) to master.grad (fp32). Held
    weakly both ways: when the optimizer that owns the master goes, they go to param.grad
    again. CPU only: on CUDA `index_add_` is not deterministic (train.deterministic), and
    autograd's own embedding gradient is."""
    if param.device.type == "cpu":
        _MASTERS[param] = weakref.ref(master)


def master_of(param: torch.Tensor) -> torch.Tensor | None:
    """The fp32 master set for param (`set_master`) while it lives, else None."""
    ref = _MASTERS.get(param)
    return None if ref is None else ref()


def add_to_master(param: torch.Tensor, grad: torch.Tensor, rows: torch.Tensor | None = None):
    """master.grad += grad in fp32 (`rows`: grad's rows added at those rows, as an embedding
    lookup's gradient), where param has a master; param.grad otherwise, in param's dtype, as
    autograd would. A grad that is fp32 and whole may become the master's .grad itself."""
    master = master_of(param)
    if master is None:
        if rows is not None:
            grad = torch.zeros_like(param).index_add_(0, rows, grad.to(param.dtype))
        accumulate_grad(param, grad.to(param.dtype))
        return
    if rows is not None:
        if master.grad is None:
            master.grad = torch.zeros_like(master)
        master.grad.index_add_(0, rows, grad.float())
    elif master.grad is None:
        master.grad = grad if grad.dtype == torch.float32 else grad.float()
    else:
        master.grad += grad


class MasterEmbedding(torch.autograd.Function):
    """`F.embedding(ids, weight)` (1-D ids, no padding_idx) whose gradient goes to the
    weight's master (`add_to_master`): rows added in fp32, no (V, D) bf16 gradient made."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, ids: torch.Tensor):  # noqa: D102
        ctx.save_for_backward(ids)
        ctx.weight = weight
        return weight.index_select(0, ids)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        (ids,) = ctx.saved_tensors
        add_to_master(ctx.weight, grad, rows=ids)
        return None, None


class MasterEmbeddingSum(torch.autograd.Function):
    """The packed path's embedding sub-layer (`model._embed_packed`: the lookup times sqrt(d),
    plus the positions' encodings, through §5.4's dropout) in one pass each way
    (`kernels.embed`, `kernels.embed_backward`): the bits of `MasterEmbedding`, `*`, `+` and
    `model._KeepScale`, forward and backward, the gradient added into the weight's master as
    `add_to_master` adds it (index_add_'s order), where those were seven passes over (N, D)
    and a serial index_add_ (~8 ms of a W1 step for the two embeddings)."""

    @staticmethod
    def forward(ctx, weight, ids, table, pos, scale, keep, keep_scale):  # noqa: D102
        ctx.save_for_backward(ids, keep)
        ctx.weight, ctx.scale, ctx.keep_scale = weight, scale, keep_scale
        return kernels.embed(weight, ids, table, pos, scale, keep, keep_scale)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        ids, keep = ctx.saved_tensors
        master = master_of(ctx.weight)
        if master is None:  # its optimizer gone since the forward: the ops' own backward
            if keep is not None:
                grad = (grad * keep.view(torch.uint8).to(grad.dtype)).mul_(ctx.keep_scale)
            add_to_master(ctx.weight, grad * ctx.scale, rows=ids)  # to the weight's .grad
            return (None,) * 7
        if master.grad is None:
            master.grad = torch.zeros_like(master)
        kernels.embed_backward(grad.contiguous(), ids, ctx.scale, keep, ctx.keep_scale, master.grad)
        return (None,) * 7


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.embedding(ids, weight)`; through `MasterEmbedding` where the gradient would go to a
    master (1-D ids, gradient wanted)."""
    if ids.dim() == 1 and torch.is_grad_enabled() and weight.requires_grad:
        if master_of(weight) is not None:
            return MasterEmbedding.apply(weight, ids)
    return F.embedding(ids, weight)


def finish() -> None:
    """`finish` of the process's helper, if one was made (a no-op otherwise)."""
    if _INSTANCE is not None:
        _INSTANCE.finish()


def active() -> WeightGradHelper | None:
    """The process's helper while it is active, else None."""
    return _INSTANCE if _INSTANCE is not None and _INSTANCE.active else None


_SCRIPTED: dict[str, Callable] = {}


def _script() -> None:
    """Compile the launchers: TorchScript's `fork` runs asynchronously only when scripted."""
    if not _SCRIPTED:
        with warnings.catch_warnings():  # torch 2.13 calls torch.jit.script deprecated
            warnings.simplefilter("ignore", DeprecationWarning)
            _SCRIPTED["weight_grads"] = torch.jit.script(_launch_weight_grads)
            _SCRIPTED["product"] = torch.jit.script(_launch_product)
            _SCRIPTED["rows"] = torch.jit.script(_launch_rows)


def _threads() -> dict[int, str]:
    """This process's threads: id -> name."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm", encoding="utf-8") as f:
                out[int(tid)] = f.read().strip()
        except OSError:  # ended meanwhile
            pass
    return out
