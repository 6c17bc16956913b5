"""The training loop on a tiny model and a small slice of real Multi30k."""

from __future__ import annotations

import functools
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from fixtures import (
    CPUINFO_AMX,
    CPUINFO_SKYLAKE,
    CPUINFO_ZEN3,
    CPUINFO_ZEN4,
    SHARED_DATA,
    dead_pid,
    fake_cpuinfo,
    prepare_slice,
)
from transformer import atomic, checkpoint, rundir
from transformer.batching import TokenBatchSampler
from transformer.cli import main
from transformer.config import build_config
from transformer.data import collate, load_prepared
from transformer.errors import UserError
from transformer.gradhelper import WeightGradHelper
from transformer.loss import chunked_label_smoothed_loss
from transformer.optim import MixedPrecisionAdam, learning_rate
from transformer.threads import usable_cores
from transformer.train import auto_train_dtype, build_model, train
from transformer.trainer import MAX_NONFINITE_IN_ROW, Trainer, TrainingError

TINY = [
    "train.max_tokens=400",
    "train.log_every_steps=2",
    "train.valid_every_steps=1000",
    "train.save_every_steps=2",
    "train.save_every_minutes=1000",
    "train.warmup_steps=10",
]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    multi30k = SHARED_DATA / "multi30k"
    if not multi30k.is_dir():
        pytest.skip("Multi30k not found in ../shared/data")
    return prepare_slice(tmp_path_factory.mktemp("data"), multi30k)


def _config(*overrides: str, dtype: str = "fp32"):
    return build_config("tiny", None, [*TINY, f"train.dtype={dtype}", *overrides])


def _params(run_dir: Path) -> dict[str, torch.Tensor]:
    return checkpoint.load_checkpoint(checkpoint.latest_checkpoint(run_dir))["model"]


def test_run_writes_run_directory(data_dir, tmp_path):
    run = tmp_path / "run"
    state = train(data_dir, run, _config("train.max_steps=4", "train.keep_last=1"), progress=False)
    assert state.step == 4 and state.tokens > 0
    assert {"config.yaml", "run.json", "train.log", "metrics.jsonl"} <= {
        p.name for p in run.iterdir()
    }
    assert [p.name for p in checkpoint.list_checkpoints(run)] == ["ckpt_4.pt"]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train_records] == [2, 4]
    assert all(math.isfinite(r["loss"]) and r["tokens_per_s"] > 0 for r in train_records)
    ckpt = checkpoint.load_checkpoint(checkpoint.latest_checkpoint(run))
    assert set(ckpt) >= {"model", "optimizer", "sampler", "rng", "config", "data", "counters"}
    assert ckpt["config"]["train"]["max_steps"] == 4
    with pytest.raises(UserError, match="--resume"):
        train(data_dir, run, _config("train.max_steps=4"), progress=False)


def test_lowercased_data_gives_a_model_that_lowercases_its_input(data_dir, tmp_path, caplog):
    from transformer.evaluate import evaluate
    from transformer.translate import Translator

    lc_data = prepare_slice(tmp_path / "lc", SHARED_DATA / "multi30k", lowercase=True)
    for data, lowercase in ((data_dir, False), (lc_data, True)):
        run = tmp_path / f"run-{lowercase}"
        train(data, run, _config("train.max_steps=2", "train.keep_last=1"), progress=False)
        assert rundir.read_config(run).model.lowercase is lowercase  # from the data, not by hand
        model = rundir.average_files(checkpoint.list_checkpoints(run), tmp_path / f"{lowercase}.st")
        translator = Translator.from_path(model)
        assert translator.loaded.config.model.lowercase is lowercase
        cased, lower = (
            translator.encode(["A Man In A Red Shirt."]),
            translator.encode(["a man in a red shirt."]),
        )
        assert (cased == lower) is lowercase
        other = data_dir if lowercase else lc_data
        with pytest.raises(UserError, match=f"{other}: holds .* but {run} was trained on"):
            train(other, run, resume=True, overrides=["train.max_steps=4"], progress=False)
        for other in (data_dir, lc_data):  # a model scored on the other kind of data: warned
            caplog.clear()
            report = evaluate(model, other, split="valid", beam_size=1, limit=2)
            assert report["lowercase"] is lowercase
            warned = "read the lowercased scores" in caplog.text
            assert warned is (other != data), caplog.text


def test_evaluate_alphas_equals_one_evaluate_per_alpha(data_dir, tmp_path, monkeypatch):
    # The reports of one search for several α (choosing α on val, valchoice.py) are those of
    # one `evaluate` per α, but for the timings, which are the shared search's.
    from transformer.evaluate import evaluate, evaluate_alphas

    run = tmp_path / "run"
    train(data_dir, run, _config("train.max_steps=3", "train.keep_last=1"), progress=False)
    alphas = (0.0, 0.6, 2.0)
    together = evaluate_alphas(run, data_dir, "valid", alphas, beam_size=3, limit=12)
    timings = {"seconds", "sentences_per_s", "target_tokens_per_s", "timed_with_alphas"}
    for alpha, got in zip(alphas, together, strict=True):
        want = evaluate(run, data_dir, "valid", beam_size=3, length_penalty=alpha, limit=12)
        assert got["search"]["length_penalty"] == alpha and got["timed_with_alphas"] == [
            0.0, 0.6, 2.0]  # fmt: skip
        assert {k: v for k, v in got.items() if k not in timings} == {
            k: v for k, v in want.items() if k not in timings
        }
    with pytest.raises(ValueError, match="at least one"):
        evaluate_alphas(run, data_dir, "valid", ())
    # each α's report scores that α's translations (this 3-step model writes the same empty
    # output under every α, so the search's outputs are replaced: the reference for α 0.6)
    from transformer.data import load_prepared
    from transformer.translate import Translation, Translator

    refs = load_prepared(data_dir).split("valid").text("de")[:12]

    def fake(self, lines, alphas, beam_size=None, n_best=None):
        assert list(alphas) == [0.0, 0.6, 2.0] and len(lines) == 12
        return [[[Translation(r if a == 0.6 else "x", [5], 0.0)] for r in refs] for a in alphas]

    monkeypatch.setattr(Translator, "translate_alphas", fake)
    bleu = [r["bleu"] for r in evaluate_alphas(run, data_dir, "valid", alphas, 3, limit=12)]
    assert bleu == pytest.approx([0.0, 100.0, 0.0])


def test_model_lowercase_is_not_set_by_hand(data_dir, tmp_path):
    config = _config("train.max_steps=2", "model.lowercase=true")
    with pytest.raises(
        UserError, match="holds cased text, but model.lowercase asks for lowercased"
    ):
        train(data_dir, tmp_path / "run", config, progress=False)


def test_tensorboard_scalars_are_written(data_dir, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    train(data_dir, run, _config("train.max_steps=4", "train.keep_last=1"), progress=False)
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [2, 4] and all(math.isfinite(e.value) for e in loss)
    assert "train/lr" in events.Tags()["scalars"]


def test_loss_goes_down(data_dir, tmp_path):
    run = tmp_path / "run"
    cfg = _config("train.max_steps=30", "train.lr_scale=4.0", "model.p_drop=0.0")
    train(data_dir, run, cfg, progress=False)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r["kind"] == "train"]
    assert losses[-1] < losses[0] - 0.5


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_resume_in_process_is_exact(data_dir, tmp_path, dtype):
    straight, split = tmp_path / "straight", tmp_path / "split"
    cfg = _config("train.max_steps=6", "train.deterministic=true", dtype=dtype)
    train(data_dir, straight, cfg, progress=False)
    train(data_dir, split, replace(cfg, train=replace(cfg.train, max_steps=3)), progress=False)
    train(None, split, resume=True, overrides=["train.max_steps=6"], progress=False)
    assert not torch.are_deterministic_algorithms_enabled()  # process settings restored
    a, b = _params(straight), _params(split)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_train_makes_the_adam_moments_before_the_first_batch(data_dir, tmp_path, monkeypatch):
    """`MixedPrecisionAdam.reserve_state` before the first batch: made at the first step, after
    that batch's activations, the moments took their memory and the second step grew the heap
    again (docs/performance.md, "Round seventy-two"). The state itself stays empty until then."""
    first = []
    collect = MixedPrecisionAdam.collect_grads

    def spy(self):
        if not first:
            first.append((all(r is not None for r in self.adam.reserved), any(self.adam.state)))
        collect(self)

    monkeypatch.setattr(MixedPrecisionAdam, "collect_grads", spy)
    train(data_dir, tmp_path / "run", _config("train.max_steps=2"), progress=False)
    assert first == [(True, False)]


def test_checkpoints_keep_the_training_seconds_over_resumes_without_the_gap(data_dir, tmp_path):
    """TrainState.seconds: what a time budget has spent, for `recipe --resume`. A resume adds
    its own training time, not the time between the two runs."""
    import time

    run = tmp_path / "run"
    train(data_dir, run, _config("train.max_steps=4"), progress=False)
    first = checkpoint.load_checkpoint(checkpoint.latest_checkpoint(run))["counters"]["seconds"]
    time.sleep(1.0)  # the machine was down
    start = time.monotonic()
    train(None, run, resume=True, overrides=["train.max_steps=6"], progress=False)
    took = time.monotonic() - start
    second = checkpoint.load_checkpoint(checkpoint.latest_checkpoint(run))["counters"]["seconds"]
    assert 0 < first < second < first + took


@pytest.mark.parametrize(
    ("cpuinfo", "expected"),
    [(CPUINFO_AMX, "bf16"), (CPUINFO_ZEN4, "bf16"), (CPUINFO_SKYLAKE, "fp32"),
     (CPUINFO_ZEN3, "fp32"), ("processor\t: 0\n", "fp32")],
)  # fmt: skip
def test_dtype_auto_is_bf16_only_where_the_cpu_multiplies_it_natively(
    tmp_path, monkeypatch, cpuinfo, expected
):
    fake_cpuinfo(monkeypatch, tmp_path, cpuinfo)
    assert auto_train_dtype("cpu")[0] == expected
    assert auto_train_dtype(torch.device("cpu"))[0] == expected
    cfg = build_config("tiny", None, ["train.max_tokens=400"])  # the default is auto
    assert cfg.train.dtype == "auto"
    want = {"bf16": torch.bfloat16, "fp32": torch.float32}[expected]
    assert {p.dtype for p in build_model(cfg, torch.device("cpu")).parameters()} == {want}


def test_a_run_records_the_dtype_auto_chose_and_resumes_in_it(
    data_dir, tmp_path, monkeypatch, caplog
):
    # Trained where auto meant fp32 (an AVX2 CPU), resumed where it would mean bf16: the run
    # keeps fp32, so a resume stays exact across machines.
    fake_cpuinfo(monkeypatch, tmp_path, CPUINFO_ZEN3)
    run = tmp_path / "run"
    cfg = build_config("tiny", None, [*TINY, "train.max_steps=2", "train.deterministic=true"])
    with caplog.at_level("INFO", logger="transformer.train"):
        train(data_dir, run, cfg, progress=False)
    assert "train.dtype auto: fp32 (the CPU has no native bf16" in caplog.text
    assert rundir.read_config(run).train.dtype == "fp32"
    fake_cpuinfo(monkeypatch, tmp_path, CPUINFO_ZEN4)
    train(None, run, resume=True, overrides=["train.max_steps=3"], progress=False)
    assert rundir.read_config(run).train.dtype == "fp32"
    assert {v.dtype for v in _params(run).values() if v.is_floating_point()} == {torch.float32}
    straight = tmp_path / "straight"
    train(data_dir, straight, replace(cfg, train=replace(cfg.train, max_steps=3, dtype="fp32")),
          progress=False)  # fmt: skip
    a, b = _params(run), _params(straight)
    assert all(torch.equal(a[k], b[k]) for k in a)


def _trainer(data_dir: Path, run_dir: Path, cfg, loss_fn=chunked_label_smoothed_loss) -> Trainer:
    data = load_prepared(data_dir)
    cfg = replace(cfg, model=replace(cfg.model, vocab_size=data.tokenizer.vocab_size))
    torch.manual_seed(0)
    model = build_model(cfg, torch.device("cpu"))
    opt = MixedPrecisionAdam(model.parameters(), (0.9, 0.98), 1e-9)
    split = data.split("train")
    sampler = TokenBatchSampler(split.src_lens, split.tgt_lens, cfg.train.max_tokens, seed=1)
    run_dir.mkdir(exist_ok=True)
    return Trainer(model, opt, loss_fn, sampler, split, data.split("valid"), data.tokenizer, cfg,
                   run_dir, progress=False)  # fmt: skip


def _capture_step_grads(trainer: Trainer) -> list:
    """Record the normalized gradients each optimizer step sees (Adam's first step is
    sign-like, so comparing parameters would amplify rounding noise in tiny gradients)."""
    seen = []
    step = trainer.optimizer.step

    def recording_step(lr, grad_scale=1.0, clip_norm=0.0):
        seen.append([g * grad_scale for g in trainer.optimizer.master_grads()])
        return step(lr, grad_scale, clip_norm)

    trainer.optimizer.step = recording_step
    return seen


def test_accumulation_equals_one_big_batch(data_dir, tmp_path):
    cfg = _config("model.p_drop=0.0")
    small, big = _trainer(data_dir, tmp_path / "a", cfg), _trainer(data_dir, tmp_path / "b", cfg)
    grads_small, grads_big = _capture_step_grads(small), _capture_step_grads(big)
    split = small.train_split
    halves = [list(range(0, 7)), list(range(7, 20))]  # unequal token counts on purpose
    out_small = small.train_step([collate(split, h) for h in halves])
    out_big = big.train_step([collate(split, halves[0] + halves[1])])
    assert out_small["tokens"] == out_big["tokens"]
    assert out_small["loss"] == pytest.approx(out_big["loss"], rel=1e-5)
    # Normalized by all tokens of the step: the mean-token gradient of the big batch.
    for g, h in zip(grads_small[0], grads_big[0], strict=True):
        torch.testing.assert_close(g, h, rtol=1e-4, atol=1e-6)
    assert max(g.abs().max().item() for g in grads_big[0]) > 1e-3  # not trivially zero


@pytest.mark.parametrize(
    ("overrides", "step", "minutes", "factor"),
    [
        (["train.max_steps=10", "train.cooldown=0.5"], 7, 0.0, 0.6),  # by steps: 1 - 0.7 / 0.5
        (["train.max_steps=10", "train.cooldown=0.5"], 2, 0.0, 1.0),  # before the cool-down
        (["train.max_minutes=10", "train.cooldown=0.2"], 1, 9.0, 0.5),  # by minutes, nearer
        (["train.max_steps=10"], 9, 0.0, 1.0),  # off by default: eq. (3) as it is
        (["train.max_minutes=0", "train.cooldown=0.2"], 0, 0.0, 0.0),  # a spent budget
    ],
)
def test_cooldown_scales_the_learning_rate(data_dir, tmp_path, overrides, step, minutes, factor):
    cfg = _config(*overrides)
    trainer = _trainer(data_dir, tmp_path / "run", cfg)
    trainer.state.step, trainer._minutes = step, minutes
    out = trainer.train_step(trainer._next_batches())
    eq3 = learning_rate(step + 1, cfg.model.d_model, cfg.train.warmup_steps, cfg.train.lr_scale)
    assert out["lr"] == pytest.approx(eq3 * factor, rel=1e-6)


def test_nonfinite_losses_skip_then_stop_with_checkpoint(data_dir, tmp_path):
    calls = {"n": 0}

    def flaky(hidden, weight, target, eps):
        loss, nll = chunked_label_smoothed_loss(hidden, weight, target, eps)
        calls["n"] += 1
        return (loss * math.nan, nll) if calls["n"] > 2 else (loss, nll)

    cfg = _config("train.max_steps=50")
    trainer = _trainer(data_dir, tmp_path / "run", cfg, flaky)
    with pytest.raises(TrainingError, match="non-finite"):
        trainer.run()
    assert trainer.state.step == 2 and trainer.state.skipped == MAX_NONFINITE_IN_ROW
    ckpt = checkpoint.load_checkpoint(checkpoint.latest_checkpoint(tmp_path / "run"))
    assert ckpt["step"] == 2
    live = trainer.optimizer.master_state(trainer.model)
    assert all(
        torch.equal(ckpt["model"][k], live[k]) for k in live
    )  # skipped steps changed nothing
    assert all(torch.isfinite(v).all() for v in ckpt["model"].values())


def test_validate_reports_loss_ppl_and_bleu(data_dir, tmp_path):
    trainer = _trainer(data_dir, tmp_path / "run", _config())
    record = trainer.validate()
    assert record["ppl"] == pytest.approx(math.exp(record["nll"]))
    # An untrained model is close to uniform over the 400-piece vocabulary: ppl near 400.
    assert 100 < record["ppl"] < 2000
    assert 0.0 <= record.get("bleu", 0.0) <= 100.0


def test_max_minutes_budget_stops(data_dir, tmp_path):
    # The budget is checked before each step and the step in flight completes: one step.
    state = train(data_dir, tmp_path / "run", _config("train.max_minutes=0"), progress=False)
    assert state.step == 1
    # Step 1 is off the cadence (every 2 steps): resumable, never averaged.
    assert checkpoint.latest_checkpoint(tmp_path / "run").name == "ckpt_1_end.pt"


def test_cli_train_resume_average(data_dir, tmp_path):
    run = tmp_path / "run"
    args = ["train", str(data_dir), "--preset", "tiny", "--out", str(run), "--max-steps", "2"]
    assert main([*args, *TINY]) == 0
    assert main(["train", "--resume", str(run), "--max-steps", "4"]) == 0
    assert checkpoint.latest_checkpoint(run).name == "ckpt_4.pt"
    out = tmp_path / "avg.safetensors"
    assert main(["average", str(run), "--last", "2", "--out", str(out)]) == 0
    assert out.is_file()
    assert main(["train", "--resume", str(tmp_path / "nothing")]) == 2


def test_validation_bleu_aligns_hypotheses_with_references(data_dir, tmp_path, monkeypatch):
    trainer = _trainer(data_dir, tmp_path / "run", _config())
    split = trainer.valid_split
    by_src = {tuple(split.src_tokens(i).tolist()): i for i in range(len(split))}

    def oracle(model, src, src_mask, **caps):  # "translates" each source into its reference
        rows = [tuple(s[m][:-1].tolist()) for s, m in zip(src, src_mask, strict=True)]
        return [split.tgt_tokens(by_src[r]).tolist() for r in rows]

    monkeypatch.setattr("transformer.search.greedy_search", oracle)
    assert trainer.validate()["bleu"] == pytest.approx(100.0)


def test_validation_caps_its_outputs_as_the_runs_decode_config_says(
    data_dir, tmp_path, monkeypatch
):
    # An untrained model rarely ends a sentence: its greedy outputs run to the cap, which is the
    # run's decode.max_len_a x source length + decode.max_len_b, as in every other search.
    import transformer.search as search

    lengths: list[tuple[int, int]] = []
    real = search.greedy_search

    def spy(model, src, src_mask, **caps):
        outs = real(model, src, src_mask, **caps)
        lengths.extend(zip(src_mask.sum(1).tolist(), map(len, outs), strict=True))
        return outs

    monkeypatch.setattr(search, "greedy_search", spy)
    cfg = _config("decode.max_len_a=0", "decode.max_len_b=3")
    _trainer(data_dir, tmp_path / "run", cfg).validate()
    assert lengths and max(n for _, n in lengths) <= 2  # 3 tokens with EOS, which is not kept
    lengths.clear()
    _trainer(data_dir, tmp_path / "run2", _config()).validate()  # the paper's: source + 50
    assert all(n <= s + 50 - 1 for s, n in lengths) and max(n for _, n in lengths) > 3


def test_pairs_longer_than_the_model_or_a_batch_are_a_user_error_before_training(
    data_dir, tmp_path
):
    from transformer.data import load_prepared

    longest = max(int(load_prepared(data_dir).split("train").tgt_lens.max()), 3)
    with pytest.raises(UserError, match=rf"train line \d+: .* exceed model.max_len={longest - 1}"):
        train(data_dir, tmp_path / "a", _config(f"model.max_len={longest - 1}"), progress=False)
    with pytest.raises(UserError, match=rf"exceed train.max_tokens={longest - 1} .*max-len"):
        train(data_dir, tmp_path / "b", _config(f"train.max_tokens={longest - 1}"), progress=False)
    assert not (tmp_path / "a" / "checkpoints").exists()


def test_a_process_share_too_small_for_a_pair_is_refused_before_the_processes_start(
    data_dir, tmp_path, monkeypatch
):
    """`--procs 99` on a corpus whose longest pair needs more than max_tokens / 99 tokens:
    the parent says so at once (it took 76 s of starting 99 processes, each of which
    stopped on it)."""
    from transformer import distributed

    monkeypatch.setattr(distributed, "run_local", lambda *a: pytest.fail("processes started"))
    longest = int(load_prepared(data_dir).split("train").tgt_lens.max())
    cfg = _config(f"train.max_tokens={2 * (longest - 1)}", "train.procs=2")
    with pytest.raises(UserError, match=rf"exceed train.max_tokens / train.procs 2={longest - 1}"):
        train(data_dir, tmp_path / "a", cfg, progress=False, device="cpu")
    assert not (tmp_path / "a").exists()


# --- run metadata written atomically, damaged checkpoints, leftovers, YAML errors ----------


def test_a_failed_metadata_write_keeps_the_run_resumable_and_leftovers_are_removed(
    data_dir, tmp_path, monkeypatch
):
    import errno

    run = tmp_path / "run"
    train(data_dir, run, _config("train.max_steps=2"), progress=False)
    before = {name: (run / name).read_bytes() for name in ("config.yaml", "run.json")}
    real_fsync = atomic.os.fsync

    def full(fd):  # the disk fills while config.yaml is rewritten at the next start
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic.os, "fsync", full)
    with pytest.raises(UserError, match=r"config\.yaml: cannot write: No space left"):
        train(None, run, resume=True, overrides=["train.max_steps=4"], progress=False)
    monkeypatch.setattr(atomic.os, "fsync", real_fsync)
    assert {name: (run / name).read_bytes() for name in before} == before  # old or new, whole
    dead = dead_pid()
    leftovers = [run / f".config.yaml.tmp-{dead}", run / "checkpoints" / f".ckpt_9.pt.tmp-{dead}"]
    for path in leftovers:
        path.write_bytes(b"killed while writing")
    state = train(None, run, resume=True, overrides=["train.max_steps=4"], progress=False)
    assert state.step == 4
    assert not any(p.exists() for p in leftovers)
    assert not list(run.glob(".*.tmp-*")) and not list(run.glob("checkpoints/.*.tmp-*"))


def test_resume_falls_back_from_a_truncated_latest_checkpoint(data_dir, tmp_path, caplog):
    run = tmp_path / "run"
    train(data_dir, run, _config("train.max_steps=4", "train.keep_last=5"), progress=False)
    latest = checkpoint.latest_checkpoint(run)
    assert latest.name == "ckpt_4.pt"
    latest.write_bytes(latest.read_bytes()[:1000])
    state = train(None, run, resume=True, overrides=["train.max_steps=6"], progress=False)
    assert state.step == 6
    assert "using" in caplog.text and "ckpt_2.pt instead of the unreadable" in caplog.text


def test_resume_with_an_optimizer_state_of_other_shapes_is_a_one_line_error(
    data_dir, tmp_path, capsys
):
    run = tmp_path / "run"
    train(data_dir, run, _config("train.max_steps=2"), progress=False)
    latest = checkpoint.latest_checkpoint(run)
    ckpt = torch.load(latest, weights_only=True)
    ckpt["optimizer"]["state"][0]["exp_avg"] = torch.zeros(3)
    torch.save(ckpt, latest)
    assert main(["train", "--resume", str(run), "--max-steps", "4"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert f"{latest}: optimizer state: parameter 0's exp_avg has shape (3,)" in err


def test_yaml_errors_in_overrides_and_the_runs_config_are_one_line(data_dir, tmp_path, capsys):
    run = tmp_path / "run"
    args = ["train", str(data_dir), "--preset", "tiny", "--out", str(run), *TINY]
    assert main([*args, "train.seed=["]) == 2
    err = capsys.readouterr().err
    assert err.startswith("transformer train: error: override 'train.seed=[': the value is not")
    assert err.count("\n") == 1
    assert main([*args, "--max-steps", "2"]) == 0
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "train.seed=["]) == 2
    assert "override 'train.seed=['" in capsys.readouterr().err
    (run / "config.yaml").write_text("model: {d_model: [\n")
    assert main(["train", "--resume", str(run)]) == 2
    err = capsys.readouterr().err
    assert "config.yaml: cannot parse YAML" in err and err.count("\n") == 1
    (run / "config.yaml").write_bytes(b"model:\n  d_model: \xff\n")
    assert main(["train", "--resume", str(run)]) == 2
    assert "config.yaml: cannot parse YAML" in capsys.readouterr().err


def test_time_cadence_saves_at_exact_marks_of_the_run_clock(data_dir, tmp_path, monkeypatch):
    # A fake clock: each step takes 0.6 minutes; save every minute, never by steps. The flag is
    # read before a step: 1.2 >= 1 (step 3), 2.4 >= 2 (step 5), 3.0 >= 3 (step 6). "1 minute
    # since the last save" would drift: steps 3 and 6 only (every 1.8 minutes). The run ends at
    # step 6, on the cadence: no separate end checkpoint.
    import types

    from transformer import trainer as trainer_module

    clock = {"s": 0.0}
    fake = types.SimpleNamespace(monotonic=lambda: clock["s"], time=lambda: 0.0)
    monkeypatch.setattr(trainer_module, "time", fake)
    cfg = _config("train.max_steps=6", "train.save_every_steps=0", "train.save_every_minutes=1",
                  "train.keep_last=10")  # fmt: skip
    trainer = _trainer(data_dir, tmp_path / "run", cfg)
    step = trainer.train_step

    def timed_step(*args):
        out = step(*args)
        clock["s"] += 36.0
        return out

    trainer.train_step = timed_step
    trainer.run()
    names = [p.name for p in checkpoint.list_checkpoints(tmp_path / "run")]
    assert names == ["ckpt_3.pt", "ckpt_5.pt", "ckpt_6.pt"]


def test_end_of_run_checkpoint_resumes_but_is_never_averaged(data_dir, tmp_path):
    run = tmp_path / "run"
    train(data_dir, run, _config("train.max_steps=5", "train.keep_last=2"), progress=False)
    # Saves every 2 steps (TINY): 2, 4 on the cadence; the end at step 5 is off it.
    assert [p.name for p in checkpoint.list_checkpoints(run)] == [
        "ckpt_2.pt", "ckpt_4.pt", "ckpt_5_end.pt"
    ]  # fmt: skip
    assert checkpoint.latest_checkpoint(run).name == "ckpt_5_end.pt"
    out = rundir.average_run(run, last=2, out=tmp_path / "avg.safetensors")
    want = checkpoint.average_checkpoints(
        [checkpoint.load_checkpoint(run / "checkpoints" / f"ckpt_{s}.pt")["model"] for s in (2, 4)]
    )
    from transformer.modelfile import load_model

    got = load_model(out).model.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    with pytest.raises(checkpoint.CheckpointError, match="--last 3 asked, 2 checkpoints"):
        rundir.average_run(run, last=3)
    # Resuming from the end checkpoint continues the run; once the cadence passes it, it goes.
    assert main(["train", "--resume", str(run), "--max-steps", "6"]) == 0
    assert [p.name for p in checkpoint.list_checkpoints(run)] == ["ckpt_4.pt", "ckpt_6.pt"]
    assert checkpoint.load_checkpoint(checkpoint.latest_checkpoint(run))["step"] == 6


def test_thread_count_follows_threads_then_omp_num_threads(monkeypatch):
    import transformer.threads
    from transformer.config import RunConfig
    from transformer.train import _setup_torch

    class Idle:  # others' load since the start (the suite's other workers): not read here
        def cores(self):
            return None

    monkeypatch.setattr(transformer.threads.OtherLoad, "since_start", classmethod(lambda c: Idle()))
    before = torch.get_num_threads()
    cpu = torch.device("cpu")
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        torch.set_num_threads(2)
        _setup_torch(RunConfig(), cpu)  # a user's OMP_NUM_THREADS is left as torch read it
        assert torch.get_num_threads() == 2
        _setup_torch(RunConfig(), cpu, threads=1)  # --threads wins
        assert torch.get_num_threads() == 1
        monkeypatch.delenv("OMP_NUM_THREADS")
        _setup_torch(RunConfig(), cpu)  # neither: every core it may use
        assert torch.get_num_threads() == usable_cores()
        with pytest.raises(UserError, match=r"--threads: at least 1 \(or auto\), not 0"):
            _setup_torch(RunConfig(), cpu, threads=0)
        with pytest.raises(UserError, match="--threads: at most 1024 "):
            _setup_torch(RunConfig(), cpu, threads=1025)
    finally:
        torch.set_num_threads(before)
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize(("others", "first"), [(1.0, 1), (0.1, 2), (None, 2)])
def test_a_run_starts_on_one_thread_where_others_crowded_the_cores_since_the_start(
    monkeypatch, others, first
):
    """Two trainings started together: each starts on one thread until the tuner's first
    probe; alone (or where it cannot be read), on every usable core as before."""
    import transformer.threads
    from transformer.config import RunConfig
    from transformer.train import _setup_torch

    class Reading:
        def cores(self):
            return others

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(transformer.threads, "usable_cores", lambda: 2)
    monkeypatch.setattr(
        transformer.threads.OtherLoad, "since_start", classmethod(lambda c: Reading())
    )
    before = torch.get_num_threads()
    try:
        tuner = _setup_torch(RunConfig(), torch.device("cpu"))
        assert tuner.best == first and torch.get_num_threads() == first
        assert tuner.candidates[0] == 2  # the probe still times every count
        # While others crowd the cores, the steps stay timed, a probe times what fits beside
        # them, and the helper only where they are not this user's other jobs of ours.
        assert tuner.probe_when_crowded and tuner.room is not None and tuner.helps is not None
    finally:
        torch.set_num_threads(before)
        torch.use_deterministic_algorithms(False)


def test_early_stopping_stops_after_patience_validations_without_improvement(
    data_dir, tmp_path, monkeypatch
):
    # Validation scores scripted: ppl improves at the 1st and 2nd validations, then not again.
    ppls = iter([50.0, 40.0, 41.0, 40.0, 39.99, 30.0])
    monkeypatch.setattr(
        Trainer, "validate", lambda self: {"loss": 1.0, "nll": 1.0, "ppl": next(ppls), "bleu": 1.0}
    )
    cfg = _config("train.valid_every_steps=2", "train.patience=2", "train.min_delta=0.05")
    state = train(data_dir, tmp_path / "run", cfg, progress=False)
    # Validations at steps 2, 4 (best 40.0), 6, 8 (no gain > 0.05): stop before step 9.
    assert state.step == 8
    assert (state.best_metric, state.best_step, state.bad_validations) == (40.0, 4, 2)
    valid = [row for _, row in rundir.read_metrics(tmp_path / "run", "valid")]
    assert [row["best_step"] for row in valid] == [2, 4, 4, 4]
    assert all(0 < row["epochs"] for row in valid)
    # Resumed, the decision stands: no further step is taken.
    again = train(None, tmp_path / "run", resume=True, progress=False)
    assert again.step == 8


def test_early_stopping_on_bleu_keeps_the_highest(data_dir, tmp_path, monkeypatch):
    bleus = iter([10.0, 12.0, 11.0, 30.0, 5.0])
    monkeypatch.setattr(
        Trainer, "validate", lambda self: {"loss": 1.0, "nll": 1.0, "ppl": 9.0, "bleu": next(bleus)}
    )
    cfg = _config("train.valid_every_steps=1", "train.patience=1", "train.patience_metric=bleu")
    state = train(data_dir, tmp_path / "run", cfg, progress=False)
    assert (state.step, state.best_metric, state.best_step) == (3, 12.0, 2)


def test_epoch_cap_stops_at_the_epoch_boundary(data_dir, tmp_path):
    cfg = _config("train.max_epochs=1", "train.save_every_steps=1000")
    run = tmp_path / "run"
    state = train(data_dir, run, cfg, progress=False)
    per_epoch = len(load_prepared(data_dir).split("train").src_lens)  # an upper bound
    assert 0 < state.step <= per_epoch
    rows = [row for _, row in rundir.read_metrics(run, "train")]
    assert rows[-1]["epochs"] == pytest.approx(1.0)


@pytest.mark.parametrize(
    "override", ["train.patience=-1", "train.patience_metric=loss", "train.max_epochs=0"]
)
def test_early_stopping_settings_are_checked(override):
    with pytest.raises(UserError, match=override.split("=")[0]):
        _config(override)


def test_validation_without_bleu_skips_the_decode(data_dir, tmp_path, monkeypatch):
    import transformer.search as search

    def no_decode(*args, **kwargs):
        raise AssertionError("decoded although train.valid_bleu=false")

    monkeypatch.setattr(search, "greedy_search", no_decode)
    record = _trainer(data_dir, tmp_path / "run", _config("train.valid_bleu=false")).validate()
    assert "bleu" not in record and record["ppl"] > 1.0
    with pytest.raises(UserError, match="valid_bleu"):
        _config("train.valid_bleu=false", "train.patience_metric=bleu")


class _NoTruth:
    """A module wrapper that, like `torch.compile`'s, cannot be truth-tested (its __len__
    raises); calls go to the model."""

    def __init__(self, model) -> None:
        self.model, self.calls = model, 0

    def __len__(self) -> int:
        raise TypeError("does not support len()")

    def __call__(self, *args):
        self.calls += 1
        return self.model(*args)


def test_a_compiled_forward_is_used_not_truth_tested(data_dir: Path, tmp_path: Path) -> None:
    """train.compile hands the trainer a compiled module; `forward or model` raised TypeError."""
    trainer = _trainer(data_dir, tmp_path / "run", _config())
    wrapper = _NoTruth(trainer.model)
    trainer = Trainer(trainer.model, trainer.optimizer, trainer.loss_fn, trainer.sampler,
                      trainer.train_split, trainer.valid_split, trainer.tokenizer, trainer.config,
                      trainer.run_dir, progress=False, forward=wrapper)  # fmt: skip
    assert trainer.forward is wrapper
    loss, _ = trainer._batch_loss(collate(trainer.train_split, next(iter(trainer.sampler))))
    assert wrapper.calls == 1 and math.isfinite(float(loss.detach()))
    from transformer.trainer import evaluate_loss

    out = evaluate_loss(trainer.model, trainer.valid_split, 2000, forward=wrapper)
    assert wrapper.calls > 0 and math.isfinite(out["loss"])


def test_compiled_forward_runs_padded_and_returns_the_packed_rows(
    data_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    """train.compile compiles the padded layout (the packed one's data-dependent row counts
    recompiled every batch on a GPU) and takes the real target rows outside the graph: the
    packed path's (N, D) in its order. torch.compile is the identity here; the compiled graph
    itself is measured on a GPU (benchmarks/gpu/compile_train.sh)."""
    from transformer.tokenizer import PAD_ID
    from transformer.train import compiled_forward

    seen = []

    def fake_compile(model):
        def call(*args):
            seen.append(len(args))
            return model(*args)

        return call

    monkeypatch.setattr(torch, "compile", fake_compile)
    trainer = _trainer(data_dir, tmp_path / "run", _config("model.p_drop=0.0"))
    b = collate(trainer.train_split, next(iter(trainer.sampler)))
    keep = b.tgt_out != PAD_ID
    assert not bool(keep.all())  # a batch with padding
    forward = compiled_forward(trainer.model)
    with torch.no_grad():
        got = forward(b.src, b.src_mask, b.tgt_in, keep)
        want = trainer.model(b.src, b.src_mask, b.tgt_in, keep)
    assert seen == [3]  # the compiled call has no target mask: the padded path
    assert got.shape == want.shape == (int(keep.sum()), trainer.model.cfg.d_model)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_a_step_with_the_weight_gradient_helper_equals_one_without(data_dir, tmp_path):
    # The tuner's "1+helper" (gradhelper.py): dW, db and the projection's (V, D) product on a
    # second thread, added to .grad after each batch's backward; two accumulated batches, the
    # loss in chunks of 16 rows (several in flight).
    helper = WeightGradHelper.for_this_process()
    assert helper is not None
    cfg = _config("model.p_drop=0.0")
    loss_fn = functools.partial(chunked_label_smoothed_loss, chunk_rows=16)
    plain = _trainer(data_dir, tmp_path / "a", cfg, loss_fn)
    helped = _trainer(data_dir, tmp_path / "b", cfg, loss_fn)
    grads_plain, grads_helped = _capture_step_grads(plain), _capture_step_grads(helped)
    halves = [list(range(0, 7)), list(range(7, 20))]
    out_plain = plain.train_step([collate(plain.train_split, h) for h in halves])
    helper.active = True
    try:
        out_helped = helped.train_step([collate(helped.train_split, h) for h in halves])
    finally:
        helper.active = False
    assert out_helped["loss"] == out_plain["loss"] and out_helped["ok"] == 1.0
    for g, h in zip(grads_plain[0], grads_helped[0], strict=True):
        torch.testing.assert_close(h, g, rtol=1e-5, atol=1e-8)
    assert helper._pending == []
