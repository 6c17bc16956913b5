from __future__ import annotations

import copy
import functools
import io
import logging
import mmap
import os
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import sentencepiece as spm
import torch
from torch import nn

import transformer.cpuinfo
import transformer.threads
import transformer.translate
from fixtures import CPUINFO_AMX, CPUINFO_AVX_VNNI, CPUINFO_ZEN3, CPUINFO_ZEN4, fake_cpuinfo
from transformer import kernels
from transformer.cli import main
from transformer.config import ConfigError, DecodeConfig, ModelConfig, RunConfig
from transformer.data import read_lines
from transformer.errors import UserError
from transformer.gradhelper import is_linear
from transformer.model import Transformer
from transformer.modelfile import load_model, save_model
from transformer.rundir import resolve_model
from transformer.search import beam_search, beam_search_alphas, greedy_search
from transformer.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from transformer.translate import (
    FP32Logits,
    Int8Linear,
    PackedLinear,
    Translator,
    auto_dtype,
    bf16_packs,
    int8_narrow_weights,
    onednn_bf16,
    quantize_int8,
    relu_input_layers,
    translate_stream,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def needs_onednn_bf16(test):
    """oneDNN packs bf16 weights only on a CPU with AVX-512 BW/VL/DQ or AVX-NE-CONVERT (every
    CPU with native bf16 products has them; a Zen 3, AVX2 only, has not, and there bf16
    decoding takes F.linear: `translate.bf16_packs`). On such a CPU the test checks that
    instead: packing refuses, and bf16 decoding does not pack."""
    if onednn_bf16():
        return test

    @functools.wraps(test)
    def refused(*args, **kwargs):
        with pytest.raises(RuntimeError, match="bf16"):
            PackedLinear(torch.zeros(4, 8).bfloat16(), None, dtype=torch.bfloat16)
        assert not bf16_packs()

    return refused


WORDS = "a man woman dog cat runs sits on the red blue street park ball with two young".split()


def _train_spm(tmp: Path) -> bytes:
    """A small joint subword model on synthetic sentences (no corpus needed)."""
    g = torch.Generator().manual_seed(0)
    lines = []
    for _ in range(400):
        n = int(torch.randint(3, 12, (1,), generator=g))
        idx = torch.randint(len(WORDS), (n,), generator=g).tolist()
        lines.append(" ".join(WORDS[i] for i in idx).capitalize() + ".")
    (tmp / "text.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(tmp / "text.txt"), model_prefix=str(tmp / "spm"), vocab_size=300,
        model_type="bpe", pad_id=PAD_ID, bos_id=BOS_ID, eos_id=EOS_ID, unk_id=UNK_ID,
        byte_fallback=True, character_coverage=1.0, normalization_rule_name="identity",
        num_threads=1, minloglevel=2,
    )  # fmt: skip
    return (tmp / "spm.model").read_bytes()


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> Path:
    """A tiny random model file (d_model 16, 2 layers, max_len 64) with a real spm model."""
    tmp = tmp_path_factory.mktemp("translate")
    proto = _train_spm(tmp)
    vocab = spm.SentencePieceProcessor(model_proto=proto).get_piece_size()
    cfg = RunConfig(
        model=ModelConfig(vocab_size=vocab, n_layers=2, d_model=16, d_ff=32, n_heads=2, d_k=8,
                          d_v=8, p_drop=0.0, max_len=64),
        decode=DecodeConfig(beam_size=3, max_len_b=8, max_tokens=40),
    )  # fmt: skip
    torch.manual_seed(0)
    model = Transformer(cfg.model).eval()
    with torch.no_grad():  # a wider logit spread than the init, so outputs vary by input
        model.src_embed.weight.mul_(4.0)
    return save_model(tmp / "model.safetensors", model, cfg, proto, "en", "de")


LINES = ["A man runs.", "", "Two young dogs sit on the red street with a ball.", "A cat."]
# The streams' tests: several small batches, and outputs capped at a quarter of the source's
# length + 6 tokens. The random model runs every search to its cap (17-63 tokens under the
# fixture's 1.0 x length + 8): capped, the outputs still differ by line and in length (7-20
# tokens), and these tests take under half the time.
SMALL_BATCHES = {"max_tokens": 24, "max_len_a": 0.25, "max_len_b": 6}


def test_batched_translation_keeps_input_order_and_equals_one_at_a_time(model_file):
    tr = Translator.from_path(model_file)
    assert len(list(tr.batches(tr.encode(LINES)))) > 1  # max_tokens=40 forces several batches
    together = tr.translate(LINES, n_best=2)
    for line, nbest in zip(LINES, together, strict=True):
        alone = tr.translate([line], n_best=2)[0]
        assert [t.tokens for t in alone] == [t.tokens for t in nbest]
    assert together[1] == [together[1][0]] and together[1][0].text == ""  # empty line -> ""
    assert [len(n) for i, n in enumerate(together) if i != 1] == [2, 2, 2]
    assert tr.translate_lines(LINES) == [n[0].text for n in together]


def test_translate_alphas_equals_translate_per_alpha(model_file):
    tr = Translator.from_path(model_file)
    lines = [f"{w} {v}" for w in ("A man", "Two dogs", "The child") for v in LINES]
    alphas = (0.0, 0.6, 3.0)
    together = tr.translate_alphas(lines, alphas, n_best=2)
    for alpha, got in zip(alphas, together, strict=True):
        assert got == tr.translate(lines, length_penalty=alpha, n_best=2)
    assert together[0] != together[-1]  # α changed some translations or their scores
    greedy = tr.translate_alphas(lines, alphas, beam_size=1)  # no α in greedy search
    assert greedy[0] == greedy[1] == greedy[2] == tr.translate(lines, beam_size=1)
    with pytest.raises(ConfigError):
        tr.translate_alphas(lines, (0.6, -1.0))


def test_translate_alphas_searches_once_for_every_alpha_in_every_dtype(model_file, monkeypatch):
    # One search serves every α in int8 too: its layers quantize each row on its own range, so
    # the sentences a larger α keeps searching change nothing in the others' outputs. (With
    # one range per batch, 9-34 of 1,014 Multi30k val translations changed per α.)
    import transformer.translate as translate_module

    searched = []

    def spy(model, src, src_mask, alphas, *args):
        searched.append(tuple(alphas))
        return beam_search_alphas(model, src, src_mask, alphas, *args)

    monkeypatch.setattr(translate_module, "beam_search_alphas", spy)
    alphas = (0.0, 0.6, 2.0)
    for dtype in ("int8", "bf16"):
        tr = Translator.from_path(model_file, dtype=dtype)
        searched.clear()
        together = tr.translate_alphas(LINES, alphas, n_best=2)
        assert searched == [alphas] * len(searched) and searched
        assert together == [tr.translate(LINES, length_penalty=alpha, n_best=2) for alpha in alphas]


def test_int8_without_fbgemm_is_a_one_line_error(model_file, monkeypatch):
    # The per-row product exists for fbgemm only (x86): elsewhere (qnnpack on ARM, a GPU)
    # `--dtype int8` must say so, not fail inside a decode; auto never picks it there.
    monkeypatch.setattr(torch.backends.quantized, "engine", "qnnpack")
    with pytest.raises(UserError, match="int8 runs on a CPU with fbgemm's kernels.*'qnnpack'"):
        Translator.from_path(model_file, dtype="int8")
    assert Translator.from_path(model_file).dtype_name in ("fp32", "bf16")


@pytest.mark.parametrize("dtype", ["int8", "bf16", "fp32"])
def test_translation_of_a_line_does_not_depend_on_its_batch(model_file, dtype):
    # A sentence must translate the same alone, in a batch, or beside whatever other requests
    # `serve` batches with it (one input range per batch changed 211 of 1,708 Multi30k lines),
    # in int8 and bf16 (`auto`'s choices) with the same scores, bit for bit (docs/decoding.md,
    # "A sentence's translation does not depend on its batch"). The long line pads the others'
    # queries and keys past a KEY_BLOCK, which rounded MKL's products of a few queries
    # differently before they were padded in whole blocks. fp32's linear layers (MKL's sgemm)
    # round a row differently with 1-3 rows than with more: the same hypotheses, their scores
    # to 1e-6.
    tr = Translator.from_path(model_file, dtype=dtype)
    lines = [*LINES, "a much longer line " * 6, "x", "unknown ÿ words here"]
    for beam, n_best in ((3, 2), (1, 1)):
        together = tr.translate(lines, beam_size=beam, n_best=n_best)
        alone = [tr.translate([line], beam_size=beam, n_best=n_best)[0] for line in lines]
        assert tr.dtype_name == dtype and _same_translations(tr, together, alone)


def test_translation_matches_search_on_the_encoded_source(model_file):
    tr = Translator.from_path(model_file)
    ids = tr.tokenizer.encode(LINES[2]) + [EOS_ID]
    src = torch.tensor([ids])
    want = beam_search(tr.model, src, src != PAD_ID, beam_size=3, length_penalty=0.6,
                       max_len_b=8)[0][0]  # fmt: skip
    got = tr.translate([LINES[2]])[0][0]
    assert got.tokens == want.tokens and got.score == pytest.approx(want.score)
    assert got.text == tr.tokenizer.decode(want.tokens)


def test_beam_1_is_greedy_and_options_are_validated(model_file):
    tr = Translator.from_path(model_file)
    greedy = tr.translate(LINES, beam_size=1)
    assert all(len(n) == 1 for n in greedy)
    ids = tr.tokenizer.encode(LINES[2]) + [EOS_ID]
    src = torch.tensor([ids])
    assert greedy[2][0].tokens == greedy_search(tr.model, src, src != PAD_ID, 1.0, 8)[0]
    with pytest.raises(UserError):
        tr.translate(LINES, beam_size=0)


def test_long_line_is_truncated_with_a_warning_naming_it(model_file, caplog):
    tr = Translator.from_path(model_file)
    long = " ".join(["two young dogs"] * 40)
    with caplog.at_level(logging.WARNING, logger="transformer.translate"):
        sources = tr.encode(["A cat.", long])
        out = tr.translate_lines(["A cat.", long])
    assert len(sources[1]) == 64 and sources[1][-1] == EOS_ID  # max_len 64 positions
    assert "line 2:" in caplog.text and "truncated" in caplog.text
    assert len(out) == 2


# --- `transformer translate` a window at a time (translate_stream) ----------------------------

STREAM_LINES = [*LINES, "A woman sits on the blue ball.", "Two cats.",
                "The young man with a dog runs in the park."]  # fmt: skip


@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_translate_stream_writes_each_window_and_equals_the_whole_input(model_file, dtype):
    tr = Translator.from_path(model_file, dtype=dtype)
    whole = tr.translate_lines(STREAM_LINES)
    raw = ("\n".join(STREAM_LINES) + "\n").encode()
    for window in (1, 3):
        out = io.StringIO()
        assert translate_stream(tr, io.BytesIO(raw), "in", out, window) == len(STREAM_LINES)
        assert out.getvalue() == "".join(t + "\n" for t in whole), window


def test_translate_stream_numbers_lines_across_windows(model_file, caplog):
    tr = Translator.from_path(model_file)
    lines = ["A cat.", "", "Two dogs.", "A man.", "A dog.", " ".join(["two young dogs"] * 40)]
    with caplog.at_level(logging.WARNING, logger="transformer.translate"):
        translate_stream(tr, io.BytesIO("\n".join(lines).encode()), "in", io.StringIO(), 2)
    assert "line 6:" in caplog.text and "truncated" in caplog.text  # the 3rd window's 2nd


class _Pipe(io.BytesIO):
    """A byte stream that cannot seek (a pipe)."""

    def seekable(self) -> bool:
        return False


def test_translate_stream_of_a_bad_file_fails_before_any_work(model_file):
    tr = Translator.from_path(model_file)
    raw = b"A man runs.\nA cat.\nTwo dogs.\n\xc3\x28 broken\n"
    out = io.StringIO()
    with pytest.raises(UserError, match=r"in\.txt:4: invalid UTF-8"):
        translate_stream(tr, io.BytesIO(raw), "in.txt", out, 2)
    assert out.getvalue() == ""  # a file is read through first
    # A pipe cannot be read twice: the lines before the bad one are translated and written.
    with pytest.raises(UserError, match=r"<stdin>:4: invalid UTF-8"):
        translate_stream(tr, _Pipe(raw), "<stdin>", out, 2)
    assert out.getvalue().split("\n")[:3] == tr.translate_lines(
        ["A man runs.", "A cat.", "Two dogs."]
    )


def test_translate_stream_from_a_file_part_read_starts_where_it_is(model_file):
    tr = Translator.from_path(model_file)
    stream = io.BytesIO(b"skipped\nA cat.\n")
    stream.readline()  # `(read header; transformer translate MODEL) < in.txt`
    out = io.StringIO()
    assert translate_stream(tr, stream, "<stdin>", out) == 1
    assert out.getvalue() == tr.translate_lines(["A cat."])[0] + "\n"


def test_cli_translate_reads_a_pipe_given_as_its_input_path(model_file, tmp_path, capsys):
    fifo = tmp_path / "in.fifo"  # `transformer translate MODEL <(zcat in.gz)`: "file not found"
    os.mkfifo(fifo)
    # daemon: where the pipe is never opened (the old "file not found"), its writer waits on
    writer = threading.Thread(target=lambda: fifo.write_bytes(b"A cat.\nTwo dogs.\n"), daemon=True)
    writer.start()
    assert main(["translate", str(model_file), str(fifo), "--dtype", "fp32"]) == 0
    writer.join(30)
    expected = Translator.from_path(model_file).translate_lines(["A cat.", "Two dogs."])
    assert capsys.readouterr().out == "".join(t + "\n" for t in expected)


def test_cli_translate_window_option_is_checked_before_loading(model_file, capsys):
    for bad in ("0", "-3", "x", "10000001"):
        with pytest.raises(SystemExit) as e:
            main(["translate", str(model_file), "--window", bad])
        assert e.value.code == 2
        assert "--window" in capsys.readouterr().err


def test_bf16_and_int8(model_file):
    fp32 = Translator.from_path(model_file).translate_lines(LINES)
    bf16 = Translator.from_path(model_file, dtype="bf16")
    assert bf16.model.output_weight().dtype == torch.bfloat16
    assert len(bf16.translate_lines(LINES)) == 4
    int8 = Translator.from_path(model_file, dtype="int8")
    quantized = [m for m in int8.model.modules() if isinstance(m, Int8Linear)]
    # encoder: 3 attn + 2 ffn; decoder: 6 attn + 2 ffn; and the pre-softmax projection
    assert len(quantized) == 2 * 5 + 2 * 8 + 1
    assert not [m for m in int8.model.modules() if is_linear(m)]
    out = int8.translate_lines(LINES)
    assert out[1] == "" and len(out) == 4
    # Cached steps stack each layer's quantized W^Q and W^KV into one product, once per layer.
    src = torch.tensor([[5, 6, EOS_ID]])
    projections = []
    for _ in range(2):
        cache = int8.model.new_cache()
        memory = int8.model.encode(src, src > 0)
        int8.model.decode(torch.tensor([[BOS_ID]]), memory, src > 0, cache)
        projections.append([c.proj for c in cache.layers])
    assert all(isinstance(p.qkv, Int8Linear) for p in projections[0])
    assert all(a is b for a, b in zip(*projections, strict=True))
    assert fp32[1] == ""
    with pytest.raises(UserError, match="dtype"):
        Translator.from_path(model_file, dtype="fp8")


def test_int8_streams_share_each_layers_stacked_projections(model_file, monkeypatch):
    # Three decoding streams start at once on a fresh int8 model: each layer's W^Q|W^KV is
    # stacked once (a lock), and the streams translate as one search at a time does.
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(transformer.threads, "usable_cores", lambda: 2)
    before = torch.get_num_threads()
    lines = [f"{w} {v} runs." for w in ("A man", "Two dogs", "The child") for v in LINES] * 2
    built = []
    stacked = Int8Linear.stacked.__func__
    monkeypatch.setattr(Int8Linear, "stacked", classmethod(
        lambda cls, parts: built.append(len(parts)) or stacked(cls, parts)))  # fmt: skip
    try:
        seq = Translator.from_path(model_file, dtype="int8", threads=1)
        par = Translator.from_path(model_file, dtype="int8", threads="auto")
        assert par.streams == 3
        for tr in (seq, par):
            tr.decode = replace(tr.decode, **SMALL_BATCHES)
        want = seq.translate_lines(lines)
        n_layers = len(par.model.decoder_layers)
        built.clear()
        assert par.translate_lines(lines) == want
        assert built == [2, 1] * n_layers  # W^Q|W^KV and cross W^Q, once per layer
    finally:
        torch.set_num_threads(before)


def test_streams_decode_batches_side_by_side_with_the_same_output(model_file, monkeypatch):
    # threads="auto" on 2 cores: 3 streams, at most one per 2 batches of a job (none for 1-3
    # batches), each search in its own thread; outputs and their order are those of one search
    # at a time.
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(transformer.threads, "usable_cores", lambda: 2)
    before = torch.get_num_threads()
    lines = [f"{w} {v} runs." for w in ("A man", "Two dogs", "The child") for v in LINES] * 2
    try:
        seq = Translator.from_path(model_file, threads=2)
        par = Translator.from_path(model_file, threads="auto")
        assert seq.streams == 1 and par.streams == 3
        for tr in (seq, par):
            tr.decode = replace(tr.decode, **SMALL_BATCHES)
        n_batches = len(list(par.batches(par.encode(lines))))
        assert n_batches >= 6
        used = []
        monkeypatch.setattr(par, "_decode_streams", lambda *a: used.append(a[-1]) or
                            Translator._decode_streams(par, *a))  # fmt: skip
        for beam in (4, 1):
            want = seq.translate(lines, beam_size=beam)
            torch.set_num_threads(2)
            assert par.translate(lines, beam_size=beam) == want
            assert torch.get_num_threads() == 2  # restored after the streams
        assert used == [3, 3]
        four = next(
            n for n in range(len(lines)) if len(list(par.batches(par.encode(lines[:n])))) == 4
        )
        got, want = (tr.translate(lines[:four], beam_size=4) for tr in (par, seq))
        # one thread per stream against two: the same tokens, scores equal up to rounding
        assert [[(t.text, t.tokens) for t in n] for n in got] == [
            [(t.text, t.tokens) for t in n] for n in want
        ]
        assert [t.score for n in got for t in n] == pytest.approx(
            [t.score for n in want for t in n]
        )
        assert used == [3, 3, 2]  # 4 batches: two streams
        assert par.translate(lines[:2]) == seq.translate(lines[:2])  # one batch: no streams
        assert used == [3, 3, 2]
    finally:
        torch.set_num_threads(before)


def _same_translations(tr, got, want):
    """`tr` gave `got` where `want` was expected (a line alone against in a batch, the streams
    against one search at a time): the same hypotheses, and the same scores bit for bit, except
    in fp32 (`auto`'s choice on a CPU with neither AMX nor VNNI, as a Zen 3), whose linear
    layers (MKL's sgemm) round a row differently in a product of 1-3 rows than of more, and
    whose last stream, given both CPUs, splits its rows between two threads: there the scores
    to 1e-6 (docs/decoding.md)."""
    if tr.dtype_name != "fp32":
        return got == want
    hyps = [[(t.text, t.tokens) for t in n] for n in got]
    return hyps == [[(t.text, t.tokens) for t in n] for n in want] and [
        t.score for n in got for t in n
    ] == pytest.approx([t.score for n in want for t in n], rel=1e-6)


class _Crowded:
    """A stand-in for `threads.OtherLoad` whose figure the test sets."""

    def __init__(self, cores):
        self.value = cores

    def cores(self):
        return self.value


@pytest.mark.parametrize("others", [1.0, 0.1, None])
def test_beside_a_busy_process_the_streams_keep_to_a_cpu_each_and_one_more_runs(
    model_file, monkeypatch, others
):
    # Another process busy on the CPUs (1.0 core): stream k keeps to CPU k mod 2 (each stream
    # thread's own affinity, the caller's untouched) and a fourth stream decodes; a machine
    # used by nothing else (0.1) or one where it cannot be measured (None): three streams, none
    # pinned. The same outputs every way.
    import os
    import threading

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(transformer.threads, "usable_cores", lambda: 2)
    pins, decoders = [], set()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cpus: pins.append(
        (threading.current_thread().name, pid, sorted(cpus))))  # fmt: skip
    before = torch.get_num_threads()
    lines = [f"{w} {v} runs." for w in ("A man", "Two dogs", "The child") for v in LINES] * 2
    try:
        seq = Translator.from_path(model_file, threads=1)
        par = Translator.from_path(model_file, threads="auto")
        assert par.streams == 3 and par.load is not None
        par.load = _Crowded(others)
        par.batches_at_once = 0  # no first batch alone (`_streams_that_fit`, tested below)
        for tr in (seq, par):
            tr.decode = replace(tr.decode, **SMALL_BATCHES)
        assert len(list(par.batches(par.encode(lines)))) >= 12
        want = seq.translate(lines)
        decode = par._decode

        def slow(*args):  # long enough a batch for every stream to start one
            decoders.add(threading.current_thread().name)
            threading.Event().wait(0.02)
            return decode(*args)

        monkeypatch.setattr(par, "_decode", slow)
        assert _same_translations(par, par.translate(lines), want)
        if others == 1.0:
            assert decoders == {"decode-0", "decode-1", "decode-2", "decode-3"}
            own = [pin for pin in pins if pin[1] == 0]  # each stream's own thread
            assert sorted(own) == [(f"decode-{k}", 0, [k % 2]) for k in range(4)]
            # Once no batch is left, the first stream to find none lets the others (still on
            # their last batch) use every CPU: by their threads' ids, each once.
            rest = [pin for pin in pins if pin[1] != 0]
            assert len(rest) == 3 and all(cpus == [0, 1] for *_, cpus in rest)
            assert len({tid for _, tid, _ in rest}) == 3 and pins.index(rest[0]) >= 4
        else:
            assert decoders == {"decode-0", "decode-1", "decode-2"} and pins == []
        if others == 1.0:  # crowded for a few batches: the streams pinned, then not again
            pins.clear()
            calls = iter([0.0] + [1.0] * 8 + [0.0] * 1000)
            monkeypatch.setattr(par.load, "cores", lambda: next(calls))
            assert _same_translations(par, par.translate(lines), want)
            assert ("decode-3", 0, [1]) in pins and any(cpus == [0, 1] for *_, cpus in pins)

            def refused(pid, cpus):  # a CPU taken away meanwhile: the streams go on unpinned
                raise OSError(22, "Invalid argument")

            monkeypatch.setattr(os, "sched_setaffinity", refused)
            monkeypatch.setattr(par.load, "cores", lambda: 1.0)
            assert _same_translations(par, par.translate(lines), want)
    finally:
        torch.set_num_threads(before)


def test_one_usable_core_decodes_one_search_and_a_quota_leaves_the_other_cpus_to_others(
    model_file, monkeypatch
):
    # One usable core (taskset, a quota of one CPU): no streams, no load watched. Eight CPUs
    # in the affinity and a quota of two: crowded only once others keep more than the six CPUs
    # beyond this process's two busy.
    import os

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        monkeypatch.setattr(transformer.threads, "usable_cores", lambda: 1)
        one = Translator.from_path(model_file, threads="auto")
        assert one.streams == 1 and one.load is None and not one.crowded()
        monkeypatch.setattr(transformer.threads, "usable_cores", lambda: 2)
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(8)))
        two = Translator.from_path(model_file, threads="auto")
        assert two.streams == 3 and two.spare_cpus == 6
        for others, room in ((0.3, None), (6.0, None), (6.25, 1.75), (7.5, 0.5)):
            two.load = _Crowded(others)
            assert two.crowded() is (room is not None) and two.room() == room
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("available", "at_once", "decoders"),
    [(10 * 2**30, 0, {"decode-0", "decode-1", "decode-2"}),  # plenty: not measured
     (2.6, 2, {"MainThread", "decode-0", "decode-1"}),  # x the bound: measured, 2 fit
     (1.2, 1, {"MainThread"}),
     (None, 0, {"decode-0", "decode-1", "decode-2"})],
)  # fmt: skip
def test_the_first_batch_alone_bounds_the_streams_by_the_memory_available(
    model_file, monkeypatch, caplog, available, at_once, decoders
):
    # Where the memory available does not hold twice the streams' bound (BATCH_BYTES_BOUND),
    # the job's first batch is decoded alone, its resident memory read; the streams are as many
    # as STREAMS_MEMORY_SHARE of the memory available holds batches of that size (here one
    # batch "takes" the bound), one at a time where one fits, as before where the memory is
    # plenty or unknown. Outputs are those of one search at a time every way; the caller's
    # threads restored.
    import logging
    import threading

    import transformer.translate as translate_module

    class FakePeak:
        grown = None  # set below: the bound

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(transformer.threads, "usable_cores", lambda: 2)
    monkeypatch.setattr(translate_module, "_PeakRSS", FakePeak)
    before = torch.get_num_threads()
    lines = [f"{w} {v} runs." for w in ("A man", "Two dogs", "The child") for v in LINES]
    try:
        seq = Translator.from_path(model_file, threads=1)
        par = Translator.from_path(model_file, threads="auto")
        par.load = _Crowded(0.0)
        for tr in (seq, par):
            tr.decode = replace(tr.decode, **SMALL_BATCHES)
        assert len(list(par.batches(par.encode(lines)))) >= 8  # the first alone, then 2-3 streams
        cfg, model_cfg = par.decode, par.model.cfg
        bound = translate_module.BATCH_BYTES_BOUND * cfg.max_tokens * cfg.beam_size
        bound *= model_cfg.n_layers * model_cfg.d_model
        FakePeak.grown = bound
        if available is not None and available < 100:
            available *= bound
        monkeypatch.setattr(translate_module, "available_memory", lambda: available)
        seen, decode = set(), par._decode

        def spy(*args):
            seen.add(threading.current_thread().name)
            threading.Event().wait(0.01)  # every stream starts a batch
            return decode(*args)

        monkeypatch.setattr(par, "_decode", spy)
        torch.set_num_threads(2)
        with caplog.at_level(logging.INFO, logger="transformer.translate"):
            assert _same_translations(par, par.translate(lines), seq.translate(lines))
        assert par.batches_at_once == at_once and seen == decoders
        assert torch.get_num_threads() == 2
        said = [r.getMessage() for r in caplog.records if "decoding stream" in r.getMessage()]
        if at_once in (1, 2):
            assert said == [f"{at_once} decoding stream{'s' if at_once > 1 else ''} instead of "
                            f"3: a batch took {bound / 2**20:.0f} MiB and "
                            f"{available / 2**20:.0f} MiB are available"]  # fmt: skip
        else:
            assert said == []
        seen.clear()  # the next job: no first batch alone, the same bound
        assert _same_translations(par, par.translate(lines), seq.translate(lines))
        assert ("MainThread" in seen) == (at_once == 1)
    finally:
        torch.set_num_threads(before)


def test_peak_rss_reads_the_growth_of_resident_memory_over_its_block():
    from transformer.translate import _PeakRSS

    peak = _PeakRSS()
    reads, read = [], peak._rss

    def counted():
        reads.append(1)
        return read()

    peak._rss = counted
    # Pages of their own: where an earlier test in this worker has set `allocator.keep_large_blocks`
    # (a mmap threshold above 64 MiB), a bytearray comes from the heap and may reuse pages that
    # are resident already (46.9 and 47.0 MiB grown for the 64 in two fresh clones on a Zen 3).
    with peak:
        block = mmap.mmap(-1, 64 * 2**20)  # anonymous: new pages, resident once written
        block[::4096] = b"x" * len(block[::4096])
        # held until the watcher has read twice more, not for a fixed time: on a loaded
        # machine its thread may not run within 50 ms (round forty-eight's suite beside a run)
        seen, wait = len(reads), threading.Event().wait
        for _ in range(1000):
            if len(reads) >= seen + 2:
                break
            wait(0.01)
        block.close()
    assert peak.grown is not None and 48 * 2**20 <= peak.grown < 1024 * 2**20


def test_a_failing_stream_stops_the_job_and_restores_the_threads(model_file, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(transformer.threads, "usable_cores", lambda: 2)
    before = torch.get_num_threads()
    lines = [f"A man number {i} runs to the red house." for i in range(40)]
    try:
        par = Translator.from_path(model_file, threads="auto")
        par.decode = replace(par.decode, max_tokens=24)
        n_batches = len(list(par.batches(par.encode(lines))))
        calls = []

        def fail(*args):
            calls.append(1)
            raise RuntimeError("out of memory")

        monkeypatch.setattr(par, "_decode", fail)
        torch.set_num_threads(2)
        with pytest.raises(RuntimeError, match="out of memory"):
            par.translate(lines)
        assert torch.get_num_threads() == 2 and len(calls) < n_batches  # the rest not run
    finally:
        torch.set_num_threads(before)


def test_translator_tuner_probes_one_unit_per_thread_count(model_file, monkeypatch):
    # A decoding unit is already search.TUNER_STEPS steps; translation jobs are often short.
    # The first unit (oneDNN's kernels built, the cache faulted in) is not timed.
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        tr = Translator.from_path(model_file, threads="auto")
        assert tr.tuner is not None and tr.tuner.probe_units == 1 and tr.tuner._warmup == 1
        if tr.tuner.candidates[0] >= 2:  # one thread while others crowd the CPUs
            assert tr.tuner.room == tr.room and tr.load is not None
            # others' load is read: a decoding unit's falling rate is no drop to re-probe on
            assert tr.tuner.drop == 0.0
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("crowded", [True, False])
def test_a_search_on_its_own_keeps_to_one_thread_while_others_crowd_the_cpus(
    model_file, monkeypatch, crowded
):
    # Beside a busy process (`Translator.crowded`, from /proc/stat) a short job's one search
    # runs its encoder and every step on one thread, as the streams keep to one CPU each.
    from transformer import search

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("transformer.threads.usable_cores", lambda: 2)
    before = torch.get_num_threads()
    counts = []
    encode, step = search.ModelStepper.__init__, search.ModelStepper.step

    def spy_init(self, model, *args, **kwargs):
        real = model.encode
        model.encode = lambda *a, **k: (counts.append(torch.get_num_threads()), real(*a, **k))[1]
        try:
            encode(self, model, *args, **kwargs)
        finally:
            del model.encode

    def spy_step(self, tokens):
        counts.append(torch.get_num_threads())
        return step(self, tokens)

    monkeypatch.setattr(search.ModelStepper, "__init__", spy_init)
    monkeypatch.setattr(search.ModelStepper, "step", spy_step)
    try:
        tr = Translator.from_path(model_file, threads="auto")
        monkeypatch.setattr(tr, "room", lambda: 1.0 if crowded else None)
        tr.tuner.room = tr.room
        torch.set_num_threads(2)
        tr.translate(["a b c", "d e"], beam_size=2)
        if crowded:
            assert counts and set(counts) == {1}
        else:  # the encoder and the first steps on both (a probe may try one thread later)
            assert counts[:2] == [2, 2]
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("cpuinfo", "expected"),
    [(CPUINFO_AMX, "bf16"), (CPUINFO_ZEN4, "int8"), (CPUINFO_AVX_VNNI, "int8"),
     (CPUINFO_ZEN3, "int8"), ("processor\t: 0\n", "fp32")],
)  # fmt: skip
def test_dtype_auto_is_bf16_with_amx_int8_with_vnni_or_avx2_else_fp32(
    model_file, tmp_path, monkeypatch, caplog, cpuinfo, expected
):
    fake_cpuinfo(monkeypatch, tmp_path, cpuinfo)
    assert auto_dtype("cpu")[0] == expected
    with caplog.at_level(logging.INFO, logger="transformer.translate"):
        tr = Translator.from_path(model_file, dtype="auto")
    assert tr.dtype_name == expected and f"dtype auto: {expected}" in caplog.text
    if expected == "int8":  # every linear and the tied projection int8, 8-bit weights (VNNI)
        proj = tr.model.projection
        assert isinstance(proj, Int8Linear) and not proj.narrow_weights
        assert not any(is_linear(m) for m in tr.model.modules())
    else:
        want = {"bf16": torch.bfloat16, "fp32": torch.float32}[expected]
        assert tr.model.output_weight().dtype == want
        # The projection through oneDNN with the weights packed once (PackedLinear): fp32's,
        # and bf16's with every linear layer (the faked CPU multiplies bf16 natively), where
        # this CPU's oneDNN packs bf16 (not on a Zen 3: bf16 there through F.linear, unpacked)
        # (bf16's projection an FP32Logits where AMX's tiles give fp32 logits: a PackedLinear
        # where the kernel does not run)
        packed = bf16_packs() if expected == "bf16" else torch.backends.mkldnn.is_available()
        fp32_logits = packed and expected == "bf16" and kernels.project_amx()
        proj = tr.model.projection
        if fp32_logits:
            assert isinstance(proj, FP32Logits) and proj.weight.dtype == want
        else:
            assert isinstance(proj, PackedLinear) if packed else proj is None
        if packed:
            assert fp32_logits or proj.dtype == want
            assert any(is_linear(m) for m in tr.model.modules()) == (expected == "fp32")
    assert len(tr.translate_lines(LINES)) == 4


def test_attention_has_pieces_and_per_layer_head_weights(model_file):
    tr = Translator.from_path(model_file)
    att = tr.attention("A man runs.")
    S, T = len(att["source_pieces"]), len(att["target_pieces"])
    assert att["source_pieces"][-1] == att["target_pieces"][-1] == "</s>"
    assert att["target_input_pieces"][0] == "<s>" and len(att["target_input_pieces"]) == T
    for key, shape in [("encoder", (S, S)), ("decoder", (T, T)), ("cross", (T, S))]:
        layers = torch.tensor(att[key])
        assert layers.shape == (2, 2, *shape)  # N layers, H heads
        torch.testing.assert_close(layers.sum(-1), torch.ones(2, 2, shape[0]))
    given = tr.attention("A man runs.", "Ein Mann.")
    assert given["translation"] == "Ein Mann."


def test_run_directory_uses_its_averaged_model(model_file, tmp_path):
    with pytest.raises(UserError, match="no model file"):
        resolve_model(tmp_path)
    loaded = load_model(model_file)
    run = tmp_path / "run"
    save_model(run / "model_avg.safetensors", loaded.model, loaded.config, loaded.spm_proto,
               "en", "de")  # fmt: skip
    assert resolve_model(run).path == run / "model_avg.safetensors"


def test_cli_translate_file_and_errors(model_file, tmp_path, capsys):
    src = tmp_path / "in.txt"
    src.write_text("\n".join(LINES) + "\n", encoding="utf-8")
    assert main(["translate", str(model_file), str(src), "--beam", "2", "--alpha", "0.6"]) == 0
    out = capsys.readouterr().out.split("\n")
    assert len(out) == 5 and out[1] == "" and out[4] == ""  # 4 lines, the empty one kept
    # The CLI's default precision is auto (bf16 on a CPU with AMX).
    expected = Translator.from_path(model_file, dtype="auto").translate(
        LINES, beam_size=2, length_penalty=0.6
    )
    assert out[:4] == [n[0].text for n in expected]
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"A man.\n\xc3\x28 broken\n")
    assert main(["translate", str(model_file), str(bad)]) == 2
    assert "bad.txt:2: invalid UTF-8" in capsys.readouterr().err
    assert main(["translate", str(tmp_path / "missing.safetensors"), str(src)]) == 2


@pytest.mark.gpu
def test_cuda_search_gives_the_cpu_translations(model_file):
    # The search's own tensors (beams, scores, finished flags) live where the model does.
    lines = ["A man runs.", "Two young dogs sit on the red street with a ball.", "A cat."]
    for beam in (1, 3):
        cpu = Translator.from_path(model_file).translate(lines, beam_size=beam)
        cuda = Translator.from_path(model_file, device="cuda").translate(lines, beam_size=beam)
        assert [[h.tokens for h in n] for n in cuda] == [[h.tokens for h in n] for n in cpu]


def test_input_lines_follow_the_corpus_line_model(model_file, tmp_path, capsys):
    # issue 18: a leading BOM was translated ("Ein Möbeler rennt."), a lone "\r" split a line
    stream = io.BytesIO(b"\xef\xbb\xbfA man.\r\nA\rcat.\n\xef\xbb\xbfA dog.")
    assert list(read_lines(stream, "x")) == ["A man.", "A cat.", "\ufeffA dog."]
    src = tmp_path / "bom.txt"
    src.write_bytes("\ufeff".encode() + b"A man runs.\r\nA\rcat.\n")
    assert main(["translate", str(model_file), str(src), "--beam", "1"]) == 0
    out = capsys.readouterr().out.split("\n")
    tr = Translator.from_path(model_file, dtype="auto")  # the CLI's default
    expected = tr.translate(["A man runs.", "A cat."], beam_size=1)
    assert out == [expected[0][0].text, expected[1][0].text, ""]


def test_cli_damaged_model_and_bad_inputs_are_one_line(model_file, tmp_path, capsys):
    src = tmp_path / "in.txt"
    src.write_text("A man.\n", encoding="utf-8")
    damaged = tmp_path / "damaged.safetensors"
    data = bytearray(model_file.read_bytes())
    data[-3] ^= 0x01
    damaged.write_bytes(bytes(data))
    assert main(["translate", str(damaged), str(src)]) == 2
    err = capsys.readouterr().err
    assert "damaged.safetensors: the tensor data does not match" in err and err.count("\n") == 1
    assert main(["translate", str(damaged), str(src), "--no-verify"]) == 0
    capsys.readouterr()
    assert main(["translate", str(model_file), str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    assert main(["translate", str(tmp_path), str(src)]) == 2  # a directory with no model
    assert capsys.readouterr().err.count("\n") == 1


def test_the_stop_rule_reaches_the_search(model_file, monkeypatch):
    import transformer.translate as translate_module

    seen = []

    def spy(*args):
        seen.append(args[-2])  # beam_search_alphas(..., constrain, stop, tuner)
        return beam_search_alphas(*args)

    monkeypatch.setattr(translate_module, "beam_search_alphas", spy)
    tr = Translator.from_path(model_file)
    tr.translate(LINES)
    tr.decode = tr.options(stop="fairseq")
    tr.translate(LINES)
    assert seen == ["t2t", "t2t", "fairseq", "fairseq"]  # two batches each (max_tokens=40)


# `Int8Linear`'s products this CPU runs: fbgemm's everywhere, oneDNN's where
# `int8_onednn()` holds (VNNI), the library's exact AVX2 one wherever the library runs with
# AVX2 (`int8_avx2()` takes it without VNNI); the layer tests below run under each.
INT8_PRODUCTS = (
    ["fbgemm"]
    + (["onednn"] if transformer.translate.int8_onednn() else [])
    + (["avx2"] if transformer.kernels.int8_product_supported() else [])
)


@pytest.fixture(params=INT8_PRODUCTS)
def int8_product(request, monkeypatch):
    """Layers built in this test multiply through this product."""
    monkeypatch.setattr(transformer.translate, "int8_onednn", lambda: request.param == "onednn")
    monkeypatch.setattr(transformer.translate, "int8_avx2", lambda: request.param == "avx2")
    return request.param


@pytest.mark.parametrize("narrow", [None, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_is_close_to_the_fp32_product(narrow, dtype, int8_product):
    # None: the weights' range quantize_int8 takes on this CPU (8 bits with VNNI, 7 without:
    # 8-bit weights and inputs saturate there, test_int8_weights_are_narrow_without_vnni).
    narrow = int8_narrow_weights() if narrow is None else narrow
    g = torch.Generator().manual_seed(0)
    linear = nn.Linear(64, 48)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(48, 64, generator=g) * torch.rand(48, 1, generator=g))
    x = torch.randn(5, 7, 64, generator=g)
    q = Int8Linear(linear.weight, linear.bias, narrow)
    got = q(x.to(dtype))
    assert got.dtype == dtype and got.shape == (5, 7, 48)
    want = linear(x).detach()
    rel = (got.float() - want).norm() / want.norm()
    assert rel < (0.02 if narrow else 0.015), rel  # 7-8-bit weights per row, 8-bit inputs
    assert Int8Linear(linear.weight, None, narrow, torch.float32)(x.to(dtype)).dtype == (
        torch.float32
    )


@pytest.mark.parametrize("nonnegative", [False, True])
@pytest.mark.parametrize("narrow", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_rows_do_not_depend_on_each_other(narrow, nonnegative, dtype, int8_product):
    # Each row is quantized on its own range: rows 1,000x apart, a row of zeros, alone or in
    # any batch, give the same values bit for bit; and the small rows keep their precision.
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(40, 64, generator=g) * 0.1, torch.randn(40, generator=g)
    q = Int8Linear(w, b, narrow, nonnegative_inputs=nonnegative)
    x = torch.randn(7, 64, generator=g) * torch.logspace(-2, 1, 7)[:, None]
    x[3] = 0
    if nonnegative:
        x = x.relu()
    x = x.to(dtype)
    together = q(x)
    for i in range(7):
        assert torch.equal(together[i : i + 1], q(x[i : i + 1])), i
    assert torch.equal(together[3], q.bias.to(dtype))  # zeros in: the bias out
    assert torch.equal(q(x.flip(0)), together.flip(0))
    assert torch.equal(q(x.view(7, 1, 64)).view(7, 40), together)
    # The precision where this CPU's kernel does not saturate: 8-bit weights only with VNNI
    # (without it AVX2's int16 pair sums saturate, which is why the product takes 7-bit
    # weights there, `int8_narrow_weights`). bf16 outputs round the small rows' products into
    # the bias, so fp32 only.
    if dtype == torch.float32 and (narrow or not int8_narrow_weights()):
        want = torch.nn.functional.linear(x, w)
        err = (together - b - want).norm(dim=1) / want.norm(dim=1).clamp_min(1e-30)
        assert err[[0, 1, 2, 4, 5, 6]].max() < (0.02 if narrow else 0.015), err


def test_int8_linear_takes_relu_inputs_on_their_own_8_bit_grid(int8_product):
    # [0, max] in 255 steps for the FFN's second layer (ReLU's outputs), not half of [-max, max]
    # in 254: an input of 1/255 of its row's largest is exact there, and rounded to 0 or 2/254
    # on the signed grid.
    w = torch.eye(4)
    x = torch.tensor([[1.0, 1 / 255, 3 / 255, 0.0]])
    got = Int8Linear(w, None, False, nonnegative_inputs=True)(x)
    assert torch.allclose(got, x, rtol=0, atol=1e-6), got
    signed = Int8Linear(w, None, False)(x)
    assert (signed - x).abs().max() > 1e-3
    model = Transformer(ModelConfig(vocab_size=30, n_layers=2, d_model=16, d_ff=32, n_heads=2))
    assert relu_input_layers(model) == {
        f"{side}_layers.{i}.ffn.w_2" for side in ("encoder", "decoder") for i in range(2)
    }
    q = quantize_int8(model.eval())
    flags = {n: m.nonnegative_inputs for n, m in q.named_modules() if isinstance(m, Int8Linear)}
    assert {n for n, f in flags.items() if f} == relu_input_layers(model)
    with pytest.raises(ValueError, match="the same inputs"):
        Int8Linear.stacked([(q.encoder_layers[0].ffn.w_2, 1.0), (q.encoder_layers[0].ffn.w_1, 1.0)])


@pytest.mark.parametrize("narrow", [False, True])
def test_stacked_int8_linears_give_each_parts_values_exactly(narrow, int8_product):
    # A decoder step's W^Q (times 1/8) and W^KV as one product must change no value: the same
    # 8-bit inputs, the same integers, each row's scale and bias times a power of two.
    g = torch.Generator().manual_seed(1)
    q = Int8Linear(torch.randn(24, 32, generator=g), torch.randn(24, generator=g), narrow)
    kv = Int8Linear(torch.randn(40, 32, generator=g), torch.randn(40, generator=g), narrow)
    nobias = Int8Linear(torch.randn(8, 32, generator=g), None, narrow)
    x = torch.randn(5, 3, 32, generator=g) * 3
    both = Int8Linear.stacked([(q, 0.125), (kv, 1.0), (nobias, 2.0)])(x)
    assert both.shape == (5, 3, 72)
    assert torch.equal(both[..., :24], q(x) * 0.125)
    assert torch.equal(both[..., 24:64], kv(x))
    assert torch.equal(both[..., 64:], nobias(x) * 2.0)


@pytest.mark.parametrize("d_k", [16, 8])  # W^Q prescaled by 1/4; sqrt(8) is no power of 2
def test_int8_cached_decoding_runs_stacked_projections_with_the_same_values(d_k, monkeypatch):
    import transformer.model as model_module

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=40, n_layers=2, d_model=32, d_ff=64, n_heads=2, d_k=d_k, d_v=8)
    model = quantize_int8(Transformer(cfg).eval())
    cache = model.new_cache()
    src = torch.tensor([[5, 6, 7, 8, EOS_ID], [9, 10, EOS_ID, PAD_ID, PAD_ID]])
    mask = src != PAD_ID
    memory = model.encode(src, mask)
    tgt = torch.tensor([[BOS_ID, 11, 12, 13], [BOS_ID, 14, 15, 16]])

    def steps(cache):
        return torch.cat([model.decode(tgt[:, i : i + 1], memory, mask, cache)
                          for i in range(tgt.size(1))], dim=1)  # fmt: skip

    with torch.inference_mode():
        stacked = steps(cache)
        assert all(isinstance(c.proj.qkv, Int8Linear) for c in cache.layers)
        assert {c.proj.prescaled for c in cache.layers} == {d_k == 16}
        monkeypatch.setattr(model_module.StepProjections, "of", staticmethod(lambda layer: None))
        assert torch.equal(stacked, steps(model.new_cache()))  # the layers' own modules


def test_narrow_int8_weights_do_not_saturate_on_any_cpu(int8_product):
    # The worst case for AVX2's int16 pair sums: inputs at the top of their 8-bit range (u8 255,
    # zero point 0: ReLU outputs, the FFN's second layer) times weights at the top of theirs.
    # With 7-bit weights the product is exact on every CPU, VNNI or not; 8-bit weights give
    # 129.5 instead of 256 without VNNI (measured on a Zen 3).
    w, x = torch.ones(8, 256), torch.ones(4, 256)
    got = Int8Linear(w, None, narrow_weights=True)(x)
    assert torch.allclose(got, torch.full((4, 8), 256.0)), got[0, :4]


@pytest.mark.parametrize(
    ("cpuinfo", "narrow"),
    [(CPUINFO_AMX, False), (CPUINFO_ZEN4, False), (CPUINFO_AVX_VNNI, False),
     (CPUINFO_ZEN3, False), ("processor\t: 0\n", True), (CPUINFO_ZEN3 + "fbgemm", True)],
)  # fmt: skip
def test_int8_weights_are_narrow_without_vnni(model_file, tmp_path, monkeypatch, cpuinfo, narrow):
    # `--dtype int8` on a CPU without VNNI (a Zen 3) must take 7-bit weights in every layer
    # where the product is fbgemm's (TRANSFORMER_INT8_PRODUCT=fbgemm, or a CPU without AVX2);
    # the library's exact AVX2 product (`int8_avx2`) takes 8-bit ones, as a VNNI CPU does.
    if cpuinfo.endswith("fbgemm"):
        cpuinfo = cpuinfo.removesuffix("fbgemm")
        monkeypatch.setenv("TRANSFORMER_INT8_PRODUCT", "fbgemm")
    fake_cpuinfo(monkeypatch, tmp_path, cpuinfo)  # (`int8_onednn` asks anew for each file)
    assert int8_narrow_weights() is narrow
    q = quantize_int8(Translator.from_path(model_file).loaded.model)
    layers = [m for m in q.modules() if isinstance(m, Int8Linear)]
    assert layers and {m.narrow_weights for m in layers} == {narrow}
    if cpuinfo == CPUINFO_ZEN3 and not narrow:  # the library's product, 8-bit weights
        assert {"product=avx2" in repr(m) for m in layers} == {True}
    assert all(m.integer_weights()[0].abs().max() == (63 if narrow else 127)
               for m in layers)  # fmt: skip


def test_an_int8_translator_keeps_no_fp32_weights_of_the_layers_it_quantized(model_file):
    import gc
    import weakref

    loaded = load_model(model_file)
    fp32 = [weakref.ref(m.weight) for m in loaded.model.modules() if is_linear(m)]
    translator = Translator(loaded, dtype="int8")
    assert not any(map(is_linear, translator.loaded.model.modules()))
    assert translator.loaded.model is translator.model
    assert translator.num_parameters == loaded.model.num_parameters()
    assert loaded.model.encoder_layers[0].ffn.w_1.weight.dtype == torch.float32  # the caller's
    del loaded
    gc.collect()
    assert fp32 and all(ref() is None for ref in fp32)  # freed with the caller's model


def test_a_translator_keeps_no_mapping_of_its_model_file_and_survives_its_rewriting(
    model_file, tmp_path
):
    """A model file's tensors are read into memory of their own (`load_model`), not views of
    a mapping of the file: a view kept (an Int8Linear's bias) kept every page of it, and a
    file rewritten in place (`cp` over it) would change the weights under a running server,
    or end it (SIGBUS) where the file was cut short."""
    import shutil

    own = shutil.copy(model_file, tmp_path / "own.safetensors")
    translators = [Translator.from_path(own, dtype=d) for d in ("fp32", "int8")]
    assert str(own) not in Path("/proc/self/maps").read_text()
    lines = ["A dog runs.", "Two men are playing football in a park."]
    before = [t.translate_lines(lines) for t in translators]
    with open(own, "r+b") as f:  # cut short and overwritten in place, as `cp` would
        f.truncate(100)
        f.write(b"\0" * 100)
    assert [t.translate_lines(lines) for t in translators] == before


def test_quantize_int8_leaves_the_model_unchanged(model_file):
    loaded = Translator.from_path(model_file).loaded
    before = {k: v.clone() for k, v in loaded.model.state_dict().items()}
    q = quantize_int8(loaded.model, torch.bfloat16)
    after = loaded.model.state_dict()  # the copy shares the replaced weights: none written
    assert all(v.dtype == before[k].dtype and torch.equal(v, before[k]) for k, v in after.items())
    assert sum(map(is_linear, loaded.model.modules())) == 2 * 5 + 2 * 8
    assert q.src_embed.weight.dtype == torch.bfloat16 and loaded.model.projection is None
    src = torch.tensor([[5, 6, EOS_ID]])
    logits = q.decode(torch.tensor([[BOS_ID]]), q.encode(src, src > 0), src > 0)
    assert logits.dtype == torch.float32  # the projection's output, for the log-softmax
    want = loaded.model.decode(torch.tensor([[BOS_ID]]), loaded.model.encode(src, src > 0), src > 0)
    assert (logits - want).norm() / want.norm() < 0.05


def _int8_study():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "int8_error_parts.py"
    spec = importlib.util.spec_from_file_location("int8_error_parts", path)
    study = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(study)
    return study


def test_int8_error_study_simulates_the_int8_kernels(int8_product):
    # benchmarks/int8_error_parts.py attributes int8's BLEU cost to weights and inputs by
    # simulating each rounding in fp32; its full variant must be what Int8Linear computes
    # (up to the kernels' accumulation order) with the weights this CPU takes (7 bits without
    # VNNI, where 8 would saturate the kernel's int16 pair sums).
    study = _int8_study()
    torch.manual_seed(0)
    weight, bias = torch.randn(48, 64) * 0.1, torch.randn(48) * 0.1
    x = torch.randn(10, 64) + 0.3
    narrow = int8_narrow_weights()
    for nonneg in (False, True):
        x = x.relu() if nonneg else x
        got = study.FakeInt8Linear(weight, bias, 63.0 if narrow else 127.0, "row", nonneg=nonneg)(x)
        kernels = Int8Linear(weight, bias, narrow, nonnegative_inputs=nonneg)(x)
        exact = torch.nn.functional.linear(x, weight, bias)
        assert (got - kernels).abs().max() < 0.01 * (got - exact).abs().max()
    rows = study.fake_quantize_inputs(x, "token")
    assert (rows - x).abs().max() < (study.fake_quantize_inputs(x, "tensor") - x).abs().max()
    for bad in ["63:tensor", "x:tensor:tensor", "300:tensor:tensor", "63:rows:tensor",
                "g:none:none", "63x:none:none", "63gg:none:none"]:  # fmt: skip
        with pytest.raises(SystemExit, match=f"bad variant '{bad}': want LEVELS"):
            study.variant(torch.nn.Module(), bad)
    assert study.parse_variant("63g:rownorm:fp32") == (63.0, True, "rownorm", "fp32")
    with pytest.raises(ValueError, match="GPTQ needs"):
        study.variant(torch.nn.Module(), "63g:none:none")


def test_int8_study_rownorm_inputs_and_the_divergence():
    from transformer.config import ModelConfig
    from transformer.data import Batch
    from transformer.model import Transformer

    study = _int8_study()
    torch.manual_seed(0)
    # rows 100x apart: one range per tensor rounds the small row coarsely, row norms do not
    x = torch.randn(2, 64) * torch.tensor([[1.0], [100.0]])
    tensor_err = (study.fake_quantize_inputs(x, "tensor") - x)[0].abs().max()
    rownorm_err = (study.fake_quantize_inputs(x, "rownorm") - x)[0].abs().max()
    assert rownorm_err < 0.1 * tensor_err
    cfg = ModelConfig(vocab_size=30, n_layers=1, d_model=16, d_ff=32, n_heads=2, d_k=8, d_v=8,
                      p_drop=0.0, max_len=32)  # fmt: skip
    model = Transformer(cfg).eval()
    src = torch.randint(4, 30, (3, 6))
    tgt = torch.randint(4, 30, (3, 5))
    b = Batch(src, tgt[:, :-1], tgt[:, 1:], torch.ones(3, 6, dtype=torch.bool), 18, 12, [0, 1, 2])
    same = study.divergence(model, model, [b])
    assert same["kl"] == pytest.approx(0.0, abs=1e-7) and same["top1"] == 1.0
    # every layer simulated, whatever class its linears are (gradhelper.Linear in the model)
    simulated = study.variant(model, "127:none:none")
    assert not [n for n, m in simulated.named_modules() if is_linear(m)]
    assert isinstance(simulated.decoder_layers[0].ffn.w_2, study.FakeInt8Linear)
    coarse = study.divergence(model, study.variant(model, "3:tensor:tensor"), [b])
    fine = study.divergence(model, simulated, [b])
    assert coarse["kl"] > fine["kl"] > 0


@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_equals_linear(bias):
    # oneDNN's product with the weights packed once: fp32 sums in another order, any rows.
    torch.manual_seed(0)
    weight = torch.randn(300, 48)
    b = torch.randn(300) if bias else None
    layer = PackedLinear(weight, b)
    for shape in [(1, 48), (5, 48), (2, 7, 48), (130, 48)]:
        x = torch.randn(*shape)
        want = torch.nn.functional.linear(x, weight, b)
        got = layer(x)
        assert got.shape == want.shape and got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_onednn_bf16
@pytest.mark.parametrize("bias", [True, False])
def test_bf16_packed_linear_equals_linear_on_a_row_and_keeps_rows_apart(bias):
    # bf16 products with the weights packed once (packed_bf16). A row alone: F.linear's
    # values bit for bit; in any batch, F.linear's to bf16's rounding. At the test models' size
    # a row's values do not depend on the other rows nor on the thread count (a sentence's
    # translation does not depend on its batch); at d_model 512 on an AMX Xeon oneDNN rounds
    # some rows by the batch's size, through F.linear too (docs/decoding.md, "bf16 on an AMX
    # Xeon"; PackedLinear's docstring).
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    try:
        for out, inp in ((300, 48), (64, 16), (1536, 512), (512, 2048)):
            weight = (torch.randn(out, inp) * 0.05).bfloat16()
            b = torch.randn(out).bfloat16() if bias else None
            layer = PackedLinear(weight, b, dtype=torch.bfloat16)
            x = torch.randn(130, inp).bfloat16()
            torch.set_num_threads(1)
            alone = torch.cat([layer(x[i : i + 1]) for i in range(x.size(0))])
            plain = torch.nn.functional.linear(x, weight, b)
            assert torch.equal(alone[:1], torch.nn.functional.linear(x[:1], weight, b))
            torch.testing.assert_close(layer(x), plain, rtol=1e-2, atol=1e-2)
            got = layer(x[:130].view(10, 13, inp))
            assert got.shape == (10, 13, out) and got.dtype == torch.bfloat16
            if inp >= 512:
                continue
            for n_threads in (1, 2):
                torch.set_num_threads(n_threads)
                for rows in (2, 33, 47, 64, 65, 128, 130):
                    assert torch.equal(layer(x[:rows]), alone[:rows]), (out, inp, rows, n_threads)
    finally:
        torch.set_num_threads(threads)


@needs_onednn_bf16
def test_bf16_packed_linears_stack_as_their_parts():
    # A decoder step's W^Q (times 1/8, exact) and W^KV as one product (cache.StepProjections).
    torch.manual_seed(0)
    bf16 = torch.bfloat16
    parts = [(PackedLinear(torch.randn(n, 64).to(bf16), torch.randn(n).to(bf16), dtype=bf16), f)
             for n, f in ((64, 0.125), (128, 1.0))]  # fmt: skip
    x = torch.randn(5, 64).bfloat16()
    want = torch.cat([part(x) * f for part, f in parts], dim=-1)
    torch.testing.assert_close(PackedLinear.stacked(parts)(x), want, rtol=1e-2, atol=1e-2)
    stacked = PackedLinear.stacked(parts)
    assert torch.equal(stacked.weight, torch.cat([p.weight * f for p, f in parts]))
    with pytest.raises(ValueError, match="every part must have a bias"):
        PackedLinear.stacked([(PackedLinear(torch.randn(4, 64), None), 1.0)])


@needs_onednn_bf16
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_linears_relu_forward_is_relu_of_its_forward(dtype):
    # max(0, .) as oneDNN's post-op on the fp32 sums, before their rounding: the same values
    # as F.relu of the rounded outputs (rounding keeps the sign). A NaN sum comes out 0 from
    # oneDNN's max (torch 2.13), NaN from F.relu: a NaN input still reaches the FFN's output
    # through the residual around it.
    from transformer.model import PositionwiseFeedForward

    torch.manual_seed(0)
    weight, bias = (torch.randn(96, 64) * 0.2).to(dtype), torch.randn(96).to(dtype)
    layer = PackedLinear(weight, bias, dtype=dtype)
    x = torch.randn(7, 5, 64).to(dtype)
    x[0, 0, 0] = float("nan")
    got, ref = layer.relu_forward(x), torch.nn.functional.relu(layer(x))
    assert got.shape == (7, 5, 96) and got.dtype == dtype
    assert torch.equal(got[1:], ref[1:]) and bool(ref[0, 0].isnan().all())
    assert bool((got[0, 0].isnan() | (got[0, 0] == 0)).all())
    assert bool((got >= 0).logical_or(got.isnan()).all()) and int((got == 0).sum()) > 100
    # the FFN of a packed decoder takes it: the same output as the layer and F.relu apart
    ffn = PositionwiseFeedForward(64, 96).eval().to(dtype)
    ffn.w_1, ffn.w_2 = layer, PackedLinear(weight.t().contiguous(), None, dtype=dtype)
    calls, fused = [], layer.relu_forward
    layer.relu_forward = lambda h: calls.append(h.shape) or fused(h)
    with torch.no_grad():
        assert torch.equal(ffn(x[1:]), ffn.w_2(torch.nn.functional.relu(layer(x[1:]))))
    assert calls == [(6, 5, 64)]


@needs_onednn_bf16
def test_packed_bf16_packs_every_linear_and_leaves_the_model_alone(model_file):
    from transformer import translate
    from transformer.cache import StepProjections

    model = Translator.from_path(model_file).loaded.model.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    packed = translate.packed_bf16(model)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert model.projection is None and model.output_weight().dtype == torch.float32
    assert not any(is_linear(m) for m in packed.modules())
    if kernels.project_amx() and bf16_packs():  # fp32 logits on AMX's tiles: the bf16 matrix
        assert isinstance(packed.projection, FP32Logits)
        assert packed.projection.weight.data_ptr() == packed.tgt_embed.weight.data_ptr()
    else:
        assert isinstance(packed.projection, PackedLinear)
        assert packed.projection.dtype == torch.bfloat16
    # §3.4: the two embeddings stay one bf16 matrix, and the projection is it or its copy
    assert packed.src_embed.weight is packed.tgt_embed.weight
    assert torch.equal(packed.projection.weight, model.output_weight().bfloat16())
    assert StepProjections.of(packed.decoder_layers[0]) is not None  # W^Q and W^KV stacked
    # Its translations are bf16's through F.linear, but for a few sums rounded otherwise.
    src = torch.tensor([[5, 6, 7, 8, 3], [9, 10, 3, 0, 0]])
    hidden = packed.decode_hidden(src[:, :2], packed.encode(src, src != 0), src != 0)
    plain = copy.deepcopy(model).bfloat16()
    ref = plain.decode_hidden(src[:, :2], plain.encode(src, src != 0), src != 0)
    torch.testing.assert_close(hidden.float(), ref.float(), rtol=0.05, atol=0.05)


@needs_onednn_bf16
def test_fp32_logits_are_the_kernels_and_a_packed_linears_where_it_is_switched_off():
    # A bf16 decoder's projection on AMX: fp32 logits from kernels.project (d_model a multiple
    # of 32); bf16 logits from a PackedLinear, as before, where the kernel does not run.
    torch.manual_seed(0)
    for d in (64, 16):  # 16: not the kernel's (the test models' size)
        weight = (torch.randn(300, d) * 0.05).bfloat16()
        layer, plain = FP32Logits(weight), PackedLinear(weight, None, dtype=torch.bfloat16)
        x = torch.randn(3, 5, d).bfloat16()
        tiles = kernels.project(x, weight)
        got = layer(x)
        assert got.shape == (3, 5, 300)
        if tiles is not None:
            assert got.dtype == torch.float32 and torch.equal(got, tiles)
        else:
            assert d % 32 or not kernels.project_amx()
            assert got.dtype == torch.bfloat16 and torch.equal(got, plain(x))
        old = kernels.project_amx()
        try:
            kernels.project_amx(False)
            assert torch.equal(layer(x), plain(x))  # switched off: bf16's logits
        finally:
            kernels.project_amx(old)


@pytest.mark.parametrize(("native", "onednn"), [([], True), (["amx_bf16"], False)])
def test_packed_bf16_where_the_cpu_cannot_pack_is_the_model_in_bf16(
    model_file, monkeypatch, native, onednn
):
    # A CPU without native bf16 products, or whose oneDNN refuses bf16's layout (a Zen 3; or
    # flags claiming more than the CPU has): the model in bf16, F.linear as before, no error.
    from transformer import translate

    model = Translator.from_path(model_file).loaded.model.eval()
    monkeypatch.setattr(translate, "native_bf16", lambda: native)
    monkeypatch.setattr(translate, "onednn_bf16", lambda: onednn)
    unpacked = translate.packed_bf16(model)
    assert unpacked.projection is None and any(is_linear(m) for m in unpacked.modules())
    assert unpacked.output_weight().dtype == torch.bfloat16
    assert model.output_weight().dtype == torch.float32  # left unchanged there too


def test_packed_projection_shares_the_parameters_and_leaves_the_model_alone(model_file):
    from transformer.translate import packed_projection

    assert torch.backends.mkldnn.is_available()  # every CPU build of torch has oneDNN
    model = Translator.from_path(model_file, dtype="bf16").loaded.model.float().eval()
    packed = packed_projection(model)
    assert model.projection is None and isinstance(packed.projection, PackedLinear)
    assert packed.output_weight() is model.output_weight()  # no copy of the parameters
    hidden = torch.randn(3, 4, model.cfg.d_model)
    torch.testing.assert_close(packed.project(hidden), model.project(hidden), rtol=1e-5, atol=1e-5)
    assert packed_projection(packed) is packed  # a projection already there is kept


@pytest.mark.parametrize("nonnegative", [False, True])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(5, 7, 64), (1, 64), (64, 512)])
def test_int8_linear_gives_the_same_bits_with_and_without_its_row_kernels(
    monkeypatch, nonnegative, bias, shape, int8_product
):
    # `kernels.int8_rows_in` / `int8_rows_out_` where they run (an AVX-512 CPU), torch's ops
    # otherwise: the same values either way, so a translation does not depend on which.
    g = torch.Generator().manual_seed(shape[-1])
    w = torch.randn(48, shape[-1], generator=g) * 0.1
    q = Int8Linear(w, torch.randn(48, generator=g) if bias else None, False,
                   nonnegative_inputs=nonnegative)  # fmt: skip
    x = torch.randn(shape, generator=g)
    x = x.relu() if nonnegative else x
    transposed = x.transpose(0, -1).contiguous().transpose(0, -1)  # not contiguous
    xb = x.to(torch.bfloat16)  # bf16 and non-contiguous inputs take torch's ops either way
    with_kernels = [q(x), q(transposed), q(xb)]
    monkeypatch.setattr(transformer.translate, "int8_row_kernels", lambda: False)
    without = [q(x), q(transposed), q(xb)]
    for a, b in zip(with_kernels, without, strict=True):
        assert a.dtype == b.dtype
        assert torch.equal(a.float().view(torch.int32), b.float().view(torch.int32))
    assert torch.equal(with_kernels[1], with_kernels[0])


def test_int8_row_kernels_run_only_where_they_give_torchs_bits(monkeypatch, caplog):
    check = transformer.translate.int8_row_kernels
    try:
        check.cache_clear()
        from transformer import kernels

        assert check() == kernels.rows_supported()
        check.cache_clear()
        monkeypatch.setattr(kernels, "rows_supported", lambda: False)
        assert not check()
        check.cache_clear()
        monkeypatch.setattr(kernels, "rows_supported", lambda: True)
        wrong = lambda x, nonnegative, tiny: (x * 1.0001, x.abs().amax(-1, keepdim=True))  # noqa: E731
        monkeypatch.setattr(kernels, "int8_rows_in", wrong)
        with caplog.at_level(logging.INFO, logger="transformer.translate"):
            assert not check()
        assert "torch's ops for the rows" in caplog.text
    finally:
        monkeypatch.undo()
        check.cache_clear()


def test_int8_narrow_weights_of_another_cpu_come_with_its_product():
    # another CPU's flags say nothing of whether the library's AVX2 product runs there (this
    # machine's `int8_avx2` does not either), so the caller says it
    assert int8_narrow_weights({"avx2", "avx512_vnni"}, avx2_product=False) is False
    assert int8_narrow_weights({"avx2"}, avx2_product=True) is False  # a Zen 3, the library's
    assert int8_narrow_weights({"avx2"}, avx2_product=False) is True  # a Zen 3, fbgemm's
    assert int8_narrow_weights(set(), avx2_product=True) is True  # no AVX2: no such product
    with pytest.raises(TypeError, match="another CPU's flags need its avx2_product"):
        int8_narrow_weights({"avx2"})


def _onednn_check() -> bool:
    """`int8_onednn`'s check itself, run anew (not its answer cached for the process)."""
    t = transformer.translate
    return t._int8_onednn.__wrapped__(t._int8_product_asked(), transformer.cpuinfo.CPUINFO)


def test_int8_onednn_follows_a_later_change_of_the_users_product(monkeypatch):
    # the answer is cached for each value of TRANSFORMER_INT8_PRODUCT, not the first one
    t = transformer.translate
    monkeypatch.setenv("TRANSFORMER_INT8_PRODUCT", "fbgemm")
    assert t.int8_onednn() is False
    monkeypatch.delenv("TRANSFORMER_INT8_PRODUCT")
    assert t.int8_onednn() is _onednn_check()
    monkeypatch.setenv("TRANSFORMER_INT8_PRODUCT", "avx2")
    assert t.int8_onednn() is False


def test_int8_linears_products_agree_and_onednns_is_the_exact_one(monkeypatch, caplog):
    """oneDNN's product of the same 8-bit inputs and integer weights is fbgemm's to fp32
    rounding where fbgemm's integer sums are exact, and the exact one (integer sums, then
    (sum x input scale) x row scale) to 2e-7 of each row's largest everywhere; the layer says
    which product it runs. A CPU without VNNI keeps fbgemm's 7-bit path, and one where oneDNN's
    product fails the check keeps fbgemm's (on the AMX Xeon of round forty-eight a one-row
    batch's bits differ from the same row's in a batch of 40)."""
    if not transformer.translate.int8_onednn():
        with caplog.at_level(logging.INFO, logger="transformer.translate"):
            assert _onednn_check() is False
        # the two reasons a torch with oneDNN goes without it, and the second is said
        assert not transformer.translate._vnni() or "fbgemm's product (oneDNN's" in caplog.text
        return
    g = torch.Generator().manual_seed(5)
    for rows, k, n, nonneg in ((64, 512, 300, False), (256, 512, 300, False), (40, 96, 24, True)):
        w, b = torch.randn(n, k, generator=g) * 0.1, torch.randn(n, generator=g)
        x = torch.randn(rows, k, generator=g)
        x = x.relu() if nonneg else x
        layer = {}
        for on in (False, True):
            monkeypatch.setattr(transformer.translate, "int8_onednn", lambda on=on: on)
            layer[on] = Int8Linear(w, b, False, nonnegative_inputs=nonneg)
        assert "product=onednn" in repr(layer[True]) and "product=fbgemm" in repr(layer[False])
        ints, scales = layer[True].integer_weights()
        assert torch.equal(ints, layer[False].integer_weights()[0])
        q, top = transformer.translate._rows_u8(x, nonneg)
        zero = 0 if nonneg else 128
        exact = ((q.double() - zero) @ ints.double().t()) * layer[True].grid[0] * scales
        exact = exact.float() * top + b  # each row scaled back, then the bias, as both do
        got = {on: layer[on](x) for on in (False, True)}
        big = exact.abs().amax(1, keepdim=True)
        assert bool(((got[True] - exact).abs() <= 1e-6 * big).all())
        assert bool(((got[False] - exact).abs() <= 1e-3 * big).all())  # fbgemm: see the docstring


def test_int8_linears_avx2_product_is_the_exact_one_with_8_bit_weights(monkeypatch):
    """The library's AVX2 product (`int8_avx2`: CPUs without VNNI) takes the 8-bit weights a
    VNNI CPU takes and gives the exact product bit for bit: the integer sums, x the inputs'
    step, x the row's scale, x each input row's top, + the bias, each in fp32: oneDNN's
    product's bits where it runs; stacked layers too. fbgemm's AVX2 kernel saturates there with
    these weights (`int8_narrow_weights`)."""
    assert transformer.kernels.int8_product_supported()
    monkeypatch.setattr(transformer.translate, "int8_onednn", lambda: False)
    monkeypatch.setattr(transformer.translate, "int8_avx2", lambda: True)
    g = torch.Generator().manual_seed(6)
    for rows, k, n, nonneg in ((64, 512, 300, False), (256, 512, 300, False), (40, 96, 24, True)):
        w, b = torch.randn(n, k, generator=g) * 0.1, torch.randn(n, generator=g)
        x = torch.randn(rows, k, generator=g)
        x = x.relu() if nonneg else x
        layer = Int8Linear(w, b, False, nonnegative_inputs=nonneg)
        assert "product=avx2" in repr(layer) and not layer.narrow_weights
        ints, scales = layer.integer_weights()
        assert ints.abs().max() == 127
        q, top = transformer.translate._rows_u8(x, nonneg)
        levels, zero = (255.0, 0) if nonneg else (127.0, 128)
        exact = transformer.translate.int8_product_exact(
            q, zero, 1 / levels, ints, scales.float(), top, b
        )
        assert torch.equal(layer(x), exact)
        if "onednn" in INT8_PRODUCTS:  # and a VNNI CPU's product (oneDNN's): the same bits
            monkeypatch.setattr(transformer.translate, "int8_onednn", lambda: True)
            dnn = Int8Linear(w, b, False, nonnegative_inputs=nonneg)
            monkeypatch.setattr(transformer.translate, "int8_onednn", lambda: False)
            assert "product=onednn" in repr(dnn)
            assert torch.equal(dnn(x).view(torch.int32), layer(x).view(torch.int32))
        h = n // 2
        halves = [Int8Linear(w[:h], b[:h], False, nonnegative_inputs=nonneg),
                  Int8Linear(w[h:], b[h:], False, nonnegative_inputs=nonneg)]  # fmt: skip
        stacked = Int8Linear.stacked([(halves[0], 1.0), (halves[1], 0.5)])
        want = torch.cat([halves[0](x), halves[1](x) * 0.5], dim=1)
        assert "product=avx2" in repr(stacked) and torch.equal(stacked(x), want)


@pytest.mark.parametrize(
    ("onednn", "avx2", "narrow", "env", "said"),
    [(True, False, False, None, "oneDNN's (VNNI), 8-bit weights"),
     (False, True, False, None, "the library's exact AVX2 product, 8-bit weights"),
     (False, True, False, "avx2",
      "the library's exact AVX2 product, 8-bit weights (TRANSFORMER_INT8_PRODUCT=avx2)"),
     (False, False, True, "fbgemm", "fbgemm's, 7-bit weights (TRANSFORMER_INT8_PRODUCT=fbgemm)"),
     (False, False, False, None, "fbgemm's, 8-bit weights")],
)  # fmt: skip
def test_int8_product_said_names_the_product_and_its_weights(
    monkeypatch, onednn, avx2, narrow, env, said
):
    t = transformer.translate
    monkeypatch.setattr(t, "int8_onednn", lambda: onednn)
    monkeypatch.setattr(t, "int8_avx2", lambda: avx2)
    monkeypatch.setattr(t, "int8_narrow_weights", lambda flags=None: narrow)
    if env is None:
        monkeypatch.delenv("TRANSFORMER_INT8_PRODUCT", raising=False)
    else:
        monkeypatch.setenv("TRANSFORMER_INT8_PRODUCT", env)
    assert t.int8_product_said() == said


def test_an_int8_product_nobody_has_is_a_one_line_error(model_file, monkeypatch, capsys):
    from transformer.cli import main

    monkeypatch.setenv("TRANSFORMER_INT8_PRODUCT", "vnni")
    for check in (transformer.translate.int8_avx2, transformer.translate.int8_product_said):
        with pytest.raises(UserError, match="TRANSFORMER_INT8_PRODUCT: fbgemm or avx2"):
            check()
    with pytest.raises(UserError, match="not 'vnni'"):
        Translator.from_path(model_file, dtype="int8")
    assert main(["kernels", "--into", str(model_file.parent / "k")]) == 2
    err = capsys.readouterr().err
    assert "TRANSFORMER_INT8_PRODUCT" in err and "Traceback" not in err


def test_int8_avx2_is_chosen_without_vnni_or_where_asked(monkeypatch, tmp_path):
    from fixtures import CPUINFO_ZEN3, CPUINFO_ZEN4, fake_cpuinfo

    choose = transformer.translate.int8_avx2
    cases = ((CPUINFO_ZEN3, None, True), (CPUINFO_ZEN3, "fbgemm", False),
             (CPUINFO_ZEN4, None, False), (CPUINFO_ZEN4, "AVX2", True),
             ("processor\t: 0\n", None, False))  # fmt: skip
    for i, (info, env, chosen) in enumerate(cases):
        (tmp_path / str(i)).mkdir()
        fake_cpuinfo(monkeypatch, tmp_path / str(i), info)  # a file of its own: checked anew
        if env is None:
            monkeypatch.delenv("TRANSFORMER_INT8_PRODUCT", raising=False)
        else:
            monkeypatch.setenv("TRANSFORMER_INT8_PRODUCT", env)
        assert choose() is chosen, (info, env)
    # a library whose product is not the exact one is not taken
    monkeypatch.setattr(transformer.kernels, "int8_product", lambda *a: torch.zeros(1))
    (tmp_path / "off").mkdir()
    fake_cpuinfo(monkeypatch, tmp_path / "off", CPUINFO_ZEN3)
    monkeypatch.delenv("TRANSFORMER_INT8_PRODUCT", raising=False)
    assert choose() is False


def test_int8_avx2_checks_the_product_with_and_without_a_bias(monkeypatch, tmp_path):
    """The check's reference sums, made once per shape, serve both biases: a product that is
    one ulp off only without a bias (or only with one) is not taken."""
    real = transformer.kernels.int8_product
    monkeypatch.delenv("TRANSFORMER_INT8_PRODUCT", raising=False)
    for i, off_without in enumerate((True, False)):

        def product(*args, off_without=off_without):
            y = real(*args)
            if (args[-1] is None) is off_without:
                y = torch.nextafter(y, torch.full_like(y, float("inf")))
            return y

        monkeypatch.setattr(transformer.kernels, "int8_product", product)
        (tmp_path / str(i)).mkdir()
        fake_cpuinfo(monkeypatch, tmp_path / str(i), CPUINFO_ZEN3)  # checked anew
        assert transformer.translate.int8_avx2() is False, off_without
    monkeypatch.setattr(transformer.kernels, "int8_product", real)
    (tmp_path / "exact").mkdir()
    fake_cpuinfo(monkeypatch, tmp_path / "exact", CPUINFO_ZEN3)
    assert transformer.translate.int8_avx2() is True


def test_int8_onednn_is_chosen_only_where_it_matches_the_exact_product(monkeypatch, caplog):
    check = _onednn_check
    monkeypatch.setenv("TRANSFORMER_INT8_PRODUCT", "fbgemm")  # the user's choice
    assert check() is False
    monkeypatch.delenv("TRANSFORMER_INT8_PRODUCT")
    monkeypatch.setenv("TRANSFORMER_INT8_PRODUCT", "avx2")  # the library's, asked for
    assert check() is False
    monkeypatch.delenv("TRANSFORMER_INT8_PRODUCT")
    monkeypatch.setattr(transformer.translate, "_vnni", lambda: False)
    assert check() is False  # no VNNI: the library's product, or fbgemm's 7-bit path
    monkeypatch.setattr(transformer.translate, "_vnni", lambda: True)
    if "onednn" not in INT8_PRODUCTS:
        return
    assert check() is True
    real = torch.ops.onednn.qlinear_pointwise

    class Ops:  # a product that is off by one part in 10^5
        qlinear_prepack = torch.ops.onednn.qlinear_prepack

        @staticmethod
        def qlinear_pointwise(*args):
            return real(*args) * (1 + 1e-5)

    monkeypatch.setattr(torch.ops, "onednn", Ops)
    with caplog.at_level(logging.INFO, logger="transformer.translate"):
        assert check() is False
    assert "oneDNN's differs from the exact one" in caplog.text

    class Missing:
        pass

    monkeypatch.setattr(torch.ops, "onednn", Missing)
    assert check() is False


@pytest.mark.parametrize(
    ("threads", "others", "omp", "loading_threads"),
    [
        ("auto", 1.0, None, 1),  # crowded since the command started: one thread
        ("auto", 0.1, None, 2),  # not crowded: as torch has it
        ("auto", None, None, 2),  # not known
        (2, 1.0, None, 2),  # a count the user gave: theirs
        ("auto", 1.0, "2", 2),  # OMP_NUM_THREADS: the user's
    ],
)
def test_a_model_loads_on_one_thread_where_others_crowded_the_cores_since_the_start(
    model_file, monkeypatch, threads, others, omp, loading_threads
):
    import transformer.translate as tr

    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    monkeypatch.setattr(transformer.threads, "usable_cores", lambda: 2)
    monkeypatch.setattr(tr.OtherLoad, "since_start", classmethod(lambda cls: _Crowded(others)))
    seen = []
    load = tr.resolve_model

    def resolve_model(*args):
        seen.append(torch.get_num_threads())
        return load(*args)

    monkeypatch.setattr(tr, "resolve_model", resolve_model)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        Translator.from_path(model_file, threads=threads)
        assert seen == [loading_threads]
        assert torch.get_num_threads() == 2  # the loading's count does not stay
    finally:
        torch.set_num_threads(before)
