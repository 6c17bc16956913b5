"""§5.4 label-smoothed cross-entropy: a reference on logits and a memory-lean chunked version.

Smoothing denominator (see docs/training.md): the target class gets probability 1 - eps_ls and
each of the other V - 1 classes gets eps_ls / (V - 1), as in the authors' tensor2tensor
(`smoothing_cross_entropy`: low_confidence = (1 - confidence) / (vocab_size - 1)) and fairseq
(`eps_i = epsilon / (V - 1)`). PyTorch's `F.cross_entropy(label_smoothing=eps)` spreads eps over
all V classes instead (the target gets 1 - eps + eps / V). Padding positions are excluded.

Both functions return sums over the real tokens; the trainer divides by the number of target
tokens in the whole (accumulated, all-rank) batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from transformer import gradhelper, kernels
from transformer.tokenizer import PAD_ID

# Rows of the (N, V) logits built at once by the chunked loss: 2048 x 37k is ~150 MB in bf16
# (~300 MB in fp32). On an AMX Xeon a W1 step (3,826 target rows, V 32,000, bf16) took 1,944 ms
# at 1,024 rows, 1,830 at 2,048 and 1,818 at 4,096 (one chunk), alternated step by step: the
# (n, V) x (V, D) products run at twice the rate with twice the rows (docs/performance.md, "Round
# twenty-four"); on a Zen 5 the loss took 473 / 476 / 469 ms at the three sizes ("Round fifteen").
CHUNK_ROWS = 2048
# Each chunk's rows as a multiple of this, the last chunk's padded with zero rows (`_chunks`).
ALIGN = 4
# Below this target probability the chunked loss takes log-sum-exp from the logits themselves
# instead of from the (bf16) softmax, whose values lose precision near the float range's end.
UNDERFLOW = 1e-30


def smoothed_target_loss(lprobs: torch.Tensor, target: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-row §5.4 loss -sum_c q_c log p_c, with q = 1 - eps on the target, eps / (V - 1) else.

    Args:
        lprobs: (N, V) log-probabilities.
        target: (N,) class ids.
        eps: eps_ls.

    Returns:
        (N,) per-row loss.
    """
    n_classes = lprobs.size(-1)
    nll = -lprobs.gather(-1, target[:, None]).squeeze(-1)  # (N,)
    if eps == 0.0:
        return nll
    eps_other = eps / (n_classes - 1)
    total = -lprobs.sum(-1)  # (N,) sum over all V classes
    # sum over c != target of eps_other * (-log p_c) = eps_other * (total - nll)
    return (1.0 - eps) * nll + eps_other * (total - nll)


def label_smoothed_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, eps: float, ignore_index: int = PAD_ID
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference §5.4 loss on full logits, positions with `target == ignore_index` excluded.

    Args:
        logits: (..., V) unnormalized scores (any float dtype; the log-softmax runs in fp32).
        target: (...) class ids.
        eps: eps_ls (§5.4: 0.1).
        ignore_index: target id whose positions are excluded (padding).

    Returns:
        (loss, nll): scalar sums over the non-ignored positions of the smoothed loss and of the
        plain negative log-likelihood (the latter gives perplexity).
    """
    logits = logits.reshape(-1, logits.size(-1))  # (N, V)
    target = target.reshape(-1)  # (N,)
    keep = target != ignore_index
    lprobs = F.log_softmax(logits[keep].float(), dim=-1)  # (n, V)
    tgt = target[keep]
    loss = smoothed_target_loss(lprobs, tgt, eps).sum()
    nll = -lprobs.gather(-1, tgt[:, None]).sum()
    return loss, nll


def _chunks(n_rows: int, chunk_rows: int, align: int = ALIGN) -> list[tuple[int, int]]:
    """Row ranges of about chunk_rows rows (at most chunk_rows rounded up to a multiple of
    `align`), as equal as can be in multiples of `align`, the last one with the n_rows % align
    rows left over (`_ChunkedProjectionLoss` pads it with zero rows to a multiple of `align`).
    On CPU the (n, V) products of a chunk whose row count is not a multiple of 4 ran 7-20%
    slower (3,826 rows: 4 x 956 + 2, not 3 x 1,024 + 754 or 4 x 957); the 2 rows on their own
    took 11 ms of a 1.45 s W1 step, two (n, V) products and a (V, D) sum of their own
    (docs/performance.md, "Round fifty")."""
    body = n_rows - n_rows % align
    size = chunk_rows
    if body:
        n_chunks = -(-body // max(chunk_rows, align))
        size = max(align, -(-body // n_chunks // align) * align)
    bounds = [(a, min(a + size, body)) for a in range(0, body, size)]
    if body < n_rows:
        bounds[-1:] = [(bounds[-1][0] if bounds else 0, n_rows)]
    return bounds


def _softmax_(logits: torch.Tensor) -> torch.Tensor:
    """softmax over V, written over the (n, V) logits: `kernels.softmax_` in bf16 on a CPU
    with the compiled kernels (torch's took 23.7 ms a 1,912-row chunk there, it 16.4), torch's
    elsewhere; fp32 inside either way."""
    if kernels.fused_takes(logits):
        return kernels.softmax_(logits)
    return torch.ops.aten._softmax.out(logits, -1, False, out=logits)


def _padded(n: int) -> int:
    """n rows rounded up to a multiple of ALIGN."""
    return -(-n // ALIGN) * ALIGN


def _class_sum(weight: torch.Tensor) -> torch.Tensor:
    """sum_c W_c (D,) in fp32 of the output projection (V, D): in bf16 by `kernels.column_sums`
    in one pass, where `weight.float().sum(0)` made an fp32 copy first (9 ms of a 1.45 s W1
    step: docs/performance.md, "Round fifty")."""
    if kernels.fused_takes(weight):
        return kernels.column_sums(weight.detach(), fp32=True)
    return weight.float().sum(0)


class _ChunkedProjectionLoss(torch.autograd.Function):
    """Projection + log-softmax + §5.4 loss, chunk by chunk, with the gradient computed in the
    forward pass, so no (N, V) tensor is ever stored for backward (only (N, D) and (V, D))."""

    @staticmethod
    def forward(ctx, hidden, weight, target, eps, chunk_rows):  # noqa: D102
        n_rows, n_classes = hidden.size(0), weight.size(0)
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_grad else None
        # d loss / d weight: sum over chunks of probs^T h, then q's part (below). In fp32 the
        # products accumulate into the fp32 gradient themselves. In bf16 they accumulate into a
        # bf16 (V, D) sum (`addmm_`: oneDNN adds in fp32 and rounds once per chunk, as each
        # chunk's own bf16 product was rounded before), made fp32 once at the end: an fp32 +=
        # bf16 per chunk cast the whole (V, D) product to fp32 first (~2% of a base step).
        fp32_sum = weight.dtype == torch.float32
        grad_weight = None
        # Beside a busy process the (V, D) products go to the weight-gradient helper thread
        # (gradhelper.py), at most three in flight: each holds its (n, V) block until done.
        helper = gradhelper.active() if ctx.needs_input_grad[1] and weight.is_leaf else None
        parts: list = []  # the helper's products not yet waited for
        if need_grad and (fp32_sum or helper is not None):
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        partial = None  # bf16: the sum of probs^T h over the chunks so far
        # With native bf16 products (gradhelper.row_major_grads: AMX, AVX-512 BF16) as (D, V) =
        # h^T probs, whose left operand is then a row-major copy: oneDNN runs probs^T (a
        # transposed view) at half its rate on AMX (on a Zen 4 the whole path won 3%).
        row_major = ctx.needs_input_grad[1] and gradhelper.row_major_grads(weight, n_rows)
        loss = hidden.new_zeros((), dtype=torch.float32)
        nll = hidden.new_zeros((), dtype=torch.float32)
        eps_other = eps / (n_classes - 1)
        on_target = 1.0 - eps - eps_other  # q at the target minus the eps_other every class has
        w_sum = _class_sum(weight)  # (D,) fp32: sum over classes of the logits = h . w_sum
        h_sum = torch.zeros(hidden.size(1), dtype=torch.float32, device=hidden.device)
        bounds = _chunks(n_rows, chunk_rows)
        # Every chunk's logits in one (n, V) block, made once and overwritten chunk by chunk.
        # A block freed and made again per chunk could land above the one before: glibc
        # may split the freed block to serve a small allocation made in between, and the
        # next chunk's no longer fits in what is left (W3's peak at ~4k tokens then +245 MB
        # in fp32 in some processes: docs/performance.md, "Round thirty-three"). The helper
        # holds its chunks' blocks until its products are done: a block each there.
        block = None
        if helper is None and bounds:
            rows = max(_padded(stop - start) for start, stop in bounds)
            block = torch.empty((rows, n_classes), dtype=weight.dtype, device=weight.device)
        # The logits h W^T: oneDNN's AMX product reads W's (V, D) rows as a transposed right
        # operand at ~1,550 GFLOP/s, a row-major (D, V) copy of W^T at ~2,300-2,400 (a
        # 1,912-row chunk at V 32,000, D 512: 38.8-40.3 -> 25.9-26.6 ms; the copy 3.4-4.7 ms
        # a step; docs/performance.md, "Round fifty-four"). Where the (V, D) gradient comes
        # from row-major copies too (native bf16 products, >= ROW_MAJOR_ROWS rows). The two
        # sum each logit's products in other orders: the same values to bf16's rounding.
        copied = row_major and block is not None
        right = kernels.transposed(weight.detach()) if copied else weight.t()  # (D, V)
        for start, stop in bounds:
            n = stop - start
            h = hidden[start:stop]  # (n, D)
            t = target[start:stop]  # (n,)
            # The products' rows: h, with zero rows to a multiple of ALIGN (the last chunk).
            # A zero row's logits are 0 and its softmax 1 / V; it adds nothing to the (V, D)
            # product h^T probs, and its loss and (n, D) gradient rows are not read.
            hp = h
            if _padded(n) > n:
                hp = torch.cat([h, h.new_zeros(_padded(n) - n, h.size(1))])
            # Beside a busy process, with nothing of the helper's in flight, a third of the
            # two (n, V) x D products' rows runs on it (`split_linear`, SPLIT_SHARE).
            split = helper.split_linear if helper is not None and not parts else F.linear
            # (n, V) (the padded rows after), in the parameters' dtype (bf16 matmul)
            if block is not None:
                logits = torch.mm(hp, right, out=block[: hp.size(0)])
            else:
                logits = split(hp, weight)
            logit_t = logits[:n].gather(-1, t[:, None]).squeeze(-1).float()  # (n,)
            # The softmax, written over the logits (the kernel reads each row before it writes
            # it; the same values as a new tensor, ~3x faster as no page is newly touched), is
            # the one (n, V) block: it gives the gradient, and with two per-row numbers the
            # loss. In the parameters' dtype, fp32 inside the kernel.
            probs = _softmax_(logits)  # (n, V)
            del logits
            # sum_c logit_c as h . sum_c W_c: (n, V).sum(dtype=fp32) made an fp32 copy of the
            # logits first (~3% of a base training step).
            h32 = h.float()  # (n, D)
            logit_sum = h32 @ w_sum  # (n,)
            p_t = probs[:n].gather(-1, t[:, None]).squeeze(-1).float()  # (n,)
            lse = logit_t - p_t.log()  # (n,) log sum_c exp(logit_c)
            tiny = p_t < UNDERFLOW  # target probability too small to carry the precision
            if bool(tiny.any()):  # those rows' logits again (rare: a diverging model)
                lse[tiny] = torch.logsumexp(F.linear(h[tiny], weight).float(), dim=-1)
            row_nll = lse - logit_t  # (n,)
            total = n_classes * lse - logit_sum  # (n,) sum over all V classes of -log p_c
            # As smoothed_target_loss: (1 - eps) * nll + eps_other * (total - nll).
            loss += ((1.0 - eps) * row_nll + eps_other * (total - row_nll)).sum()
            nll += row_nll.sum()
            if need_grad:
                # d loss / d logits = softmax - q. q (eps_other everywhere, 1 - eps at the target)
                # is applied to the (n, D) and (V, D) products below instead of to the logits.
                g_h = split(probs, weight.t())[:n].float()  # (n, D) = probs @ weight
                g_h -= eps_other * w_sum + on_target * weight.index_select(0, t).float()
                grad_hidden[start:stop] = g_h
                if helper is not None:
                    parts.append(helper.product(probs, hp))
                    if len(parts) > 2:
                        grad_weight += helper.wait(parts.pop(0))
                elif fp32_sum:  # accumulated by the product itself: no (V, D) temporary
                    grad_weight.addmm_(probs.t(), hp)
                elif row_major:  # (D, V) = h^T probs from a row-major copy of h^T
                    h_t = kernels.transposed(hp)  # (D, n)
                    partial = h_t @ probs if partial is None else partial.addmm_(h_t, probs)
                elif partial is None:
                    partial = probs.t() @ hp  # (V, D)
                else:
                    partial.addmm_(probs.t(), hp)
                h_sum += h32.sum(0)
            # With the helper: freed before the next chunk's logits are made (with or without
            # the gradient), not when the name is rebound after them: otherwise two (n, V)
            # blocks are alive at once.
            del probs
        del block, right
        if need_grad and helper is not None:
            # d loss / d weight is finished in the helper's `finish`, after backward.
            ctx.helper, ctx.weight, ctx.parts = helper, weight, parts
            ctx.weight_rest = (grad_weight, target, hidden, on_target, eps_other * h_sum)
            ctx.save_for_backward(grad_hidden)
        elif need_grad:
            if grad_weight is None and partial is not None:  # bf16
                if row_major:
                    partial = kernels.transposed(partial)  # (D, V) -> (V, D)
                grad_weight = _minus_q(partial, target, hidden, on_target, eps_other * h_sum)
            else:
                if grad_weight is None:
                    grad_weight = weight.new_zeros(weight.shape, dtype=torch.float32)
                _subtract_q(grad_weight, target, hidden, on_target, eps_other * h_sum)
            if not fp32_sum and gradhelper.master_of(weight) is not None:
                # To the weight's fp32 master as it is (gradhelper.add_to_master), in backward.
                ctx.weight, ctx.grad_weight = weight, grad_weight
                ctx.save_for_backward(grad_hidden)
            else:
                ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype))
        ctx.mark_non_differentiable(nll)
        return loss, nll

    @staticmethod
    def backward(ctx, grad_loss, grad_nll):  # noqa: ARG004, D102
        if getattr(ctx, "helper", None) is not None:
            (grad_hidden,) = ctx.saved_tensors
            ctx.helper.at_finish(lambda: _finish_weight_grad(ctx, grad_loss))
            return grad_hidden * grad_loss.to(grad_hidden.dtype), None, None, None, None
        if hasattr(ctx, "grad_weight"):  # for the weight's master
            if ctx.grad_weight is None:
                raise RuntimeError("the loss's weight gradient went to its master: one backward")
            (grad_hidden,) = ctx.saved_tensors
            grad_weight, ctx.grad_weight = ctx.grad_weight, None  # the master may keep it
            if bool(grad_loss != 1.0):
                grad_weight = grad_weight * grad_loss
            gradhelper.add_to_master(ctx.weight, grad_weight)
            return grad_hidden * grad_loss.to(grad_hidden.dtype), None, None, None, None
        grad_hidden, grad_weight = ctx.saved_tensors
        scale = grad_loss.to(grad_hidden.dtype)
        return grad_hidden * scale, grad_weight * scale, None, None, None


def _finish_weight_grad(ctx, grad_loss: torch.Tensor) -> None:
    """The deferred d loss / d weight (`_ChunkedProjectionLoss` beside a busy process): the
    helper's products summed in fp32, q's part, the scale; added to the weight's .grad."""
    grad_weight, *q = ctx.weight_rest
    for part in ctx.parts:
        grad_weight += ctx.helper.wait(part)
    _subtract_q(grad_weight, *q)
    gradhelper.add_to_master(ctx.weight, grad_weight * grad_loss)  # else to .grad, its dtype
    ctx.parts, ctx.weight_rest = [], None


def _minus_q(partial, target, hidden, on_target: float, eps_h_sum) -> torch.Tensor:
    """partial.float() with `_subtract_q` done to it, the same bits, in one pass over (V, D)
    where the copy, index_add_ and -= made three (9 ms of a W1 step; `kernels.widen_minus`):
    the target rows' sums made first on their own rows, in index_add_'s order, then each row
    less eps_h_sum."""
    if not (kernels.fused_takes(partial) and partial.dim() == 2 and partial.size(1) % 16 == 0):
        grad_weight = partial.float()
        _subtract_q(grad_weight, target, hidden, on_target, eps_h_sum)
        return grad_weight
    rows, at = torch.unique(target, return_inverse=True)  # the target rows, each once
    sums = partial.index_select(0, rows).float().index_add_(0, at, hidden.float(), alpha=-on_target)
    grad_weight = kernels.widen_minus(partial, eps_h_sum)
    return grad_weight.index_copy_(0, rows, sums.sub_(eps_h_sum))


def _subtract_q(grad_weight, target, hidden, on_target: float, eps_h_sum) -> None:
    """d loss / d weight -= q's part (fp32, in place): on_target times each row's hidden state
    at its target's row, and eps_other times the sum of the hidden states at every row."""
    grad_weight.index_add_(0, target, hidden.float(), alpha=-on_target)
    grad_weight -= eps_h_sum


def chunked_label_smoothed_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    eps: float,
    chunk_rows: int = CHUNK_ROWS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The §5.4 loss of the pre-softmax projection of the non-pad hidden states, in row chunks.

    Equal to `label_smoothed_cross_entropy(hidden @ weight.T, target, eps)` but builds at most
    `chunk_rows` x V logits at a time and keeps none of them for backward: the gradient with
    respect to the logits, softmax - q, is folded into (N, D) and (V, D) gradients during the
    forward pass. The softmax (fp32 arithmetic, stored in the parameters' dtype) overwrites
    the chunk's logits: one (n, V) block at a time; the loss comes from it and two per-row
    numbers (docs/performance.md), and q is applied to the small products, not to the block.

    Args:
        hidden: (N, D) decoder states of the non-pad target positions only.
        weight: (V, D) output projection (the shared embedding when tied, §3.4).
        target: (N,) the ids those positions predict (no padding).
        eps: eps_ls.
        chunk_rows: rows of logits per chunk.

    Returns:
        (loss, nll): scalar fp32 sums; only `loss` is differentiable.
    """
    return _ChunkedProjectionLoss.apply(hidden, weight, target, eps, chunk_rows)
