"""gptq.py: GPTQ's int8 weights stay on Int8Linear's grid and beat rounding to nearest on the
inputs they were calibrated with; input_moments; quantize_int8 with them."""

from __future__ import annotations

import pytest
import torch

from transformer.config import ModelConfig
from transformer.data import Batch
from transformer.gptq import PROJECTION, gptq_round, input_moments, row_scales
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
    linears = {n for n, m in model.named_modules() if type(m) is torch.nn.Linear}
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
    w_rtn = torch.ops.quantized.linear_unpack(ffn_rtn.packed)[0]
    w_gptq = torch.ops.quantized.linear_unpack(ffn_gptq.packed)[0]
    assert torch.equal(w_rtn.q_per_channel_scales(), w_gptq.q_per_channel_scales())  # one grid
    assert not torch.equal(w_rtn.int_repr(), w_gptq.int_repr())
    levels = 63.0 if ffn_gptq.narrow_weights else 127.0
    w = model.encoder_layers[0].ffn.w_1.weight
    want = gptq_round(w, row_scales(w, levels), levels, moments["encoder_layers.0.ffn.w_1"])
    assert torch.equal(w_gptq.int_repr().double(), want)
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
