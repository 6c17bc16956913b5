"""The §5 training loop: accumulation, validation, checkpoint cadence, budgets, fault handling.

The trainer owns the loop and nothing else: the model, the optimizer (optim.MixedPrecisionAdam),
the loss function, the batch sampler and the data are passed in (train.train builds them).

One optimizer step = `accum_steps` batches per rank. The loss is summed over real target tokens
and the summed gradient is divided by the number of target tokens in the whole step (all
accumulated batches on all ranks), so the update equals that of one big batch.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from transformer import checkpoint, distributed, gradhelper, rundir
from transformer.batching import TokenBatchSampler
from transformer.config import RunConfig, to_dict
from transformer.data import Batch, ParallelSplit, collate
from transformer.errors import UserError
from transformer.loss import chunked_label_smoothed_loss
from transformer.optim import MixedPrecisionAdam, cooldown_factor, learning_rate
from transformer.threads import ThreadTuner
from transformer.tokenizer import PAD_ID

logger = logging.getLogger(__name__)

MAX_NONFINITE_IN_ROW = 5  # consecutive skipped steps before the run stops
LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, ...]]


class TrainingError(UserError):
    """Training cannot go on (e.g. the loss keeps diverging); the message says what to change."""


@dataclass
class TrainState:
    """Counters saved in every checkpoint."""

    step: int = 0  # optimizer steps taken (skipped steps excluded)
    tokens: int = 0  # target tokens trained on, all ranks
    skipped: int = 0  # non-finite steps skipped in total
    nonfinite_in_row: int = 0
    # early stopping (train.patience): the best validation so far and the validations since
    best_metric: float | None = None
    best_step: int = 0
    bad_validations: int = 0
    # wall-clock seconds of training up to this state, over every resume (0.0 in checkpoints
    # written before it was kept): what a resumed job's time budget has already spent
    seconds: float = 0.0


@dataclass
class _Window:
    """Running sums between two log lines."""

    loss: float = 0.0
    nll: float = 0.0
    tokens: int = 0
    steps: int = 0
    lr: float = 0.0  # of the last step taken
    start: float = field(default_factory=time.monotonic)


class Trainer:
    """Runs optimizer steps until `max_steps` or `max_minutes`, validating and saving on cadence.

    Args:
        model: the Transformer (parameters in bf16 or fp32; the optimizer holds fp32 masters).
        optimizer: MixedPrecisionAdam over the model's parameters.
        loss_fn: (hidden (N, D), weight (V, D), target (N,), eps) -> (loss sum, nll sum).
        sampler: this rank's resumable training batch sampler.
        train_split, valid_split: the data (valid may be None: no validation).
        tokenizer: decodes ids for validation BLEU.
        config: the resolved run config.
        run_dir: where checkpoints, metrics.jsonl and tensorboard/ go (rank 0 writes).
        state: counters (restored on resume).
        dist_info: this rank's place in a distributed job.
        checkpoint_extra: plain values stored in every checkpoint (data/tokenizer info).
        forward: called for training as the model is, (src, src_mask, tgt, tgt_mask) -> (N, D)
            (`train.compiled_forward` with train.compile), default `model`.
        progress: show a tqdm progress bar (rank 0).
        tuner: chooses the CPU thread count step by step (threads.py), or None.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: MixedPrecisionAdam,
        loss_fn: LossFn,
        sampler: TokenBatchSampler,
        train_split: ParallelSplit,
        valid_split: ParallelSplit | None,
        tokenizer: Any,
        config: RunConfig,
        run_dir: Path,
        state: TrainState | None = None,
        dist_info: distributed.DistInfo | None = None,
        checkpoint_extra: dict[str, Any] | None = None,
        forward: Callable[..., torch.Tensor] | None = None,
        progress: bool = True,
        tuner: ThreadTuner | None = None,
    ) -> None:
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.forward = model if forward is None else forward
        self.sampler, self.train_split, self.valid_split = sampler, train_split, valid_split
        self.tokenizer, self.config, self.cfg = tokenizer, config, config.train
        self.run_dir = Path(run_dir)
        self.state = state or TrainState()
        self.dist = dist_info or distributed.DistInfo()
        self.extra = checkpoint_extra or {}
        self.progress = progress and self.dist.is_main
        self.tuner = tuner
        self.device = next(model.parameters()).device
        self._batches = iter(self.sampler)
        self._writer = None
        self._saved_step: int | None = None  # the step of the last checkpoint written
        self._run_start: float | None = None  # time.monotonic() when run() began
        self._stop_reason: str | None = None  # early stopping or the epoch cap, on this rank
        self._minutes = 0.0  # of this run, at the start of the current step

    # ---------------------------------------------------------------- one step

    def _next_batches(self) -> list[Batch]:
        """The next batches of this rank's step (`accum_steps`, shared out among `train.procs`
        processes: `TrainConfig.per_process`), crossing epoch boundaries."""
        out: list[Batch] = []
        while len(out) < self.cfg.per_process()[1]:
            try:
                indices = next(self._batches)
            except StopIteration:
                self._batches = iter(self.sampler)  # the sampler has moved to the next epoch
                continue
            out.append(collate(self.train_split, indices))
        return out

    def _batch_loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        b = batch.to(self.device)
        return batch_loss(self.model, self.forward, self.loss_fn, b, self.cfg.eps_ls)

    def train_step(
        self, batches: list[Batch], time_up: bool = False, save_due: bool = False
    ) -> dict[str, float]:
        """Forward/backward over the batches, reduce across ranks, one Adam step (or a skip).

        Returns:
            loss, nll (sums), tokens, grad_norm, lr, ok (1.0 if the step was taken),
            time_up / save_due (> 0 if any rank's time budget is spent / checkpoint is due:
            the flags are reduced with the gradients so every rank decides alike).
        """
        self.model.train()
        loss_sum = torch.zeros((), dtype=torch.float32)
        nll_sum = torch.zeros((), dtype=torch.float32)
        for batch in batches:
            loss, nll = self._batch_loss(batch)
            loss.backward()
            gradhelper.finish()  # the weight gradients of a helper thread, if one ran
            self.optimizer.collect_grads()
            loss_sum += loss.detach().float().cpu()
            nll_sum += nll.detach().float().cpu()
        tokens = sum(b.n_tgt_tokens for b in batches)
        flags = [float(time_up), float(save_due)]
        # The minutes travel with the gradients: every rank takes their mean, so every rank
        # computes the same learning rate (train.cooldown).
        stats = [loss_sum, nll_sum, tokens, *flags, self._minutes]
        stats = torch.tensor(stats, dtype=torch.float32).to(self.device)
        # One process: no fp32 copies of the gradients asked for (the optimizer may read its
        # bf16 gradients as they are, optim.one_pass_adam).
        grads = self.optimizer.master_grads() if self.dist.world_size > 1 else []
        distributed.all_reduce_sum([*grads, stats], self.dist)
        loss_g, nll_g, tokens_g, time_g, save_g, minutes_g = stats.tolist()
        lr = learning_rate(
            self.state.step + 1, self.config.model.d_model, self.cfg.warmup_steps, self.cfg.lr_scale
        ) * cooldown_factor(self._progress(minutes_g / self.dist.world_size), self.cfg.cooldown)
        norm = math.nan
        if math.isfinite(loss_g):
            norm = self.optimizer.step(lr, 1.0 / max(tokens_g, 1.0), self.cfg.clip_norm)
        else:
            self.optimizer.zero_grad()
        ok = math.isfinite(loss_g) and math.isfinite(norm)
        return {
            "loss": loss_g,
            "nll": nll_g,
            "tokens": tokens_g,
            "grad_norm": norm,
            "lr": lr,
            "ok": float(ok),
            "time_up": time_g,
            "save_due": save_g,
        }

    def _progress(self, minutes: float) -> float:
        """The spent fraction of the run's budget at this step: steps, or minutes if nearer."""
        spent = self.state.step / self.cfg.max_steps
        budget = self.cfg.max_minutes
        if budget is not None:
            spent = max(spent, minutes / budget if budget > 0 else 1.0)
        return spent

    # ---------------------------------------------------------------- the loop

    def run(self) -> TrainState:
        """Train until a budget is spent; the last state is always checkpointed (`_save_end`)."""
        start = self._run_start = time.monotonic()
        self._seconds_before = self.state.seconds  # a resumed run's earlier training
        self._next_save_minutes = self.cfg.save_every_minutes
        if self.state.step > 0:  # resumed: this state is already a checkpoint
            self._saved_step = self.state.step
        if 0 < self.cfg.patience <= self.state.bad_validations:  # resumed an early-stopped run
            self._stop_reason = "early stop: already decided before the resume"
        window = _Window()
        bar = self._progress_bar()
        try:
            while self.state.step < self.cfg.max_steps:
                minutes = self._minutes = (time.monotonic() - start) / 60
                time_up = self.cfg.max_minutes is not None and minutes >= self.cfg.max_minutes
                cap = self.cfg.max_epochs
                if cap is not None and self.sampler.epochs_done >= cap and not self._stop_reason:
                    self._stop_reason = f"epoch cap of {cap} reached"
                if self._stop_reason is not None and self.dist.world_size == 1:
                    logger.info("%s", self._stop_reason)
                    break
                # Across ranks the early-stopping decision (made on rank 0, which validates)
                # travels with the time flag, so every rank stops after the same step.
                time_up = time_up or self._stop_reason is not None
                save_due = minutes >= self._next_save_minutes
                batches = self._next_batches()
                if self.tuner is not None:
                    self.tuner.start()
                out = self.train_step(batches, time_up, save_due)
                if self.tuner is not None:
                    self.tuner.stop(sum(b.n_tgt_tokens for b in batches))
                if self._account(out, window):
                    self._update_bar(bar, out, window)
                    window = self._after_step(out, window)
                if out["time_up"] > 0:  # the flag was raised before this step: it counts
                    reason = f"time budget of {self.cfg.max_minutes} minutes spent"
                    logger.info("%s", self._stop_reason or reason)
                    break
        finally:
            if bar is not None:
                bar.close()
        if window.steps:
            self._log_train(window)
        self._save_end()
        if self._writer:
            self._writer.close()
        return self.state

    def _after_step(self, out: dict[str, float], window: _Window) -> _Window:
        """Log, validate and checkpoint on their cadences; returns the (new) log window."""
        step = self.state.step
        if step % self.cfg.log_every_steps == 0:
            self._log_train(window)
            window = _Window()
        if self.valid_split is not None and step % self.cfg.valid_every_steps == 0:
            self._log_valid()
        by_steps = self.cfg.save_every_steps > 0 and step % self.cfg.save_every_steps == 0
        if by_steps or out["save_due"] > 0:
            self.save()
            # §6.1 checkpoints at exact intervals of the run's clock (10, 20, 30 ... minutes:
            # the first step that starts past each mark), not 10 minutes after the previous
            # save, which drifts by a step or more each time.
            every = self.cfg.save_every_minutes
            self._next_save_minutes = (math.floor(self._minutes / every) + 1) * every
        return window

    def _account(self, out: dict[str, float], window: _Window) -> bool:
        """Update counters; on a skipped step, log it and stop after too many in a row."""
        if out["ok"]:
            self.state.step += 1
            self.state.tokens += int(out["tokens"])
            self.state.nonfinite_in_row = 0
            window.loss += out["loss"]
            window.nll += out["nll"]
            window.tokens += int(out["tokens"])
            window.steps += 1
            window.lr = out["lr"]
            return True
        self.state.skipped += 1
        self.state.nonfinite_in_row += 1
        logger.warning(
            "step %d: non-finite loss %s or gradient norm %s; step skipped (%d in a row)",
            self.state.step + 1,
            out["loss"],
            out["grad_norm"],
            self.state.nonfinite_in_row,
        )
        if self.state.nonfinite_in_row >= MAX_NONFINITE_IN_ROW:
            path = self._save_end()
            raise TrainingError(
                f"{MAX_NONFINITE_IN_ROW} non-finite losses in a row after step {self.state.step}; "
                f"stopped. The last checkpoint ({path}) holds the parameters before them. "
                "Lower the learning rate (train.lr_scale), raise train.warmup_steps, set "
                "train.clip_norm, or try train.dtype=fp32"
            )
        return False

    # ---------------------------------------------------------------- monitoring

    def _progress_bar(self):
        if not self.progress:
            return None
        from tqdm import tqdm

        return tqdm(
            total=self.cfg.max_steps, initial=self.state.step, unit="step", dynamic_ncols=True
        )

    def _update_bar(self, bar, out: dict[str, float], window: _Window) -> None:
        if bar is None:
            return
        elapsed = max(time.monotonic() - window.start, 1e-9)
        bar.update(1)
        postfix = {
            "tok_s": f"{window.tokens / elapsed:.0f}",
            "loss": f"{out['loss'] / max(out['tokens'], 1):.3f}",
            "lr": f"{out['lr']:.2e}",
        }
        if self.cfg.max_minutes is not None:  # a time budget ends the run before max_steps
            spent = (time.monotonic() - self._run_start) / 60
            postfix["min_left"] = f"{max(self.cfg.max_minutes - spent, 0.0):.1f}"
        bar.set_postfix(postfix, refresh=False)

    def _log_train(self, window: _Window) -> None:
        if not self.dist.is_main or not window.steps:
            return
        elapsed = max(time.monotonic() - window.start, 1e-9)
        tokens = max(window.tokens, 1)
        lr = window.lr
        record = {
            "loss": window.loss / tokens,
            "nll": window.nll / tokens,
            "ppl": math.exp(min(window.nll / tokens, 50.0)),
            "lr": lr,
            "tokens_per_s": window.tokens / elapsed,
            "tokens": self.state.tokens,
            "epochs": self.sampler.epochs_done,
        }
        logger.info(
            "step %d | loss %.4f | ppl %.2f | lr %.3e | %.0f tok/s",
            self.state.step,
            record["loss"],
            record["ppl"],
            lr,
            record["tokens_per_s"],
        )
        self._record("train", record)

    def _log_valid(self) -> None:
        # Every rank validates its share and gets the same record, so every rank makes the
        # same early-stopping decision; rank 0 logs it.
        record = self.validate()
        record["epochs"] = self.sampler.epochs_done
        self._early_stopping(record)
        if not self.dist.is_main:
            return
        logger.info(
            "step %d | valid loss %.4f | valid ppl %.2f | valid BLEU %s",
            self.state.step,
            record["loss"],
            record["ppl"],
            record.get("bleu", "n/a"),
        )
        self._record("valid", record)

    def _early_stopping(self, record: dict[str, Any]) -> None:
        """Track the best validation; after `patience` validations without an improvement of
        more than `min_delta`, ask the loop to stop (at the next step, on every rank)."""
        if self.cfg.patience <= 0:
            return
        name = self.cfg.patience_metric
        value = float(record[name])
        best = self.state.best_metric
        sign = -1.0 if name == "ppl" else 1.0  # higher is better after the sign
        if best is None or sign * (value - best) > self.cfg.min_delta:
            self.state.best_metric, self.state.best_step = value, self.state.step
            self.state.bad_validations = 0
        else:
            self.state.bad_validations += 1
        record["best_" + name], record["best_step"] = self.state.best_metric, self.state.best_step
        if self.state.bad_validations >= self.cfg.patience:
            self._stop_reason = (
                f"early stop: valid {name} has not improved for {self.cfg.patience} validations "
                f"(best {self.state.best_metric:.4g} at step {self.state.best_step})"
            )

    def _record(self, kind: str, values: dict[str, Any]) -> None:
        """Append to metrics.jsonl (always) and TensorBoard (if installed)."""
        line = {"kind": kind, "step": self.state.step, "time": time.time(), **values}
        rundir.append_metrics(self.run_dir, line)
        writer = self._tensorboard()
        if writer is not None:
            for key, value in values.items():
                if isinstance(value, int | float):
                    writer.add_scalar(f"{kind}/{key}", value, self.state.step)

    def _tensorboard(self):
        if self._writer is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # the optional `tensorboard` extra is not installed
                self._writer = False
                return None
            self._writer = SummaryWriter(str(self.run_dir / rundir.TENSORBOARD))
        return self._writer or None

    @torch.no_grad()
    def validate(self) -> dict[str, Any]:
        """Validation loss, per-token perplexity and (train.valid_bleu) greedy BLEU on the valid
        split, outputs capped at the run's decode.max_len_a x source length + decode.max_len_b."""
        from transformer.bleu import corpus_bleu
        from transformer.search import greedy_search

        split = self.valid_split
        hyps: dict[int, str] = {}
        dec = self.config.decode  # outputs capped as in the run's other searches
        caps = {"max_len_a": dec.max_len_a, "max_len_b": dec.max_len_b}

        def decode(b: Batch) -> None:  # greedy, in the same pass as the loss
            outs = greedy_search(self.model, b.src, b.src_mask, **caps)
            for i, ids in zip(b.indices, outs, strict=True):
                hyps[i] = self.tokenizer.decode(ids)

        record: dict[str, Any] = evaluate_loss(
            self.model, split, self.cfg.max_tokens, self.cfg.eps_ls, self.loss_fn, self.forward,
            each=decode if self.cfg.valid_bleu else None, dist_info=self.dist,
        )  # fmt: skip
        del record["tokens"]  # a valid record's numbers are per token; "tokens" means training's
        if not self.cfg.valid_bleu:
            return record
        if self.dist.world_size > 1:  # each rank decoded its share of the batches
            shares: list[dict[int, str] | None] = [None] * self.dist.world_size
            torch.distributed.all_gather_object(shares, hyps)
            hyps = {i: h for share in shares for i, h in share.items()}
        refs = [split.tgt_text(i) for i in range(len(split))]
        result = corpus_bleu([hyps[i] for i in range(len(split))], refs)
        record["bleu"] = float(result.score)
        return record

    # ---------------------------------------------------------------- checkpoints

    def training_state(self) -> dict[str, Any]:
        """Everything resume needs, as tensors and plain values (weights_only-safe)."""
        rng = [checkpoint.rng_state()]
        if self.dist.world_size > 1:
            rng = [None] * self.dist.world_size
            torch.distributed.all_gather_object(rng, checkpoint.rng_state())
        if self._run_start is not None:
            self.state.seconds = self._seconds_before + time.monotonic() - self._run_start
        return {
            "step": self.state.step,
            "counters": dict(vars(self.state)),
            "model": self.optimizer.master_state(self.model),
            "optimizer": self.optimizer.state_dict(),
            "sampler": self.sampler.state_dict(),
            "rng": rng,
            "config": to_dict(self.config),
            **self.extra,
        }

    def _save_end(self) -> Path | None:
        """The run's last state, unless the cadence has just written it. Off the cadence it is
        `ckpt_<step>_end.pt`: it resumes, but §6.1's average leaves it out."""
        if self._saved_step == self.state.step:
            return checkpoint.latest_checkpoint(self.run_dir)
        return self.save(on_cadence=False)

    def save(self, on_cadence: bool = True) -> Path | None:
        """Checkpoint the current state (rank 0 writes; every rank takes part).

        on_cadence: False for the end of a run between two save points (not averaged).
        """
        state = self.training_state()
        self._saved_step = self.state.step
        if not self.dist.is_main:
            return None
        return checkpoint.save_checkpoint(
            self.run_dir, self.state.step, state, self.cfg.keep_last, on_cadence
        )


def batch_loss(
    model: nn.Module, forward: Callable[..., torch.Tensor], loss_fn: LossFn, b: Batch, eps_ls: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, nll) sums of one batch on the model's device; only real target positions are
    projected to the vocabulary."""
    keep = b.tgt_out != PAD_ID  # (B, T): the positions of tgt_in too (right padding)
    hidden = forward(b.src, b.src_mask, b.tgt_in, keep)  # (N, D): real tokens only (Packing)
    return loss_fn(hidden, model.output_weight(), b.tgt_out[keep], eps_ls)[:2]


@torch.no_grad()
def evaluate_loss(
    model: nn.Module,
    split: ParallelSplit,
    max_tokens: int,
    eps_ls: float = 0.0,
    loss_fn: LossFn = chunked_label_smoothed_loss,
    forward: Callable[..., torch.Tensor] | None = None,
    each: Callable[[Batch], None] | None = None,
    dist_info: distributed.DistInfo | None = None,
) -> dict[str, float]:
    """Teacher-forced loss on a split, dropout off: {"loss" (label-smoothed with eps_ls), "nll",
    per target token, "ppl" = exp(nll) (per subword, §6.2 Table 3's PPL), "tokens"}.
    `each` is called with every batch (on the model's device), e.g. to decode it too.
    With `dist_info` of a job of several ranks, each rank takes its share of the batches and
    every rank returns the totals of all."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    loss = nll = 0.0
    tokens = 0
    rank, world = (dist_info.rank, dist_info.world_size) if dist_info else (0, 1)
    sampler = TokenBatchSampler(
        split.src_lens, split.tgt_lens, max_tokens, seed=0, shuffle=False, rank=rank,
        world_size=world,
    )  # fmt: skip
    for indices in sampler:
        b = collate(split, indices).to(device)
        out = batch_loss(model, model if forward is None else forward, loss_fn, b, eps_ls)
        if each is not None:
            each(b)
        loss, nll, tokens = loss + float(out[0]), nll + float(out[1]), tokens + b.n_tgt_tokens
    model.train(was_training)
    if world > 1:
        sums = torch.tensor([loss, nll, tokens], dtype=torch.float64, device=device)  # nccl: GPU
        distributed.all_reduce_sum([sums], dist_info)
        loss, nll, tokens = sums[0].item(), sums[1].item(), int(sums[2].item())
    n = max(tokens, 1)
    return {"loss": loss / n, "nll": nll / n, "ppl": math.exp(min(nll / n, 50.0)), "tokens": tokens}
