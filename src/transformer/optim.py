"""§5.3 Adam and the eq. (3) learning-rate schedule; fp32 master weights for bf16 training.

Mixed precision (not in the paper, which trained in fp32): with dtype bf16 the model's parameters
themselves live in bf16, so every matrix product runs in bf16 without per-call autocast casts.
`MixedPrecisionAdam` keeps an fp32 master copy of every parameter and fp32 Adam moments:
after each backward the bf16 gradients are added into fp32 master gradients (accumulation sums
in fp32), the step clips and updates the fp32 masters, and the result is copied back to bf16.
With fp32 parameters the masters are the parameters themselves: plain Adam.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn


def learning_rate(step: int, d_model: int, warmup: int, scale: float = 1.0) -> float:
    """§5.3 eq. (3): scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5).

    Args:
        step: optimizer step, counted from 1 (step 0 is treated as 1).
        d_model: model width.
        warmup: warmup_steps (§5.3: 4000).
        scale: constant multiplier (1.0 in the paper; tensor2tensor later used 2.0).
    """
    step = max(step, 1)
    return scale * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


def cooldown_factor(progress: float, cooldown: float) -> float:
    """The multiplier on eq. (3) at `progress` (0 to 1: the spent fraction of the run's budget)
    with a linear fall to 0 over the last `cooldown` of it (train.cooldown; 0 = always 1)."""
    if cooldown <= 0.0:
        return 1.0
    return min(1.0, max(0.0, (1.0 - progress) / cooldown))


class MixedPrecisionAdam:
    """§5.3 Adam over fp32 master weights of (possibly bf16) model parameters.

    Args:
        params: the model's parameters (each shared tensor once), in bf16 or fp32.
        betas: (beta1, beta2); §5.3: (0.9, 0.98).
        eps: §5.3: 1e-9.
    """

    def __init__(
        self, params: Iterable[nn.Parameter], betas: tuple[float, float], eps: float
    ) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.mixed = any(p.dtype != torch.float32 for p in self.params)
        if self.mixed:
            self.masters = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        else:
            self.masters = self.params
        # fused: one elementwise kernel per tensor (CPU and CUDA), ~8x faster than foreach on
        # this CPU (benchmarks/bench_train.py); elementwise, hence deterministic.
        self.adam = torch.optim.Adam(self.masters, lr=0.0, betas=betas, eps=eps, fused=True)

    def collect_grads(self) -> None:
        """Add the model's fresh gradients into the fp32 master gradients (call after each
        backward). In fp32 mode autograd already accumulates into the parameters."""
        if not self.mixed:
            return
        for p, m in zip(self.params, self.masters, strict=True):
            if p.grad is None:
                continue
            if m.grad is None:
                m.grad = p.grad.float()
            else:
                m.grad.add_(p.grad)
            p.grad = None

    def master_grads(self) -> list[torch.Tensor]:
        """The fp32 gradients (zeros where a parameter got none), for all-reduce or inspection."""
        for m in self.masters:
            if m.grad is None:
                m.grad = torch.zeros_like(m)
        return [m.grad for m in self.masters]

    def step(self, lr: float, grad_scale: float = 1.0, clip_norm: float = 0.0) -> float:
        """Scale the gradients, optionally clip them, take one Adam step and refresh the model.

        Args:
            lr: this step's learning rate (eq. 3).
            grad_scale: multiplier on the summed gradients (1 / target tokens in the batch).
            clip_norm: clip the global gradient L2 norm to this value; 0 = off.

        Returns:
            The global gradient norm before clipping (inf/nan if non-finite: no step is taken).
        """
        grads = self.master_grads()
        if grad_scale != 1.0:
            torch._foreach_mul_(grads, grad_scale)
        norm = float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))))
        if not math.isfinite(norm):
            self.zero_grad()
            return norm
        if clip_norm > 0.0 and norm > clip_norm:
            torch._foreach_mul_(grads, clip_norm / (norm + 1e-6))
        for group in self.adam.param_groups:
            group["lr"] = lr
        self.adam.step()
        self.zero_grad()
        if self.mixed:
            with torch.no_grad():
                torch._foreach_copy_(self.params, self.masters)
        return norm

    def zero_grad(self) -> None:
        """Drop all gradients (model and masters)."""
        for p in self.params:
            p.grad = None
        for m in self.masters:
            m.grad = None

    def master_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The model's state dict with fp32 master values in place of its (bf16) parameters."""
        by_id = {id(p): m for p, m in zip(self.params, self.masters, strict=True)}
        out = {}
        for name, t in model.state_dict(keep_vars=True).items():
            out[name] = by_id.get(id(t), t).detach().float().clone()
        return out

    def load_master_state(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Load fp32 master values into the masters and (cast) into the model."""
        model.load_state_dict(state)
        if self.mixed:
            by_id = {id(p): m for p, m in zip(self.params, self.masters, strict=True)}
            with torch.no_grad():
                for name, t in model.state_dict(keep_vars=True).items():
                    if id(t) in by_id:
                        by_id[id(t)].copy_(state[name])

    def state_dict(self) -> dict:
        """Adam's state (moments, step counts) over the masters."""
        return self.adam.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.adam.load_state_dict(state)
