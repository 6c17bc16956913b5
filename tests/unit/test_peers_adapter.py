"""benchmarks/peers_adapter.py: our side of the peers' W2 harness searches as our search does."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from transformer.config import ModelConfig
from transformer.model import Transformer
from transformer.search import ModelStepper
from transformer.tokenizer import BOS_ID, EOS_ID, PAD_ID

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from peers_adapter import forced_length_search  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@torch.inference_mode()
def _every_pair(model, src, src_mask, beam: int, n_out: int, banned: list[int]) -> list[list[int]]:
    """The same search ranking all k * V (beam, token) sums at every step."""
    B = src.size(0)
    stepper = ModelStepper(model, src, src_mask)
    last, scores = torch.full((B,), BOS_ID), torch.zeros(B, 1)
    tokens = torch.empty(B, 0, dtype=torch.long)
    for _ in range(n_out):
        lprobs = stepper.step(last)
        lprobs[:, banned] = float("-inf")
        k, V = scores.size(1), lprobs.size(1)
        total = (scores[:, :, None] + lprobs.view(B, k, V)).view(B, k * V)
        scores, flat = total.topk(beam, dim=1)
        parents = (flat // V + torch.arange(B)[:, None] * k).reshape(-1)
        last = (flat % V).reshape(-1)
        stepper.reorder(parents, same_sentences=k == beam)
        tokens = torch.cat([tokens.index_select(0, parents), last[:, None]], 1)
    return tokens.view(B, beam, n_out)[:, 0].tolist()


@pytest.mark.parametrize("beam", [1, 3])
def test_forced_length_search_equals_ranking_every_pair(beam):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=1500, n_layers=2, d_model=32, d_ff=64, n_heads=2, d_k=16, d_v=16)
    model = Transformer(cfg).eval()
    src = torch.randint(4, 1500, (5, 7))
    src[1, 4:] = PAD_ID
    src[:, -1] = torch.where(src[:, -1] == PAD_ID, PAD_ID, EOS_ID)
    src_mask = src != PAD_ID
    banned = [PAD_ID, BOS_ID, EOS_ID]
    got = forced_length_search(model, src, src_mask, beam, 9, BOS_ID, banned)
    assert [len(t) for t in got] == [9] * 5
    assert not {t for row in got for t in row} & set(banned)
    assert got == _every_pair(model, src, src_mask, beam, 9, banned)


def _steps_seeing(monkeypatch, state, makes) -> list:
    """One bf16 step of a tiny model by each adapter factory in makes, in turn; returns what
    state() said inside each step (train_step wrapped), asserting it is back after each."""
    import peers_adapter

    seen = []
    real = peers_adapter.train_step
    monkeypatch.setattr(peers_adapter, "train_step", lambda *a: (seen.append(state()), real(*a))[1])
    cfg = dict(
        d_model=32, d_ff=64, heads=2, layers=1, dropout=0.1, max_pos=64, vocab=300, seed=1,
        betas=(0.9, 0.98), eps=1e-9, label_smoothing=0.1, lr=1e-4,
    )  # fmt: skip
    src = torch.randint(4, 300, (3, 6))
    tgt = torch.randint(4, 300, (3, 5))
    batch = {"src": src, "tgt_in": tgt, "tgt_out": tgt.roll(-1, 1)}
    before = state()
    for make in makes:
        adapter = make(cfg)
        loss = adapter.step(adapter.prepare(batch), torch.bfloat16)
        assert loss > 0 and state() == before  # restored after the step
    return seen


def test_the_torch_ops_adapter_turns_the_fused_kernels_off_for_its_own_steps(monkeypatch):
    import peers_adapter
    from transformer import kernels

    before = kernels.FUSED
    makes = (peers_adapter.make_train_torch_ops, peers_adapter.make_train)
    assert _steps_seeing(monkeypatch, lambda: kernels.FUSED, makes) == [False, before]


def test_the_lanes_attention_adapter_puts_the_attention_on_the_lanes_for_its_own_steps(
    monkeypatch,
):
    import peers_adapter
    from transformer import kernels

    before = kernels.attention_products()
    makes = (peers_adapter.make_train_lanes_attention, peers_adapter.make_train)
    seen = _steps_seeing(monkeypatch, kernels.attention_products, makes)
    assert seen == ["lanes", before]
