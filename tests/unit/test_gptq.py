"""gptq.py: GPTQ's int8 weights stay on Int8Linear's grid and beat rounding to nearest on the
inputs they were calibrated with; input_moments; quantize_int8 with them."""

from __future__ import annotations

import re

import pytest
import torch

from transformer.config import ModelConfig
from transformer.data import Batch
from transformer.gptq import PROJECTION, gptq_round, input_moments, row_scales
from transformer.gradhelper import is_linear
from transformer.model import Transformer
from transformer.translate import Int8Linear, quantize_int8


def _correlated(n: int, d: int) -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(n, d) @ torch.randn(d, d)  # a layer's inputs are correlated


@pytest.mark.parametrize("levels", [63.0, 127.0])
def test_gptq_stays_on_the_grid_and_beats_rounding_to_nearest(levels):
    w = torch.randn(40, 24)
    x = _correlated(500, 24)
    x[:, 5] = 0.0  # an input that is always 0: its weights cannot matter
    scales = row_scales(w, levels)
    q = gptq_round(w, scales, levels, x.double().T @ x.double())
    assert torch.equal(q, q.round()) and q.abs().max() <= levels
    assert (q[:, 5] == 0).all()
    nearest = (w.double() / scales[:, None]).round()
    err_gptq = (x.double() @ ((q - w.double() / scales[:, None]) * scales[:, None]).T).norm()
    err_nearest = x.double() @ ((nearest - w.double() / scales[:, None]) * scales[:, None]).T
    assert err_gptq < 0.8 * err_nearest.norm()


def test_gptq_with_identity_moments_rounds_to_nearest():
    # H = I: no input direction is preferred, so nothing is pushed onto later columns.
    w = torch.randn(16, 32)
    scales = row_scales(w, 63.0)
    q = gptq_round(w, scales, 63.0, torch.eye(32, dtype=torch.float64))
    assert torch.equal(q, (w.double() / scales[:, None]).round())


def _tiny_model() -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=30, n_layers=1, d_model=16, d_ff=32, n_heads=2, d_k=8, d_v=8,
                      p_drop=0.0, max_len=32)  # fmt: skip
    return Transformer(cfg).eval()


class _Split:
    """The two methods input_moments reads, over fixed random pairs."""

    def __init__(self, n: int):
        g = torch.Generator().manual_seed(1)
        self.pairs = [
            (torch.randint(4, 30, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g),
             torch.randint(4, 30, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g))
            for _ in range(n)
        ]  # fmt: skip

    def __len__(self) -> int:
        return len(self.pairs)

    def src_tokens(self, i: int):
        return self.pairs[i][0].numpy()

    def tgt_tokens(self, i: int):
        return self.pairs[i][1].numpy()


def test_input_moments_and_quantize_int8_with_them(monkeypatch):
    import numpy as np

    import transformer.gptq as gptq

    model = _tiny_model()
    split = _Split(9)
    split.src_lens = np.array([len(p[0]) + 1 for p in split.pairs])  # EOS included
    split.tgt_lens = np.array([len(p[1]) + 1 for p in split.pairs])
    moments = input_moments(model, split, sentences=9, rows=4)
    linears = {n for n, m in model.named_modules() if is_linear(m)}
    assert set(moments) == linears | {PROJECTION}
    d = model.cfg.d_model
    assert moments[PROJECTION].shape == (d, d) and moments[PROJECTION].dtype == torch.float64
    # the projection's moments are those of the decoder's output at every real target token
    batch = gptq.collate(split, list(range(9)))
    keep = batch.tgt_out != 0
    h = model(batch.src, batch.src_mask, batch.tgt_in, keep).double()
    torch.testing.assert_close(moments[PROJECTION], h.T @ h, rtol=1e-5, atol=1e-5)  # other batches
    assert not model.training

    rtn, calibrated = quantize_int8(model), quantize_int8(model, moments=moments)
    ffn_rtn = rtn.encoder_layers[0].ffn.w_1
    ffn_gptq = calibrated.encoder_layers[0].ffn.w_1
    assert isinstance(ffn_gptq, Int8Linear)
    (ints_rtn, scales_rtn), (ints_gptq, scales_gptq) = (
        ffn_rtn.integer_weights(), ffn_gptq.integer_weights())  # fmt: skip
    assert torch.equal(scales_rtn, scales_gptq)  # one grid
    assert not torch.equal(ints_rtn, ints_gptq)
    levels = 63.0 if ffn_gptq.narrow_weights else 127.0
    w = model.encoder_layers[0].ffn.w_1.weight
    want = gptq_round(w, row_scales(w, levels), levels, moments["encoder_layers.0.ffn.w_1"])
    assert torch.equal(ints_gptq.double(), want)
    with pytest.raises(ValueError, match="no input moments for"):
        quantize_int8(model, moments={PROJECTION: moments[PROJECTION]})
    src = torch.randint(4, 30, (3, 6))
    tgt = torch.randint(4, 30, (3, 5))
    b = Batch(src, tgt[:, :-1], tgt[:, 1:], torch.ones(3, 6, dtype=torch.bool), 18, 12, [0, 1, 2])
    with torch.no_grad():
        got = calibrated.project(calibrated(b.src, b.src_mask, b.tgt_in))
        want = model.project(model(b.src, b.src_mask, b.tgt_in))
    assert got.shape == want.shape == (3, 4, 30)
    assert (got - want).abs().max() < 0.05 * want.abs().max()  # int8: close, not equal


# --- the model file's int8 weights and `transformer quantize` ------------------------------


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """(model file with GPTQ int8 weights, the plain one, the prepared data it was made on): a
    tiny random model whose tokenizer is the prepared slice's."""
    from fixtures import MULTI30K, prepare_slice
    from transformer.config import DecodeConfig, RunConfig
    from transformer.data import load_prepared
    from transformer.gptq import quantize_model_file
    from transformer.modelfile import save_model
    from transformer.tokenizer import strip_build_paths

    if not MULTI30K.is_dir():
        pytest.skip(f"real corpora not found at {MULTI30K}")
    tmp = tmp_path_factory.mktemp("gptq")
    data_dir = prepare_slice(tmp, MULTI30K, n_train=200, n_valid=10, vocab_size=400)
    data = load_prepared(data_dir)
    spm = strip_build_paths((data.path / data.manifest["spm_model"]).read_bytes())
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=400, n_layers=1, d_model=32, d_ff=64, n_heads=2, d_k=16,
                      d_v=16, p_drop=0.0, max_len=128)  # fmt: skip
    model = Transformer(cfg).eval()
    config = RunConfig(model=cfg, decode=DecodeConfig(max_len_b=8))
    plain = save_model(tmp / "plain.safetensors", model, config, spm, "en", "de")
    out = quantize_model_file(plain, data_dir, tmp / "int8.safetensors", sentences=50)
    return out, plain, data_dir


def test_a_quantized_file_holds_both_grids_and_the_model_is_unchanged(calibrated):
    from transformer.modelfile import load_model

    out, plain, _ = calibrated
    q, p = load_model(out), load_model(plain)
    assert set(q.int8) == {63, 127} and p.int8 == {}
    assert q.int8_info == {"method": "gptq", "split": "train", "sentences": 50,
                           "data": str(calibrated[2])}  # fmt: skip
    for a, b in zip(q.model.state_dict().values(), p.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    names = {n for n, m in q.model.named_modules() if is_linear(m)} | {PROJECTION}
    for levels, weights in q.int8.items():
        assert set(weights) == names
        for ints, scales in weights.values():
            assert ints.dtype == torch.int8 and ints.abs().max() <= levels
            assert scales.dtype == torch.float32 and (scales > 0).all()


def test_translator_int8_takes_the_files_gptq_weights_and_auto_picks_them(
    calibrated, monkeypatch, tmp_path
):
    from fixtures import CPUINFO_ZEN3, fake_cpuinfo
    from transformer.modelfile import load_model
    from transformer.translate import Translator, int8_levels

    out, plain, _ = calibrated
    fake_cpuinfo(monkeypatch, tmp_path, CPUINFO_ZEN3)  # no AMX, no VNNI
    # fbgemm's product there: 63 levels, and auto takes int8 only with GPTQ's weights for them
    monkeypatch.setenv("TRANSFORMER_INT8_PRODUCT", "fbgemm")
    for levels in (63, 127):
        if levels == 127:  # the library's exact AVX2 product: 8-bit weights, int8 either way
            monkeypatch.delenv("TRANSFORMER_INT8_PRODUCT")
        assert int8_levels() == levels
        tr = Translator.from_path(out, dtype="int8")
        ints, scales = load_model(out).int8[levels]["encoder_layers.0.ffn.w_1"]
        assert tr.loaded.int8 == {}  # taken into the model, not kept beside it
        w_ints, w_scales = tr.model.encoder_layers[0].ffn.w_1.integer_weights()
        assert torch.equal(w_ints, ints)
        assert torch.equal(w_scales.float(), scales)
        assert Translator.from_path(out, dtype="auto").dtype_name == "int8"
        plain_auto = Translator.from_path(plain, dtype="auto").dtype_name
        assert plain_auto == ("fp32" if levels == 63 else "int8")
    lines = ["A man is riding a bike.", "Two dogs play in the snow."]
    assert len(Translator.from_path(out, dtype="auto").translate(lines)) == 2


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda t: t.update({"int8.63.projection": t["int8.63.projection"][:-1]}),
         "int8.63.projection is I8 [399, 32], the config needs I8 [400, 32]"),
        (lambda t: t.update({"int8.63.projection.scale": t["int8.63.projection.scale"].double()}),
         "int8.63.projection.scale is F64"),
        (lambda t: t.pop("int8.127.encoder_layers.0.ffn.w_2.scale"),
         "the 127-level int8 weights are incomplete (missing int8.127.encoder_layers.0.ffn.w_2"),
        (lambda t: t.update({"int8.63.decoder_layers.7.ffn.w_1": t["int8.63.projection"] + 0}),
         "for a layer the config does not have"),
        (lambda t: t.update({"int8.64.projection": torch.zeros(2, 2, dtype=torch.int8)}),
         "int8.64.projection is not an int8 weight name"),
        (lambda t: t["int8.63.projection"].fill_(100),
         "int8 weights int8.63.projection are outside their 63-level grid"),
        (lambda t: t["int8.127.projection"].fill_(-128),
         "int8 weights int8.127.projection are outside their 127-level grid"),
        (lambda t: t["int8.127.projection.scale"].fill_(float("nan")),
         "int8 weights int8.127.projection are outside their 127-level grid"),
    ],
)  # fmt: skip
def test_a_forged_int8_section_is_one_clean_error(calibrated, tmp_path, change, message):
    # a consistent checksum, so that the checks of the int8 section itself are what fail
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from transformer.errors import UserError
    from transformer.modelfile import CHECKSUM, load_model, tensors_sha256

    out = calibrated[0]
    tensors = load_file(str(out))
    with safe_open(str(out), framework="pt") as f:
        meta = dict(f.metadata())
    change(tensors)
    meta[CHECKSUM] = tensors_sha256(tensors)
    forged = tmp_path / "forged.safetensors"
    save_file(tensors, str(forged), metadata=meta)
    with pytest.raises(UserError, match=re.escape(message)):
        load_model(forged)


def test_quantize_tunes_its_threads_and_gives_the_same_weights(calibrated, tmp_path, monkeypatch):
    """`--threads auto` (the CLI's default, and the quickstart's) times the calibration batches
    at each thread count and keeps the fastest for GPTQ (torch's every-core default took 3x as
    long beside a busy process, 25 s against 8 s alone on 2 Zen 5 cores); the weights are the
    same as with a fixed count, and torch's own count is put back."""
    import transformer.gptq as gptq
    from transformer.modelfile import load_model

    _, plain, data_dir = calibrated
    tuners = []
    real = gptq.input_moments

    def spy(*args, tuner=None, **kwargs):
        tuners.append(tuner)
        return real(*args, tuner=tuner, **kwargs)

    monkeypatch.setattr(gptq, "input_moments", spy)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    # 200 pairs: 4 batches of 64, the first untimed, then each thread count on its own
    tuned = gptq.quantize_model_file(plain, data_dir, tmp_path / "auto.safetensors",
                                     sentences=200, threads="auto")  # fmt: skip
    assert torch.get_num_threads() == before
    assert tuners[0] is not None
    assert tuners[0]._rates or len(tuners[0].candidates) == 1  # the batches were timed
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the user's count: no tuning
    fixed = gptq.quantize_model_file(plain, data_dir, tmp_path / "omp.safetensors",
                                     sentences=200, threads="auto")  # fmt: skip
    assert tuners[1] is None
    # The same weights (identical on the Zen 5; a BLAS that splits a product's sum by thread
    # count could move a moment by a rounding error, and with it a rare integer by one).
    for levels, weights in load_model(fixed).int8.items():
        for name, (ints, scales) in weights.items():
            again = load_model(tuned).int8[levels][name]
            assert torch.equal(scales, again[1]), name
            assert (ints != again[0]).float().mean() <= 1e-3, name


def test_quantize_refuses_data_of_another_model(calibrated, tmp_path, capsys):
    from fixtures import make_model_file
    from transformer.cli import main

    out, plain, data_dir = calibrated
    other = make_model_file(tmp_path / "other")  # its own subword model
    assert main(["quantize", str(other), str(data_dir)]) == 2
    assert "its subword model is not the one" in capsys.readouterr().err
    assert main(["quantize", str(plain), str(data_dir), "--split", "nope", "--out",
                 str(tmp_path / "x.safetensors")]) == 2  # fmt: skip
    assert "no split 'nope'; have train, valid" in capsys.readouterr().err
    assert main(["quantize", str(plain), str(data_dir), "--sentences", "0"]) == 2
    assert "--sentences must be at least 1" in capsys.readouterr().err
    assert main(["quantize", str(plain), str(tmp_path / "none")]) == 2
    assert "run `transformer prepare` first" in capsys.readouterr().err
    assert not (tmp_path / "x.safetensors").exists()


def test_quantize_refuses_a_checkpoint_without_out_and_another_language_pair(
    calibrated, tmp_path, capsys
):
    """A run directory without a model file resolves to its latest checkpoint, which is not a
    model file to rewrite in place; data of another language pair is not the model's."""
    import json
    import shutil

    from transformer import checkpoint
    from transformer.cli import main
    from transformer.config import RunConfig, to_dict

    out, plain, data_dir = calibrated
    run = tmp_path / "run"
    cfg = ModelConfig(vocab_size=30, d_model=16, d_ff=32, n_heads=2, n_layers=1, max_len=32)
    spm = torch.frombuffer(bytearray(b"spm-bytes"), dtype=torch.uint8)
    state = {"model": Transformer(cfg).state_dict(), "config": to_dict(RunConfig(model=cfg)),
             "data": {"spm_proto": spm, "src": "en", "tgt": "de"}}  # fmt: skip
    ckpt = checkpoint.save_checkpoint(run, 7, state, keep_last=5)
    before = ckpt.read_bytes()
    assert main(["quantize", str(run), str(data_dir)]) == 2
    err = capsys.readouterr().err
    assert f"resolves to a checkpoint ({ckpt}); give --out" in err
    assert "Traceback" not in err
    assert ckpt.read_bytes() == before
    assert sorted(p.name for p in (run / checkpoint.CHECKPOINT_DIR).iterdir()) == [
        "ckpt_7.pt", checkpoint.LATEST]  # fmt: skip

    swapped = tmp_path / "de-en"
    shutil.copytree(data_dir, swapped)
    manifest = json.loads((swapped / "manifest.json").read_text(encoding="utf-8"))
    manifest["src_lang"], manifest["tgt_lang"] = "de", "en"
    (swapped / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    dest = tmp_path / "x.safetensors"
    assert main(["quantize", str(plain), str(swapped), "--out", str(dest)]) == 2
    err = capsys.readouterr().err
    assert f"{swapped}: de->en data, the model translates en->de" in err
    assert "Traceback" not in err
    assert not dest.exists()
