"""`transformer train` (train.train): build the model, optimizer, sampler and run directory, then
run the loop (trainer.Trainer).

The run directory's layout is rundir.py's. Every checkpoint also carries the sentencepiece model,
so `transformer average` writes a self-contained model file from the run directory alone.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from transformer import checkpoint, distributed, rundir
from transformer.allocator import keep_large_blocks
from transformer.batching import TokenBatchSampler
from transformer.config import RunConfig, apply_overrides, parse_overrides
from transformer.cpuinfo import count_problem, native_bf16
from transformer.data import load_prepared
from transformer.errors import JobError, UserError, out_of_memory, what_to_lower
from transformer.loss import chunked_label_smoothed_loss
from transformer.model import DTYPES, Transformer, accelerator_dtype
from transformer.optim import MixedPrecisionAdam
from transformer.threads import (
    AUTO,
    CROWDED_CORES,
    OtherLoad,
    ThreadTuner,
    room_left,
    siblings,
    usable_cores,
)
from transformer.threads import resolve as resolve_threads
from transformer.trainer import Trainer, TrainState

logger = logging.getLogger(__name__)


def resolve_run(
    data_dir: Path | None, out_dir: Path, config: RunConfig | None, resume: bool, overrides
) -> tuple[Path, RunConfig]:
    """The data directory and config of a new run, or of the run being resumed."""
    out_dir = Path(out_dir)
    if not resume:
        if config is None or data_dir is None:
            raise UserError("train: a new run needs DATA_DIR and a config (--preset/--config)")
        if checkpoint.latest_checkpoint(out_dir) is not None:
            raise UserError(f"{out_dir}: already holds a run; use --resume {out_dir} to continue")
        return Path(data_dir), apply_overrides(
            config, parse_overrides(overrides), source="override"
        )
    saved = rundir.read_config(out_dir)
    data_dir = Path(data_dir) if data_dir else rundir.read_data_dir(out_dir)
    return data_dir, apply_overrides(saved, parse_overrides(overrides), "override")


# Training steps before the thread tuner's first probe (threads.ThreadTuner's warmup_units).
TUNER_WARMUP_STEPS = 4
# Seconds over which others' use of the CPUs is read for the tuner (`_read_others_load`): a few
# quickstart steps, so that one step's burst of another process does not read as a change.
TUNER_LOAD_WINDOW_S = 2.0


def set_deterministic(mode: bool, compile: bool = False) -> None:
    """`torch.use_deterministic_algorithms(mode)`, without importing torch._inductor (and with it
    torch._dynamo: ~2 s of a process's start on a 2-core CPU) to set its config's copy of the flag
    when nothing in this process is compiled: the flag that eager kernels read is ATen's."""
    if compile or "torch._inductor.config" in sys.modules:
        torch.use_deterministic_algorithms(mode)
    else:
        torch._C._set_deterministic_algorithms(mode)


def _setup_torch(
    config: RunConfig, device: torch.device, threads: int | str | None = None
) -> ThreadTuner | None:
    """Determinism, the seed and the CPU threads: `threads` if a number; else 1 for a
    deterministic run; else OMP_NUM_THREADS if set; else tuned while training (threads.py)
    among this node's share of the cores. Returns the tuner, if any. Large freed blocks stay
    in the heap for the next step's tensors (allocator.py)."""
    problem = count_problem(threads) if isinstance(threads, int) else None
    if problem is not None:  # before anything is set up
        raise UserError(f"--threads: {problem}")
    if device.type == "cpu":
        keep_large_blocks()
    torch.manual_seed(config.train.seed)
    if config.train.deterministic:
        # Bit-exact runs: deterministic kernels and a fixed thread count (reductions split
        # work by thread count).
        set_deterministic(True, config.train.compile)
        torch.set_num_threads(threads if isinstance(threads, int) else 1)
        siblings()  # a job of ours, as `threads.resolve` says of the others
    elif isinstance(threads, int) or device.type == "cpu":
        # A count is set (and said if above the cores); else auto, as every other command, with
        # the weight-gradient helper as a candidate (gradhelper.py; not under torch.compile,
        # which would trace its futures).
        tuner = resolve_threads(threads if isinstance(threads, int) else AUTO,
                                warmup_units=TUNER_WARMUP_STEPS,
                                helper=not config.train.compile)  # fmt: skip
        if tuner is not None:
            if OtherLoad.crowded_since_start():
                # Others kept the CPUs busy while this command started (its imports): the first
                # steps on one thread, until the first probe times the counts. On every core,
                # two quickstart trainings of 40 steps started together took 9.9-10.3 s
                # against 7.2 on one thread each; now 7.9-8.9 (docs/performance.md, "Round
                # forty-seven").
                tuner.best = tuner.fewest()
            torch.set_num_threads(tuner.best)  # every core until the first step is timed
            _read_others_load(tuner)
        return tuner
    return None


def _read_others_load(tuner: ThreadTuner) -> None:
    """While other processes crowd the cores (`threads.OtherLoad`, over windows of
    TUNER_LOAD_WINDOW_S), the tuner's probes time only the counts that fit beside them, with
    the steps still timed: beside a busy process on 2 cores the helper, not one thread, ran
    fastest (gradhelper.py). Not the helper where the crowding is this user's other jobs of
    ours (`threads.Siblings`): between them it only moves CPU from one to the other."""
    load = OtherLoad(window_s=TUNER_LOAD_WINDOW_S, siblings=siblings())
    cores = tuner.candidates[0]  # the usable cores (the helper's candidate comes last)
    spare = load.spare_cpus(cores)
    tuner.room = lambda: room_left(load.cores(), cores, spare)
    tuner.probe_when_crowded = True
    # The helper only where strangers crowd the cores, not only this user's other jobs of ours
    # (`threads.Siblings`), read in the same window as `room` just was.
    tuner.helps = lambda: (load.last or 0.0) - load.last_siblings >= CROWDED_CORES


def _log_to_file(run_dir: Path) -> logging.Handler:
    handler = logging.FileHandler(run_dir / rundir.LOG, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger("transformer").addHandler(handler)
    if logging.getLogger("transformer").getEffectiveLevel() > logging.INFO:
        logging.getLogger("transformer").setLevel(logging.INFO)
    return handler


def auto_train_dtype(device: str | torch.device) -> tuple[str, str]:
    """`train.dtype=auto`: the precision to train in on this device, and why. bf16 (with fp32
    master weights) where the device multiplies bf16 natively: CUDA with bf16, a CPU with
    avx512_bf16 or AMX; fp32 elsewhere (docs/training.md, "Mixed precision")."""
    device = torch.device(device)
    if device.type != "cpu":
        return accelerator_dtype(device)
    native = native_bf16()
    if native:
        return "bf16", f"the CPU has {native[-1]}"
    return "fp32", "the CPU has no native bf16 products (avx512_bf16 or AMX)"


def resolve_train_dtype(config: RunConfig, device: str | torch.device) -> RunConfig:
    """`config` with train.dtype "auto" replaced by `auto_train_dtype`'s choice (logged); a
    run records the dtype it trained in, so a resume on another machine keeps it."""
    if config.train.dtype != "auto":
        return config
    name, why = auto_train_dtype(device)
    logger.info("train.dtype auto: %s (%s)", name, why)
    return replace(config, train=replace(config.train, dtype=name))


def build_model(config: RunConfig, device: torch.device) -> Transformer:
    """The model with parameters in the training dtype (train.dtype "auto": resolved for
    `device`); buffers (the §3.5 table) stay fp32."""
    model = Transformer(config.model).to(device)
    dtype = DTYPES[resolve_train_dtype(config, device).train.dtype]
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return model


def train(
    data_dir: Path | None,
    out_dir: Path,
    config: RunConfig | None = None,
    resume: bool = False,
    overrides: Sequence[str] = (),
    device: str | None = None,
    progress: bool = True,
    threads: int | str | None = None,
) -> TrainState:
    """Train (or resume) a run; returns the final counters. Launch with `torchrun` for DDP
    across GPUs or machines; `train.procs` > 1 starts a job of that many processes on this CPU.

    Args:
        data_dir: a prepared-data directory (`transformer prepare`); on resume, None = the
            directory the run was started with.
        out_dir: the run directory.
        config: the resolved config of a new run (ignored on resume: the run's own is used).
        resume: continue from the run's latest checkpoint, exactly where it stopped.
        overrides: `section.key=value` strings applied on top (e.g. a larger train.max_steps).
        device: "cpu", "cuda" ...; default CUDA when available.
        progress: show a progress bar.
        threads: CPU threads (default: OMP_NUM_THREADS if set, else tuned to the machine's
            load while training, threads.ThreadTuner; 1 when train.deterministic); per
            process with train.procs > 1, where the default is 1.
    """
    out_dir = Path(out_dir)
    data_dir, config = resolve_run(data_dir, out_dir, config, resume, overrides)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    config = resolve_train_dtype(config, dev)
    n = config.train.procs
    if n > 1:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise UserError(
                f"train.procs={n}: this process is already one rank of a torchrun job; "
                "under torchrun leave train.procs at 1"
            )
        if dev.type != "cpu":
            raise UserError(f"train.procs={n} is for CPU training (device {dev}); "
                            "across GPUs use torchrun")  # fmt: skip
        threads = threads if isinstance(threads, int) else 1
        cores = _usable_cores()
        if n * threads > cores:  # allowed (a test of a larger job's split), but say so
            logger.warning(
                "train.procs=%d x %d thread(s) on %d core(s): the processes will take turns on "
                "the cores, and train more slowly than %d process(es) of one thread would",
                n, threads, cores, cores,
            )  # fmt: skip
        # Checked here before the n processes start (each checks again), so that a share
        # too small for the corpus's longest pair (`--procs 99`) is an error in a second,
        # not after a minute of starting processes that all stop on it.
        _check_lengths(load_prepared(data_dir), config)
        args = (data_dir, out_dir, config, resume, dev, progress, threads)
        try:
            return distributed.run_local(n, _train_job, args)
        except JobError as e:  # a rank killed or out of memory: say what the run has kept
            raise JobError(f"train.procs={n}: {e}; {_kept(out_dir)}") from None
    try:
        return _train_job(data_dir, out_dir, config, resume, dev, progress, threads)
    except (MemoryError, RuntimeError) as e:
        what = out_of_memory(e)
        if what is None:
            raise
        smaller = f"a smaller train.max_tokens (now {config.train.max_tokens}) needs"
        raise JobError(f"{what}: {what_to_lower(what, smaller)}; {_kept(out_dir)}") from None


def _kept(out_dir: Path) -> str:
    """What a stopped run directory holds for a resume, in words (`train --resume RUN`;
    `recipe` resumes with its own `--resume`, while `quickstart` starts afresh)."""
    try:
        path = checkpoint.latest_checkpoint(out_dir)
    except checkpoint.CheckpointError as e:
        return str(e)
    if path is None:
        return f"{out_dir} holds no checkpoint yet"
    return f"{out_dir} keeps its last checkpoint, {path.name}, for a resume"


def _usable_cores() -> int:
    """The cores this process may run on (threads.usable_cores; a seam for tests)."""
    return usable_cores()


def _train_job(
    data_dir: Path, out_dir: Path, config: RunConfig, resume: bool, dev: torch.device,
    progress: bool, threads: int | str | None,
) -> TrainState:  # fmt: skip
    """train() once the run is resolved: this process's part of the job (all of it, or one
    rank's; module level, so that `distributed.run_local`'s children can import it)."""
    info = distributed.init_from_env(dev)
    if dev.type == "cuda":
        dev = torch.device("cuda", info.local_rank)
        torch.cuda.set_device(dev)
    saved_torch = (torch.are_deterministic_algorithms_enabled(), torch.get_num_threads())
    tuner = _setup_torch(config, dev, threads)
    data = load_prepared(data_dir)
    if config.model.lowercase != data.lowercase and (resume or config.model.lowercase):
        # model.lowercase follows the data; a run never changes case midway, nor is it set by hand
        want = "lowercased" if config.model.lowercase else "cased"
        have = "lowercased" if data.lowercase else "cased"
        whose = f"{out_dir} was trained on" if resume else "model.lowercase asks for"
        raise UserError(
            f"{data_dir}: holds {have} text, but {whose} {want} text "
            "(model.lowercase follows the data: transformer prepare --lowercase)"
        )
    config = replace(
        config,
        model=replace(config.model, vocab_size=data.tokenizer.vocab_size, lowercase=data.lowercase),
    )
    handler = None
    if info.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        handler = _log_to_file(out_dir)
        for directory in (out_dir, out_dir / checkpoint.CHECKPOINT_DIR):
            checkpoint.remove_stale(directory)  # temporary files of killed runs
    try:
        return _run(data, data_dir, out_dir, config, resume, info, dev, progress, tuner)
    finally:
        if handler is not None:
            logging.getLogger("transformer").removeHandler(handler)
            handler.close()
        distributed.shutdown(info)
        # Process-wide settings go back to what they were (train() may run inside a bigger
        # program, or a test session).
        set_deterministic(saved_torch[0], config.train.compile)
        torch.set_num_threads(saved_torch[1])


def _rank_tokens(config: RunConfig) -> int:
    """Tokens per batch of one process (`TrainConfig.per_process`)."""
    return config.train.per_process()[0]


def _check_lengths(data, config: RunConfig) -> None:
    """Every train and valid pair fits the model (`model.max_len` positions) and one batch
    (`train.max_tokens`, a process's share of it where train.procs splits batches): a
    UserError naming the split and line now, not a failure mid-run."""
    tokens, share = _rank_tokens(config), config.train.procs
    per_process = f" / train.procs {share}" if tokens != config.train.max_tokens else ""
    limits = (
        ("model.max_len", "", config.model.max_len),
        ("train.max_tokens", per_process, tokens),
    )
    for name in ("train", "valid"):
        if name not in data.split_names:
            continue
        split = data.split(name)
        longest = np.maximum(split.src_lens, split.tgt_lens)
        for key, per, limit in limits:
            over = np.flatnonzero(longest > limit)
            if over.size:
                i = int(over[0])
                raise UserError(
                    f"{data.path}: {name} line {i + 1}: {int(split.src_lens[i])} source and "
                    f"{int(split.tgt_lens[i])} target tokens (EOS included) exceed "
                    f"{key}{per}={limit} "
                    f"({over.size} such pairs); raise {key} or prepare with a smaller --max-len"
                )


def _run(data, data_dir, out_dir, config, resume, info, dev, progress, tuner=None) -> TrainState:
    model = build_model(config, dev)
    distributed.broadcast_parameters(list(model.parameters()), info)
    optimizer = MixedPrecisionAdam(
        model.parameters(), (config.train.beta1, config.train.beta2), config.train.adam_eps
    )
    train_split = data.split("train")
    _check_lengths(data, config)
    sampler = TokenBatchSampler(
        train_split.src_lens,
        train_split.tgt_lens,
        _rank_tokens(config),
        seed=config.train.seed,
        rank=info.rank,
        world_size=info.world_size,
    )
    if len(sampler) == 0:
        raise UserError(f"{data.path}: the train split gives no batch for this rank")
    state = TrainState()
    if resume:
        state = _restore(out_dir, model, optimizer, sampler, info)
    else:
        torch.manual_seed(config.train.seed + info.rank)  # dropout differs between ranks
    optimizer.reserve_state()  # the moments' memory before the first batch's (optim.py)
    if info.is_main:  # after the restore: a refused resume leaves the run's files as they were
        rundir.write_run_files(out_dir, config, data_dir)
    logger.info(
        "model: %d parameters, %s; %d train batches per epoch and rank",
        model.num_parameters(),
        config.train.dtype,
        len(sampler),
    )
    spm_proto = (Path(data.path) / data.manifest["spm_model"]).read_bytes()
    extra = {
        "data": {
            "spm_proto": torch.frombuffer(bytearray(spm_proto), dtype=torch.uint8),
            "src": data.src_lang,
            "tgt": data.tgt_lang,
        }
    }
    forward = compiled_forward(model) if config.train.compile else model
    valid = data.split("valid") if "valid" in data.split_names else None
    trainer = Trainer(
        model, optimizer, chunked_label_smoothed_loss, sampler, train_split, valid,
        data.tokenizer, config, out_dir, state, info, extra, forward, progress, tuner,
    )  # fmt: skip
    return trainer.run()


def compiled_forward(model: Transformer) -> Callable[..., torch.Tensor]:
    """`train.compile`: the training forward through torch.compile, on the padded layout.

    The packed path (`model.Packing`) finds its rows with data-dependent ops (`nonzero`, a
    row count that changes every batch), where dynamo breaks the graph and guards on values:
    on a GPU it recompiled 43 times in the first 250 steps of the base preset on Multi30k
    (docs/performance.md). Compiled, the model runs padded, (B, T, D), whose only changing
    sizes are the batch's B, S and T (dynamic after their first change), and the real target
    rows are taken outside the graph: the same values as the packed path up to rounding."""
    compiled = torch.compile(model)

    def forward(src, src_mask, tgt, tgt_mask):
        return compiled(src, src_mask, tgt)[tgt_mask]  # (N, D), as the packed path returns

    return forward


def _restore(out_dir, model, optimizer, sampler, info) -> TrainState:
    found = checkpoint.load_latest(out_dir)
    if found is None:
        raise UserError(f"{out_dir}: no checkpoint to resume from")
    path, ckpt = found
    optimizer.load_master_state(model, ckpt["model"])
    try:
        optimizer.load_state_dict(ckpt["optimizer"])
    except ValueError as e:  # a checkpoint of another model
        raise UserError(f"{path}: {e}") from None
    ranks = ckpt["sampler"]["world_size"]
    if ranks != info.world_size:
        raise UserError(
            f"{path}: trained by {ranks} process(es), resumed by {info.world_size}: the batches "
            "would not line up; resume with the same train.procs (or torchrun world size)"
        )
    try:
        sampler.load_state_dict(ckpt["sampler"])
    except ValueError as e:  # the data or the batching changed under the run
        raise UserError(f"{path}: {e}") from None
    rng = ckpt["rng"]
    checkpoint.set_rng_state(rng[info.rank] if len(rng) == info.world_size else rng[0])
    logger.info("resumed from %s at step %d", path, ckpt["step"])
    return TrainState(**ckpt["counters"])
