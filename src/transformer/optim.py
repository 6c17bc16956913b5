"""§5.3 Adam and the eq. (3) learning-rate schedule; fp32 master weights for bf16 training.

Mixed precision (not in the paper, which trained in fp32): with dtype bf16 the model's parameters
themselves live in bf16, so every matrix product runs in bf16 without per-call autocast casts.
`MixedPrecisionAdam` keeps an fp32 master copy of every parameter and fp32 Adam moments:
after each backward the bf16 gradients are added into fp32 master gradients (accumulation sums
in fp32), the step clips and updates the fp32 masters, and the result is copied back to bf16.
The tied embedding's gradients (the loss's and the lookups') are added to its master during
backward instead, in fp32, never made bf16 (`gradhelper.add_to_master`).
With fp32 parameters the masters are the parameters themselves: plain Adam.

On a CPU with AVX-512 the step takes two passes over the gradients instead of torch's five
(`one_pass_adam`, `kernels.adam_update`): a step's first bf16 gradients are held as they are,
not copied to fp32, and the update reads them, scaling each as it goes, with torch's fused
Adam's bits; the gradient norm is summed in fp64 (docs/performance.md, "Round thirty-nine").
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Iterable

import torch
from torch import nn

from transformer import gradhelper, kernels

logger = logging.getLogger(__name__)


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


class FusedAdam:
    """§5.3 Adam over fp32 tensors: `torch.optim.Adam(fused=True)` without `torch.optim`.

    The same kernel (`torch._fused_adam_`: one elementwise pass per tensor, ~8x faster than
    foreach on a 2-core CPU, and deterministic), the same lazily created state (a float32 step
    count, first and second moments) and the same `state_dict` format, so checkpoints written by
    either load in the other and the parameters are bit-identical. What it leaves out are
    `torch.optim.Optimizer`'s wrappers: the first call of `add_param_group` or `step` imports
    torch._dynamo, ~2 s of every training process's start on a 2-core CPU (the model file's
    skeleton had the same cost: `model.building_skeleton`).

    Args:
        params: the tensors to update (each once); their `.grad` are the gradients.
        betas: (beta1, beta2); §5.3: (0.9, 0.98).
        eps: §5.3: 1e-9.
    """

    def __init__(self, params: list[torch.Tensor], betas: tuple[float, float], eps: float):
        self.params = list(params)
        self.betas, self.eps, self.lr = (float(betas[0]), float(betas[1])), float(eps), 0.0
        # Per parameter, as torch.optim.Adam: empty until the parameter's first gradient.
        self.state: list[dict[str, torch.Tensor]] = [{} for _ in self.params]
        # The moments made ahead by `reserve`, each pair taken at its parameter's first
        # gradient (`_start`); None: none made.
        self.reserved: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(self.params)

    def reserve(self) -> None:
        """Make the moments of every parameter without state now, zeros, to be taken at its
        first gradient (the state itself stays empty until then, as torch.optim.Adam's): call
        before the first batch. Made at the first step instead, after that batch's activations
        had come and gone, they took the memory those had used, and the second batch's grew
        the heap again: ~120,000 fresh pages, the second step of a base model 1.014-1.063x the
        third's time on a Zen 4 (docs/performance.md, "Round seventy-two")."""
        for i, (p, state) in enumerate(zip(self.params, self.state, strict=True)):
            if not state and self.reserved[i] is None:
                self.reserved[i] = self._moments(p)

    @staticmethod
    def _moments(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero first and second moments for parameter p, as torch.optim.Adam makes them."""
        return (
            torch.zeros_like(p, memory_format=torch.preserve_format),
            torch.zeros_like(p, memory_format=torch.preserve_format),
        )

    def _start(self, i: int) -> dict[str, torch.Tensor]:
        """Parameter i's state, made as torch.optim.Adam's at its first gradient (the moments
        from `reserve` where made there)."""
        state = self.state[i]
        if not state:
            p, made = self.params[i], self.reserved[i]
            self.reserved[i] = None
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"], state["exp_avg_sq"] = self._moments(p) if made is None else made
        return state

    @torch.no_grad()
    def step(self, lr: float) -> None:
        """One Adam update of every parameter that has a gradient, at learning rate `lr`."""
        self.lr = float(lr)
        # One kernel call per (device, dtype), each tensor's update independent of the others'.
        groups: dict[tuple[torch.device, torch.dtype], list[tuple[torch.Tensor, dict]]] = {}
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            groups.setdefault((p.device, p.dtype), []).append((p, self._start(i)))
        for rows in groups.values():
            params, states = [p for p, _ in rows], [s for _, s in rows]
            steps = [s["step"] for s in states]
            torch._foreach_add_(steps, 1)
            # Contiguous gradients: torch 2.13's CPU kernel reads a gradient's storage in order
            # whatever its strides (FusedAdamKernel.cpp makes a contiguous copy, then passes the
            # original), so a column-major gradient updated the parameter transposed.
            grads = [p.grad.contiguous() for p in params]
            torch._fused_adam_(
                params, grads, [s["exp_avg"] for s in states],
                [s["exp_avg_sq"] for s in states], [], steps, amsgrad=False, lr=self.lr,
                beta1=self.betas[0], beta2=self.betas[1], weight_decay=0.0, eps=self.eps,
                maximize=False, grad_scale=None, found_inf=None,
            )  # fmt: skip

    @torch.no_grad()
    def step_in_one_pass(
        self,
        lr: float,
        grads: list[torch.Tensor | None],
        copies: list[torch.Tensor | None],
        scale: float = 1.0,
        clip: float = 1.0,
    ) -> None:
        """`step(lr)` of every parameter with gradients `grads` (None: zeros) made (g * scale) *
        clip first, as two in-place products would, and each of `copies` (None: none) given its
        parameter's new value: `kernels.adam_update`, one pass over each tensor (CPU tensors
        that `kernels.adam_problem` takes). The same bits as `step`."""
        self.lr = float(lr)
        for i in range(len(self.params)):
            self._start(i)
        steps = [s["step"] for s in self.state]
        torch._foreach_add_(steps, 1)
        kernels.adam_update(
            self.params, [s["exp_avg"] for s in self.state], [s["exp_avg_sq"] for s in self.state],
            grads, copies, [float(t) for t in steps], self.lr, self.betas, self.eps, scale, clip,
        )  # fmt: skip

    def state_dict(self) -> dict:
        """`torch.optim.Adam(fused=True).state_dict()`'s format (the tensors themselves, as it)."""
        return {
            "state": {i: dict(s) for i, s in enumerate(self.state) if s},
            "param_groups": [
                {
                    "lr": self.lr, "betas": self.betas, "eps": self.eps, "weight_decay": 0,
                    "amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
                    "differentiable": False, "fused": True, "decoupled_weight_decay": False,
                    "params": list(range(len(self.params))),
                }
            ],
        }  # fmt: skip

    def load_state_dict(self, state_dict: dict) -> None:
        """Load `state_dict` (this class's or torch.optim.Adam's with one parameter group over
        the same parameters), as torch.optim.Adam does: hyperparameters from it, the moments
        cast to each parameter's dtype and device, the fused step count to float32 there.

        Raises:
            ValueError: the state does not fit these parameters (what differs is named).
        """
        groups = state_dict.get("param_groups")
        if not isinstance(groups, list) or len(groups) != 1:
            raise ValueError("optimizer state: expected one parameter group")
        (group,) = groups
        if len(group.get("params", ())) != len(self.params):
            raise ValueError(
                f"optimizer state: {len(group.get('params', ()))} parameters, the model has "
                f"{len(self.params)}"
            )
        position = {index: i for i, index in enumerate(group["params"])}
        loaded: list[dict[str, torch.Tensor]] = [{} for _ in self.params]
        for index, saved in state_dict.get("state", {}).items():
            if index not in position or not {"step", "exp_avg", "exp_avg_sq"} <= set(saved):
                raise ValueError(f"optimizer state: no parameter {index!r} or not Adam's state")
            i = position[index]
            p = self.params[i]
            for key in ("exp_avg", "exp_avg_sq"):
                if tuple(saved[key].shape) != tuple(p.shape):
                    raise ValueError(
                        f"optimizer state: parameter {i}'s {key} has shape "
                        f"{tuple(saved[key].shape)}, the parameter {tuple(p.shape)}"
                    )
            loaded[i] = {
                "step": saved["step"].to(dtype=torch.float32, device=p.device),
                "exp_avg": saved["exp_avg"].to(dtype=p.dtype, device=p.device),
                "exp_avg_sq": saved["exp_avg_sq"].to(dtype=p.dtype, device=p.device),
            }
        self.state = loaded
        self.reserved = [None] * len(self.params)  # a parameter without saved state makes its own
        self.lr = float(group["lr"])
        self.betas = (float(group["betas"][0]), float(group["betas"][1]))
        self.eps = float(group["eps"])


def one_pass_adam() -> bool:
    """Whether `MixedPrecisionAdam` steps on the CPU in one pass (`kernels.adam_update`: the
    library built with AVX-512, `kernels.FUSED`), once it has given torch's five passes' bits
    (bf16 copy, scaling, clipping, `_fused_adam_`, the copy back) on tensors of every kind, over
    three steps: bf16, fp32 and no gradients, lengths off 16 and 8, a clip factor, the step
    count and learning rate changing (checked once a process)."""
    return kernels.fused_supported() and _one_pass_agrees()


@functools.cache
def _one_pass_agrees() -> bool:
    g = torch.Generator().manual_seed(0)
    sizes = (1, 9, 16, 37, 4099)
    copies = [torch.randn(n, generator=g).bfloat16() for n in sizes]
    ours = FusedAdam([c.float() for c in copies], (0.9, 0.98), 1e-9)
    theirs = FusedAdam([c.float() for c in copies], (0.9, 0.98), 1e-9)
    theirs_copies = [c.clone() for c in copies]
    for step, clip in ((1, 1.0), (2, 0.37), (3, 1.0)):
        raw = [torch.randn(n, generator=g) * 10.0 ** -(step + i) for i, n in enumerate(sizes)]
        grads = [raw[0], None, *(r.bfloat16() for r in raw[2:])]
        for p, r in zip(theirs.params, grads, strict=True):
            p.grad = torch.zeros_like(p) if r is None else r.float().clone()
        gs = [p.grad for p in theirs.params]
        torch._foreach_mul_(gs, 1 / 3.7)
        if clip != 1.0:
            torch._foreach_mul_(gs, clip)
        theirs.step(1e-3 * step)
        torch._foreach_copy_(theirs_copies, theirs.params)
        ours.step_in_one_pass(1e-3 * step, grads, copies, 1 / 3.7, clip)
    same = all(
        torch.equal(a.view(torch.int32), b.view(torch.int32))
        for a, b in zip(ours.params, theirs.params, strict=True)
    ) and all(torch.equal(a, b) for a, b in zip(copies, theirs_copies, strict=True))
    if not same:
        logger.info("optimizer: torch's passes for the Adam step (the compiled kernel differs)")
    return same


class MixedPrecisionAdam:
    """§5.3 Adam over fp32 master weights of (possibly bf16) model parameters.

    With bf16 parameters on the CPU, the gradients of the tied embedding (§3.4: the loss's and
    the packed path's lookups) go to its master's .grad during backward, not to the
    parameter's: read the gradients from `master_grads()`, not from the model.

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
            for p, m in zip(self.params, self.masters, strict=True):
                # The gradients our own functions send straight to it (the tied weight's:
                # gradhelper.add_to_master) skip p.grad: collect_grads adds only the rest.
                gradhelper.set_master(p, m)
        else:
            self.masters = self.params
        self.adam = FusedAdam(self.masters, betas, eps)
        # On CUDA `collect_grads` copies a step's first gradients bf16 -> fp32 as one
        # multi-tensor kernel (per tensor they were ~260 launches of a few µs each in a base
        # step, the largest count in its profile; docs/performance.md, "GPU"). On the CPU one
        # at a time, each bf16 gradient freed as its copy is made: holding them all until one
        # copy raised a 15k-token step's peak RSS (W3) by 55-196 MiB.
        self.batched_copies = self.mixed and self.masters[0].is_cuda
        # A step's first bf16 gradients, held as they are for a one-pass step (`one_pass_adam`)
        # to read: not copied to fp32 (`master_grads` makes the copies when asked).
        self.held: list[torch.Tensor | None] = [None] * len(self.params)

    def reserve_state(self) -> None:
        """Make the Adam moments of the parameters without state now (`FusedAdam.reserve`):
        after a resume, before the first batch."""
        self.adam.reserve()

    def collect_grads(self) -> None:
        """Add the model's fresh gradients into the fp32 master gradients (call after each
        backward). In fp32 mode autograd already accumulates into the parameters."""
        if not self.mixed:
            return
        fresh, grads = [], []
        hold = self._one_pass()
        for i, (p, m) in enumerate(zip(self.params, self.masters, strict=True)):
            if p.grad is None:
                continue
            self._settle(i)  # a second batch's gradients: the first's in fp32, as before
            if m.grad is not None:
                m.grad.add_(p.grad)
            elif self.batched_copies:
                fresh.append(m)
                grads.append(p.grad)
            elif hold:
                self.held[i] = p.grad
            else:
                m.grad = p.grad.float()
            p.grad = None
        if fresh:
            copies = [torch.empty_like(m) for m in fresh]
            torch._foreach_copy_(copies, grads)  # exact, as p.grad.float()
            for m, g in zip(fresh, copies, strict=True):
                m.grad = g

    def _one_pass(self) -> bool:
        """Whether steps take `kernels.adam_update` (CPU masters, `one_pass_adam`)."""
        return bool(self.masters) and self.masters[0].device.type == "cpu" and one_pass_adam()

    def _settle(self, i: int) -> None:
        """Master i's held bf16 gradient made (or added to) its fp32 .grad."""
        held, self.held[i] = self.held[i], None
        if held is not None:
            m = self.masters[i]
            if m.grad is None:
                m.grad = held.float()
            else:
                m.grad.add_(held)

    def master_grads(self) -> list[torch.Tensor]:
        """The fp32 gradients (zeros where a parameter got none), for all-reduce or inspection."""
        for i, m in enumerate(self.masters):
            self._settle(i)
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
        if self._one_pass():
            held = zip(self.held, self.masters, strict=True)
            grads = [h if h is not None else m.grad for h, m in held]
            grads = [g if g is None or g.is_contiguous() else g.contiguous() for g in grads]
            copies = self.params if self.mixed else [None] * len(self.params)
            if kernels.adam_problem(self.masters, grads, copies) is None:
                return self._step_in_one_pass(lr, grads, copies, grad_scale, clip_norm)
        grads = self.master_grads()
        if grad_scale != 1.0:
            torch._foreach_mul_(grads, grad_scale)
        norm = float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))))
        if not math.isfinite(norm):
            self.zero_grad()
            return norm
        if clip_norm > 0.0 and norm > clip_norm:
            torch._foreach_mul_(grads, clip_norm / (norm + 1e-6))
        self.adam.step(lr)
        self.zero_grad()
        if self.mixed:
            with torch.no_grad():
                torch._foreach_copy_(self.params, self.masters)
        return norm

    def _step_in_one_pass(self, lr, grads, copies, grad_scale: float, clip_norm: float) -> float:
        """`step` in two passes over the gradients (`kernels`): their norm, summed in fp64
        (torch's in fp32: the same to ~1e-6, its last bits can differ, and so can a clip
        factor made from it), then Adam's update with the scaling, the clipping and the copy
        back to the model, the same bits as torch's passes."""
        norm = math.sqrt(kernels.adam_sum_squares(grads, grad_scale))
        if math.isfinite(norm):
            clip = clip_norm / (norm + 1e-6) if 0.0 < clip_norm < norm else 1.0
            self.adam.step_in_one_pass(lr, grads, copies, grad_scale, clip)
        self.zero_grad()
        return norm

    def zero_grad(self) -> None:
        """Drop all gradients (model and masters)."""
        self.held = [None] * len(self.params)
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
